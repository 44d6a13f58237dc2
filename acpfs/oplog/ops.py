"""What one change of the mount is: a small class per kind of op, with its fields and its
journal record.

The cache makes an op for each change it acknowledges and queues it on the op log
(``OpLog.push``), which gives it its seq, its stamp and its journal record. The flusher's
sequencer applies the ops to the backing in seq order, each kind by its own method
(``Flusher.APPLY``); a daemon recovering a dead one's journal replays the records, each kind
by its own method (``recovery.Replayer.BY_KIND``).

Adding a kind of op: a class here (its fields, ``record``, and ``others`` if it touches
nodes besides ``node``), the cache's method that makes it, an entry in ``Flusher.APPLY``
(and its repair), an entry in ``Replayer.BY_KIND``, and its field list in
``journal.LAYOUT``. A test checks that the two tables know every kind (tests/unit).

Fields every op has are in ``Op``. Which thread touches which: the FUSE thread makes the op;
``state``, ``error``, ``attempts`` and ``next_retry`` are the flusher's, read by status
under the op log's lock; a publish's ``future``, ``dir_fd`` and ``temp_name`` are its
upload's.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Callable, ClassVar

from .journal import Record
from ..node import Node, OpKind, OpState, Snapshot, mount_path, name_path

Refs = Callable[[object], list[int]]   # the block references of a content (Store.ref)


class Op:
    """One mutation of the mount, to be applied to the backing in seq order."""
    kind: ClassVar[OpKind]
    __slots__ = ("seq", "node", "path", "state", "error", "attempts", "next_retry", "since",
                 "stamp", "floor")

    def __init__(self, node: Node) -> None:
        self.seq = 0                # given by OpLog.push
        self.node = node
        self.path = ""              # for humans (status, logs): set by OpLog.push
        self.state = OpState.QUEUED
        self.error: str | None = None
        self.attempts = 0
        self.next_retry = 0.0
        self.since = time.time()
        # global order (peers.py): when this change was acknowledged (the close that
        # acknowledged a snapshot; the request of other ops), and the oldest acknowledgement
        # it makes durable (a file closed twice before its snapshot was taken)
        self.stamp = 0.0
        self.floor = 0.0

    def where(self) -> bytes | None:
        """The mount path the op is about (its ``path``)."""
        return mount_path(self.node)

    def others(self) -> tuple[Node, ...]:
        """The nodes besides ``node`` whose place it changes: they are not quiescent until
        it is applied (``Node.last_seq``)."""
        return ()

    def moves(self) -> tuple[Node, ...]:
        """The nodes whose positions in the backing applying it may change."""
        return (self.node,)

    def record(self, refs: Refs) -> Record:
        raise NotImplementedError


class Placed(Op):
    """An op about one name in one directory: where a node lands or leaves."""
    __slots__ = ("parent", "name")

    def __init__(self, node: Node, parent: Node, name: bytes) -> None:
        super().__init__(node)
        self.parent = parent
        self.name = name

    def others(self) -> tuple[Node, ...]:
        return (self.parent,)


class Make(Placed):
    """A directory, symlink or special file made; its mode and owner as made (later changes
    are ops of their own)."""
    __slots__ = ("mode", "uid", "gid")

    def __init__(self, node: Node, parent: Node, name: bytes, uid: int, gid: int) -> None:
        super().__init__(node, parent, name)
        self.mode, self.uid, self.gid = node.mode, uid, gid


class Mkdir(Make):
    kind = OpKind.MKDIR
    __slots__ = ()

    def record(self, refs: Refs) -> Record:
        return Record(self.seq, self.kind, self.node.ino, mount_path(self.node), mode=self.mode,
                      uid=self.uid, gid=self.gid)


class Symlink(Make):
    kind = OpKind.SYMLINK
    __slots__ = ()

    def record(self, refs: Refs) -> Record:
        return Record(self.seq, self.kind, self.node.ino, mount_path(self.node),
                      target=self.node.target, uid=self.uid, gid=self.gid)


class Mknod(Make):
    kind = OpKind.MKNOD
    __slots__ = ()

    def record(self, refs: Refs) -> Record:
        return Record(self.seq, self.kind, self.node.ino, mount_path(self.node), mode=self.mode,
                      uid=self.uid, gid=self.gid, size=self.node.rdev)


class Remove(Placed):
    """A name removed; ``old_path``: where it was in the mount."""
    __slots__ = ("old_path",)

    def __init__(self, node: Node, parent: Node, name: bytes, old_path: bytes | None) -> None:
        super().__init__(node, parent, name)
        self.old_path = old_path

    def where(self) -> bytes | None:
        return self.old_path

    def record(self, refs: Refs) -> Record:
        return Record(self.seq, self.kind, self.node.ino, self.old_path)


class Unlink(Remove):
    kind = OpKind.UNLINK
    __slots__ = ("links",)

    def __init__(self, node: Node, parent: Node, name: bytes, old_path: bytes | None,
                 links: list[tuple[Node, bytes]] | None) -> None:
        super().__init__(node, parent, name, old_path)
        self.links = links          # the names the file keeps (hard links)


class Rmdir(Remove):
    kind = OpKind.RMDIR
    __slots__ = ()


class Rename(Placed):
    """``node`` moved from ``src_name`` in ``src`` to ``name`` in ``parent``, over
    ``replaced`` if the name held a node."""
    kind = OpKind.RENAME
    __slots__ = ("src", "src_name", "replaced", "src_path")

    def __init__(self, node: Node, parent: Node, name: bytes, src: Node, src_name: bytes,
                 replaced: Node | None, src_path: bytes | None) -> None:
        super().__init__(node, parent, name)
        self.src, self.src_name, self.replaced = src, src_name, replaced
        self.src_path = src_path

    def where(self) -> bytes | None:
        return name_path(self.parent, self.name)

    def others(self) -> tuple[Node, ...]:
        # the replaced node too: a file with other names stays in the mount, and the rename
        # still moves one of its positions (it is not quiescent until then)
        return (self.parent, self.src) + ((self.replaced,) if self.replaced else ())

    def moves(self) -> tuple[Node, ...]:
        return (self.node, self.replaced) if self.replaced else (self.node,)

    def record(self, refs: Refs) -> Record:
        return Record(self.seq, self.kind, self.node.ino, name_path(self.parent, self.name),
                      src_path=self.src_path)


class Link(Placed):
    """One more name of a file."""
    kind = OpKind.LINK
    __slots__ = ("src_path",)

    def __init__(self, node: Node, parent: Node, name: bytes, src_path: bytes | None) -> None:
        super().__init__(node, parent, name)
        self.src_path = src_path

    def where(self) -> bytes | None:
        return name_path(self.parent, self.name)

    def record(self, refs: Refs) -> Record:
        return Record(self.seq, self.kind, self.node.ino, name_path(self.parent, self.name),
                      src_path=self.src_path)


class SetAttr(Op):
    """Mode (None: unchanged), owner (None: unchanged) and times (None: unchanged) set."""
    kind = OpKind.SETATTR
    __slots__ = ("mode", "uid", "gid", "times")

    def __init__(self, node: Node, mode: int | None, uid: int | None, gid: int | None,
                 times: tuple[int, int] | None) -> None:
        super().__init__(node)
        self.mode, self.uid, self.gid, self.times = mode, uid, gid, times

    def record(self, refs: Refs) -> Record:
        return Record(self.seq, self.kind, self.node.ino, mount_path(self.node), mode=self.mode,
                      uid=self.uid, gid=self.gid, times=self.times)


class SetXattr(Op):
    """An extended attribute set (``value``) or removed (None)."""
    kind = OpKind.XATTR
    __slots__ = ("key", "value")

    def __init__(self, node: Node, key: bytes, value: bytes | None) -> None:
        super().__init__(node)
        self.key, self.value = key, value

    def record(self, refs: Refs) -> Record:
        return Record(self.seq, self.kind, self.node.ino, mount_path(self.node), key=self.key,
                      value=self.value)


class Publish(Placed):
    """A file's content at its last close (``snap``) lands under its name, and under each
    of its other names (``links``, as they were when it was queued)."""
    kind = OpKind.PUBLISH
    __slots__ = ("snap", "links", "nbytes", "future", "dir_fd", "temp_name")

    def __init__(self, node: Node, parent: Node, name: bytes, snap: Snapshot,
                 links: list[tuple[Node, bytes]] | None) -> None:
        super().__init__(node, parent, name)
        self.snap = snap
        self.links = links
        self.nbytes = snap.size
        self.future: cf.Future | None = None   # its upload
        self.dir_fd = -1            # directory of its temporary file
        self.temp_name = b""

    def record(self, refs: Refs) -> Record:
        snap = self.snap
        return content_record(self.seq, self.kind, self.node, snap,
                              [] if snap.content is None else refs(snap.content),
                              snap.times, snap.xattrs)


def content_record(seq: int, kind: str, node: Node, src: Node | Snapshot, blocks: list[int],
                   times: tuple[int, int], xattrs: dict[bytes, bytes]) -> Record:
    """A record of a file's content: of the node itself, or of a snapshot of it (``src``)."""
    sp = src.staged
    links = [p for p in (name_path(d, n) for d, n in node.links or ()) if p is not None]
    return Record(seq, kind, node.ino, mount_path(node), size=src.size, mode=src.mode,
                  uid=src.uid, gid=src.gid, times=times, xattrs=xattrs, blocks=blocks,
                  staged_name=sp.name if sp is not None else b"", links=links)
