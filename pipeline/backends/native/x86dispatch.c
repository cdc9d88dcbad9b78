/* xxHash's runtime dispatch (vendored beside this file, BSD 2-Clause: LICENSE.xxhash)
   on x86 only, where it exists: XXH3 runs on the widest vector unit the CPU has, about
   twice as fast with AVX2 as on the SSE2 baseline the extension is compiled for. */
#if defined(__x86_64__) || defined(__i386__)
#include "xxh_x86dispatch.c"
#endif
