/*
 * acpfs.fuse._fastwrite, part three: OPEN, FLUSH and RELEASE offered to Python without a
 * coroutine.
 *
 * Every request pyfuse3 hands to Python becomes a coroutine run as a trio task, which costs
 * more than most of these requests need: an OPEN of a reader whose file is in the cache (or
 * passed through to a backing file already) with a close-to-open check of one lstat, the
 * FLUSH of a close (journal the close, stamp it), the RELEASE of a reader or of a writer
 * whose file nothing holds. This part offers each to a callable set with set_at_once(),
 * called right here, as the WRITE handler is (_fastwrite.c):
 *
 *     open(ino: int, flags: int) -> tuple | int | None       (read-only OPENs only)
 *         (fh, backing_id)  answered: the open gets file handle fh, is passed through to
 *                           backing_id (0: served by the daemon) and says FOPEN_NOFLUSH
 *                           (a reader's close has nothing for the daemon to do)
 *     flush(fh: int) -> int | None
 *     release(fh: int) -> int | None
 *         0 or -errno       answered with that
 *     None (any of them)    not answered here: pyfuse3's handler takes the request
 *                           (Operations.open, flush, release), from the start
 *
 * Python decides (acpfs/core/opennow.py, Operations.flush_now and release_now); this part
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
#include <fcntl.h>
#include <string.h>

#include "_atonce.h"

typedef void (*file_op)(fuse_req_t, fuse_ino_t, struct fuse_file_info *);

enum { OPEN, FLUSH, RELEASE, KINDS };
static const char *const kind_names[KINDS] = {"open", "flush", "release"};
static file_op next_op[KINDS];            /* pyfuse3's handlers */
static PyObject *handler[KINDS];          /* set_at_once(); NULL: all go to pyfuse3 */
static unsigned long long answered[KINDS], passed[KINDS], failed[KINDS];

/* Calls handler[kind]; returns its result (a new reference), or NULL after printing an
 * exception. */
static PyObject *offer(int kind, fuse_ino_t ino, struct fuse_file_info *fi)
{
    PyObject *fn = handler[kind];
    Py_INCREF(fn);   /* set_at_once() may run during the call */
    PyObject *res = kind == OPEN
        ? PyObject_CallFunction(fn, "Ki", (unsigned long long)ino, fi->flags)
        : PyObject_CallFunction(fn, "K", (unsigned long long)fi->fh);
    if (res == NULL)
        PyErr_WriteUnraisable(fn);
    Py_DECREF(fn);
    return res;
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
    if (res == Py_None) {
        Py_DECREF(res);
        passed[kind]++;
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

void atonce_hook(struct fuse_lowlevel_ops *ops)
{
    file_op *slots[KINDS] = {&ops->open, &ops->flush, &ops->release};
    const file_op ours[KINDS] = {open_at_once, flush_at_once, release_at_once};
    for (int k = 0; k < KINDS; k++) {
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
    if (fn != Py_None && next_op[kind] == NULL) {
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
        PyObject *one = Py_BuildValue("{s:O,s:K,s:K,s:K}", "on",
                                      handler[k] != NULL ? Py_True : Py_False,
                                      "answered", answered[k], "passed", passed[k],
                                      "failed", failed[k]);
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
     "set_at_once(kind, fn): offer each request of kind 'open' (read-only), 'flush' or "
     "'release' to fn first (see acpfs/fuse/_atonce.c); None unsets."},
    {"at_once_stats", at_once_stats, METH_NOARGS,
     "{kind: {'on': a callable is set, 'answered': requests it answered, 'passed': left to "
     "pyfuse3, 'failed': answered with an error}} for 'open', 'flush' and 'release'"},
    {NULL, NULL, 0, NULL},
};
