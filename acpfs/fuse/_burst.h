/* acpfs/fuse/_burst.c: what _fastwrite.c calls of the burst loop, and the reverse. */
#ifndef ACPFS_BURST_H
#define ACPFS_BURST_H

#include <Python.h>
#include <stdint.h>

/* (_burst.c) A reply is being sent (the session's writev): to request ``unique``. */
void burst_note_reply(uint64_t unique);
/* (_burst.c) A new session is mounted: nothing from an earlier one counts. */
void burst_reset(void);
/* (_fastwrite.c) The mounted session whose I/O is ours, or NULL. */
struct fuse_session *fastwrite_session(void);
/* (_fastwrite.c) The session's device is non-blocking (its reads say EINTR for "none"). */
int fastwrite_nonblocking(void);
/* (_fastwrite.c) libfuse's own definition of an interposed function. */
void *fastwrite_libfuse_symbol(const char *name);

extern PyMethodDef burst_methods[];

#endif
