/* The packaged xxh3, compiled for AVX2 (see xxh3.h); called only on a CPU with AVX2. */
#if defined(__x86_64__)
#pragma GCC target("avx2")
#define XXH_VECTOR XXH_AVX2
#include "xxh3.h"

const kv_xxh3_calls kv_xxh3_avx2 = {
    XXH3_64bits_withSeed, XXH3_64bits_reset_withSeed, XXH3_64bits_update,
    XXH3_64bits_digest,
};
#endif
