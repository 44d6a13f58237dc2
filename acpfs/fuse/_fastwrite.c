/*
 * acpfs.fuse._fastwrite: WRITE requests reach Python as a view of libfuse's receive buffer.
 *
 * pyfuse3 copies every WRITE request into a new bytes object before it calls
 * Operations.write, and acpfs then copies that into the pool: two copies in the daemon for
 * each byte. Measured side by side (docs/design.md, "What limits writes"), dropping the
 * first copy makes 1 MiB writes ~20 % faster.
 *
 * How: this library defines fuse_session_new. acpfs.fastwrite loads it RTLD_GLOBAL before
 * pyfuse3 is imported, so pyfuse3's call to fuse_session_new binds here (the dynamic linker
 * searches the global scope before pyfuse3's own dependencies). The wrapper keeps
 * pyfuse3's write_buf handler and passes the real fuse_session_new a copy of the
 * operations with write_buf replaced by fast_write_buf, which first offers the request to
 * the Python callable set with set_handler():
 *
 *     handler(fh: int, off: int, data: memoryview) -> int | None
 *         n >= 0  n bytes written: answered with fuse_reply_write
 *         n < 0   -errno: answered with fuse_reply_err
 *         None    not handled here: pyfuse3's handler takes the request (async
 *                 Operations.write with a bytes copy), e.g. to wait for cache space
 *
 * Invariant: `data` views libfuse's buffer, which is reused for the next request, so it
 * is released as soon as the handler returns; the handler must not keep it or slices of
 * it (acpfs copies it into the pool before returning).
 *
 * The GIL is held: libfuse calls the handler from fuse_session_process_buf, which pyfuse3
 * calls from Python without releasing the GIL (its own handlers rely on this too).
 *
 * Second job: shared mmap of direct_io files. The kernel (6.6+) lets a file opened with
 * direct_io be mmapped MAP_SHARED only if the daemon's INIT reply sets
 * FUSE_DIRECT_IO_ALLOW_MMAP; libfuse learns that flag only in 3.16, and pyfuse3 has no way
 * to ask for it. This library also defines fuse_session_mount: after the real one it gives
 * the session a custom I/O (fuse_session_custom_io, libfuse 3.14+) whose read notes the
 * kernel's INIT request and whose writev adds the flag to the INIT reply when the kernel
 * offered it. Every other request and reply passes through unchanged (also by splice, as
 * libfuse would do without us). direct_io_mmap() then tells acpfs that readers of cached
 * files may get direct_io (no page-cache copy) without breaking mmap.
 *
 * Third job: one st_ino per file. A file may be known to the kernel under several node
 * ids (a kernel inode passed through to a backing file keeps its node id to itself:
 * acpfs/core/coldreads.py); the entry replies (fuse_reply_entry, fuse_reply_create,
 * fuse_add_direntry_plus) show the file's own inode number in st_ino, not the node id.
 *
 * Fourth job (acpfs/fuse/_attrs.c): GETATTR and security GETXATTRs answered from a table
 * that Python keeps current (fuse/attrtable.py); the WRITE and FALLOCATE handlers here drop
 * the inode's entry on arrival.
 *
 * Fifth job (acpfs/fuse/_atonce.c): read-only OPENs, FLUSH and RELEASE offered to Python
 * callables without a coroutine; OPENs answered with fastwrite_reply_next() and
 * fuse_reply_open() below.
 *
 * Only on Linux 6.9 and later: 6.6 to 6.8 shipped the flag with writable shared mappings
 * of direct_io files broken (no page_mkwrite; fixed in stable updates of March 2024 that
 * cannot be told apart by version here), and acpfs's writers have direct_io. There, and
 * with ACPFS_NO_READ_DIRECT_IO=1, the session's I/O is left alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION 32
#include <fuse_lowlevel.h>
#ifdef fuse_session_new
#undef fuse_session_new   /* libfuse >= 3.17 makes it a macro over a versioned function */
#endif

/* dlvsym and RTLD_NEXT need _GNU_SOURCE, which Python.h defines */
#include <dlfcn.h>
#include <errno.h>
#include <linux/fuse.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/uio.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <sys/ioctl.h>

#include "_attrs.h"
#include "_atonce.h"
#include "_burst.h"
#include "_idlepoll.h"
#include "_clock.h"

#ifndef FUSE_DIRECT_IO_ALLOW_MMAP
#define FUSE_DIRECT_IO_ALLOW_MMAP (1ULL << 36)   /* Linux 6.6 (as FUSE_DIRECT_IO_RELAX) */
#endif
/* Linux 6.9: passthrough of read, write, splice and mmap to a registered backing file.
 * Defined here: the uapi headers of the build machine may predate it. */
#define ACPFS_FUSE_PASSTHROUGH (1ULL << 37)
#define ACPFS_FOPEN_PASSTHROUGH (1U << 7)
#define ACPFS_KILLPRIV_V2 (1U << 28)
#define ACPFS_INIT_OUT_FLAGS2 32          /* byte offsets in struct fuse_init_out */
#define ACPFS_INIT_OUT_STACK_DEPTH 36
struct acpfs_backing_map {
    int32_t fd;
    uint32_t flags;
    uint64_t padding;
};
#define ACPFS_IOC_BACKING_OPEN _IOW(229, 1, struct acpfs_backing_map)
#define ACPFS_IOC_BACKING_CLOSE _IOW(229, 2, uint32_t)

typedef struct fuse_session *(*session_new_fn)(struct fuse_args *, const struct fuse_lowlevel_ops *,
                                               size_t, void *);
typedef void (*write_buf_fn)(fuse_req_t, fuse_ino_t, struct fuse_bufvec *, off_t,
                             struct fuse_file_info *);

static write_buf_fn next_write_buf;     /* pyfuse3's handler */
static PyObject *handler;               /* set_handler(); NULL: every request goes to pyfuse3 */
static int sessions_hooked;             /* sessions created through the wrapper */
static unsigned long long fast_writes, passed_on, failed, from_pipe;
static unsigned long long python_ns;   /* time in the WRITE handler, whatever it returned */
static char *scratch;                   /* for requests that arrive in a pipe (splice) */
static size_t scratch_size;

/* The object the handler's memoryview is made from: it counts the buffers exported from
 * it, so that after the call a view or slice still alive is detected (slices of a
 * memoryview keep the export open even after the view itself is released). */
typedef struct {
    PyObject_HEAD
    char *mem;
    Py_ssize_t len;
    int exports;
} Slot;

static int slot_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    Slot *s = (Slot *)self;
    if (PyBuffer_FillInfo(view, self, s->mem, s->len, 1, flags) < 0)
        return -1;
    s->exports++;
    return 0;
}

static void slot_releasebuffer(PyObject *self, Py_buffer *view)
{
    ((Slot *)self)->exports--;
}

static PyBufferProcs slot_as_buffer = {slot_getbuffer, slot_releasebuffer};

static PyTypeObject SlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "acpfs.fuse._fastwrite.Slot",
    .tp_basicsize = sizeof(Slot),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_as_buffer = &slot_as_buffer,
    .tp_doc = "libfuse's buffer for the duration of one WRITE",
};

/* Call the handler with a read-only view of len bytes at mem. Returns its result (a new
 * reference), or NULL with an exception set. */
static PyObject *offer(PyObject *fn, struct fuse_file_info *fi, off_t off, char *mem, size_t len)
{
    Slot *slot = PyObject_New(Slot, &SlotType);
    if (slot == NULL)
        return NULL;
    slot->mem = mem;
    slot->len = (Py_ssize_t)len;
    slot->exports = 0;
    PyObject *view = PyMemoryView_FromObject((PyObject *)slot);
    if (view == NULL) {
        Py_DECREF(slot);
        return NULL;
    }
    uint64_t start = monotonic_ns();
    PyObject *res = PyObject_CallFunction(fn, "KLO", (unsigned long long)fi->fh, (long long)off,
                                          view);
    python_ns += monotonic_ns() - start;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *rel = PyObject_CallMethod(view, "release", NULL);
    Py_XDECREF(rel);
    PyErr_Clear();   /* a failed release shows as exports left, below */
    Py_DECREF(view);
    if (slot->exports != 0) {
        /* Python code kept a view or slice of memory that libfuse reuses for the next
         * request: whatever it does with it later would read another request's bytes. */
        Py_FatalError("acpfs.fuse._fastwrite: the WRITE handler kept a view of libfuse's buffer");
    }
    Py_DECREF(slot);
    PyErr_Restore(type, value, tb);
    return res;
}

static void fast_write_buf(fuse_req_t req, fuse_ino_t ino, struct fuse_bufvec *bufv, off_t off,
                           struct fuse_file_info *fi)
{
    attrs_drop_key(ino);   /* its size and times change */
    if (handler == NULL) {
        next_write_buf(req, ino, bufv, off, fi);
        return;
    }
    size_t len = fuse_buf_size(bufv) - bufv->off;
    char *mem;
    struct fuse_bufvec membuf = FUSE_BUFVEC_INIT(len);
    int copied = 0;
    if (bufv->count == 1 && !(bufv->buf[0].flags & FUSE_BUF_IS_FD)) {
        mem = (char *)bufv->buf[0].mem + bufv->off;
    } else {
        if (scratch_size < len) {
            char *p = realloc(scratch, len);
            if (p == NULL) {
                fuse_reply_err(req, ENOMEM);
                return;
            }
            scratch = p;
            scratch_size = len;
        }
        membuf.buf[0].mem = scratch;
        ssize_t got = fuse_buf_copy(&membuf, bufv, 0);
        if (got < 0) {
            fuse_reply_err(req, (int)-got);
            return;
        }
        len = (size_t)got;
        membuf.buf[0].size = len;
        mem = scratch;
        copied = 1;
        from_pipe++;
    }

    PyObject *fn = handler;
    Py_INCREF(fn);   /* set_handler() may run during the call */
    PyObject *res = offer(fn, fi, off, mem, len);
    if (res == NULL) {
        PyErr_WriteUnraisable(fn);
        Py_DECREF(fn);
        fuse_reply_err(req, EIO);
        return;
    }
    if (res == Py_None) {
        Py_DECREF(res);
        Py_DECREF(fn);
        passed_on++;
        next_write_buf(req, ino, copied ? &membuf : bufv, off, fi);
        return;
    }
    long long n = PyLong_AsLongLong(res);
    Py_DECREF(res);
    if (n == -1 && PyErr_Occurred()) {
        PyErr_WriteUnraisable(fn);
        n = -EIO;
    } else if (n > (long long)len || n < -4095) {
        PyErr_Format(PyExc_ValueError, "WRITE handler returned %lld for a %zu-byte request", n, len);
        PyErr_WriteUnraisable(fn);
        n = -EIO;
    }
    Py_DECREF(fn);
    if (n >= 0) {
        fast_writes++;
        fuse_reply_write(req, (size_t)n);
    } else {
        failed++;
        fuse_reply_err(req, (int)-n);
    }
}

/* FALLOCATE, which pyfuse3 has no handler for (libfuse would answer ENOSYS, and the kernel
 * would then refuse every fallocate on the mount): offered to the callable set with
 * set_fallocate_handler() as (fh, mode, offset, length) -> 0 or -errno; EOPNOTSUPP without
 * one (glibc's posix_fallocate then writes the range itself). The GIL is held, as for WRITE. */
static PyObject *fallocate_handler;

static void fast_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length,
                           struct fuse_file_info *fi)
{
    attrs_drop_key(ino);
    PyObject *fn = fallocate_handler;
    if (fn == NULL) {
        fuse_reply_err(req, EOPNOTSUPP);
        return;
    }
    Py_INCREF(fn);
    PyObject *res = PyObject_CallFunction(fn, "KiLL", (unsigned long long)fi->fh, mode,
                                          (long long)offset, (long long)length);
    int error = EIO;
    if (res == NULL) {
        PyErr_WriteUnraisable(fn);
    } else {
        long v = PyLong_AsLong(res);
        Py_DECREF(res);
        if (v == -1 && PyErr_Occurred())
            PyErr_WriteUnraisable(fn);
        else if (v <= 0 && v > -4096)
            error = (int)-v;
    }
    Py_DECREF(fn);
    fuse_reply_err(req, error);     /* 0: done */
}

/* libfuse's own definition of a function this library interposes; NULL (and a line on
 * stderr) if it cannot be found. */
static void *libfuse_symbol(const char *name)
{
    void *fn = dlvsym(RTLD_NEXT, name, "FUSE_3.0");
    if (fn == NULL)
        fn = dlsym(RTLD_NEXT, name);
    if (fn == NULL)
        fprintf(stderr, "acpfs.fuse._fastwrite: libfuse's %s not found: %s\n", name, dlerror());
    return fn;
}

/* -- the INIT exchange: FUSE_DIRECT_IO_ALLOW_MMAP ------------------------------------------ */
typedef int (*session_mount_fn)(struct fuse_session *, const char *);

static uint64_t init_unique;        /* the INIT request's id, until its reply is sent */
static uint64_t kernel_flags;       /* what the kernel offered in INIT (flags | flags2 << 32) */
static int direct_io_mmap;          /* the reply granted FUSE_DIRECT_IO_ALLOW_MMAP */
static int custom_io;               /* the session's I/O is ours */
static struct fuse_session *session; /* the mounted session (for the backing ioctls) */
static int want_passthrough;        /* max_stack_depth to ask for; 0: do not ask */
static int passthrough;             /* the reply granted FUSE_PASSTHROUGH */
static int killpriv_v2;             /* ... and FUSE_HANDLE_KILLPRIV_V2 with it */
static int32_t next_backing;        /* reply_backing(): for the next OPEN/CREATE reply */
static int32_t patching;            /* the OPEN/CREATE reply being sent carries this id */
static int next_noflush;            /* reply_noflush(): the next OPEN reply gets FOPEN_NOFLUSH */
static unsigned long long noflush_opens;
static unsigned long long passthrough_opens;

/* The device is non-blocking while the I/O is ours (fuse_session_mount): a request that
 * poll showed may be withdrawn before the read (its caller interrupted), and nothing must
 * then wait with the GIL held. "Nothing there" is EINTR to libfuse's callers, which read
 * again once the device is readable (pyfuse3's loop) or stop (the burst loop, _burst.c). */
static int nonblocking;

int fastwrite_nonblocking(void)
{
    return nonblocking;
}

static ssize_t io_read(int fd, void *buf, size_t len, void *userdata)
{
    ssize_t n = read(fd, buf, len);
    if (n < 0 && errno == EAGAIN)
        errno = EINTR;
    if (n >= (ssize_t)(sizeof(struct fuse_in_header) + offsetof(struct fuse_init_in, flags2)
                       + sizeof(uint32_t))) {
        const struct fuse_in_header *in = buf;
        if (in->opcode == FUSE_INIT) {
            const struct fuse_init_in *arg = (const void *)(in + 1);
            init_unique = in->unique;
            kernel_flags = arg->flags;
            if (arg->flags & FUSE_INIT_EXT)
                kernel_flags |= (uint64_t)arg->flags2 << 32;
        }
    }
    return n;
}

static ssize_t io_splice_receive(int fdin, off_t *offin, int fdout, off_t *offout, size_t len,
                                 unsigned int flags, void *userdata)
{
    ssize_t n = splice(fdin, offin, fdout, offout, len, flags);
    if (n < 0 && errno == EAGAIN)
        errno = EINTR;   /* as io_read */
    return n;
}

static ssize_t io_splice_send(int fdin, off_t *offin, int fdout, off_t *offout, size_t len,
                              unsigned int flags, void *userdata)
{
    return splice(fdin, offin, fdout, offout, len, flags);
}

static int want_direct_io_mmap(void)
{
    const char *off = getenv("ACPFS_NO_READ_DIRECT_IO");
    return !(off != NULL && *off != '\0' && strcmp(off, "0") != 0);
}

/* Linux 6.9 or later: shared writable mappings of direct_io files work there. */
static int kernel_maps_direct_io_safely(void)
{
    struct utsname u;
    int major = 0, minor = 0;
    if (uname(&u) != 0 || sscanf(u.release, "%d.%d", &major, &minor) != 2)
        return 0;
    return major > 6 || (major == 6 && minor >= 9);
}

static ssize_t io_writev(int fd, struct iovec *iov, int count, void *userdata)
{
    if (count >= 1 && iov[0].iov_len >= sizeof(struct fuse_out_header))
        burst_note_reply(((struct fuse_out_header *)iov[0].iov_base)->unique);
    if (init_unique != 0 && count >= 2 && iov[0].iov_len == sizeof(struct fuse_out_header)) {
        struct fuse_out_header *out = iov[0].iov_base;
        if (out->unique == init_unique) {
            init_unique = 0;
            struct fuse_init_out *arg = iov[1].iov_base;
            if (out->error == 0 && iov[1].iov_len >= offsetof(struct fuse_init_out, unused)
                && (arg->flags & FUSE_INIT_EXT) && (kernel_flags & FUSE_DIRECT_IO_ALLOW_MMAP)
                && want_direct_io_mmap()) {
                arg->flags2 |= (uint32_t)(FUSE_DIRECT_IO_ALLOW_MMAP >> 32);
                direct_io_mmap = 1;
            }
            /* the kernel ignores the flag with the writeback cache, or without a depth */
            if (out->error == 0 && want_passthrough
                && iov[1].iov_len >= ACPFS_INIT_OUT_STACK_DEPTH + sizeof(uint32_t)
                && (arg->flags & FUSE_INIT_EXT) && !(arg->flags & FUSE_WRITEBACK_CACHE)
                && (kernel_flags & ACPFS_FUSE_PASSTHROUGH)) {
                char *raw = iov[1].iov_base;
                uint32_t flags2, depth = (uint32_t)want_passthrough;
                memcpy(&flags2, raw + ACPFS_INIT_OUT_FLAGS2, sizeof(flags2));
                flags2 |= (uint32_t)(ACPFS_FUSE_PASSTHROUGH >> 32);
                memcpy(raw + ACPFS_INIT_OUT_FLAGS2, &flags2, sizeof(flags2));
                memcpy(raw + ACPFS_INIT_OUT_STACK_DEPTH, &depth, sizeof(depth));
                passthrough = 1;
                /* passthrough writes never reach the daemon: without this the kernel asks
                 * for security.capability (a GETXATTR) before each of them */
                if (kernel_flags & ACPFS_KILLPRIV_V2) {
                    arg->flags |= ACPFS_KILLPRIV_V2;
                    killpriv_v2 = 1;
                }
            }
        }
    }
    if (patching != 0 && count >= 2 && iov[0].iov_len == sizeof(struct fuse_out_header)
        && iov[count - 1].iov_len >= 16) {
        /* the OPEN or CREATE reply (fuse_open_out last: after fuse_entry_out for CREATE) */
        struct fuse_out_header *out = iov[0].iov_base;
        if (out->error == 0) {
            char *open_out = (char *)iov[count - 1].iov_base + iov[count - 1].iov_len - 16;
            uint32_t open_flags;
            memcpy(&open_flags, open_out + 8, sizeof(open_flags));
            open_flags |= ACPFS_FOPEN_PASSTHROUGH;
            memcpy(open_out + 8, &open_flags, sizeof(open_flags));
            memcpy(open_out + 12, &patching, sizeof(patching));
            passthrough_opens++;
        }
        patching = 0;
    }
    return writev(fd, iov, count);
}

struct fuse_session *fastwrite_session(void)
{
    return custom_io ? session : NULL;
}

void *fastwrite_libfuse_symbol(const char *name)
{
    return libfuse_symbol(name);
}

/* Interposed like fuse_session_new: mount, then take over the session's I/O. */
int fuse_session_mount(struct fuse_session *se, const char *mountpoint)
{
    static session_mount_fn real;
    if (real == NULL && (real = (session_mount_fn)libfuse_symbol("fuse_session_mount")) == NULL)
        return -1;
    init_unique = kernel_flags = 0;   /* a session of its own: nothing from an earlier one */
    direct_io_mmap = custom_io = passthrough = killpriv_v2 = nonblocking = 0;
    next_backing = patching = next_noflush = 0;
    session = NULL;
    attrs_reset();
    burst_reset();
    int res = real(se, mountpoint);
    if (res != 0 || !kernel_maps_direct_io_safely()
        || (!want_direct_io_mmap() && !want_passthrough))
        return res;
    session = se;
    static const struct fuse_custom_io io = {.writev = io_writev, .read = io_read,
                                             .splice_receive = io_splice_receive,
                                             .splice_send = io_splice_send};
    /* the fd stays the mount's: closed once, by fuse_session_destroy */
    if (fuse_session_custom_io(se, &io, fuse_session_fd(se)) == 0) {
        custom_io = 1;
        int fd = fuse_session_fd(se), flags = fcntl(fd, F_GETFL);
        nonblocking = flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
    }
    return res;
}

/* The interposed libfuse entry point; see the top of this file. */
struct fuse_session *fuse_session_new(struct fuse_args *args, const struct fuse_lowlevel_ops *op,
                                      size_t op_size, void *userdata)
{
    static session_new_fn real;
    if (real == NULL && (real = (session_new_fn)libfuse_symbol("fuse_session_new")) == NULL)
        return NULL;
    size_t need = offsetof(struct fuse_lowlevel_ops, write_buf) + sizeof(op->write_buf);
    if (op == NULL || op_size < need || op->write_buf == NULL
        || (next_write_buf != NULL && op->write_buf != next_write_buf))
        return real(args, op, op_size, userdata);
    /* libfuse copies the operations into the session, so a temporary copy suffices */
    struct fuse_lowlevel_ops *ours = malloc(op_size);
    if (ours == NULL)
        return real(args, op, op_size, userdata);
    memcpy(ours, op, op_size);
    next_write_buf = op->write_buf;
    ours->write_buf = fast_write_buf;
    if (op_size >= offsetof(struct fuse_lowlevel_ops, fallocate) + sizeof(op->fallocate)
        && ours->fallocate == NULL)
        ours->fallocate = fast_fallocate;
    attrs_hook(ours);
    atonce_hook(ours);
    struct fuse_session *se = real(args, ours, op_size, userdata);
    free(ours);
    if (se != NULL)
        sessions_hooked++;
    return se;
}

/* -- passthrough: the OPEN and CREATE replies ---------------------------------------------- */
typedef int (*reply_open_fn)(fuse_req_t, const struct fuse_file_info *);
typedef int (*reply_create_fn)(fuse_req_t, const struct fuse_entry_param *,
                               const struct fuse_file_info *);

/* Interposed like fuse_session_new. pyfuse3 calls it right after Operations.open returns,
 * with no other request handled in between, so the id reply_backing() set during that call
 * belongs to this reply; io_writev adds it (the reply is written within the real call).
 * reply_noflush() during that call: the reply says FOPEN_NOFLUSH (libfuse's noflush bit,
 * which pyfuse3's FileInfo cannot set), so that close() of this open sends no FLUSH. */
int fuse_reply_open(fuse_req_t req, const struct fuse_file_info *fi)
{
    static reply_open_fn real;
    if (real == NULL && (real = (reply_open_fn)libfuse_symbol("fuse_reply_open")) == NULL)
        return -ENOSYS;
    struct fuse_file_info copy;
    if (next_noflush && fi != NULL) {
        copy = *fi;
        copy.noflush = 1;
        fi = &copy;
        noflush_opens++;
    }
    next_noflush = 0;
    patching = next_backing;
    next_backing = 0;
    int res = real(req, fi);
    patching = 0;
    return res;
}

/* -- kernel inodes of one file: the inode number shown beside the node id ----------------- */
/* A file may be known to the kernel under several node ids (acpfs.cache.inodes: a kernel
 * inode passed through to a backing file is never handed out again for other opens). Python
 * puts the node id into st_ino, as pyfuse3 fills both from it; the entry replies below show
 * the file's own number (the low ACPFS_ALIAS_SHIFT bits) in the attributes, so stat() sees
 * one st_ino whichever kernel inode answers. */
#define ACPFS_ALIAS_SHIFT 40

static const struct fuse_entry_param *shown(const struct fuse_entry_param *e,
                                            struct fuse_entry_param *copy)
{
    if (e == NULL || (e->attr.st_ino >> ACPFS_ALIAS_SHIFT) == 0)
        return e;
    *copy = *e;
    copy->attr.st_ino &= (1ULL << ACPFS_ALIAS_SHIFT) - 1;
    return copy;
}

typedef int (*reply_entry_fn)(fuse_req_t, const struct fuse_entry_param *);
typedef size_t (*add_direntry_plus_fn)(fuse_req_t, char *, size_t, const char *,
                                       const struct fuse_entry_param *, off_t);

int fuse_reply_entry(fuse_req_t req, const struct fuse_entry_param *e)
{
    static reply_entry_fn real;
    struct fuse_entry_param copy;
    if (real == NULL && (real = (reply_entry_fn)libfuse_symbol("fuse_reply_entry")) == NULL)
        return -ENOSYS;
    return real(req, shown(e, &copy));
}

size_t fuse_add_direntry_plus(fuse_req_t req, char *buf, size_t bufsize, const char *name,
                              const struct fuse_entry_param *e, off_t off)
{
    static add_direntry_plus_fn real;
    struct fuse_entry_param copy;
    if (real == NULL && (real = (add_direntry_plus_fn)libfuse_symbol("fuse_add_direntry_plus")) == NULL)
        return 0;
    return real(req, buf, bufsize, name, shown(e, &copy), off);
}

int fuse_reply_create(fuse_req_t req, const struct fuse_entry_param *e,
                      const struct fuse_file_info *fi)
{
    static reply_create_fn real;
    struct fuse_entry_param copy;
    if (real == NULL && (real = (reply_create_fn)libfuse_symbol("fuse_reply_create")) == NULL)
        return -ENOSYS;
    patching = next_backing;
    next_backing = 0;
    int res = real(req, shown(e, &copy), fi);
    patching = 0;
    return res;
}

static PyObject *set_passthrough(PyObject *self, PyObject *arg)
{
    long depth = PyLong_AsLong(arg);
    if (depth == -1 && PyErr_Occurred())
        return NULL;
    if (depth < 0 || depth > 2) {
        PyErr_SetString(PyExc_ValueError, "max_stack_depth must be 0 (off), 1 or 2");
        return NULL;
    }
    want_passthrough = (int)depth;
    Py_RETURN_NONE;
}

static PyObject *backing_open(PyObject *self, PyObject *arg)
{
    int fd = (int)PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (session == NULL || !passthrough) {
        errno = EOPNOTSUPP;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    struct acpfs_backing_map map = {.fd = fd, .flags = 0, .padding = 0};
    int id = ioctl(fuse_session_fd(session), ACPFS_IOC_BACKING_OPEN, &map);
    if (id < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(id);
}

static PyObject *backing_close(PyObject *self, PyObject *arg)
{
    long id = PyLong_AsLong(arg);
    if (id == -1 && PyErr_Occurred())
        return NULL;
    if (session == NULL) {
        errno = EOPNOTSUPP;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    uint32_t bid = (uint32_t)id;
    if (ioctl(fuse_session_fd(session), ACPFS_IOC_BACKING_CLOSE, &bid) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *reply_backing(PyObject *self, PyObject *arg)
{
    long id = PyLong_AsLong(arg);
    if (id == -1 && PyErr_Occurred())
        return NULL;
    next_backing = (int32_t)id;
    Py_RETURN_NONE;
}

void fastwrite_reply_next(int32_t backing_id, int noflush)
{
    next_backing = backing_id;
    next_noflush = noflush;
}

static PyObject *reply_noflush(PyObject *self, PyObject *unused)
{
    next_noflush = 1;
    Py_RETURN_NONE;
}

static PyObject *get_passthrough(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("{s:O,s:O,s:K}", "granted", passthrough ? Py_True : Py_False,
                         "killpriv_v2", killpriv_v2 ? Py_True : Py_False,
                         "opens", passthrough_opens);
}

/* Replace the callable in *slot with arg (None: none). */
static PyObject *set_callable(PyObject **slot, PyObject *arg)
{
    if (arg != Py_None && !PyCallable_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "handler must be callable or None");
        return NULL;
    }
    Py_XDECREF(*slot);
    *slot = NULL;
    if (arg != Py_None) {
        Py_INCREF(arg);
        *slot = arg;
    }
    Py_RETURN_NONE;
}

static PyObject *set_handler(PyObject *self, PyObject *arg)
{
    return set_callable(&handler, arg);
}

static PyObject *set_fallocate_handler(PyObject *self, PyObject *arg)
{
    return set_callable(&fallocate_handler, arg);
}

static PyObject *stats(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("{s:i,s:K,s:K,s:K,s:K,s:i,s:K,s:K,s:d}", "sessions_hooked",
                         sessions_hooked, "fast_writes", fast_writes, "passed_on", passed_on,
                         "failed", failed, "from_pipe", from_pipe, "custom_io", custom_io,
                         "kernel_flags", (unsigned long long)kernel_flags,
                         "noflush_opens", noflush_opens, "python_s", python_ns / 1e9);
}

static PyObject *get_direct_io_mmap(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(direct_io_mmap);
}

static PyMethodDef methods[] = {
    {"set_handler", set_handler, METH_O,
     "Set the callable offered each WRITE as (fh, off, memoryview) -> int | None; None unsets."},
    {"set_fallocate_handler", set_fallocate_handler, METH_O,
     "Set the callable offered each FALLOCATE as (fh, mode, offset, length) -> 0 | -errno."},
    {"direct_io_mmap", get_direct_io_mmap, METH_NOARGS,
     "Whether the INIT reply granted FUSE_DIRECT_IO_ALLOW_MMAP (shared mmap of direct_io files)."},
    {"stats", stats, METH_NOARGS,
     "{'sessions_hooked': sessions created through the hook, 'fast_writes': WRITEs written by "
     "the handler, 'passed_on': WRITEs it passed on to pyfuse3, 'failed': WRITEs answered with "
     "an error, 'from_pipe': WRITEs that arrived in libfuse's splice pipe, 'custom_io': the "
     "session's I/O is ours, 'kernel_flags': the INIT flags the kernel offered, "
     "'noflush_opens': OPEN replies sent with FOPEN_NOFLUSH, 'python_s': seconds spent in the "
     "WRITE handler}"},
    {"set_passthrough", set_passthrough, METH_O,
     "Before the mount: ask for FUSE_PASSTHROUGH in INIT with this max_stack_depth (0: do not)."},
    {"passthrough", get_passthrough, METH_NOARGS,
     "{'granted': the INIT reply enabled passthrough, 'killpriv_v2': and the daemon clears "
     "setuid/setgid, 'opens': OPEN/CREATE replies sent with a backing id}"},
    {"backing_open", backing_open, METH_O,
     "Register an open file descriptor as a backing file (FUSE_DEV_IOC_BACKING_OPEN): its id."},
    {"backing_close", backing_close, METH_O,
     "Unregister a backing id (FUSE_DEV_IOC_BACKING_CLOSE)."},
    {"reply_backing", reply_backing, METH_O,
     "The OPEN or CREATE reply pyfuse3 sends next passes the file through to this backing id."},
    {"reply_noflush", reply_noflush, METH_NOARGS,
     "The OPEN reply pyfuse3 sends next says FOPEN_NOFLUSH: its close() sends no FLUSH."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "acpfs.fuse._fastwrite",
    "WRITE requests handed to Python as a view of libfuse's buffer (see acpfs/fastwrite.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastwrite(void)
{
    if (PyType_Ready(&SlotType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddFunctions(m, attrs_methods) < 0
                      || PyModule_AddFunctions(m, atonce_methods) < 0
                      || PyModule_AddFunctions(m, burst_methods) < 0
                      || PyModule_AddFunctions(m, idlepoll_methods) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
