/* acpfs/fuse/_attrs.c: what _fastwrite.c calls of the attribute table. */
#ifndef ACPFS_ATTRS_H
#define ACPFS_ATTRS_H

#include <Python.h>
#include <stdint.h>

struct fuse_lowlevel_ops;

/* In fuse_session_new: GETATTR and GETXATTR go through the table first. */
void attrs_hook(struct fuse_lowlevel_ops *ops);
/* In fuse_session_mount: a new session starts with an empty, disabled table. */
void attrs_reset(void);
/* A WRITE or FALLOCATE of this node id arrived: its entry no longer holds. */
void attrs_drop_key(uint64_t nodeid);

extern PyMethodDef attrs_methods[];

#endif
