/* Block copies with their checksums, one call per run of values, without the GIL.

   A value is its block's pages (one per segment) back to back, then 8 bytes: the
   xxh3-64 of those pages, seeded (pipeline.core.integrity). Python hands a run of
   values over as addresses it worked out from tensors it holds; this file only moves
   bytes and hashes them, so a copy thread takes the GIL once per run instead of once
   per page. A saved page is hashed chunk by chunk as it is read from the engine, and
   each chunk is then copied from L1: a checksum costs no second pass over memory. (A
   block the engine wrote meanwhile, which it must not, then fails its check on load;
   it is never the other way round.)

   Every call trusts the addresses: pipeline.backends.cpu_copy checks block ids against
   every segment before it calls. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t, to keep one on the stack */
#if defined(__x86_64__) || defined(__i386__)
#include "xxh_x86dispatch.h" /* XXH3 names mapped to their dispatching versions */
#else
#include "xxhash.h"
#endif

#if defined(__x86_64__)
#include <immintrin.h> /* SSE2 in every x86-64 CPU; AVX where the CPU has it */
#define STREAMING 1

/* Whether the CPU (and the OS) run AVX: its 32-byte streaming stores cost 2-5% less
   CPU per byte than SSE2's 16-byte ones. Set as the module loads; use_avx starts as it
   (stream_width() can narrow it, so that both kinds are tested on any machine). */
static int have_avx, use_avx;

__attribute__((target("avx"))) static void stream_avx(char *out, const char *in, size_t n) {
    for (; n >= 64; out += 64, in += 64, n -= 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)in);
        __m256i b = _mm256_loadu_si256((const __m256i *)(in + 32));
        _mm256_stream_si256((__m256i *)out, a);
        _mm256_stream_si256((__m256i *)(out + 32), b);
    }
}

static void stream_sse2(char *out, const char *in, size_t n) {
    for (; n >= 64; out += 64, in += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)in);
        __m128i b = _mm_loadu_si128((const __m128i *)(in + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(in + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(in + 48));
        _mm_stream_si128((__m128i *)out, a);
        _mm_stream_si128((__m128i *)(out + 16), b);
        _mm_stream_si128((__m128i *)(out + 32), c);
        _mm_stream_si128((__m128i *)(out + 48), d);
    }
}
#endif

/* Small enough that a chunk just hashed is still in L1 when it is copied. */
#define CHUNK_BYTES (16 * 1024)
#define CHECKSUM_BYTES 8

/* memcpy; with stream, the destination is written around the caches (streaming
   stores). Into memory that is not in the caches, that moves each byte once each way
   instead of first reading in every line it writes: about a fifth less CPU per byte
   on a 2-core Xeon. Into memory that is (a staging slot used a moment ago), it costs
   half as much again: the caller says which (stream). Stores made this way are
   ordered only by a fence: each call that streams ends with stream_fence(). */
static void copy_bytes(char *out, const char *in, size_t n, int stream) {
#ifdef STREAMING
    if (!stream) {
        memcpy(out, in, n);
        return;
    }
    size_t head = (size_t)(-(uintptr_t)out & 31); /* to where either kind of store may start */
    if (n < head + 64) {
        memcpy(out, in, n);
        return;
    }
    memcpy(out, in, head);
    out += head, in += head, n -= head;
    size_t body = n & ~(size_t)63;
    if (use_avx)
        stream_avx(out, in, body);
    else
        stream_sse2(out, in, body);
    out += body, in += body, n -= body;
#endif
    memcpy(out, in, n);
}

static void stream_fence(void) {
#ifdef STREAMING
    _mm_sfence();
#endif
}

typedef struct {
    Py_buffer pages;   /* int64 [values * segments]: each value's page in each segment */
    Py_buffer offsets; /* int64 [segments]: where each page lies in a value (copies only) */
    Py_buffer sizes;   /* int64 [segments]: each page's bytes */
    Py_ssize_t values;
    Py_ssize_t segments;
} Plan;

static void plan_release(Plan *plan) {
    PyBuffer_Release(&plan->pages);
    PyBuffer_Release(&plan->offsets);
    PyBuffer_Release(&plan->sizes);
}

/* Checks the tables' shapes; on failure, the buffers are released and an error set. */
static int plan_check(Plan *plan) {
    const Py_ssize_t word = (Py_ssize_t)sizeof(int64_t);
    plan->segments = plan->sizes.len / word;
    if (plan->sizes.len % word || (plan->offsets.obj && plan->offsets.len != plan->sizes.len) ||
        plan->segments == 0 || plan->pages.len % (plan->segments * word)) {
        PyErr_SetString(PyExc_ValueError,
                        "pages, offsets and sizes must be int64 tables of one segment count");
        plan_release(plan);
        return -1;
    }
    plan->values = plan->pages.len / (plan->segments * word);
    return 0;
}

static PyObject *gather(PyObject *module, PyObject *args) {
    Plan plan;
    unsigned long long rows, row_stride, seed, payload_bytes;
    int seal, stream;
    if (!PyArg_ParseTuple(args, "y*KKy*y*pKKp:gather", &plan.pages, &rows, &row_stride,
                          &plan.offsets, &plan.sizes, &seal, &seed, &payload_bytes, &stream))
        return NULL;
    if (plan_check(&plan) < 0)
        return NULL;
    const int64_t *pages = plan.pages.buf, *offsets = plan.offsets.buf, *sizes = plan.sizes.buf;
    Py_BEGIN_ALLOW_THREADS
    XXH3_state_t state;
    for (Py_ssize_t v = 0; v < plan.values; v++) {
        char *row = (char *)(uintptr_t)(rows + v * row_stride);
        if (seal)
            XXH3_64bits_reset_withSeed(&state, seed);
        for (Py_ssize_t s = 0; s < plan.segments; s++) {
            const char *page = (const char *)(uintptr_t)pages[v * plan.segments + s];
            char *out = row + offsets[s];
            for (int64_t done = 0; done < sizes[s]; done += CHUNK_BYTES) {
                size_t n = (size_t)(sizes[s] - done < CHUNK_BYTES ? sizes[s] - done : CHUNK_BYTES);
                if (seal)
                    XXH3_64bits_update(&state, page + done, n);
                copy_bytes(out + done, page + done, n, stream);
            }
        }
        if (seal) {
            uint64_t digest = XXH3_64bits_digest(&state);
            memcpy(row + payload_bytes, &digest, CHECKSUM_BYTES);
        }
    }
    if (stream)
        stream_fence();
    Py_END_ALLOW_THREADS
    plan_release(&plan);
    Py_RETURN_NONE;
}

static PyObject *scatter(PyObject *module, PyObject *args) {
    Plan plan;
    Py_buffer intact;
    unsigned long long rows, row_stride, seed, payload_bytes;
    int check, stream;
    if (!PyArg_ParseTuple(args, "y*KKy*y*pKKw*p:scatter", &plan.pages, &rows, &row_stride,
                          &plan.offsets, &plan.sizes, &check, &seed, &payload_bytes, &intact,
                          &stream))
        return NULL;
    if (plan_check(&plan) < 0) {
        PyBuffer_Release(&intact);
        return NULL;
    }
    if (intact.len != plan.values) {
        PyErr_SetString(PyExc_ValueError, "intact must hold one byte per value");
        plan_release(&plan);
        PyBuffer_Release(&intact);
        return NULL;
    }
    const int64_t *pages = plan.pages.buf, *offsets = plan.offsets.buf, *sizes = plan.sizes.buf;
    unsigned char *ok = intact.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t v = 0; v < plan.values; v++) {
        const char *row = (const char *)(uintptr_t)(rows + v * row_stride);
        /* The whole value is checked before a byte of it reaches the engine; the copy
           then reads it back from cache. */
        if (check) {
            uint64_t sealed;
            memcpy(&sealed, row + payload_bytes, CHECKSUM_BYTES);
            ok[v] = XXH3_64bits_withSeed(row, payload_bytes, seed) == sealed;
        } else {
            ok[v] = 1;
        }
        if (!ok[v])
            continue;
        for (Py_ssize_t s = 0; s < plan.segments; s++)
            copy_bytes((char *)(uintptr_t)pages[v * plan.segments + s], row + offsets[s],
                       (size_t)sizes[s], stream);
    }
    if (stream)
        stream_fence();
    Py_END_ALLOW_THREADS
    plan_release(&plan);
    PyBuffer_Release(&intact);
    Py_RETURN_NONE;
}

static PyObject *digests(PyObject *module, PyObject *args) {
    Plan plan = {0}; /* no offsets: a digest reads pages where they lie */
    Py_buffer out;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*y*Kw*:digests", &plan.pages, &plan.sizes, &seed, &out))
        return NULL;
    if (plan_check(&plan) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    if (out.len != plan.values * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "out must hold 8 bytes per value");
        plan_release(&plan);
        PyBuffer_Release(&out);
        return NULL;
    }
    const int64_t *pages = plan.pages.buf, *sizes = plan.sizes.buf;
    char *digest_at = out.buf;
    Py_BEGIN_ALLOW_THREADS
    XXH3_state_t state;
    for (Py_ssize_t v = 0; v < plan.values; v++) {
        XXH3_64bits_reset_withSeed(&state, seed);
        for (Py_ssize_t s = 0; s < plan.segments; s++)
            XXH3_64bits_update(&state, (const void *)(uintptr_t)pages[v * plan.segments + s],
                               (size_t)sizes[s]);
        uint64_t digest = XXH3_64bits_digest(&state);
        memcpy(digest_at + v * CHECKSUM_BYTES, &digest, CHECKSUM_BYTES);
    }
    Py_END_ALLOW_THREADS
    plan_release(&plan);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyObject *stream_width(PyObject *module, PyObject *args) {
    int width = -1;
    if (!PyArg_ParseTuple(args, "|i:stream_width", &width))
        return NULL;
#ifdef STREAMING
    if (width == 16 || (width == 32 && have_avx))
        use_avx = width == 32;
    else if (width != -1)
        return PyErr_Format(PyExc_ValueError, "this CPU streams 16%s bytes at a time, not %d",
                            have_avx ? " or 32" : "", width);
    return PyLong_FromLong(use_avx ? 32 : 16);
#else
    if (width != -1 && width != 0)
        return PyErr_Format(PyExc_ValueError, "this CPU has no streaming stores");
    return PyLong_FromLong(0);
#endif
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(pages, rows, row_stride, offsets, sizes, seal, seed, payload_bytes, stream)\n"
     "Copy each value's pages into its row, then (seal) its checksum after them;\n"
     "stream: write the rows around the caches."},
    {"scatter", scatter, METH_VARARGS,
     "scatter(pages, rows, row_stride, offsets, sizes, check, seed, payload_bytes, intact,\n"
     "        stream)\n"
     "Copy each intact value's row into its pages; intact[v]: whether value v was;\n"
     "stream: write the pages around the caches."},
    {"digests", digests, METH_VARARGS,
     "digests(pages, sizes, seed, out)\n"
     "Each value's checksum over its pages where they lie, into out (8 bytes each)."},
    {"stream_width", stream_width, METH_VARARGS,
     "stream_width([width])\n"
     "The bytes each streaming store writes (0: the CPU has none); with width, use that\n"
     "width from now on (16, or 32 on a CPU with AVX)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pipeline.backends._blockcopy",
    "Block copies with their checksums, without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__blockcopy(void) {
#ifdef STREAMING
    __builtin_cpu_init();
    have_avx = use_avx = __builtin_cpu_supports("avx");
#endif
    return PyModule_Create(&module);
}
