/*
 * acpfs.backing._beneath: a file or directory under a directory descriptor opened in one
 * system call, following no symlink and never leaving that directory.
 *
 *     open(dirfd: int, path: bytes, flags: int) -> int     (a new descriptor, O_CLOEXEC)
 *
 * is openat2(2) (Linux 5.6 and later) with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS: a symlink
 * anywhere in ``path`` is ELOOP, a ".." that would climb out of ``dirfd`` is EXDEV. That is
 * what acpfs/backing/root.py's walk from the root one name at a time (``openat`` with
 * O_NOFOLLOW per name, a close per step) promises, in one call instead of two per name: a
 * lookup or an open of a file one directory down cost five system calls, and the Python
 * around each. An OSError carries the errno and says nothing of which name failed: the
 * walk, run after any error, tells (``RootDir._open_dir``). ENOSYS where the kernel has no
 * openat2 (or a sandbox hides it): the walk is used from then on.
 *
 * The GIL is released around the call (a backing on a network filesystem can take long).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437
#endif

static PyObject *open_beneath(PyObject *Py_UNUSED(self), PyObject *args)
{
    int dirfd, flags;
    const char *path;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "iy#i", &dirfd, &path, &len, &flags))
        return NULL;
    if ((Py_ssize_t)strlen(path) != len) {
        PyErr_SetString(PyExc_ValueError, "embedded null byte");
        return NULL;
    }
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = (unsigned long long)(unsigned)flags | O_CLOEXEC;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS;
    long fd;
    int err;
    Py_BEGIN_ALLOW_THREADS
    do {
        fd = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
        err = errno;
    } while (fd < 0 && err == EINTR);
    Py_END_ALLOW_THREADS
    if (fd < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(fd);
}

static PyMethodDef methods[] = {
    {"open", open_beneath, METH_VARARGS,
     "open(dirfd, path, flags) -> fd: openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "acpfs.backing._beneath", NULL, -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__beneath(void)
{
    return PyModule_Create(&module);
}
