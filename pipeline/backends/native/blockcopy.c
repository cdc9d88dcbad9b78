/* Block copies with their checksums, one call per run of values, without the GIL.

   A value is its block's pages (one per segment) back to back, then 8 bytes: the
   xxh3-64 of those pages, seeded (pipeline.core.integrity). Python hands a run of
   values over as addresses it worked out from tensors it holds; this file only moves
   bytes and hashes them, so a copy thread takes the GIL once per run instead of once
   per page. A saved value is hashed as it is read from the engine: on a CPU with AVX2,
   stripe by stripe in the copy's own pass (sealcopy.c), elsewhere chunk by chunk, each
   chunk hashed from L2 just after it is copied. Either way a checksum costs no second
   pass over memory.
   A checksum guards a value at rest and in transit, not against a writer during the
   copy: each piece is hashed as it was read, so a block the engine rewrites while
   its copy runs (which the fence contract forbids) is stored torn under a checksum
   that matches. Only the engine's fence keeps writers out of a block being saved.

   The copies trust the addresses they are given: page_table, which works them out
   from block ids, refuses any id that is not a block of every segment. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "xxh3.h"

#if defined(__x86_64__)
#include <immintrin.h> /* SSE2 in every x86-64 CPU; AVX where the CPU has it */
#include "sealcopy.h"
#define STREAMING 1

/* Whether the CPU (and the OS) run AVX: its 32-byte streaming stores cost 2-5% less
   CPU per byte than SSE2's 16-byte ones. Set as the module loads; use_avx starts as it
   (stream_width() can narrow it, so that both kinds are tested on any machine). */
static int have_avx, use_avx;

/* Whether the CPU runs AVX2, and whether a save seals its values in the copy's pass
   (sealcopy.c) where their pages allow; starts as the CPU allows (fused_seal() can turn
   it off, so that both ways are tested on any machine). */
static int have_avx2, use_fused;

/* The xxh3 calls: the baseline build, or the AVX2 one on a CPU that runs it (xxh3.h). */
static kv_xxh3_calls xxh3 = {
    XXH3_64bits_withSeed, XXH3_64bits_reset_withSeed, XXH3_64bits_update,
    XXH3_64bits_digest,
};

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

/* A chunk just copied is still in L2 when it is hashed. Streaming copies of smaller
   pieces, one after another, ran slower on a 2-core AMD EPYC (an 18 MiB gather into
   cold values, one thread, three alternations): 1.8-2.0 ms in 64 KiB pieces against
   1.9-2.4 in 16 KiB ones, hashing each 16 KiB first; hashed, 2.5-2.9 against 2.9-3.5
   ms. In 2-4 KiB pieces the copy took 4-5 ms. */
#define CHUNK_BYTES (64 * 1024)
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

/* A run's values are copied in order by one caller or, shared (progress: int64 [2], the
   values claimed so far and the values done), by every caller given the same progress,
   each value by whichever claims it first: callers that start at different times still
   finish together, and one that may copy only so many (limit > 0, of which it has
   copied copied) leaves the rest to the others. Returns the next of the run's values
   to copy, or -1: none is left, or the limit is reached. */
static Py_ssize_t claim(int64_t *progress, Py_ssize_t *next, Py_ssize_t values,
                        Py_ssize_t limit, Py_ssize_t copied) {
    if (limit > 0 && copied >= limit)
        return -1;
    Py_ssize_t v = progress ? (Py_ssize_t)__atomic_fetch_add(&progress[0], 1, __ATOMIC_RELAXED)
                            : (*next)++;
    return v < values ? v : -1;
}

/* A shared value is done once every thread sees its bytes (streamed stores fenced). */
static void value_done(int64_t *progress, int stream) {
    if (!progress)
        return;
    if (stream)
        stream_fence();
    __atomic_fetch_add(&progress[1], 1, __ATOMIC_RELEASE);
}

/* The optional progress argument (None: the run is not shared) into *progress, held in
   *buffer; on a bad one, an error is set. */
static int progress_of(PyObject *object, Py_buffer *buffer, int64_t **progress) {
    *progress = NULL;
    if (object == Py_None)
        return 0;
    if (PyObject_GetBuffer(object, buffer, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (buffer->len != 2 * (Py_ssize_t)sizeof(int64_t) || (uintptr_t)buffer->buf % 8) {
        PyErr_SetString(PyExc_ValueError, "progress must be an aligned int64 [2]");
        PyBuffer_Release(buffer);
        return -1;
    }
    *progress = buffer->buf;
    return 0;
}

/* Whether a value of these pages is sealed in the copy's pass (sealcopy.c): with AVX2,
   pages of whole stripes that make up the payload, and a payload of xxh3's long kind. */
static int fusable(const int64_t *sizes, Py_ssize_t segments, unsigned long long payload_bytes) {
#ifdef STREAMING
    if (!use_fused || payload_bytes <= XXH3_MIDSIZE_MAX)
        return 0;
    unsigned long long total = 0;
    for (Py_ssize_t s = 0; s < segments; s++) {
        if (sizes[s] % 64)
            return 0;
        total += (unsigned long long)sizes[s];
    }
    return total == payload_bytes;
#else
    return 0;
#endif
}

/* Copies a value's pages into its row chunk by chunk and, given a state, hashes each
   chunk just after it is copied: the digest (0 without a state). */
static uint64_t copy_in_chunks(char *row, const int64_t *pages, const int64_t *offsets,
                               const int64_t *sizes, Py_ssize_t segments,
                               XXH3_state_t *state, unsigned long long seed, int stream) {
    if (state)
        xxh3.reset(state, seed);
    for (Py_ssize_t s = 0; s < segments; s++) {
        const char *page = (const char *)(uintptr_t)pages[s];
        char *out = row + offsets[s];
        for (int64_t done = 0; done < sizes[s]; done += CHUNK_BYTES) {
            size_t n = (size_t)(sizes[s] - done < CHUNK_BYTES ? sizes[s] - done : CHUNK_BYTES);
            copy_bytes(out + done, page + done, n, stream);
            if (state)
                xxh3.update(state, page + done, n);
        }
    }
    return state ? xxh3.digest(state) : 0;
}

static PyObject *gather(PyObject *module, PyObject *args) {
    Plan plan;
    Py_buffer shared = {0};
    PyObject *share = Py_None;
    int64_t *progress;
    Py_ssize_t limit = 0, copied = 0;
    unsigned long long rows, row_stride, seed, payload_bytes;
    int seal, stream;
    if (!PyArg_ParseTuple(args, "y*KKy*y*pKKp|On:gather", &plan.pages, &rows, &row_stride,
                          &plan.offsets, &plan.sizes, &seal, &seed, &payload_bytes, &stream,
                          &share, &limit))
        return NULL;
    if (progress_of(share, &shared, &progress) < 0) {
        plan_release(&plan);
        return NULL;
    }
    if (plan_check(&plan) < 0) {
        PyBuffer_Release(&shared);
        return NULL;
    }
    const int64_t *pages = plan.pages.buf, *offsets = plan.offsets.buf, *sizes = plan.sizes.buf;
    const int fused = seal && fusable(sizes, plan.segments, payload_bytes);
    Py_BEGIN_ALLOW_THREADS
    /* A state on the stack must be initialized before its first seeded reset, which
       derives the seed's secret only if the seed it finds differs: a thread's stack
       still holds its last call's state there (the same seed), with the secret partly
       overwritten since. Every checksum of the call was then wrong. */
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    for (Py_ssize_t next = 0, v; (v = claim(progress, &next, plan.values, limit, copied)) >= 0;
         copied++) {
        char *row = (char *)(uintptr_t)(rows + v * row_stride);
        const int64_t *value_pages = pages + v * plan.segments;
        uint64_t digest;
#ifdef STREAMING
        if (fused)
            digest = sealcopy_avx2(row, value_pages, offsets, sizes, (size_t)plan.segments,
                                   payload_bytes, seed, stream);
        else
#endif
            digest = copy_in_chunks(row, value_pages, offsets, sizes, plan.segments,
                                    seal ? &state : NULL, seed, stream);
        if (seal)
            memcpy(row + payload_bytes, &digest, CHECKSUM_BYTES);
        value_done(progress, stream);
    }
    if (stream)
        stream_fence();
    Py_END_ALLOW_THREADS
    plan_release(&plan);
    PyBuffer_Release(&shared);
    return PyLong_FromSsize_t(copied);
}

static PyObject *scatter(PyObject *module, PyObject *args) {
    Plan plan;
    Py_buffer intact, shared = {0};
    PyObject *share = Py_None;
    int64_t *progress;
    Py_ssize_t limit = 0, copied = 0;
    unsigned long long rows, row_stride, seed, payload_bytes;
    int check, stream;
    if (!PyArg_ParseTuple(args, "y*KKy*y*pKKw*p|On:scatter", &plan.pages, &rows, &row_stride,
                          &plan.offsets, &plan.sizes, &check, &seed, &payload_bytes, &intact,
                          &stream, &share, &limit))
        return NULL;
    if (progress_of(share, &shared, &progress) < 0) {
        plan_release(&plan);
        PyBuffer_Release(&intact);
        return NULL;
    }
    if (plan_check(&plan) < 0) {
        PyBuffer_Release(&intact);
        PyBuffer_Release(&shared);
        return NULL;
    }
    if (intact.len != plan.values) {
        PyErr_SetString(PyExc_ValueError, "intact must hold one byte per value");
        plan_release(&plan);
        PyBuffer_Release(&intact);
        PyBuffer_Release(&shared);
        return NULL;
    }
    const int64_t *pages = plan.pages.buf, *offsets = plan.offsets.buf, *sizes = plan.sizes.buf;
    unsigned char *ok = intact.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t next = 0, v; (v = claim(progress, &next, plan.values, limit, copied)) >= 0;
         copied++) {
        const char *row = (const char *)(uintptr_t)(rows + v * row_stride);
        /* The whole value is checked before a byte of it reaches the engine; the copy
           then reads it back from cache. */
        if (check) {
            uint64_t sealed;
            memcpy(&sealed, row + payload_bytes, CHECKSUM_BYTES);
            ok[v] = xxh3.oneshot(row, payload_bytes, seed) == sealed;
        } else {
            ok[v] = 1;
        }
        if (ok[v])
            for (Py_ssize_t s = 0; s < plan.segments; s++)
                copy_bytes((char *)(uintptr_t)pages[v * plan.segments + s], row + offsets[s],
                           (size_t)sizes[s], stream);
        value_done(progress, stream);
    }
    if (stream)
        stream_fence();
    Py_END_ALLOW_THREADS
    plan_release(&plan);
    PyBuffer_Release(&intact);
    PyBuffer_Release(&shared);
    return PyLong_FromSsize_t(copied);
}

static PyObject *digests(PyObject *module, PyObject *args) {
    Plan plan = {0}; /* no offsets: a digest reads pages where they lie */
    Py_buffer out, shared = {0};
    PyObject *share = Py_None;
    int64_t *progress;
    Py_ssize_t copied = 0;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*y*Kw*|O:digests", &plan.pages, &plan.sizes, &seed, &out,
                          &share))
        return NULL;
    if (progress_of(share, &shared, &progress) < 0) {
        plan_release(&plan);
        PyBuffer_Release(&out);
        return NULL;
    }
    if (plan_check(&plan) < 0) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&shared);
        return NULL;
    }
    if (out.len != plan.values * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "out must hold 8 bytes per value");
        plan_release(&plan);
        PyBuffer_Release(&out);
        PyBuffer_Release(&shared);
        return NULL;
    }
    const int64_t *pages = plan.pages.buf, *sizes = plan.sizes.buf;
    char *digest_at = out.buf;
    Py_BEGIN_ALLOW_THREADS
    XXH3_state_t state;
    XXH3_INITSTATE(&state); /* as in gather() */
    for (Py_ssize_t next = 0, v; (v = claim(progress, &next, plan.values, 0, copied)) >= 0;
         copied++) {
        xxh3.reset(&state, seed);
        for (Py_ssize_t s = 0; s < plan.segments; s++)
            xxh3.update(&state, (const void *)(uintptr_t)pages[v * plan.segments + s],
                               (size_t)sizes[s]);
        uint64_t digest = xxh3.digest(&state);
        memcpy(digest_at + v * CHECKSUM_BYTES, &digest, CHECKSUM_BYTES);
        value_done(progress, 0);
    }
    Py_END_ALLOW_THREADS
    plan_release(&plan);
    PyBuffer_Release(&out);
    PyBuffer_Release(&shared);
    return PyLong_FromSsize_t(copied);
}

static double seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* Each block's page in each segment: first[s] + id * stride[s], from the geometry's
   segment table (int64 [4, segments]: its first two rows). Worked out here rather than
   with numpy, whose few small calls cost tens of microseconds a request in a busy
   sidecar, where each runs cold. Refused unless every id is a block of every segment:
   the copies trust these addresses. */
static PyObject *page_table(PyObject *module, PyObject *args) {
    PyObject *ids, *fast;
    Py_buffer table;
    Py_ssize_t num_blocks;
    if (!PyArg_ParseTuple(args, "Oy*n:page_table", &ids, &table, &num_blocks))
        return NULL;
    const Py_ssize_t row = 4 * (Py_ssize_t)sizeof(int64_t);
    if (table.len == 0 || table.len % row) {
        PyBuffer_Release(&table);
        PyErr_SetString(PyExc_ValueError, "the segment table must be int64 [4, segments]");
        return NULL;
    }
    if (!(fast = PySequence_Fast(ids, "block ids must be a sequence"))) {
        PyBuffer_Release(&table);
        return NULL;
    }
    const Py_ssize_t segments = table.len / row, count = PySequence_Fast_GET_SIZE(fast);
    const int64_t *first = table.buf, *stride = first + segments;
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * segments * (Py_ssize_t)sizeof(int64_t));
    if (out) {
        int64_t *pages = (int64_t *)PyBytes_AS_STRING(out);
        for (Py_ssize_t b = 0; b < count; b++) {
            Py_ssize_t id = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(fast, b), PyExc_IndexError);
            if (id == -1 && PyErr_Occurred())
                break;
            if (id < 0 || id >= num_blocks) {
                PyErr_Format(PyExc_IndexError, "block ids out of range 0..%zd: %R",
                             num_blocks - 1, ids);
                break;
            }
            for (Py_ssize_t s = 0; s < segments; s++)
                pages[b * segments + s] = first[s] + (int64_t)id * stride[s];
        }
        if (PyErr_Occurred())
            Py_CLEAR(out);
    }
    Py_DECREF(fast);
    PyBuffer_Release(&table);
    return out;
}

/* Spins, without the GIL, until the shared runs' values are all done or spin_s have
   passed: whether they are. For the last values of a copy, in another thread's hands
   for at most the time one takes: a sleeping thread is woken late on a small VM. */
static PyObject *wait_done(PyObject *module, PyObject *args) {
    Py_buffer shared;
    long long values;
    double spin_s;
    if (!PyArg_ParseTuple(args, "w*Ld:wait_done", &shared, &values, &spin_s))
        return NULL;
    if (shared.len % (2 * (Py_ssize_t)sizeof(int64_t)) || (uintptr_t)shared.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "progress must be an aligned int64 [runs, 2]");
        PyBuffer_Release(&shared);
        return NULL;
    }
    const int64_t *progress = shared.buf;
    Py_ssize_t runs = shared.len / (2 * (Py_ssize_t)sizeof(int64_t));
    long long done = 0;
    Py_BEGIN_ALLOW_THREADS
    double deadline = seconds_now() + spin_s;
    for (unsigned spins = 0;; spins++) {
        done = 0;
        for (Py_ssize_t r = 0; r < runs; r++)
            done += __atomic_load_n(&progress[2 * r + 1], __ATOMIC_ACQUIRE);
        if (done >= values || (spins % 64 == 0 && seconds_now() > deadline))
            break;
#ifdef STREAMING
        _mm_pause();
#endif
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&shared);
    return PyBool_FromLong(done >= values);
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

static PyObject *fused_seal(PyObject *module, PyObject *args) {
    int on = -1;
    if (!PyArg_ParseTuple(args, "|i:fused_seal", &on))
        return NULL;
#ifdef STREAMING
    if (on == 1 && !have_avx2)
        return PyErr_Format(PyExc_ValueError, "this CPU has no AVX2 to seal in the copy's pass");
    if (on != -1)
        use_fused = on != 0;
    return PyBool_FromLong(use_fused);
#else
    if (on == 1)
        return PyErr_Format(PyExc_ValueError, "sealing in the copy's pass needs x86-64 AVX2");
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(pages, rows, row_stride, offsets, sizes, seal, seed, payload_bytes, stream\n"
     "       [, progress[, limit]])\n"
     "Copy each value's pages into its row, then (seal) its checksum after them;\n"
     "stream: write the rows around the caches; progress: shared with other callers,\n"
     "limit: at most so many values copied here. Returns the values copied here."},
    {"scatter", scatter, METH_VARARGS,
     "scatter(pages, rows, row_stride, offsets, sizes, check, seed, payload_bytes, intact,\n"
     "        stream[, progress[, limit]])\n"
     "Copy each intact value's row into its pages; intact[v]: whether value v was;\n"
     "stream: write the pages around the caches; progress: shared with other callers,\n"
     "limit: at most so many values copied here. Returns the values copied here."},
    {"page_table", page_table, METH_VARARGS,
     "page_table(block_ids, segment_table, num_blocks)\n"
     "Each block's page in each segment (int64 [blocks, segments], as bytes): the\n"
     "pages argument of gather, scatter and digests. IndexError unless every id is\n"
     "in range(num_blocks)."},
    {"wait_done", wait_done, METH_VARARGS,
     "wait_done(progress, values, spin_s)\n"
     "Spin until the shared runs' values are all done, for at most spin_s: whether they are."},
    {"digests", digests, METH_VARARGS,
     "digests(pages, sizes, seed, out[, progress])\n"
     "Each value's checksum over its pages where they lie, into out (8 bytes each);\n"
     "progress: shared with other callers. Returns the values digested here."},
    {"stream_width", stream_width, METH_VARARGS,
     "stream_width([width])\n"
     "The bytes each streaming store writes (0: the CPU has none); with width, use that\n"
     "width from now on (16, or 32 on a CPU with AVX)."},
    {"fused_seal", fused_seal, METH_VARARGS,
     "fused_seal([on])\n"
     "Whether a save seals each value in the copy's pass, where its pages allow; with on,\n"
     "do so from now on or not (on: only on a CPU with AVX2)."},
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
    have_avx2 = use_fused = __builtin_cpu_supports("avx2");
    if (have_avx2)
        xxh3 = kv_xxh3_avx2;
#endif
    return PyModule_Create(&module);
}
