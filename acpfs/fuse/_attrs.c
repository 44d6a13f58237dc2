/*
 * acpfs.fuse._fastwrite, part two: GETATTR and GETXATTR of security names answered in C.
 *
 * The kernel asks for a file's attributes again after every change it makes or sees: a
 * write (also one passed through to a memory file), a create or unlink in a directory
 * (with default_permissions the directory's mode is checked next), a read (atime). Most of
 * those GETATTRs get the answer Python gave last, and each costs a trip through pyfuse3 and
 * a trio task. This part keeps, per inode, the attributes Python last answered and answers
 * GETATTR from them while they hold:
 *
 *     attrs_put(ino, mode, nlink, uid, gid, rdev, size, atime_ns, mtime_ns, ctime_ns, valid_for)
 *     attrs_drop(ino)     the inode changed: the next GETATTR goes to Python
 *     attrs_clear()       every inode may have changed (a rename, an unlink, a removal elsewhere)
 *
 * A file the kernel writes itself (a writer passed through to its memory file) comes with
 * a descriptor of that memory file, which the table duplicates and keeps while the answer
 * does: its size and times are taken from an fstat of it once they differ from what Python
 * last saw (as Files.sync_content would), the rest from the answer.
 *
 * Who keeps it right: Python (acpfs/fuse/attrtable.py), which puts an answer only where it
 * would give the same one until ``valid_for`` seconds have passed unless a request or
 * another node changes the inode, and drops it when that happens. Here only WRITE and
 * FALLOCATE, which the extension hands to Python without a trio task, drop their inode on
 * arrival. A GETATTR of an inode with no valid entry goes to pyfuse3 as before; the reply's
 * attribute timeout is what is left of ``valid_for``, so the kernel never keeps an answer
 * longer than Python allowed.
 *
 * GETXATTR of a name outside the "user." namespace is answered ENODATA: acpfs stores no
 * other extended attributes (Core.getxattr answers the same). The kernel asks for
 * "security.capability" before the first write of every open (file_remove_privs), on
 * passthrough too, so this saves one Python request per written file.
 *
 * Keys are inode numbers: a node id with alias bits (ACPFS_ALIAS_SHIFT) is one more kernel
 * inode of the same file, and shares its entry. Open addressing, linear probing, deletion
 * by backward shift; ``attrs_clear`` is O(1): entries put before it no longer count (their
 * ``seq`` is not above ``cleared_seq``) and are overwritten or swept as the table fills.
 * Bounded: at MAX_ENTRIES the table is emptied (it only saves requests, never holds state).
 *
 * Threads: everything runs with the GIL held (the handlers are called from pyfuse3's
 * fuse_session_process_buf in the trio thread, as the WRITE handler), so no lock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION 32
#include <fuse_lowlevel.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "_attrs.h"
#include "_clock.h"

#define ALIAS_MASK ((1ULL << 40) - 1)   /* acpfs.cache.inodes.ALIAS_SHIFT */
#define MIN_SLOTS 1024
#define MAX_ENTRIES (1 << 16)

struct entry {
    uint64_t ino;          /* 0: empty slot */
    uint64_t seq;          /* put after the last clear when above cleared_seq */
    uint64_t until_ns;     /* CLOCK_MONOTONIC */
    uint64_t size, rdev;
    int64_t atime_ns, mtime_ns, ctime_ns;
    uint32_t mode, nlink, uid, gid;
    /* A file the kernel writes itself (passed through): our descriptor of its memory file,
     * or -1, and the memory file's (size, mtime, ctime) when Python last looked: where it
     * changed since, its size and times are the memory file's (Files.sync_content). */
    int fd;
    uint64_t seen_size;
    int64_t seen_mtime, seen_ctime;
};

static struct entry *slots;
static size_t nslots, used;        /* used: slots holding an ino, valid or not */
static uint64_t seq, cleared_seq;
static int enabled;
static long blksize = 1 << 20;
static unsigned long long hits, misses, xattr_answered, drops, clears;
static size_t with_fd;             /* entries holding a descriptor */

typedef void (*getattr_fn)(fuse_req_t, fuse_ino_t, struct fuse_file_info *);
typedef void (*getxattr_fn)(fuse_req_t, fuse_ino_t, const char *, size_t);
static getattr_fn next_getattr;
static getxattr_fn next_getxattr;

static size_t home(uint64_t ino)
{
    return (size_t)((ino * 0x9E3779B97F4A7C15ULL) >> 32) & (nslots - 1);
}

/* The slot holding ino, or -1. */
static long find(uint64_t ino)
{
    if (nslots == 0)
        return -1;
    for (size_t i = home(ino);; i = (i + 1) & (nslots - 1)) {
        if (slots[i].ino == ino)
            return (long)i;
        if (slots[i].ino == 0)
            return -1;
    }
}

static void close_fd(struct entry *e)
{
    if (e->fd >= 0) {
        close(e->fd);
        e->fd = -1;
        with_fd--;
    }
}

static void remove_slot(size_t i)
{
    size_t mask = nslots - 1;
    close_fd(&slots[i]);
    for (size_t j = (i + 1) & mask; slots[j].ino != 0; j = (j + 1) & mask) {
        size_t k = home(slots[j].ino);
        /* move j back into i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            slots[i] = slots[j];
            i = j;
        }
    }
    slots[i].ino = 0;
    used--;
}

static void empty_table(void)
{
    for (size_t i = 0; i < nslots; i++)
        if (slots[i].ino != 0)
            close_fd(&slots[i]);
    free(slots);
    slots = NULL;
    nslots = used = 0;
}

/* Room for one more entry: grow, or rebuild without the entries that no longer count. */
static int make_room(void)
{
    if (nslots != 0 && (used + 1) * 2 <= nslots)
        return 0;
    uint64_t now = monotonic_ns();
    size_t live = 0;
    for (size_t i = 0; i < nslots; i++)
        live += slots[i].ino != 0 && slots[i].seq > cleared_seq && slots[i].until_ns > now;
    if (live >= MAX_ENTRIES) {
        empty_table();
        clears++;
        live = 0;
    }
    size_t want = MIN_SLOTS;
    while (want < (live + 1) * 4)
        want *= 2;
    struct entry *old = slots;
    size_t oldn = nslots;
    struct entry *fresh = calloc(want, sizeof(*fresh));
    if (fresh == NULL)
        return -1;
    slots = fresh;
    nslots = want;
    used = 0;
    for (size_t i = 0; i < oldn; i++) {
        if (old[i].ino == 0)
            continue;
        if (old[i].seq <= cleared_seq || old[i].until_ns <= now) {
            close_fd(&old[i]);
            continue;
        }
        size_t j = home(old[i].ino);
        while (slots[j].ino != 0)
            j = (j + 1) & (nslots - 1);
        slots[j] = old[i];
        used++;
    }
    free(old);
    return 0;
}

void attrs_drop_key(uint64_t nodeid)
{
    long i = find(nodeid & ALIAS_MASK);
    if (i >= 0) {
        remove_slot((size_t)i);
        drops++;
    }
}

static void answer_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (enabled) {
        long i = find(ino & ALIAS_MASK);
        if (i >= 0) {
            struct entry *e = &slots[i];
            uint64_t now = monotonic_ns();
            struct stat mem;
            int usable = e->seq > cleared_seq && e->until_ns > now
                         && (e->fd < 0 || fstat(e->fd, &mem) == 0);
            if (usable) {
                uint64_t size = e->size;
                int64_t mtime = e->mtime_ns, ctime = e->ctime_ns;
                if (e->fd >= 0) {
                    int64_t mm = (int64_t)mem.st_mtim.tv_sec * 1000000000LL + mem.st_mtim.tv_nsec;
                    int64_t mc = (int64_t)mem.st_ctim.tv_sec * 1000000000LL + mem.st_ctim.tv_nsec;
                    if ((uint64_t)mem.st_size != e->seen_size || mm != e->seen_mtime
                        || mc != e->seen_ctime) {   /* the kernel wrote it since */
                        size = (uint64_t)mem.st_size;
                        mtime = mm;
                        ctime = mc > ctime ? mc : ctime;
                    }
                }
                struct stat st;
                memset(&st, 0, sizeof(st));
                st.st_ino = e->ino;
                st.st_mode = e->mode;
                st.st_nlink = e->nlink;
                st.st_uid = e->uid;
                st.st_gid = e->gid;
                st.st_rdev = e->rdev;
                st.st_size = (off_t)size;
                st.st_blksize = blksize;
                st.st_blocks = (blkcnt_t)((size + 511) / 512);
                st.st_atim.tv_sec = e->atime_ns / 1000000000LL;
                st.st_atim.tv_nsec = e->atime_ns % 1000000000LL;
                st.st_mtim.tv_sec = mtime / 1000000000LL;
                st.st_mtim.tv_nsec = mtime % 1000000000LL;
                st.st_ctim.tv_sec = ctime / 1000000000LL;
                st.st_ctim.tv_nsec = ctime % 1000000000LL;
                hits++;
                fuse_reply_attr(req, &st, (double)(e->until_ns - now) / 1e9);
                return;
            }
            remove_slot((size_t)i);
        }
        misses++;
    }
    next_getattr(req, ino, fi);
}

static void answer_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size)
{
    if (enabled && strncmp(name, "user.", 5) != 0) {
        xattr_answered++;
        fuse_reply_err(req, ENODATA);
        return;
    }
    next_getxattr(req, ino, name, size);
}

void attrs_hook(struct fuse_lowlevel_ops *ops)
{
    if (ops->getattr != NULL) {
        next_getattr = ops->getattr;
        ops->getattr = answer_getattr;
    }
    if (ops->getxattr != NULL) {
        next_getxattr = ops->getxattr;
        ops->getxattr = answer_getxattr;
    }
}

void attrs_reset(void)
{
    empty_table();
    seq = cleared_seq = 0;
    enabled = 0;
    hits = misses = xattr_answered = drops = clears = 0;
}

/* -- Python ------------------------------------------------------------------------------ */
static PyObject *attrs_enable(PyObject *self, PyObject *args)
{
    int on;
    long bs;
    if (!PyArg_ParseTuple(args, "pl", &on, &bs))
        return NULL;
    if (on && (next_getattr == NULL || next_getxattr == NULL)) {
        PyErr_SetString(PyExc_RuntimeError, "the session's handlers were not hooked");
        return NULL;
    }
    enabled = on;
    blksize = bs;
    if (!on)
        empty_table();
    Py_RETURN_NONE;
}

static PyObject *attrs_put(PyObject *self, PyObject *args)
{
    unsigned long long ino, rdev, size, seen_size = 0;
    unsigned int mode, nlink, uid, gid;
    long long atime, mtime, ctime, seen_mtime = 0, seen_ctime = 0;
    double valid_for;
    int fd = -1;
    if (!PyArg_ParseTuple(args, "KIIIIKKLLLd|iKLL", &ino, &mode, &nlink, &uid, &gid, &rdev,
                          &size, &atime, &mtime, &ctime, &valid_for, &fd, &seen_size,
                          &seen_mtime, &seen_ctime))
        return NULL;
    ino &= ALIAS_MASK;
    if (!enabled || ino == 0)
        Py_RETURN_NONE;
    long i = find(ino);
    if (valid_for <= 0) {
        if (i >= 0)
            remove_slot((size_t)i);
        Py_RETURN_NONE;
    }
    if (i < 0) {
        if (make_room() != 0)
            return PyErr_NoMemory();
        size_t j = home(ino);
        while (slots[j].ino != 0 && slots[j].ino != ino)
            j = (j + 1) & (nslots - 1);
        i = (long)j;
        used++;
    }
    struct entry *e = &slots[i];
    if (e->ino == ino)
        close_fd(e);   /* an answer replaced */
    else
        e->fd = -1;
    if (fd >= 0) {
        int own = fcntl(fd, F_DUPFD_CLOEXEC, 3);
        if (own < 0) {   /* no answer without its memory file */
            e->ino = ino;
            remove_slot((size_t)i);
            Py_RETURN_NONE;
        }
        e->fd = own;
        with_fd++;
    }
    e->seen_size = seen_size;
    e->seen_mtime = seen_mtime;
    e->seen_ctime = seen_ctime;
    e->ino = ino;
    e->seq = ++seq;
    e->until_ns = monotonic_ns() + (uint64_t)(valid_for * 1e9);
    e->mode = mode;
    e->nlink = nlink;
    e->uid = uid;
    e->gid = gid;
    e->rdev = rdev;
    e->size = size;
    e->atime_ns = atime;
    e->mtime_ns = mtime;
    e->ctime_ns = ctime;
    Py_RETURN_NONE;
}

static PyObject *attrs_drop(PyObject *self, PyObject *arg)
{
    unsigned long long ino = PyLong_AsUnsignedLongLong(arg);
    if (ino == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    attrs_drop_key(ino);
    Py_RETURN_NONE;
}

static PyObject *attrs_clear(PyObject *self, PyObject *unused)
{
    /* entries put before no longer count; those holding a memory file let it go now */
    for (size_t i = 0; with_fd > 0 && i < nslots; i++)
        if (slots[i].ino != 0)
            close_fd(&slots[i]);
    cleared_seq = seq;
    clears++;
    Py_RETURN_NONE;
}

static PyObject *attrs_stats(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("{s:O,s:K,s:K,s:K,s:K,s:K,s:n}", "on", enabled ? Py_True : Py_False,
                         "getattr_answered", hits, "getattr_passed", misses,
                         "getxattr_answered", xattr_answered, "drops", drops, "clears", clears,
                         "entries", (Py_ssize_t)used);
}

PyMethodDef attrs_methods[] = {
    {"attrs_enable", attrs_enable, METH_VARARGS,
     "attrs_enable(on, blksize): answer GETATTR from the table and security GETXATTRs in C."},
    {"attrs_put", attrs_put, METH_VARARGS,
     "attrs_put(ino, mode, nlink, uid, gid, rdev, size, atime_ns, mtime_ns, ctime_ns, "
     "valid_for[, fd, seen_size, seen_mtime_ns, seen_ctime_ns]): GETATTR of ino is answered "
     "with these for valid_for seconds (<= 0: drop); with fd (a memory file the kernel "
     "writes, duplicated and kept), size and times are the file's once they differ from seen."},
    {"attrs_drop", attrs_drop, METH_O, "attrs_drop(ino): the next GETATTR of ino goes to Python."},
    {"attrs_clear", attrs_clear, METH_NOARGS, "Every entry is dropped (O(1))."},
    {"attrs_stats", attrs_stats, METH_NOARGS,
     "{'on', 'getattr_answered', 'getattr_passed', 'getxattr_answered', 'drops', 'clears', "
     "'entries'}"},
    {NULL, NULL, 0, NULL},
};
