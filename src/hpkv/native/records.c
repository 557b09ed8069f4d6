/* hpkv's native data path: a batch of chunk records read from their files and checked in one call
 * that releases Python's GIL until every record has landed.
 *
 * Each record costs, in Python, an open, a stat, a page-cache question, a read, a checksum and a
 * close: every one a round trip for the GIL, which an engine's own loop holds for up to its switch
 * interval each time. Here a batch costs one call, spread over threads of its own.
 *
 * The record format is core/record.py's (a 64-byte header, then the payload); the checksum is
 * xxh3-64 from the xxhash package's own library (bound at import by hpkv.native, so both sides
 * compute the same function from the same code).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define HEADER_BYTES 64
#define PAGE 4096
#define MAX_PIECES 1024

/* Statuses: 0..6 are record.Verdict's (in its order), the rest say why nothing was checked. */
enum {
    ST_OK = 0,
    ST_SHORT = 1,
    ST_BAD_HEADER = 2,
    ST_WRONG_NAMESPACE = 3,
    ST_WRONG_KEY = 4,
    ST_WRONG_LENGTH = 5,
    ST_BAD_CHECKSUM = 6,
    ST_NOT_FOUND = 7,   /* no such file */
    ST_NOT_REGULAR = 8, /* a link, a FIFO, a directory at the name */
    ST_IO_ERROR = 9,    /* errno says which */
    ST_NOT_CACHED = 10, /* cached-only mode: not whole in the page cache, not read */
};

/* Modes: how a file is read. */
enum {
    MODE_BUFFERED = 0, /* plain reads */
    MODE_CACHED = 1,   /* only if whole in the page cache, else ST_NOT_CACHED */
    MODE_DIRECT = 2,   /* buffered if whole in the page cache, else O_DIRECT where it works */
};

/* How a file was read (the result's ``how``). */
enum { HOW_NONE = 0, HOW_BUFFERED = 1, HOW_CACHED = 2, HOW_DIRECT = 3, HOW_DIRECT_REFUSED = 4 };

typedef void *(*create_state_fn)(void);
typedef int (*free_state_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);

static create_state_fn xxh3_create;
static free_state_fn xxh3_free;
static reset_fn xxh3_reset;
static update_fn xxh3_update;
static digest_fn xxh3_digest;

typedef struct {
    PyObject *path; /* bytes, kept by the job list */
    Py_buffer *bufs; /* nbufs of them, PyMem */
    int nbufs;
    size_t expected; /* record bytes: header + payload */
    unsigned char ns[16], key[16];
    int version, check, mode;
    /* results */
    int status, how, err;
    int64_t nread;
    uint64_t ino;
} job_t;

typedef struct {
    job_t *jobs;
    Py_ssize_t n;
    atomic_long next;
} batch_t;

static int cachestat_works = 1;

/* Whether every page of the file's first ``size`` bytes is in the page cache (0 when the kernel
 * will not say). cachestat(2) where the kernel has it (one call per file), else mincore(2). */
static int all_cached(int fd, size_t size) {
    size_t pages = (size + PAGE - 1) / PAGE;
    if (!size) return 1;
    if (cachestat_works) {
        struct { uint64_t off, len; } range = {0, size};
        uint64_t st[5] = {0};
        long rc = syscall(451, fd, &range, st, 0);
        if (rc == 0) return st[0] >= pages;
        if (errno != ENOSYS && errno != EPERM) return 0;
        cachestat_works = 0;
    }
    void *addr = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    if (addr == MAP_FAILED) return 0;
    unsigned char *vec = malloc(pages);
    int all = 0;
    if (vec && mincore(addr, size, vec) == 0) {
        all = 1;
        for (size_t i = 0; i < pages; i++)
            if (!(vec[i] & 1)) { all = 0; break; }
    }
    free(vec);
    munmap(addr, size);
    return all;
}

/* Read from ``offset`` to the end of the buffers (or the file), resuming after short reads.
 * Returns the bytes read, or -1 with errno. */
static int64_t read_from(int fd, job_t *j, size_t offset) {
    struct iovec iov[MAX_PIECES];
    int64_t total = (int64_t)offset;
    for (;;) {
        size_t skip = (size_t)total, at = 0;
        int n = 0;
        for (int b = 0; b < j->nbufs; b++) {
            size_t len = (size_t)j->bufs[b].len;
            if (skip >= at + len) { at += len; continue; }
            size_t from = skip > at ? skip - at : 0;
            iov[n].iov_base = (char *)j->bufs[b].buf + from;
            iov[n].iov_len = len - from;
            n++;
            at += len;
        }
        if (!n) return total;
        ssize_t got = preadv(fd, iov, n, total);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) return total;
        total += got;
    }
}

static int direct_ok = 1; /* until a file system refuses O_DIRECT */

static void read_job(job_t *j) {
    int fd = open(PyBytes_AS_STRING(j->path), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        j->err = errno;
        j->status = errno == ENOENT ? ST_NOT_FOUND : errno == ELOOP ? ST_NOT_REGULAR : ST_IO_ERROR;
        return;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        j->err = errno;
        j->status = ST_IO_ERROR;
        close(fd);
        return;
    }
    j->ino = (uint64_t)st.st_ino;
    if (!S_ISREG(st.st_mode)) {
        j->status = ST_NOT_REGULAR;
        close(fd);
        return;
    }
    size_t size = (size_t)st.st_size;
    if (size > j->expected) { /* longer than a record of this layout: never read */
        j->nread = (int64_t)j->expected + 1;
        j->status = ST_WRONG_LENGTH;
        close(fd);
        return;
    }
    int64_t total = 0;
    j->how = HOW_BUFFERED;
    if (j->mode != MODE_BUFFERED) {
        if (all_cached(fd, size)) {
            j->how = HOW_CACHED;
        } else if (j->mode == MODE_CACHED) {
            j->status = ST_NOT_CACHED;
            j->how = HOW_NONE;
            close(fd);
            return;
        } else if (direct_ok && j->nbufs == 1 && ((uintptr_t)j->bufs[0].buf % PAGE) == 0) {
            int dfd = open(PyBytes_AS_STRING(j->path), O_RDONLY | O_DIRECT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
            if (dfd < 0 && errno == EINVAL) {
                direct_ok = 0;
                j->how = HOW_DIRECT_REFUSED;
            } else if (dfd >= 0) {
                /* Whole pages only: O_DIRECT needs aligned lengths; the tail goes buffered. */
                size_t body = (size_t)j->bufs[0].len / PAGE * PAGE;
                ssize_t got = body ? pread(dfd, j->bufs[0].buf, body, 0) : 0;
                if (got > 0) total = got;
                close(dfd);
                j->how = HOW_DIRECT;
            }
        }
    }
    if ((size_t)total < size) total = read_from(fd, j, (size_t)total);
    if (total < 0) {
        j->err = errno;
        j->status = ST_IO_ERROR;
        close(fd);
        return;
    }
    close(fd);
    j->nread = total;
}

static uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* record.verify's checks, in its order: the header, the length, the checksum. */
static void check_job(job_t *j, void *state) {
    const unsigned char *h = j->bufs[0].buf;
    size_t payload = j->expected - HEADER_BYTES;
    if (j->nread < HEADER_BYTES) { j->status = ST_SHORT; return; }
    if (memcmp(h, "HPKV", 4) != 0 || le16(h + 4) != j->version || le16(h + 6) != HEADER_BYTES) {
        j->status = ST_BAD_HEADER;
        return;
    }
    if (memcmp(h + 8, j->ns, 16) != 0) { j->status = ST_WRONG_NAMESPACE; return; }
    if (memcmp(h + 24, j->key, 16) != 0) { j->status = ST_WRONG_KEY; return; }
    if (le64(h + 40) != payload) { j->status = ST_WRONG_LENGTH; return; }
    if ((size_t)j->nread < j->expected) { j->status = ST_SHORT; return; }
    if ((size_t)j->nread > j->expected) { j->status = ST_WRONG_LENGTH; return; }
    j->status = ST_OK;
    if (!j->check || j->version != 1) return; /* a MAC'd record: the caller checks its MAC */
    xxh3_reset(state);
    size_t at = 0;
    for (int b = 0; b < j->nbufs; b++) {
        size_t len = (size_t)j->bufs[b].len, from = 0;
        if (at + len <= HEADER_BYTES) { at += len; continue; }
        if (at < HEADER_BYTES) from = HEADER_BYTES - at;
        size_t end = len;
        if (at + end > j->expected) end = j->expected > at ? j->expected - at : 0;
        if (end > from) xxh3_update(state, (const char *)j->bufs[b].buf + from, end - from);
        at += len;
    }
    if (xxh3_digest(state) != le64(h + 48)) j->status = ST_BAD_CHECKSUM;
}

static void *worker(void *arg) {
    batch_t *b = arg;
    void *state = xxh3_create();
    for (;;) {
        long i = atomic_fetch_add(&b->next, 1);
        if (i >= b->n) break;
        job_t *j = &b->jobs[i];
        read_job(j);
        if (j->status == ST_OK && j->nread >= 0) check_job(j, state);
    }
    xxh3_free(state);
    return NULL;
}

static void release_jobs(job_t *jobs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        for (int b = 0; b < jobs[i].nbufs; b++) PyBuffer_Release(&jobs[i].bufs[b]);
        PyMem_Free(jobs[i].bufs);
        Py_XDECREF(jobs[i].path);
    }
    PyMem_Free(jobs);
}

static int copy16(PyObject *o, unsigned char *out, const char *what) {
    if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) != 16) {
        PyErr_Format(PyExc_ValueError, "%s must be 16 bytes", what);
        return -1;
    }
    memcpy(out, PyBytes_AS_STRING(o), 16);
    return 0;
}

/* read_records(jobs, threads) -> [(status, nread, inode, errno, how), ...]
 * job: (path: bytes, buffers: sequence of writable contiguous buffers (the first holds at least the
 *       64-byte header), record_bytes: int, namespace: 16 bytes, key: 16 bytes, version: int,
 *       check_payload: bool, mode: int) */
static PyObject *read_records(PyObject *self, PyObject *args) {
    PyObject *list;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi", &list, &threads)) return NULL;
    if (!xxh3_create) {
        PyErr_SetString(PyExc_RuntimeError, "hpkv.native: xxh3 is not bound (import hpkv.native)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(list, "jobs must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    job_t *jobs = PyMem_Calloc(n ? n : 1, sizeof(job_t));
    if (!jobs) { Py_DECREF(seq); return PyErr_NoMemory(); }
    Py_ssize_t ready = 0;
    for (; ready < n; ready++) {
        job_t *j = &jobs[ready];
        PyObject *path, *bufs, *ns, *key;
        Py_ssize_t expected;
        int check;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, ready);
        if (!PyArg_ParseTuple(item, "O!OnOOipi", &PyBytes_Type, &path, &bufs, &expected, &ns, &key,
                              &j->version, &check, &j->mode))
            goto fail;
        Py_INCREF(path);
        j->path = path;
        j->check = check;
        if (expected < HEADER_BYTES) { PyErr_SetString(PyExc_ValueError, "record_bytes < 64"); goto fail; }
        j->expected = (size_t)expected;
        if (copy16(ns, j->ns, "namespace") || copy16(key, j->key, "key")) goto fail;
        PyObject *bseq = PySequence_Fast(bufs, "buffers must be a sequence");
        if (!bseq) goto fail;
        Py_ssize_t nb = PySequence_Fast_GET_SIZE(bseq);
        if (nb < 1 || nb > MAX_PIECES) {
            Py_DECREF(bseq);
            PyErr_Format(PyExc_ValueError, "a record needs 1 to %d buffers", MAX_PIECES);
            goto fail;
        }
        j->bufs = PyMem_Calloc((size_t)nb, sizeof(Py_buffer));
        if (!j->bufs) {
            Py_DECREF(bseq);
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t b = 0; b < nb; b++) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(bseq, b), &j->bufs[b], PyBUF_WRITABLE) != 0) {
                Py_DECREF(bseq);
                goto fail;
            }
            j->nbufs++;
        }
        Py_DECREF(bseq);
        if (j->bufs[0].len < HEADER_BYTES) {
            PyErr_SetString(PyExc_ValueError, "the first buffer must hold the 64-byte header");
            goto fail;
        }
    }
    batch_t batch = {jobs, n, 0};
    Py_BEGIN_ALLOW_THREADS
    int k = threads < 1 ? 1 : threads;
    if (k > n) k = (int)n;
    pthread_t tids[64];
    if (k > 64) k = 64;
    int started = 0;
    for (int t = 1; t < k; t++)
        if (pthread_create(&tids[started], NULL, worker, &batch) == 0) started++;
    if (n) worker(&batch);
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        job_t *j = &jobs[i];
        PyObject *r = Py_BuildValue("(iLKii)", j->status, (long long)j->nread, (unsigned long long)j->ino,
                                    j->err, j->how);
        if (!r) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, r);
    }
    release_jobs(jobs, n);
    Py_DECREF(seq);
    return out;
fail:
    release_jobs(jobs, ready + 1);
    Py_DECREF(seq);
    return NULL;
}

/* bind_xxh3(path): take xxh3's streaming functions from the xxhash package's library at ``path``. */
static PyObject *bind_xxh3(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        PyErr_Format(PyExc_ImportError, "hpkv.native: cannot open %s: %s", path, dlerror());
        return NULL;
    }
    xxh3_create = (create_state_fn)dlsym(h, "XXH3_createState");
    xxh3_free = (free_state_fn)dlsym(h, "XXH3_freeState");
    xxh3_reset = (reset_fn)dlsym(h, "XXH3_64bits_reset");
    xxh3_update = (update_fn)dlsym(h, "XXH3_64bits_update");
    xxh3_digest = (digest_fn)dlsym(h, "XXH3_64bits_digest");
    if (!xxh3_create || !xxh3_free || !xxh3_reset || !xxh3_update || !xxh3_digest) {
        xxh3_create = NULL;
        PyErr_Format(PyExc_ImportError, "hpkv.native: %s has no XXH3 streaming functions", path);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* in_page_cache(path) -> bool: the whole file in the page cache (False when absent, not readable or
 * the kernel will not say); starts no I/O. */
static PyObject *in_page_cache(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "y", &path)) return NULL;
    int cached = 0;
    Py_BEGIN_ALLOW_THREADS
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    struct stat st;
    if (fd >= 0) {
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) cached = all_cached(fd, (size_t)st.st_size);
        close(fd);
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(cached);
}

/* ask_cachestat(flag) -> bool: whether the page cache is asked with cachestat(2) (where the kernel
 * has it) or with mincore(2) from now on; returns whether cachestat was in use. For tests of the
 * fallback, and a kernel whose cachestat misbehaves. */
static PyObject *ask_cachestat(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
    int was = cachestat_works;
    cachestat_works = flag;
    return PyBool_FromLong(was);
}

static PyMethodDef methods[] = {
    {"in_page_cache", in_page_cache, METH_VARARGS, "Whether the whole file is in the page cache."},
    {"ask_cachestat", ask_cachestat, METH_VARARGS, "Ask the page cache with cachestat (else mincore)."},
    {"read_records", read_records, METH_VARARGS, "Read and check a batch of chunk records; releases the GIL."},
    {"bind_xxh3", bind_xxh3, METH_VARARGS, "Bind xxh3 from the xxhash package's library."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_records", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__records(void) { return PyModule_Create(&module); }
