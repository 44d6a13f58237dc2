"""The kernel's GETATTRs answered below Python: the attributes this mount last answered
for each inode, kept in the C extension (acpfs/fuse/_attrs.c) for as long as they hold.

The kernel drops a file's attributes after every change it makes or sees (a write, also
one passed through; a create or unlink in a directory, whose mode ``default_permissions``
then checks; a read, for atime) and asks again; most of those GETATTRs would get the answer
given last. The extension answers them, and GETXATTRs of names outside ``user.`` (ENODATA,
as ``Core.getxattr``), without a trio task.

Owns the rule that keeps the answers right:
- an answer is put (``put``) by the adapter right after it answered a request about the
  inode, for as long as the core says the answer holds (``Loader.answer_holds_for``: 0 for a
  writer passed through, whose size the kernel changes without asking; until the next
  comparison with the backing for a clean file) and at most what the kernel may keep it
  (``operations.timeout_of``: the kernel timeout, longer for a file whose change is pending);
- it is removed when the inode changes: at the end of every request that changes it, before
  the reply (``fuse.operations``); by the extension when a WRITE or FALLOCATE arrives; and
  when the cache learns of another node's change (``KernelCacheNotices``: ``drop`` for an
  inode, ``clear`` for a name removed elsewhere).
A GETATTR that arrives while a change is in Python (between its request and its reply) may
get the answer from before it: the change is not acknowledged yet, as with the kernel's own
cache.

Off without the extension, and with ACPFS_NO_ATTR_TABLE=1 (every GETATTR goes to Python).
"""

from __future__ import annotations

import logging
import os
from . import fastwrite

log = logging.getLogger(__name__)

_ext = fastwrite.extension()
_on = False
_why_not = "not enabled"


def enable(blksize: int) -> bool:
    """After the session is hooked (``fastwrite.install``): answer from the table."""
    global _on, _why_not
    if os.environ.get("ACPFS_NO_ATTR_TABLE"):
        _why_not = "disabled by ACPFS_NO_ATTR_TABLE"
    elif _ext is None or not _ext.stats()["sessions_hooked"]:
        _why_not = "the C extension does not hook the session"
    else:
        _ext.attrs_enable(True, blksize)
        _on = True
        return True
    log.info("GETATTR and GETXATTR answered in Python only: %s", _why_not)
    return False


def active() -> bool:
    return _on


def put(ino: int, mode: int, nlink: int, uid: int, gid: int, rdev: int, size: int,
        atime_ns: int, mtime_ns: int, ctime_ns: int, holds_for: float, fd: int = -1,
        seen: tuple[int, int, int] = (-1, -1, -1)) -> None:
    """GETATTR of ``ino`` is answered with these for ``holds_for`` seconds (<= 0: removed).
    ``fd``: the memory file of a writer passed through (the table keeps a duplicate until
    the answer goes), whose size and times are answered once they differ from ``seen``."""
    if _on:
        _ext.attrs_put(ino, mode, nlink, uid, gid, rdev, size, atime_ns, mtime_ns, ctime_ns,
                       holds_for, fd, *seen)


def drop(ino: int) -> None:
    """``ino`` changed: its next GETATTR goes to Python."""
    if _on:
        _ext.attrs_drop(ino)


def clear() -> None:
    """Any inode may have changed (a rename, an unlink, a failed change, a name removed
    elsewhere): every answer is removed."""
    if _on:
        _ext.attrs_clear()


def state() -> dict:
    """For ``acpfs status``: whether the table is on, and the requests answered from it."""
    if not _on:
        return {"on": False, "why_not": _why_not}
    return _ext.attrs_stats()

