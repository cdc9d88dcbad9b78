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

#define _GNU_SOURCE /* pthread_setname_np */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

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

/* The copies themselves: they touch no Python object, so they run without the GIL,
   in a caller that let it go or in a pool thread that never had it. */
static void run_gather(const Plan *plan, uint64_t rows, uint64_t row_stride, int seal,
                       uint64_t seed, uint64_t payload_bytes, int stream) {
    const int64_t *pages = plan->pages.buf, *offsets = plan->offsets.buf,
                  *sizes = plan->sizes.buf;
    XXH3_state_t state;
    for (Py_ssize_t v = 0; v < plan->values; v++) {
        char *row = (char *)(uintptr_t)(rows + v * row_stride);
        if (seal)
            XXH3_64bits_reset_withSeed(&state, seed);
        for (Py_ssize_t s = 0; s < plan->segments; s++) {
            const char *page = (const char *)(uintptr_t)pages[v * plan->segments + s];
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
}

static void run_scatter(const Plan *plan, uint64_t rows, uint64_t row_stride, int check,
                        uint64_t seed, uint64_t payload_bytes, unsigned char *ok, int stream) {
    const int64_t *pages = plan->pages.buf, *offsets = plan->offsets.buf,
                  *sizes = plan->sizes.buf;
    for (Py_ssize_t v = 0; v < plan->values; v++) {
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
        for (Py_ssize_t s = 0; s < plan->segments; s++)
            copy_bytes((char *)(uintptr_t)pages[v * plan->segments + s], row + offsets[s],
                       (size_t)sizes[s], stream);
    }
    if (stream)
        stream_fence();
}

/* One copy call: a run of values, its tables, and what to do. */
typedef struct {
    int scatter; /* else gather */
    Plan plan;
    Py_buffer intact; /* scatter: one byte per value, whether it was intact */
    unsigned long long rows, row_stride, seed, payload_bytes;
    int checksum; /* gather: seal; scatter: check */
    int stream;
} Copy;

static void copy_release(Copy *copy) {
    plan_release(&copy->plan);
    if (copy->scatter)
        PyBuffer_Release(&copy->intact);
}

/* Parses a copy's arguments (those of gather or scatter); on failure, nothing is held and
   an error is set. */
static int copy_parse(Copy *copy, int scatter, PyObject *args) {
    memset(copy, 0, sizeof *copy);
    copy->scatter = scatter;
    Plan *plan = &copy->plan;
    if (scatter) {
        if (!PyArg_ParseTuple(args, "y*KKy*y*pKKw*p:scatter", &plan->pages, &copy->rows,
                              &copy->row_stride, &plan->offsets, &plan->sizes, &copy->checksum,
                              &copy->seed, &copy->payload_bytes, &copy->intact, &copy->stream))
            return -1;
    } else if (!PyArg_ParseTuple(args, "y*KKy*y*pKKp:gather", &plan->pages, &copy->rows,
                                 &copy->row_stride, &plan->offsets, &plan->sizes,
                                 &copy->checksum, &copy->seed, &copy->payload_bytes,
                                 &copy->stream)) {
        return -1;
    }
    if (plan_check(plan) < 0) {
        if (scatter)
            PyBuffer_Release(&copy->intact);
        return -1;
    }
    if (scatter && copy->intact.len != plan->values) {
        PyErr_SetString(PyExc_ValueError, "intact must hold one byte per value");
        copy_release(copy);
        return -1;
    }
    return 0;
}

static void copy_run(const Copy *copy) {
    if (copy->scatter)
        run_scatter(&copy->plan, copy->rows, copy->row_stride, copy->checksum, copy->seed,
                    copy->payload_bytes, copy->intact.buf, copy->stream);
    else
        run_gather(&copy->plan, copy->rows, copy->row_stride, copy->checksum, copy->seed,
                   copy->payload_bytes, copy->stream);
}

static PyObject *copy_now(PyObject *args, int scatter) {
    Copy copy;
    if (copy_parse(&copy, scatter, args) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    copy_run(&copy);
    Py_END_ALLOW_THREADS
    copy_release(&copy);
    Py_RETURN_NONE;
}

static PyObject *gather(PyObject *module, PyObject *args) { return copy_now(args, 0); }

static PyObject *scatter(PyObject *module, PyObject *args) { return copy_now(args, 1); }

/* A pool of threads of this module's own that run copies handed to them and never take
   the GIL: not to start a copy, not to report it done. A Python thread that ran the
   same copy took the GIL back as the copy returned, and again to report it, each time
   while the event loop might be letting it go for a moment (a socket send, a torch
   op): the event loop then waited for that thread to be scheduled, let go and be
   scheduled again, on a host whose cores the engines keep busy.

   Python submits a batch of copies with a token; the thread that runs a batch's last
   copy counts it on an eventfd, which the event loop watches (one wake-up a batch), and
   collect() hands back the tokens of the batches run since, with the GIL, releasing
   their buffers there. */

typedef struct Batch Batch;

typedef struct Job {
    struct Job *next; /* in the queue */
    Copy copy;
    Batch *batch;
} Job;

struct Batch {
    Batch *next; /* among those done */
    PyObject *token;
    Py_ssize_t count, left;
    Job *jobs; /* count of them */
};

static void batch_free(Batch *batch) {
    for (Py_ssize_t i = 0; i < batch->count; i++)
        copy_release(&batch->jobs[i].copy);
    Py_DECREF(batch->token);
    PyMem_RawFree(batch->jobs);
    PyMem_RawFree(batch);
}

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t wake;    /* a job was queued, or the pool is closing */
    pthread_cond_t started; /* a thread has started */
    Job *queued, *queued_tail;
    Batch *done;
    int efd;
    int closing, closed;
    int nice, nice_error;
    char name[16]; /* each thread's is this with its index, as Linux keeps it (15 bytes) */
    Py_ssize_t threads, started_threads;
    pthread_t *handles;
    long *native_ids;
} Pool;

static void *pool_thread(void *arg) {
    Pool *pool = arg;
    long tid = (long)syscall(SYS_gettid);
    int error = 0;
    if (pool->nice) {
        /* Linux keeps a nice value per thread: this lowers this thread's only. */
        errno = 0;
        int now = getpriority(PRIO_PROCESS, (id_t)tid);
        if ((now == -1 && errno) || setpriority(PRIO_PROCESS, (id_t)tid, now + pool->nice))
            error = errno;
    }
    pthread_mutex_lock(&pool->lock);
    char name[32];
    snprintf(name, sizeof name, "%s%zd", pool->name, pool->started_threads);
    name[15] = 0;
    pthread_setname_np(pthread_self(), name);
    pool->native_ids[pool->started_threads++] = tid;
    if (error)
        pool->nice_error = error;
    pthread_cond_broadcast(&pool->started);
    for (;;) {
        while (!pool->queued && !pool->closing)
            pthread_cond_wait(&pool->wake, &pool->lock);
        Job *job = pool->queued;
        if (!job) /* closing, and every job queued has run */
            break;
        pool->queued = job->next;
        if (!pool->queued)
            pool->queued_tail = NULL;
        pthread_mutex_unlock(&pool->lock);
        copy_run(&job->copy);
        pthread_mutex_lock(&pool->lock);
        Batch *batch = job->batch;
        if (--batch->left == 0) {
            batch->next = pool->done;
            pool->done = batch;
            uint64_t one = 1;
            ssize_t written = write(pool->efd, &one, sizeof one);
            (void)written; /* fails only if the counter would overflow: it is read meanwhile */
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

/* Lets the threads finish what is queued and waits for them (GIL released). */
static void pool_stop(Pool *pool) {
    pthread_mutex_lock(&pool->lock);
    pool->closing = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < pool->started_threads; i++)
        pthread_join(pool->handles[i], NULL);
    Py_END_ALLOW_THREADS
}

/* The tokens of the batches run, their buffers released; the list is new. */
static PyObject *pool_take_done(Pool *pool) {
    pthread_mutex_lock(&pool->lock);
    Batch *batch = pool->done;
    pool->done = NULL;
    pthread_mutex_unlock(&pool->lock);
    PyObject *tokens = PyList_New(0);
    while (batch) {
        Batch *next = batch->next;
        if (tokens && PyList_Append(tokens, batch->token) < 0)
            Py_CLEAR(tokens);
        batch_free(batch);
        batch = next;
    }
    return tokens;
}

static void pool_close(Pool *pool) {
    if (pool->closed)
        return;
    pool->closed = 1;
    pool_stop(pool);
    Py_XDECREF(pool_take_done(pool));
    close(pool->efd);
}

static void Pool_dealloc(Pool *pool) {
    if (pool->handles) { /* fully made */
        pool_close(pool);
        pthread_mutex_destroy(&pool->lock);
        pthread_cond_destroy(&pool->wake);
        pthread_cond_destroy(&pool->started);
    }
    PyMem_Free(pool->handles);
    PyMem_Free(pool->native_ids);
    Py_TYPE(pool)->tp_free((PyObject *)pool);
}

static PyObject *Pool_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"threads", "nice", "name", NULL};
    Py_ssize_t threads;
    int nice = 0;
    const char *name = "";
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n|is:Pool", keywords, &threads, &nice,
                                     &name))
        return NULL;
    if (threads < 1)
        return PyErr_Format(PyExc_ValueError, "threads must be at least 1, got %zd", threads);
    Pool *pool = (Pool *)type->tp_alloc(type, 0);
    if (!pool)
        return NULL;
    pool->nice = nice;
    snprintf(pool->name, sizeof pool->name, "%s", name);
    pool->threads = threads;
    pool->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (pool->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(pool);
        return NULL;
    }
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->started, NULL);
    pool->native_ids = PyMem_Calloc((size_t)threads, sizeof(long));
    pool->handles = PyMem_Calloc((size_t)threads, sizeof(pthread_t));
    if (!pool->native_ids || !pool->handles) {
        PyErr_NoMemory();
        Py_DECREF(pool);
        return NULL;
    }
    int error = 0;
    Py_ssize_t created = 0;
    for (; created < threads && !error; created++)
        error = pthread_create(&pool->handles[created], NULL, pool_thread, pool);
    if (error)
        created--;
    /* Every thread created has said so (and set its priority) before any job exists. */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&pool->lock);
    while (pool->started_threads < created)
        pthread_cond_wait(&pool->started, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
    Py_END_ALLOW_THREADS
    if (error) {
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(pool); /* stops the threads created */
        return NULL;
    }
    return (PyObject *)pool;
}

static PyObject *Pool_run(Pool *pool, PyObject *args) {
    int scatter;
    PyObject *token, *calls;
    if (!PyArg_ParseTuple(args, "pOO!:run", &scatter, &token, &PyList_Type, &calls))
        return NULL;
    if (pool->closed)
        return PyErr_Format(PyExc_RuntimeError, "the copy pool is closed");
    Py_ssize_t count = PyList_GET_SIZE(calls);
    if (count == 0)
        return PyErr_Format(PyExc_ValueError, "a batch needs a copy");
    Batch *batch = PyMem_RawCalloc(1, sizeof *batch);
    Job *jobs = PyMem_RawCalloc((size_t)count, sizeof *jobs);
    if (!batch || !jobs) {
        PyMem_RawFree(batch);
        PyMem_RawFree(jobs);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *call = PyList_GET_ITEM(calls, i);
        if (!PyTuple_Check(call)) {
            PyErr_SetString(PyExc_TypeError, "each copy's arguments must be a tuple");
        } else if (copy_parse(&jobs[i].copy, scatter, call) == 0) {
            jobs[i].batch = batch;
            jobs[i].next = i + 1 < count ? &jobs[i + 1] : NULL;
            continue;
        }
        while (i--) /* those parsed, released */
            copy_release(&jobs[i].copy);
        PyMem_RawFree(jobs);
        PyMem_RawFree(batch);
        return NULL;
    }
    batch->token = Py_NewRef(token);
    batch->count = batch->left = count;
    batch->jobs = jobs;
    pthread_mutex_lock(&pool->lock);
    if (pool->queued_tail)
        pool->queued_tail->next = jobs;
    else
        pool->queued = jobs;
    pool->queued_tail = &jobs[count - 1];
    if (count > 1)
        pthread_cond_broadcast(&pool->wake);
    else
        pthread_cond_signal(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    Py_RETURN_NONE;
}

static PyObject *Pool_collect(Pool *pool, PyObject *unused) {
    uint64_t count;
    ssize_t got = read(pool->efd, &count, sizeof count); /* resets it; EAGAIN: none since */
    (void)got;
    return pool_take_done(pool);
}

static PyObject *Pool_fileno(Pool *pool, PyObject *unused) {
    if (pool->closed)
        return PyErr_Format(PyExc_RuntimeError, "the copy pool is closed");
    return PyLong_FromLong(pool->efd);
}

static PyObject *Pool_native_ids(Pool *pool, PyObject *unused) {
    PyObject *ids = PyList_New(pool->started_threads);
    for (Py_ssize_t i = 0; ids && i < pool->started_threads; i++) {
        PyObject *id = PyLong_FromLong(pool->native_ids[i]);
        if (!id) {
            Py_CLEAR(ids);
            break;
        }
        PyList_SET_ITEM(ids, i, id);
    }
    return ids;
}

static PyObject *Pool_close(Pool *pool, PyObject *unused) {
    pool_close(pool);
    Py_RETURN_NONE;
}

static PyObject *Pool_nice_error(Pool *pool, void *closure) {
    return PyLong_FromLong(pool->nice_error);
}

static PyMethodDef pool_methods[] = {
    {"run", (PyCFunction)Pool_run, METH_VARARGS,
     "run(scatter, token, calls): queue a batch of copies for the threads, each scatter(*args)\n"
     "(else gather(*args)) for args in calls (a list of tuples); collect() returns token\n"
     "once every one has run."},
    {"collect", (PyCFunction)Pool_collect, METH_NOARGS,
     "collect(): the tokens of the batches run since the last call (fileno() is readable\n"
     "while there are some)."},
    {"fileno", (PyCFunction)Pool_fileno, METH_NOARGS,
     "fileno(): an eventfd, readable once a copy has run."},
    {"native_ids", (PyCFunction)Pool_native_ids, METH_NOARGS,
     "native_ids(): each thread's id (Linux's, as threading.get_native_id gives)."},
    {"close", (PyCFunction)Pool_close, METH_NOARGS,
     "close(): run what is queued, end the threads; batches run but not collected are\n"
     "dropped. Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"nice_error", (getter)Pool_nice_error, NULL,
     "The errno of a thread that could not lower its priority (0: none).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pipeline.backends._blockcopy.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(threads, nice=0, name=''): threads that run copies without the GIL,\n"
              "named name0, name1, ... (15 bytes at most).",
    .tp_new = Pool_new,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
};

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
    if (PyType_Ready(&PoolType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddObjectRef(m, "Pool", (PyObject *)&PoolType) < 0)
        Py_CLEAR(m);
    return m;
}
