/* Block copies with their checksums, one call per run of values, without the GIL.

   A value is its block's pages (one per segment) back to back, then 8 bytes: the
   xxh3-64 of those pages, seeded (pipeline.core.integrity). Python hands a run of
   values over as addresses it worked out from tensors it holds; this file only moves
   bytes and hashes them, so a copy thread takes the GIL once per run instead of once
   per page, and a saved page is hashed chunk by chunk while it is still in L1.

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

/* Small enough that a chunk just written is still in L1 when it is hashed. */
#define CHUNK_BYTES (16 * 1024)
#define CHECKSUM_BYTES 8

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
    int seal;
    if (!PyArg_ParseTuple(args, "y*KKy*y*pKK:gather", &plan.pages, &rows, &row_stride,
                          &plan.offsets, &plan.sizes, &seal, &seed, &payload_bytes))
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
                memcpy(out + done, page + done, n);
                if (seal)
                    XXH3_64bits_update(&state, out + done, n);
            }
        }
        if (seal) {
            uint64_t digest = XXH3_64bits_digest(&state);
            memcpy(row + payload_bytes, &digest, CHECKSUM_BYTES);
        }
    }
    Py_END_ALLOW_THREADS
    plan_release(&plan);
    Py_RETURN_NONE;
}

static PyObject *scatter(PyObject *module, PyObject *args) {
    Plan plan;
    Py_buffer intact;
    unsigned long long rows, row_stride, seed, payload_bytes;
    int check;
    if (!PyArg_ParseTuple(args, "y*KKy*y*pKKw*:scatter", &plan.pages, &rows, &row_stride,
                          &plan.offsets, &plan.sizes, &check, &seed, &payload_bytes, &intact))
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
            memcpy((char *)(uintptr_t)pages[v * plan.segments + s], row + offsets[s],
                   (size_t)sizes[s]);
    }
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

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(pages, rows, row_stride, offsets, sizes, seal, seed, payload_bytes)\n"
     "Copy each value's pages into its row, then (seal) its checksum after them."},
    {"scatter", scatter, METH_VARARGS,
     "scatter(pages, rows, row_stride, offsets, sizes, check, seed, payload_bytes, intact)\n"
     "Copy each intact value's row into its pages; intact[v]: whether value v was."},
    {"digests", digests, METH_VARARGS,
     "digests(pages, sizes, seed, out)\n"
     "Each value's checksum over its pages where they lie, into out (8 bytes each)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pipeline.backends._blockcopy",
    "Block copies with their checksums, without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__blockcopy(void) { return PyModule_Create(&module); }
