/* acpfs/fuse/_atonce.c: what _fastwrite.c calls of the hooks that answer at once, and the
 * reverse. */
#ifndef ACPFS_ATONCE_H
#define ACPFS_ATONCE_H

#include <Python.h>
#include <stdint.h>

struct fuse_lowlevel_ops;

/* In fuse_session_new: OPEN, FLUSH and RELEASE are offered to the Python handlers first. */
void atonce_hook(struct fuse_lowlevel_ops *ops);
/* (_fastwrite.c) The OPEN reply sent next passes the file through to backing_id (0: not)
 * and, with noflush, says FOPEN_NOFLUSH: as reply_backing() and reply_noflush(). */
void fastwrite_reply_next(int32_t backing_id, int noflush);

extern PyMethodDef atonce_methods[];

#endif
