/* acpfs/fuse/_idlepoll.c: what _burst.c calls of it, and its methods. */
#ifndef ACPFS_IDLEPOLL_H
#define ACPFS_IDLEPOLL_H

#include <Python.h>

/* (_idlepoll.c) A request of the mounted session arrived (the dispatching thread). */
void idlepoll_note_request(void);

extern PyMethodDef idlepoll_methods[];

#endif
