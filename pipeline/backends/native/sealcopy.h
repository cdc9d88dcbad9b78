/* A save's copy and its checksum in one pass (sealcopy.c), on x86-64 CPUs with AVX2. */
#ifndef KVSIDECAR_SEALCOPY_H
#define KVSIDECAR_SEALCOPY_H

#include <stddef.h>
#include <stdint.h>

/* Copies a value's pages (pages[s], sizes[s] bytes each, whole 64-byte stripes) into
   row + offsets[s], written around the caches if stream, and returns the xxh3-64 of
   the payload (payload_bytes, the pages back to back, more than 240) with seed: what
   XXH3_64bits_withSeed returns. Only on a CPU with AVX2. */
uint64_t sealcopy_avx2(char *row, const int64_t *pages, const int64_t *offsets,
                       const int64_t *sizes, size_t segments, uint64_t payload_bytes,
                       uint64_t seed, int stream);

#endif
