/* tools/passthrough_floor.c: the fastest a libfuse daemon written in C answers a load of a file
   it does not hold, with the kernel's passthrough.

   What a checkpoint loader costs through FUSE beyond the file's bytes is requests: a load of
   `step/model.pt` by `torch.load(mmap=True)` sends LOOKUPs for the names the kernel does not
   know, two OPENs, the GETATTR the kernel asks after a read or mapping passed through (it
   forgets the atime), and RELEASEs. This daemon answers each of them at once, on one thread,
   in C: a read-only mirror of a directory whose files are passed through to the kernel at
   every open (FOPEN_PASSTHROUGH, FOPEN_NOFLUSH), nothing cached, nothing checked. Whatever a
   load through it costs beyond the same load on the directory itself is the floor of this
   kernel and machine, which no daemon answering the same requests can go under;
   tools/passthrough_floor.py runs the loaders on it, on acpfs and on the directory side by
   side (docs/benchmarks.md, "The floor of a cold load").

   libfuse before 3.16 cannot ask for passthrough, so the session's I/O is this file's own
   (fuse_session_custom_io, libfuse 3.14+): the INIT reply gets FUSE_PASSTHROUGH and a stack
   depth, and each OPEN reply the backing id, as acpfs/fuse/_fastwrite.c does. Built against
   libfuse 3.18 or later (-DFUSE_USE_VERSION=318: the headers define FUSE_CAP_OVER_IO_URING),
   it asks through libfuse instead, and `-o io_uring` (argument 3) moves the session onto
   FUSE-over-io_uring: one queue per CPU, each served by a thread pinned to that CPU
   (libfuse's lib/fuse_uring.c; the kernel needs `enable_uring`).

       cc -O2 -o passthrough-floor tools/passthrough_floor.c $(pkg-config --cflags --libs fuse3)
       ./passthrough-floor MOUNTPOINT DIRECTORY [io_uring]   # foreground; fusermount3 -u ends it
*/
#define _GNU_SOURCE                         /* asprintf, realpath */
#ifndef FUSE_USE_VERSION
#define FUSE_USE_VERSION 34
#endif
#include <fuse_lowlevel.h>
#ifdef FUSE_CAP_OVER_IO_URING
#define NATIVE 1                            /* libfuse asks for passthrough itself */
#else
#define NATIVE 0
#endif
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define PASSTHROUGH_FLAG (1ULL << 37)       /* FUSE_PASSTHROUGH, Linux 6.9 */
#define FOPEN_PASSTHROUGH_FLAG (1U << 7)
#define INIT_OUT_FLAGS2 32                  /* byte offsets in struct fuse_init_out */
#define INIT_OUT_STACK_DEPTH 36
struct backing_map { int32_t fd; uint32_t flags; uint64_t padding; };
#define IOC_BACKING_OPEN _IOW(229, 1, struct backing_map)
#define IOC_BACKING_CLOSE _IOW(229, 2, uint32_t)
#define TIMEOUT 1.0                         /* s: acpfs's default --coherence-timeout */

static struct fuse_session *se;
/* node id -> its path, and the backing file its opens share (the kernel passes all opens
 * of an inode through to one backing file, and answers EIO to an open with another) */
struct node { char *path; int fd; int32_t backing_id; unsigned opens; };
static struct node *nodes;
static size_t nnodes, cap;
#if !NATIVE
static uint64_t init_unique, kernel_flags;
static int32_t patching;                    /* the OPEN reply being sent gets this id */
#endif

static fuse_ino_t add(char *path)
{
    if (nnodes == cap) {
        cap = cap ? 2 * cap : 1024;
        nodes = realloc(nodes, cap * sizeof(*nodes));
        if (nodes == NULL)
            abort();
    }
    nodes[nnodes] = (struct node){.path = path, .fd = -1};
    return nnodes++;
}

static int known(fuse_ino_t ino)
{
    return ino >= FUSE_ROOT_ID && ino < nnodes;
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct fuse_entry_param e;
    char *path;
    if (!known(parent) || asprintf(&path, "%s/%s", nodes[parent].path, name) < 0) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    memset(&e, 0, sizeof(e));
    if (lstat(path, &e.attr) != 0) {
        free(path);
        fuse_reply_err(req, errno);
        return;
    }
    e.ino = e.attr.st_ino = add(path);     /* a node id per lookup: the floor keeps no table */
    e.attr_timeout = e.entry_timeout = TIMEOUT;
    fuse_reply_entry(req, &e);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct stat st;
    (void)fi;
    if (!known(ino) || lstat(nodes[ino].path, &st) != 0) {
        fuse_reply_err(req, known(ino) ? errno : ENOENT);
        return;
    }
    st.st_ino = ino;
    fuse_reply_attr(req, &st, TIMEOUT);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (!known(ino) || (fi->flags & O_ACCMODE) != O_RDONLY) {
        fuse_reply_err(req, known(ino) ? EROFS : ENOENT);
        return;
    }
    struct node *n = &nodes[ino];
    if (n->opens == 0) {
        n->fd = open(n->path, O_RDONLY | O_CLOEXEC);
        if (n->fd < 0) {
            fuse_reply_err(req, errno);
            return;
        }
#if NATIVE
        n->backing_id = fuse_passthrough_open(req, n->fd);
#else
        struct backing_map map = {.fd = n->fd};
        n->backing_id = ioctl(fuse_session_fd(se), IOC_BACKING_OPEN, &map);
#endif
        if (n->backing_id <= 0) {
            int e = errno;
            close(n->fd);
            fuse_reply_err(req, e);
            return;
        }
    }
    n->opens++;
    fi->fh = ino;
    fi->noflush = 1;
#if NATIVE
    fi->backing_id = n->backing_id;
    fuse_reply_open(req, fi);
#else
    patching = n->backing_id;
    fuse_reply_open(req, fi);
    patching = 0;
#endif
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct node *n = &nodes[fi->fh];
    (void)ino;
    if (--n->opens == 0) {
#if NATIVE
        fuse_passthrough_close(req, n->backing_id);
#else
        uint32_t id = (uint32_t)n->backing_id;
        ioctl(fuse_session_fd(se), IOC_BACKING_CLOSE, &id);
#endif
        close(n->fd);
    }
    fuse_reply_err(req, 0);
}

static void op_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino, (void)fi;
    fuse_reply_err(req, 0);
}

#if NATIVE
static void op_init(void *userdata, struct fuse_conn_info *conn)
{
    (void)userdata;
    if (!fuse_set_feature_flag(conn, FUSE_CAP_PASSTHROUGH)) {
        fprintf(stderr, "passthrough-floor: the kernel offers no passthrough\n");
        exit(1);
    }
    conn->max_backing_stack_depth = 1;
    fuse_set_feature_flag(conn, FUSE_CAP_OVER_IO_URING);   /* used only with -o io_uring */
}
#endif

static const struct fuse_lowlevel_ops ops = {
#if NATIVE
    .init = op_init,
#endif
    .lookup = op_lookup, .getattr = op_getattr, .open = op_open, .release = op_release,
    .flush = op_flush,
};

#if !NATIVE

static ssize_t io_read(int fd, void *buf, size_t len, void *userdata)
{
    ssize_t n = read(fd, buf, len);
    (void)userdata;
    if (n >= (ssize_t)(sizeof(struct fuse_in_header) + sizeof(struct fuse_init_in))) {
        const struct fuse_in_header *in = buf;
        if (in->opcode == FUSE_INIT) {
            const struct fuse_init_in *arg = (const void *)(in + 1);
            init_unique = in->unique;
            kernel_flags = arg->flags | ((arg->flags & FUSE_INIT_EXT) ? (uint64_t)arg->flags2 << 32 : 0);
        }
    }
    return n;
}

static ssize_t io_writev(int fd, struct iovec *iov, int count, void *userdata)
{
    (void)userdata;
    if (count >= 2 && iov[0].iov_len == sizeof(struct fuse_out_header)) {
        struct fuse_out_header *out = iov[0].iov_base;
        char *last = (char *)iov[count - 1].iov_base + iov[count - 1].iov_len;
        if (init_unique != 0 && out->unique == init_unique) {
            init_unique = 0;
            char *raw = iov[1].iov_base;
            uint32_t flags2, depth = 1;
            if (!(kernel_flags & PASSTHROUGH_FLAG) || iov[1].iov_len < INIT_OUT_STACK_DEPTH + 4) {
                fprintf(stderr, "passthrough-floor: the kernel offers no passthrough\n");
                exit(1);
            }
            memcpy(&flags2, raw + INIT_OUT_FLAGS2, sizeof(flags2));
            flags2 |= (uint32_t)(PASSTHROUGH_FLAG >> 32);
            memcpy(raw + INIT_OUT_FLAGS2, &flags2, sizeof(flags2));
            memcpy(raw + INIT_OUT_STACK_DEPTH, &depth, sizeof(depth));
        } else if (patching != 0 && out->error == 0 && iov[count - 1].iov_len >= 16) {
            uint32_t open_flags;                              /* fuse_open_out, last 16 bytes */
            memcpy(&open_flags, last - 8, sizeof(open_flags));
            open_flags |= FOPEN_PASSTHROUGH_FLAG;
            memcpy(last - 8, &open_flags, sizeof(open_flags));
            memcpy(last - 4, &patching, sizeof(patching));
        }
    }
    return writev(fd, iov, count);
}

#endif

int main(int argc, char **argv)
{
    int uring = argc == 4 && strcmp(argv[3], "io_uring") == 0;
    if (argc != 3 && !(uring && NATIVE)) {
        fprintf(stderr, "usage: %s MOUNTPOINT DIRECTORY%s\n", argv[0],
                NATIVE ? " [io_uring]" : " (io_uring: build against libfuse 3.18+)");
        return 2;
    }
    char *opts[] = {argv[0], "-o", "default_permissions,fsname=passthrough-floor", "-o",
                    "io_uring"};
    struct fuse_args args = FUSE_ARGS_INIT(uring ? 5 : 3, opts);
    add(NULL);                                                /* node id 0: none */
    add(realpath(argv[2], NULL));                             /* FUSE_ROOT_ID */
    if (nodes[FUSE_ROOT_ID].path == NULL) {
        perror(argv[2]);
        return 1;
    }
    se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
    if (se == NULL || fuse_session_mount(se, argv[1]) != 0)
        return 1;
#if !NATIVE
    static const struct fuse_custom_io io = {.writev = io_writev, .read = io_read};
    if (fuse_session_custom_io(se, &io, fuse_session_fd(se)) != 0)
        return 1;
#endif
    int res = fuse_session_loop(se);
    fuse_session_unmount(se);
    fuse_session_destroy(se);
    return res < 0 ? 1 : 0;
}
