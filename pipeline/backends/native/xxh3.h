/* xxh3-64 as this extension calls it: the packaged xxHash (libxxhash-dev), inlined,
   with the widest vector code the CPU runs.

   xxhash.h picks its vector code when it is compiled, not when it runs, and the
   packaged library carries no runtime dispatch. So each file that includes it with
   XXH_INLINE_ALL gets its own static copy of the functions: blockcopy.c the baseline
   (SSE2 on x86-64), xxh3_avx2.c one compiled for AVX2. kv_xxh3_select() points the
   calls below at the AVX2 copy on a CPU that has it; the digests are the same either
   way (xxh3 is defined by its output, whatever the vector width). */
#ifndef KVSIDECAR_XXH3_H
#define KVSIDECAR_XXH3_H

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t, to keep one on the stack */
#define XXH_INLINE_ALL
#include <xxhash.h>

#if XXH_VERSION_NUMBER < 801
#error "xxHash 0.8.1 or later is needed (apt-get install libxxhash-dev)"
#endif

typedef struct {
    XXH64_hash_t (*oneshot)(const void *input, size_t length, XXH64_hash_t seed);
    XXH_errorcode (*reset)(XXH3_state_t *state, XXH64_hash_t seed);
    XXH_errorcode (*update)(XXH3_state_t *state, const void *input, size_t length);
    XXH64_hash_t (*digest)(const XXH3_state_t *state);
} kv_xxh3_calls;

/* The AVX2 build of the four calls (xxh3_avx2.c); only for a CPU with AVX2. */
extern const kv_xxh3_calls kv_xxh3_avx2;

#endif
