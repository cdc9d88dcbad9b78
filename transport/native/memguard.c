/* Shared-memory mappings that survive their file being shrunk under them.
 *
 * A process that maps another process's memory file (a memfd, a /dev/shm file) dies by
 * SIGBUS when it touches a page past the file's end, and the file's owner may shrink
 * it at any time. As libwayland does for clients' shm pools, a SIGBUS handler looks
 * the faulting address up in a table of watched mappings; when it lies in one, the
 * whole mapping is replaced in place by anonymous zero pages (same address, length and
 * protection), the mapping is marked lost, and the faulting instruction resumes and
 * reads zeros (or writes into memory no one else sees). The caller checks lost()
 * after its access and discards what it read.
 *
 * A fault outside every watched mapping, or a SIGBUS sent by kill()/raise(), goes to
 * the handler that was installed before this one, so a real crash stays a crash (and
 * faulthandler still prints its traceback).
 *
 * Contracts:
 * - watch() before the first access that may fault; unwatch() before the mapping is
 *   closed: a slot still watched after munmap would let a later, unrelated mapping at
 *   the same address be zeroed on its own SIGBUS.
 * - watch(), lost(), unwatch() and watched() run with the GIL, which serialises every
 *   writer of the table; the handler only reads base/len and sets lost, all atomics.
 * - Replacing memory from a handler calls mmap(), not on POSIX's async-signal-safe
 *   list but a plain system call on Linux (libwayland relies on the same).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#define NSLOTS 65536 /* 64 engines of 1024 segments each */
#define INDEX_BITS 16 /* token = generation << INDEX_BITS | slot index */

_Static_assert(ATOMIC_POINTER_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "the handler needs lock-free atomics");
_Static_assert(NSLOTS <= (1 << INDEX_BITS), "slot index must fit in the token");

typedef struct {
    _Atomic uintptr_t base; /* 0: free. Stored last (release), so len/prot are set when seen */
    _Atomic size_t len;     /* rounded up to whole pages, as the mapping is */
    atomic_int prot;        /* PROT_READ for a read-only buffer, else also PROT_WRITE */
    atomic_int lost;        /* set by the handler once the mapping is replaced */
    uint64_t gen;           /* bumped on every watch of the slot; GIL only */
} slot_t;

static slot_t slots[NSLOTS];
static _Atomic size_t top;   /* slots ever used: the handler scans [0, top) */
static Py_ssize_t in_use;    /* GIL only */
static size_t page_size;

/* The action that was installed before ours, taken over each time watch() finds ours
 * replaced. Written with the GIL, read by the handler (a rewrite racing a fault in
 * another thread is not guarded against). */
static struct sigaction prev;
/* Set when a signal is handed to `prev`: a raise of SIGBUS by this process coming back
 * to us afterwards means `prev` restored its own previous action, which is ours (the
 * chain loops, as when faulthandler was enabled after a watch() and another watch()
 * re-installed ours on top of it). */
static atomic_int chained;

/* Hand the signal on as if ours had never been installed. */
static void chain(int sig, siginfo_t *info, void *uctx)
{
    int sent = info->si_code <= 0; /* kill(), raise(), tgkill(): no fault to repeat */
    if (!(sent && info->si_pid == getpid() && atomic_load(&chained))) {
        if (prev.sa_flags & SA_SIGINFO) {
            atomic_store(&chained, 1);
            prev.sa_sigaction(sig, info, uctx);
            return;
        }
        if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
            atomic_store(&chained, 1);
            prev.sa_handler(sig);
            return;
        }
        if (prev.sa_handler == SIG_IGN && sent)
            return; /* an ignored SIGBUS stays ignored; the kernel kills for a fault anyway */
    }
    /* The default action: the fault repeats on return (a sent signal is sent again,
     * pending until we return) and the process dies by SIGBUS as it would have. */
    struct sigaction dfl = {.sa_handler = SIG_DFL};
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    if (sent)
        raise(sig);
}

/* Async-signal-safe: atomics, mmap, sigaction, getpid, raise; no locks, no allocation. */
static void on_sigbus(int sig, siginfo_t *info, void *uctx)
{
    int saved_errno = errno;
    if (info->si_code > 0) { /* a fault: si_addr is the address touched */
        atomic_store(&chained, 0);
        uintptr_t addr = (uintptr_t)info->si_addr;
        size_t n = atomic_load_explicit(&top, memory_order_acquire);
        for (size_t i = 0; i < n; i++) {
            uintptr_t base = atomic_load_explicit(&slots[i].base, memory_order_acquire);
            if (base == 0 || addr - base >= atomic_load_explicit(&slots[i].len,
                                                                 memory_order_relaxed))
                continue;
            /* Every faulting thread replaces the mapping again: a later fault can only
             * come from a thread that faulted before the first replacement (anonymous
             * pages do not fault), and the contents are forfeit once lost. Marked lost
             * first: another thread may read the zeros as soon as they are mapped, and
             * must then find the mapping lost when it checks. */
            atomic_store(&slots[i].lost, 1);
            if (mmap((void *)base, atomic_load_explicit(&slots[i].len, memory_order_relaxed),
                     atomic_load_explicit(&slots[i].prot, memory_order_relaxed),
                     MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                == MAP_FAILED)
                break; /* no memory to replace it with: die as before */
            errno = saved_errno;
            return;
        }
    }
    chain(sig, info, uctx);
    errno = saved_errno;
}

/* Install ours unless it is installed, taking whatever is there as the one to chain to. */
static int install(void)
{
    struct sigaction cur, ours = {.sa_sigaction = on_sigbus,
                                  .sa_flags = SA_SIGINFO | SA_ONSTACK};
    if (sigaction(SIGBUS, NULL, &cur) != 0)
        return -1;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus)
        return 0;
    prev = cur; /* before ours is live, so a fault never sees a stale previous action */
    sigemptyset(&ours.sa_mask);
    return sigaction(SIGBUS, &ours, NULL);
}

/* The slot a token names while that watch is live, else NULL (*err set, with an
 * exception, for something that is not a non-negative int). */
static slot_t *lookup(PyObject *token, int *err)
{
    unsigned long long t = PyLong_AsUnsignedLongLong(token);
    *err = t == (unsigned long long)-1 && PyErr_Occurred();
    if (*err)
        return NULL;
    size_t i = (size_t)(t & ((1u << INDEX_BITS) - 1));
    if (i >= NSLOTS)
        return NULL;
    slot_t *s = &slots[i];
    if (atomic_load(&s->base) == 0 || s->gen != t >> INDEX_BITS)
        return NULL;
    return s;
}

static PyObject *watch(PyObject *self, PyObject *obj)
{
    (void)self;
    Py_buffer view;
    /* Only the address and length are kept: the export is released at once, so that
     * mmap.close() does not fail with BufferError. */
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) != 0)
        return NULL;
    uintptr_t base = (uintptr_t)view.buf;
    size_t len = (size_t)view.len;
    int readonly = view.readonly;
    PyBuffer_Release(&view);
    if (len == 0 || base % page_size != 0) {
        PyErr_SetString(PyExc_ValueError, "watch() needs a non-empty, page-aligned mapping");
        return NULL;
    }
    size_t i = 0;
    while (i < NSLOTS && atomic_load(&slots[i].base) != 0)
        i++;
    if (i == NSLOTS) {
        PyErr_SetString(PyExc_OverflowError, "memguard: every slot is watched");
        return NULL;
    }
    if (install() != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    slot_t *s = &slots[i];
    s->gen = (s->gen + 1) & (UINT64_MAX >> INDEX_BITS);
    atomic_store(&s->len, (len + page_size - 1) / page_size * page_size);
    atomic_store(&s->prot, readonly ? PROT_READ : PROT_READ | PROT_WRITE);
    atomic_store(&s->lost, 0);
    if (atomic_load(&top) <= i)
        atomic_store_explicit(&top, i + 1, memory_order_release);
    atomic_store_explicit(&s->base, base, memory_order_release);
    in_use++;
    return PyLong_FromUnsignedLongLong(s->gen << INDEX_BITS | i);
}

static PyObject *lost(PyObject *self, PyObject *token)
{
    (void)self;
    int err;
    slot_t *s = lookup(token, &err);
    if (err)
        return NULL;
    return PyBool_FromLong(s != NULL && atomic_load(&s->lost));
}

static PyObject *unwatch(PyObject *self, PyObject *token)
{
    (void)self;
    int err;
    slot_t *s = lookup(token, &err);
    if (err)
        return NULL;
    if (s != NULL) {
        atomic_store_explicit(&s->base, 0, memory_order_release);
        in_use--;
    }
    Py_RETURN_NONE;
}

static PyObject *watched(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromSsize_t(in_use);
}

static PyMethodDef methods[] = {
    {"watch", watch, METH_O,
     "watch(mapping) -> int: survive the mapping's file being shrunk; a token for lost() "
     "and unwatch()."},
    {"lost", lost, METH_O,
     "lost(token) -> bool: whether a fault replaced the mapping with zeros (False once "
     "unwatched, or for a token never given)."},
    {"unwatch", unwatch, METH_O,
     "unwatch(token) -> None: stop watching (before closing the mapping); idempotent."},
    {"watched", watched, METH_NOARGS, "watched() -> int: how many mappings are watched."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "transport._memguard",
    .m_doc = "Shared-memory mappings that survive their file being shrunk (a SIGBUS handler).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__memguard(void)
{
    page_size = (size_t)sysconf(_SC_PAGESIZE);
    return PyModule_Create(&module);
}
