/* tools/fuse_floor.c: the fastest a libfuse daemon written in C answers small-file requests.

   The C twin of tools/fuse_floor.py's Floor: one directory of names and sizes in a hash
   table, every request answered at once on one thread (as pyfuse3 answers on one), nothing
   kept anywhere else. tools/fuse_floor.py builds it, mounts it beside the Python floor and
   runs the same workload on both, so the two ceilings come from one run:

       cc -O2 -o fuse-floor-c tools/fuse_floor.c $(pkg-config --cflags --libs fuse3)
       ./fuse-floor-c MOUNTPOINT          # foreground; fusermount3 -u MOUNTPOINT ends it
*/
#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define SLOTS (1u << 20)           /* open addressing; the workload stays far below this */

struct slot { char *name; fuse_ino_t ino; off_t size; };
static struct slot table[SLOTS];   /* name -> inode; removed names leave a tombstone */
static off_t *sizes;               /* inode -> size */
static fuse_ino_t next_ino = FUSE_ROOT_ID + 1;
static const char TOMB[] = "";

static unsigned hash(const char *s)
{
    unsigned h = 2166136261u;
    while (*s)
        h = (h ^ (unsigned char)*s++) * 16777619u;
    return h & (SLOTS - 1);
}

static struct slot *find(const char *name)
{
    for (unsigned i = hash(name);; i = (i + 1) & (SLOTS - 1)) {
        if (!table[i].name)
            return NULL;
        if (table[i].name != TOMB && !strcmp(table[i].name, name))
            return &table[i];
    }
}

static void attr_of(fuse_ino_t ino, struct stat *st)
{
    memset(st, 0, sizeof(*st));
    st->st_ino = ino;
    st->st_mode = ino == FUSE_ROOT_ID ? S_IFDIR | 0755 : S_IFREG | 0644;
    st->st_nlink = ino == FUSE_ROOT_ID ? 2 : 1;
    st->st_size = ino == FUSE_ROOT_ID ? 0 : sizes[ino];
    st->st_blksize = 4096;
}

static void reply_entry(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct fuse_entry_param e;
    memset(&e, 0, sizeof(e));
    e.ino = ino;
    e.attr_timeout = e.entry_timeout = 1.0;
    attr_of(ino, &e.attr);
    if (fi)
        fuse_reply_create(req, &e, fi);
    else
        fuse_reply_entry(req, &e);
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct slot *s = parent == FUSE_ROOT_ID ? find(name) : NULL;
    if (!s)
        fuse_reply_err(req, ENOENT);
    else
        reply_entry(req, s->ino, NULL);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct stat st;
    (void)fi;
    attr_of(ino, &st);
    fuse_reply_attr(req, &st, 1.0);
}

static void op_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                      struct fuse_file_info *fi)
{
    struct slot *s = find(name);
    (void)parent; (void)mode;
    if (!s) {
        unsigned i = hash(name);
        while (table[i].name && table[i].name != TOMB)
            i = (i + 1) & (SLOTS - 1);
        s = &table[i];
        s->name = strdup(name);
        s->ino = next_ino++;
        sizes[s->ino] = 0;
    }
    fi->fh = s->ino;
    reply_entry(req, s->ino, fi);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    fi->fh = ino;
    fuse_reply_open(req, fi);
}

static void op_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off,
                     struct fuse_file_info *fi)
{
    (void)buf; (void)fi;
    if (off + (off_t)size > sizes[ino])
        sizes[ino] = off + size;
    fuse_reply_write(req, size);
}

static void op_ok(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino; (void)fi;
    fuse_reply_err(req, 0);
}

static void op_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size)
{
    (void)ino; (void)name; (void)size;
    fuse_reply_err(req, ENODATA);
}

static void op_unlink(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct slot *s = parent == FUSE_ROOT_ID ? find(name) : NULL;
    if (!s) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    free(s->name);
    s->name = (char *)TOMB;
    fuse_reply_err(req, 0);
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    fuse_reply_open(req, fi);
}

static const struct fuse_lowlevel_ops ops = {
    .lookup = op_lookup, .getattr = op_getattr, .create = op_create, .open = op_open,
    .write = op_write, .flush = op_ok, .release = op_ok, .getxattr = op_getxattr,
    .unlink = op_unlink, .opendir = op_opendir, .releasedir = op_ok,
};

int main(int argc, char *argv[])
{
    char *args[] = {argv[0], "-o", "fsname=floor-c,default_permissions", NULL};
    struct fuse_args fa = FUSE_ARGS_INIT(3, args);
    struct fuse_session *se;
    int rc;

    if (argc != 2) {
        fprintf(stderr, "usage: %s MOUNTPOINT\n", argv[0]);
        return 2;
    }
    sizes = calloc(SLOTS, sizeof(*sizes));
    se = fuse_session_new(&fa, &ops, sizeof(ops), NULL);
    if (!sizes || !se || fuse_session_mount(se, argv[1]))
        return 1;
    rc = fuse_session_loop(se);
    fuse_session_unmount(se);
    fuse_session_destroy(se);
    return rc ? 1 : 0;
}
