/*
 * acpfs.fuse._fastwrite, part three: OPEN offered to Python without a coroutine.
 *
 * Every request pyfuse3 hands to Python becomes a coroutine run as a trio task, which costs
 * more than most OPENs of a reader need: the file is in the cache, or its kernel inode is
 * passed through to a backing file already, and the close-to-open check is one lstat of a
 * local backing. This part offers each read-only OPEN to the callable set with
 * set_open_handler(), called right here, as the WRITE handler is (_fastwrite.c):
 *
 *     handler(ino: int, flags: int) -> tuple | int | None
 *         (fh, backing_id)  answered: the open gets file handle fh, is passed through to
 *                           backing_id (0: served by the daemon) and says FOPEN_NOFLUSH
 *                           (a reader's close has nothing for the daemon to do)
 *         -errno            answered with that error
 *         None              not answered here: pyfuse3's handler takes the request
 *                           (Operations.open), from the start
 *
 * Python decides (acpfs/core/opennow.py); this part only calls it and replies. An
 * exception in the handler is printed and answered EIO. Opens for writing, and every OPEN
 * while no handler is set, go to pyfuse3 untouched.
 *
 * Threads: the GIL is held (libfuse calls the handler from fuse_session_process_buf,
 * which pyfuse3 calls from Python without releasing it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION 32
#include <fuse_lowlevel.h>

#include <errno.h>
#include <fcntl.h>

#include "_opens.h"

typedef void (*open_fn)(fuse_req_t, fuse_ino_t, struct fuse_file_info *);

static open_fn next_open;                 /* pyfuse3's handler */
static PyObject *open_handler;            /* set_open_handler(); NULL: all go to pyfuse3 */
static unsigned long long answered, passed, failed;

static void open_now(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    PyObject *fn = open_handler;
    if (fn == NULL || (fi->flags & O_ACCMODE) != O_RDONLY) {
        next_open(req, ino, fi);
        return;
    }
    Py_INCREF(fn);   /* set_open_handler() may run during the call */
    PyObject *res = PyObject_CallFunction(fn, "Ki", (unsigned long long)ino, fi->flags);
    unsigned long long fh = 0;
    int backing_id = 0, error = 0;
    if (res == NULL) {
        error = EIO;
    } else if (res == Py_None) {
        Py_DECREF(res);
        Py_DECREF(fn);
        passed++;
        next_open(req, ino, fi);
        return;
    } else if (PyLong_Check(res)) {
        long v = PyLong_AsLong(res);
        error = (v < 0 && v > -4096) ? (int)-v : EIO;
    } else if (!PyArg_ParseTuple(res, "Ki", &fh, &backing_id)) {
        error = EIO;
    }
    if (PyErr_Occurred())
        PyErr_WriteUnraisable(fn);
    Py_XDECREF(res);
    Py_DECREF(fn);
    if (error) {
        failed++;
        fuse_reply_err(req, error);
        return;
    }
    fi->fh = fh;
    fi->direct_io = 0;
    fi->keep_cache = 0;
    answered++;
    fastwrite_reply_next(backing_id, 1);
    fuse_reply_open(req, fi);   /* the interposed one (_fastwrite.c) */
}

void opens_hook(struct fuse_lowlevel_ops *ops)
{
    if (ops->open != NULL && ops->open != open_now) {
        next_open = ops->open;
        ops->open = open_now;
    }
}

static PyObject *set_open_handler(PyObject *self, PyObject *arg)
{
    if (arg != Py_None && !PyCallable_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "handler must be callable or None");
        return NULL;
    }
    if (arg != Py_None && next_open == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no FUSE session was created through the hook");
        return NULL;
    }
    Py_XDECREF(open_handler);
    open_handler = NULL;
    if (arg != Py_None) {
        Py_INCREF(arg);
        open_handler = arg;
    }
    Py_RETURN_NONE;
}

static PyObject *opens_stats(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("{s:O,s:K,s:K,s:K}", "on", open_handler != NULL ? Py_True : Py_False,
                         "open_answered", answered, "open_passed", passed,
                         "open_failed", failed);
}

PyMethodDef opens_methods[] = {
    {"set_open_handler", set_open_handler, METH_O,
     "Set the callable offered each read-only OPEN as (ino, flags) -> (fh, backing_id) | "
     "-errno | None; None unsets."},
    {"opens_stats", opens_stats, METH_NOARGS,
     "{'on': a handler is set, 'open_answered': OPENs it answered, 'open_passed': OPENs it "
     "left to pyfuse3, 'open_failed': OPENs answered with an error}"},
    {NULL, NULL, 0, NULL},
};
