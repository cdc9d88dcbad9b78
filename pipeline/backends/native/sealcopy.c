/* A save's copy and its checksum in one pass: each 64-byte stripe of a value is read
   once, written to the value's row, and fed to xxh3 while it is still in registers.

   Hashing a value chunk by chunk beside its copy (blockcopy.c's way where this file
   cannot serve) reads memory and hashes it one after the other. Fused, the hash's
   arithmetic runs in the time the copy waits on memory anyway. The arithmetic is
   xxHash's own (its AVX2 accumulate, scramble, secret and merge, from the packaged
   header, libxxhash-dev, inlined into this file); only the walk
   over the stripes is written here, and it follows XXH3_hashLong_internal_loop's: a
   value's stripes, pages back to back, are its input. So the digest is exactly
   XXH3_64bits_withSeed's over the value's payload, as the tests check.

   It takes values whose pages are whole stripes and make up the payload, which is
   longer than xxh3's short-input cut (240 bytes), on a CPU with AVX2; blockcopy.c
   checks, and copies any other value its own way. */

#if defined(__x86_64__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL /* xxh3's internals, private to this file */
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#include <xxhash.h>

#include "sealcopy.h"

#define STRIPES_PER_BLOCK ((XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE)

XXH_TARGET_AVX2 static inline void copy_stripe(char *out, const char *in, int stream) {
    __m256i a = _mm256_loadu_si256((const __m256i *)in);
    __m256i b = _mm256_loadu_si256((const __m256i *)(in + 32));
    if (stream) {
        _mm256_stream_si256((__m256i *)out, a);
        _mm256_stream_si256((__m256i *)(out + 32), b);
    } else {
        _mm256_storeu_si256((__m256i *)out, a);
        _mm256_storeu_si256((__m256i *)(out + 32), b);
    }
}

XXH_TARGET_AVX2 uint64_t sealcopy_avx2(char *row, const int64_t *pages, const int64_t *offsets,
                                       const int64_t *sizes, size_t segments,
                                       uint64_t payload_bytes, uint64_t seed, int stream) {
    XXH_ALIGN(64) unsigned char secret[XXH_SECRET_DEFAULT_SIZE];
    XXH_ALIGN(32) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    XXH3_initCustomSecret_avx2(secret, seed); /* seed 0 gives the default secret */
    const uint64_t stripes = payload_bytes / XXH_STRIPE_LEN;
    /* Stripes of whole blocks: each block is scrambled after its last stripe. The last
       stripe is hashed with a secret of its own; a partial block is not scrambled. */
    const uint64_t blocked = (payload_bytes - 1) / (STRIPES_PER_BLOCK * XXH_STRIPE_LEN)
                             * STRIPES_PER_BLOCK;
    uint64_t stripe = 0;
    for (size_t s = 0; s < segments; s++) {
        const char *in = (const char *)(uintptr_t)pages[s];
        char *out = row + offsets[s];
        const int streams = stream && (uintptr_t)out % 32 == 0;
        for (int64_t n = sizes[s] / XXH_STRIPE_LEN; n > 0;
             n--, stripe++, in += XXH_STRIPE_LEN, out += XXH_STRIPE_LEN) {
            copy_stripe(out, in, streams);
            if (stripe + 1 == stripes) {
                XXH3_accumulate_512_avx2(acc, in, secret + XXH_SECRET_DEFAULT_SIZE -
                                         XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
                break;
            }
            const uint64_t at = stripe % STRIPES_PER_BLOCK;
            XXH3_accumulate_512_avx2(acc, in, secret + at * XXH_SECRET_CONSUME_RATE);
            if (at == STRIPES_PER_BLOCK - 1 && stripe < blocked)
                XXH3_scrambleAcc_avx2(acc, secret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN);
        }
    }
    /* XXH3_hashLong_64b_internal's ending, as 0.8.1 writes it out. */
    return XXH3_mergeAccs(acc, secret + XXH_SECRET_MERGEACCS_START,
                          (xxh_u64)payload_bytes * XXH_PRIME64_1);
}

#endif
