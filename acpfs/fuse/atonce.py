"""Requests answered at once, from the extension's hooks (acpfs/fuse/_atonce.c): ``AtOnce``.

Every request pyfuse3 hands to Python becomes a coroutine run as a trio task, which costs
more than most of these requests need. The extension offers LOOKUP, CREATE, UNLINK,
read-only OPEN, FLUSH, RELEASE and READ to the methods below first, called inside libfuse's dispatch with the GIL held;
each does the work of its ``Operations`` handler where none of that work waits, and returns
None where some would: the handler then takes the request from the start, nothing half done.

- ``lookup``: ``Core.find_now``: a name missing from a loaded directory (its lstat on the
  event loop, ``BackingCalls.try_now``), or a regular file with one name whose close-to-open
  comparison with the backing holds (``Loader.unchanged_now``).
- ``create``: in a directory whose entries are loaded (``Core.create_now``).
- ``unlink``: as ``lookup`` finds the name, where global order would not wait
  (``Core.unlinkable_now``, ``unlink_in``).
- ``open``: a reader (``core/opennow.py``).
- ``flush``: journaled and stamped where global order would not wait.
- ``release``: where nothing is to be waited for (``Handles.release_now``).
- ``read``: a cached file, or a local backing file's bytes its page cache holds
  (``Handles.read_now``).

Owns nothing: the counts are the extension's and ``MountInfo.requests``'s. Threads: the trio
thread.
"""

from __future__ import annotations

from typing import NamedTuple

from . import attrtable, notices
from .operations import Operations, entry_fields, errno_of, offer


class Caller(NamedTuple):
    """Who made a CREATE (``core.requests.Caller``), from libfuse's request context."""
    uid: int
    gid: int
    umask: int


class AtOnce:
    def __init__(self, ops: Operations) -> None:
        self.ops = ops
        self.core = ops.core
        self.handles = ops.handles
        self.give_way = ops.give_way

    def hooks(self) -> dict:
        """For ``fastwrite.install``: the callable of each kind."""
        return {"lookup": self.lookup, "create": self.create, "unlink": self.unlink,
                "open": self.open, "flush": self.flush, "release": self.release,
                "read": self.read}

    def lookup(self, parent: int, name: bytes) -> tuple | int | None:
        """LOOKUP (``Operations.lookup``): the entry's fields, (0, timeout) for a name
        missing for sure, -errno, or None."""
        core = self.core
        try:
            known, node = core.find_now(parent, name)
            if not known:
                return None
            self._counted("lookup")
            kernel = core.cache.kernel
            kernel.looking(parent, name)
            if node is None:
                kernel.missing(parent, name)
                return 0, notices.kernel_timeout
            offer(core, node)
            return entry_fields(core, node)
        except Exception as e:
            self._counted("lookup")
            return -errno_of(e, "lookup")

    def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int,
               umask: int) -> tuple | int | None:
        """CREATE (``Operations.create``): (file handle, backing id, direct_io, the entry's
        fields), -errno, or None."""
        core = self.core
        try:
            got = core.create_now(parent, name, mode, flags, Caller(uid, gid, umask))
            if got is None:
                return None
            self._counted("create")
            fh, node, backing_id = got
            self.ops.fresh_in(parent, node)
            return (fh, backing_id, self.ops.created_direct(fh, backing_id),
                    *entry_fields(core, node))
        except Exception as e:
            attrtable.clear()   # as ``changes``
            self._counted("create")
            return -errno_of(e, "create")

    def unlink(self, parent: int, name: bytes) -> int | None:
        """UNLINK (``Operations.unlink``), where no wait of global order can follow
        (``acknowledges``, as ``flush``): 0, -errno, or None."""
        core = self.core
        order = core.order
        try:
            # the comparison with the backing first: no backing call under OpLog.lock
            where = core.unlinkable_now(parent, name)
            if where is None:
                return None
            with core.oplog.lock:
                if order is not None and not order.acknowledges_at_once():
                    return None
                core.unlink_in(where, name)
            self._counted("unlink")
            self.ops.unlinked(parent)
        except Exception as e:
            attrtable.clear()   # as ``changes``
            self._counted("unlink")
            return -errno_of(e, "unlink")
        return 0

    def open(self, ino: int, flags: int) -> tuple[int, int] | int | None:
        """A read-only OPEN (core/opennow.py): (file handle, backing id), -errno or None."""
        try:
            got = self.core.opens_now.open(ino, flags)
            if got is not None:
                self._counted("open")
                offer(self.core, self.handles.handle(got[0]).node)
            return got
        except Exception as e:
            attrtable.clear()   # as ``changes``: any node may have changed halfway
            self._counted("open")
            return -errno_of(e, "open")

    def flush(self, fh: int) -> int | None:
        """FLUSH, where no wait of global order can follow (``acknowledges``): asked and
        stamped under the op log's lock, which the node records' thread takes to change
        what the answer depends on (a promise, the peers)."""
        order = self.core.order
        if self.core.replica_wait is not None:   # --replica-wait: a coroutine waits for the copy
            return None
        with self.core.oplog.lock:
            if order is not None and not order.acknowledges_at_once():
                return None
            self._counted("flush")
            try:
                attrtable.drop(self.handles.handle(fh).node.ino)
                self.handles.flush(fh)
            except Exception as e:
                return -errno_of(e, "flush")
        return 0

    def release(self, fh: int) -> int | None:
        """RELEASE, where it waits for nothing (``Handles.release_now``)."""
        try:
            node = self.handles.handle(fh).node
            if not self.handles.release_now(fh):
                return None
            self._counted("release")
            attrtable.drop(node.ino)
            self.core.cache.kernel.let_go(node)   # a writer's close that changed nothing
            offer(self.core, node)   # the last writer's close: its final size and times
            return 0
        except Exception as e:
            attrtable.clear()
            self._counted("release")
            return -errno_of(e, "release")

    def read(self, fh: int, off: int, size: int) -> bytes | memoryview | int | None:
        """READ (``Handles.read_now``): the bytes, -errno, or None. A data request: counted,
        but no sign of programs at work for the flusher (as a WRITE: ``burst_last_request``)."""
        try:
            got = self.handles.read_now(fh, off, size)
        except Exception as e:
            self.core.info.requests["read"] += 1
            return -errno_of(e, "read")
        if got is not None:
            self.core.info.requests["read"] += 1
        return got

    def _counted(self, kind: str) -> None:
        self.core.info.requests[kind] += 1
        self.give_way.request()
