/*
 * acpfs.fuse._fastwrite, part three: LOOKUP, CREATE, UNLINK, OPEN, FLUSH, RELEASE and READ
 * offered to Python without a coroutine.
 *
 * Every request pyfuse3 hands to Python becomes a coroutine run as a trio task, which costs
 * more than most of these requests need: an OPEN of a reader whose file is in the cache (or
 * passed through to a backing file already) with a close-to-open check of one lstat, the
 * FLUSH of a close (journal the close, stamp it), the RELEASE of a reader or of a writer
 * whose file nothing holds, the READ the daemon serves from the cache or from a backing
 * file's page cache. This part offers each to a callable set with set_at_once(),
 * called right here, as the WRITE handler is (_fastwrite.c):
 *
 *     open(ino: int, flags: int) -> tuple | int | None       (read-only OPENs only)
 *         (fh, backing_id)  answered: the open gets file handle fh, is passed through to
 *                           backing_id (0: served by the daemon) and says FOPEN_NOFLUSH
 *                           (a reader's close has nothing for the daemon to do)
 *     flush(fh: int) -> int | None
 *     release(fh: int) -> int | None
 *         0 or -errno       answered with that
 *     lookup(parent: int, name: bytes) -> tuple | int | None
 *         (0, entry_timeout)               a negative entry: the name is missing
 *         the 14 fields of operations.fields()   the entry (the kernel holds one more
 *                                                lookup of it)
 *         -errno                           answered with that
 *     unlink(parent: int, name: bytes) -> int | None
 *         0 or -errno       answered with that
 *     read(fh: int, off: int, size: int) -> buffer | int | None
 *         an object with the buffer protocol   answered with its bytes (at most size; fewer
 *                           only at the end of the file: the kernel fills a page-cache
 *                           page past a short reply with zeros)
 *         -errno            answered with that
 *     create(parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int,
 *            umask: int) -> tuple | int | None
 *         (fh, backing_id, direct_io, the 14 fields)   created and opened: the reply gives
 *                                                       the entry and the open
 *         -errno                           answered with that
 *     None (any of them)    not answered here: pyfuse3's handler takes the request
 *                           (Operations.open, flush, release), from the start
 *
 * Python decides (acpfs/fuse/atonce.py); this part
 * only calls and replies. An exception in a handler is printed and answered EIO. OPENs for
 * writing, and every request of a kind with no callable set, go to pyfuse3 untouched.
 *
 * Threads: the GIL is held (libfuse calls the handlers from fuse_session_process_buf,
 * which pyfuse3 calls from Python without releasing it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION 32
#include <fuse_lowlevel.h>

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <string.h>

#include "_atonce.h"
#include "_clock.h"

typedef void (*file_op)(fuse_req_t, fuse_ino_t, struct fuse_file_info *);

enum { OPEN, FLUSH, RELEASE, LOOKUP, UNLINK, CREATE, READ, KINDS };
static const char *const kind_names[KINDS] = {"open", "flush", "release", "lookup", "unlink",
                                              "create", "read"};
static file_op next_op[KINDS];            /* pyfuse3's handlers (but LOOKUP's:) */
typedef void (*name_op)(fuse_req_t, fuse_ino_t, const char *);
static name_op next_lookup, next_unlink;
typedef void (*create_op)(fuse_req_t, fuse_ino_t, const char *, mode_t, struct fuse_file_info *);
static create_op next_create;
typedef void (*read_op)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
static read_op next_read;
static PyObject *handler[KINDS];          /* set_at_once(); NULL: all go to pyfuse3 */
static unsigned long long answered[KINDS], passed[KINDS], failed[KINDS];
static unsigned long long python_ns[KINDS];   /* time in the handler, whatever it returned */

/* Calls handler[kind] (set) with the arguments Py_BuildValue makes of fmt (a tuple's);
 * returns its result (a new reference), or NULL after printing an exception. */
static PyObject *call(int kind, const char *fmt, ...)
{
    PyObject *fn = handler[kind];
    Py_INCREF(fn);   /* set_at_once() may run during the call */
    uint64_t start = monotonic_ns();
    va_list va;
    va_start(va, fmt);
    PyObject *args = Py_VaBuildValue(fmt, va);
    va_end(va);
    PyObject *res = args != NULL ? PyObject_CallObject(fn, args) : NULL;
    Py_XDECREF(args);
    if (res == NULL)
        PyErr_WriteUnraisable(fn);
    Py_DECREF(fn);
    python_ns[kind] += monotonic_ns() - start;
    return res;
}

/* Whether the handler left the request to pyfuse3 (returned None): counted, res released. */
static int left(int kind, PyObject *res)
{
    if (res != Py_None)
        return 0;
    Py_DECREF(res);
    passed[kind]++;
    return 1;
}

static PyObject *offer(int kind, fuse_ino_t ino, struct fuse_file_info *fi)
{
    return kind == OPEN ? call(kind, "(Ki)", (unsigned long long)ino, fi->flags)
                        : call(kind, "(K)", (unsigned long long)fi->fh);
}

/* An int result: 0 or the errno to answer (EIO for anything else). */
static int error_of(PyObject *res)
{
    long v = PyLong_AsLong(res);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return EIO;
    }
    return (v <= 0 && v > -4096) ? (int)-v : EIO;
}

static void answer(int kind, fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (handler[kind] == NULL || (kind == OPEN && (fi->flags & O_ACCMODE) != O_RDONLY)) {
        next_op[kind](req, ino, fi);
        return;
    }
    PyObject *res = offer(kind, ino, fi);
    if (left(kind, res)) {
        next_op[kind](req, ino, fi);
        return;
    }
    int error = EIO;
    unsigned long long fh = 0;
    int backing_id = 0;
    if (res != NULL && PyLong_Check(res)) {
        error = error_of(res);
        if (kind == OPEN && error == 0)
            error = EIO;   /* an OPEN is answered with a handle, never with 0 */
    } else if (res != NULL && kind == OPEN) {
        if (PyArg_ParseTuple(res, "Ki", &fh, &backing_id))
            error = 0;
        else
            PyErr_WriteUnraisable(res);
    }
    Py_XDECREF(res);
    if (error) {
        failed[kind]++;
        fuse_reply_err(req, error);
        return;
    }
    answered[kind]++;
    if (kind != OPEN) {
        fuse_reply_err(req, 0);
        return;
    }
    fi->fh = fh;
    fi->direct_io = 0;
    fi->keep_cache = 0;
    fastwrite_reply_next(backing_id, 1);
    fuse_reply_open(req, fi);   /* the interposed one (_fastwrite.c) */
}

static void open_at_once(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    answer(OPEN, req, ino, fi);
}

static void flush_at_once(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    answer(FLUSH, req, ino, fi);
}

static void release_at_once(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    answer(RELEASE, req, ino, fi);
}

/* A LOOKUP's answer: (0, entry_timeout) for a negative entry, or the 14 fields of
 * operations.fields(); 0 and an exception set where it is neither. */
static int entry_of(PyObject *res, struct fuse_entry_param *e)
{
    unsigned long long ino, rdev, size, blksize, blocks;
    unsigned int mode, nlink, uid, gid;
    long long ns[3];
    if (PyTuple_Check(res) && PyTuple_GET_SIZE(res) == 2)
        return PyArg_ParseTuple(res, "Kd", &ino, &e->entry_timeout) && ino == 0;
    if (!PyArg_ParseTuple(res, "KddIIIIKKKKLLL", &ino, &e->entry_timeout, &e->attr_timeout,
                          &mode, &nlink, &uid, &gid, &rdev, &size, &blksize, &blocks,
                          &ns[0], &ns[1], &ns[2]))
        return 0;
    e->ino = ino;
    e->attr.st_ino = ino;   /* fuse_reply_entry (_fastwrite.c) shows the file's own number */
    e->attr.st_mode = mode;
    e->attr.st_nlink = nlink;
    e->attr.st_uid = uid;
    e->attr.st_gid = gid;
    e->attr.st_rdev = rdev;
    e->attr.st_size = (off_t)size;
    e->attr.st_blksize = (blksize_t)blksize;
    e->attr.st_blocks = (blkcnt_t)blocks;
    struct timespec *times[3] = {&e->attr.st_atim, &e->attr.st_mtim, &e->attr.st_ctim};
    for (int i = 0; i < 3; i++) {
        long long sec = ns[i] / 1000000000LL, nsec = ns[i] % 1000000000LL;
        if (nsec < 0) {
            nsec += 1000000000LL;
            sec--;
        }
        times[i]->tv_sec = sec;
        times[i]->tv_nsec = nsec;
    }
    return 1;
}

static void unlink_at_once(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    PyObject *res = NULL;
    if (handler[UNLINK] == NULL
        || left(UNLINK, res = call(UNLINK, "(Ky)", (unsigned long long)parent, name))) {
        next_unlink(req, parent, name);
        return;
    }
    int error = res != NULL && PyLong_Check(res) ? error_of(res) : EIO;
    Py_XDECREF(res);
    if (error)
        failed[UNLINK]++;
    else
        answered[UNLINK]++;
    fuse_reply_err(req, error);
}

static void lookup_at_once(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    PyObject *res = NULL;
    if (handler[LOOKUP] == NULL
        || left(LOOKUP, res = call(LOOKUP, "(Ky)", (unsigned long long)parent, name))) {
        next_lookup(req, parent, name);
        return;
    }
    struct fuse_entry_param e;
    memset(&e, 0, sizeof(e));
    int error = EIO;
    if (res != NULL && PyLong_Check(res)) {
        error = error_of(res);
        if (error == 0)
            error = EIO;   /* a LOOKUP is answered with an entry, never with 0 */
    } else if (res != NULL) {
        if (entry_of(res, &e))
            error = 0;
        else if (PyErr_Occurred())
            PyErr_WriteUnraisable(res);
    }
    Py_XDECREF(res);
    if (error) {
        failed[LOOKUP]++;
        fuse_reply_err(req, error);
        return;
    }
    answered[LOOKUP]++;
    fuse_reply_entry(req, &e);   /* the interposed one (_fastwrite.c) */
}

static void create_at_once(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                           struct fuse_file_info *fi)
{
    const struct fuse_ctx *ctx = fuse_req_ctx(req);
    PyObject *res = NULL;
    if (handler[CREATE] == NULL
        || left(CREATE, res = call(CREATE, "(KyIiIII)", (unsigned long long)parent, name,
                                   (unsigned int)mode, fi->flags, (unsigned int)ctx->uid,
                                   (unsigned int)ctx->gid, (unsigned int)ctx->umask))) {
        next_create(req, parent, name, mode, fi);
        return;
    }
    struct fuse_entry_param e;
    memset(&e, 0, sizeof(e));
    unsigned long long fh = 0;
    int backing_id = 0, direct_io = 0, error = EIO;
    if (res != NULL && PyLong_Check(res)) {
        error = error_of(res);
        if (error == 0)
            error = EIO;
    } else if (res != NULL && PyTuple_Check(res) && PyTuple_GET_SIZE(res) == 3 + 14) {
        PyObject *head = PyTuple_GetSlice(res, 0, 3), *tail = PyTuple_GetSlice(res, 3, 3 + 14);
        if (head != NULL && tail != NULL && PyArg_ParseTuple(head, "Kip", &fh, &backing_id,
                                                             &direct_io)
            && entry_of(tail, &e) && e.ino != 0)
            error = 0;
        if (error && PyErr_Occurred())
            PyErr_WriteUnraisable(res);
        Py_XDECREF(head);
        Py_XDECREF(tail);
    }
    Py_XDECREF(res);
    if (error) {
        failed[CREATE]++;
        fuse_reply_err(req, error);
        return;
    }
    answered[CREATE]++;
    fi->fh = fh;
    fi->direct_io = direct_io;
    fi->keep_cache = 0;
    fastwrite_reply_next(backing_id, 0);
    fuse_reply_create(req, &e, fi);   /* the interposed one (_fastwrite.c) */
}

static void read_at_once(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                         struct fuse_file_info *fi)
{
    PyObject *res = NULL;
    if (handler[READ] == NULL
        || left(READ, res = call(READ, "(KLn)", (unsigned long long)fi->fh, (long long)off,
                                 (Py_ssize_t)size))) {
        next_read(req, ino, size, off, fi);
        return;
    }
    int error = EIO;
    Py_buffer view;
    if (res != NULL && PyLong_Check(res)) {
        error = error_of(res);
        if (error == 0)
            error = EIO;   /* bytes are answered as a buffer, never as 0 */
    } else if (res != NULL && PyObject_GetBuffer(res, &view, PyBUF_SIMPLE) == 0) {
        if ((size_t)view.len <= size) {
            answered[READ]++;
            fuse_reply_buf(req, view.buf, (size_t)view.len);   /* copied into the device */
            PyBuffer_Release(&view);
            Py_DECREF(res);
            return;
        }
        PyBuffer_Release(&view);
    } else if (res != NULL) {
        PyErr_WriteUnraisable(res);
    }
    Py_XDECREF(res);
    failed[READ]++;
    fuse_reply_err(req, error);
}

void atonce_hook(struct fuse_lowlevel_ops *ops)
{
    if (ops->read != NULL && ops->read != read_at_once) {
        next_read = ops->read;
        ops->read = read_at_once;
    }
    if (ops->unlink != NULL && ops->unlink != unlink_at_once) {
        next_unlink = ops->unlink;
        ops->unlink = unlink_at_once;
    }
    if (ops->create != NULL && ops->create != create_at_once) {
        next_create = ops->create;
        ops->create = create_at_once;
    }
    if (ops->lookup != NULL && ops->lookup != lookup_at_once) {
        next_lookup = ops->lookup;
        ops->lookup = lookup_at_once;
    }
    file_op *slots[LOOKUP] = {&ops->open, &ops->flush, &ops->release};
    const file_op ours[LOOKUP] = {open_at_once, flush_at_once, release_at_once};
    for (int k = 0; k < LOOKUP; k++) {
        if (*slots[k] != NULL && *slots[k] != ours[k]) {
            next_op[k] = *slots[k];
            *slots[k] = ours[k];
        }
    }
}

static PyObject *set_at_once(PyObject *self, PyObject *args)
{
    const char *kind_name;
    PyObject *fn;
    if (!PyArg_ParseTuple(args, "sO", &kind_name, &fn))
        return NULL;
    int kind = 0;
    while (kind < KINDS && strcmp(kind_names[kind], kind_name) != 0)
        kind++;
    if (kind == KINDS) {
        PyErr_Format(PyExc_ValueError, "no such request kind: %s", kind_name);
        return NULL;
    }
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "handler must be callable or None");
        return NULL;
    }
    int hooked = kind == LOOKUP ? next_lookup != NULL : kind == UNLINK ? next_unlink != NULL
                 : kind == CREATE ? next_create != NULL : kind == READ ? next_read != NULL
                 : next_op[kind] != NULL;
    if (fn != Py_None && !hooked) {
        PyErr_SetString(PyExc_RuntimeError, "no FUSE session was created through the hook");
        return NULL;
    }
    PyObject *old = handler[kind];
    handler[kind] = NULL;   /* cleared before the old one may run a __del__ */
    Py_XDECREF(old);
    if (fn != Py_None) {
        Py_INCREF(fn);
        handler[kind] = fn;
    }
    Py_RETURN_NONE;
}

static PyObject *at_once_stats(PyObject *self, PyObject *unused)
{
    PyObject *out = PyDict_New();
    for (int k = 0; out != NULL && k < KINDS; k++) {
        PyObject *one = Py_BuildValue("{s:O,s:K,s:K,s:K,s:d}", "on",
                                      handler[k] != NULL ? Py_True : Py_False,
                                      "answered", answered[k], "passed", passed[k],
                                      "failed", failed[k], "python_s", python_ns[k] / 1e9);
        if (one == NULL || PyDict_SetItemString(out, kind_names[k], one) < 0) {
            Py_XDECREF(one);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(one);
    }
    return out;
}

PyMethodDef atonce_methods[] = {
    {"set_at_once", set_at_once, METH_VARARGS,
     "set_at_once(kind, fn): offer each request of kind 'open' (read-only), 'flush', "
     "'release', 'lookup', 'unlink', 'create' or 'read' to fn first (see acpfs/fuse/_atonce.c); None unsets."},
    {"at_once_stats", at_once_stats, METH_NOARGS,
     "{kind: {'on': a callable is set, 'answered': requests it answered, 'passed': left to "
     "pyfuse3, 'failed': answered with an error, 'python_s': seconds spent in the callable}} "
     "for each kind"},
    {NULL, NULL, 0, NULL},
};
