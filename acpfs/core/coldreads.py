"""Reads of files the cache does not hold, passed through by the kernel to the backing file.

Owns the kernel inodes whose opens the kernel passes through to a file of the backing
directory (``serving``: node id -> ``Served``: the read-only descriptor of the version the
first open revalidated, its backing id, the opens on that kernel inode), and how many such
opens each node has (``opens_of``). A read-only open of a regular file that is neither
cached nor staged is passed through to its backing file when the kernel grants passthrough
and its kernel inode has no other open (``open``): the kernel's own client of the backing
then reads, reads ahead, caches and maps it, and the daemon sees none of it.

The kernel allows one backing file per kernel inode and no other kind of open beside it
(an open that is not passed through to the same backing file fails with EIO in the
caller, fs/fuse/iomode.c). So an open of such a kernel inode that cannot share the backing
file (a writer; a reader once the file changed: another version in the backing, a copy in
the cache, a write queued) is answered ESTALE (``conflicts``) after new lookups of the node
were given a new node id (``Inodes.realias``): the kernel looks the name up again
(LOOKUP_REVAL), meets the new node id, and opens a new kernel inode, which takes the usual
path; readers of the old one keep the version they opened (the descriptor holds it, also
once it is replaced or removed in the backing).

Runs on the trio thread; the backing file is opened where ``BackingCalls`` says (on the
event loop for a local backing, else in a worker thread).
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Protocol

import trio

from ..cache.files import Files
from ..cache.inodes import Inodes
from ..node import Node, err, node_path
from .backcalls import BackingCalls

log = logging.getLogger(__name__)


class Kernel(Protocol):
    """What open files need of the kernel's passthrough (``fuse.passthrough.Kernel``, which
    the daemon hands in): whether the kernel granted it, and backing ids for descriptors."""

    def granted(self) -> bool: ...

    def register(self, fd: int) -> int: ...

    def unregister(self, backing_id: int) -> None: ...


class Served:
    """A kernel inode whose opens read one version of a backing file: passed through to it
    (``backing_id``), or read by the daemon from ``fd`` (``backing_id`` 0)."""
    __slots__ = ("node", "fd", "backing_id", "generation", "opens", "idle")

    def __init__(self, node: Node, fd: int, backing_id: int, generation: int) -> None:
        self.node = node
        self.fd = fd                  # the backing file, read-only: the version opened
        self.backing_id = backing_id
        self.generation = generation  # Node.generation when it was opened
        self.opens = 0
        # set once its last open is closed: a copy into the cache from a fast backing waits
        # for it (Fetch._keep), so that it never takes CPU from the readers
        self.idle = trio.Event()


class ColdReads:
    def __init__(self, inodes: Inodes, files: Files, kernel: Kernel | None,
                 calls: BackingCalls) -> None:
        self.inodes = inodes
        self.files = files
        self.kernel = kernel
        self.calls = calls   # where the backing file is opened
        self.serving: dict[int, Served] = {}
        self.opening: dict[int, trio.Event] = {}   # node ids whose backing file is being opened
        self.opens_of: dict[int, int] = {}   # node ino -> its opens passed through to the backing
        self.opened = 0                      # opens passed through to a backing file, ever
        self.refused = 0                     # backing files the kernel refused (said once)

    @staticmethod
    def shares(served: Served, node: Node) -> bool:
        """A reader of a kernel inode passed through to ``served`` may be passed through to
        it too: it holds the version the node shows, and nothing newer is cached (a copy
        kept since, clean, is that version) or queued."""
        return (served.node is node and node.generation == served.generation
                and node.staged is None and not node.writers and not node.publish_ops
                and not node.dirty)

    def conflicts(self, nodeid: int, node: Node, writable: bool) -> None:
        """Before an open of kernel inode ``nodeid`` takes any path: ESTALE when that kernel
        inode is passed through to a backing file (or is being) and this open cannot share
        it; new lookups of the node get a new node id first, so the kernel's second try
        (LOOKUP_REVAL) opens a new kernel inode."""
        served = self.serving.get(nodeid)
        if served is None and nodeid not in self.opening:
            return
        if not writable and (served is None or self.shares(served, node)):
            return
        if node.nodeid == nodeid:
            self.inodes.realias(node)
        raise err(errno.ESTALE, f"{node_path(node)}: its kernel inode reads the backing "
                                "version other opens hold; opened anew under another node id")

    def claim(self, nodeid: int, node: Node, writable: bool, kernel_opens: int) -> str:
        """Whether this open (``conflicts`` let it through) is passed through to the
        backing file: "share" for a reader of a kernel inode that already is (or is being),
        "open" for a reader of a regular file neither cached nor staged whose kernel inode has
        no other open, "" for the usual path. Claimed at once: an open of another kind
        arriving while the backing file is opened meets ``conflicts``. ``open`` then does it."""
        if writable or not node.is_reg:
            return ""
        if nodeid in self.serving or nodeid in self.opening:
            return "share"
        if not self.first(nodeid, node, kernel_opens):
            return ""
        self.opening[nodeid] = trio.Event()
        return "open"

    def first(self, nodeid: int, node: Node, kernel_opens: int) -> bool:
        """Whether a read-only open of kernel inode ``nodeid`` would open the backing file
        (``claim`` "open"): a regular file neither cached nor staged nor written, with a
        backing copy, and no open of that kernel inode yet."""
        return (node.is_reg and node.content is None and node.staged is None and not node.writers
                and node.backing_parent is not None and not kernel_opens
                and nodeid not in self.serving and nodeid not in self.opening)

    async def open(self, nodeid: int, node: Node, claimed: str) -> Served | None:
        """What a claimed open of kernel inode ``nodeid`` reads: the backing version the open
        revalidated (ESTALE if the backing holds another), passed through to the kernel
        where it grants passthrough (``Served.backing_id``), else read by the daemon from
        ``Served.fd``; None where the usual path serves it (the file changed meanwhile, or
        the kernel refused the backing file)."""
        if claimed == "open":
            event = self.opening[nodeid]
            try:
                served = await self._open_backing(nodeid, node)
            finally:
                del self.opening[nodeid]
                event.set()
        else:
            event = self.opening.get(nodeid)
            if event is not None:
                await event.wait()
            served = self.serving.get(nodeid)
        return None if served is None else self._joined(nodeid, node, served)

    def open_now(self, nodeid: int, node: Node, claimed: str) -> Served | None:
        """``open`` at once, for an OPEN answered without a coroutine (``core.opennow``):
        None where ``open`` would wait (a backing file being opened, a backing call that
        cannot run on the event loop) or the usual path serves the open; a claim to open
        is then withdrawn, and ``open`` decides anew."""
        if claimed == "share":
            served = self.serving.get(nodeid)
            return None if served is None or nodeid in self.opening \
                else self._joined(nodeid, node, served)
        generation = node.generation
        try:
            fd = self.calls.run_now(self.files.open_backing_copy, node, True)
            served = None if fd is None else self._serve(nodeid, node, fd, generation)
        except OSError:   # another version (ESTALE), gone: ``open`` looks first
            served = None
        finally:
            del self.opening[nodeid]   # nobody waited: nothing ran meanwhile
        return None if served is None else self._joined(nodeid, node, served)

    def _joined(self, nodeid: int, node: Node, served: Served) -> Served:
        if not self.shares(served, node):   # changed while it waited
            self.conflicts(nodeid, node, False)
        served.opens += 1
        self.opens_of[node.ino] = self.opens_of.get(node.ino, 0) + 1
        self.opened += 1
        return served

    async def _open_backing(self, nodeid: int, node: Node) -> Served | None:
        generation = node.generation
        fd = await self.calls.run(self.files.open_backing_copy, node, True)
        return self._serve(nodeid, node, fd, generation)

    def _serve(self, nodeid: int, node: Node, fd: int, generation: int) -> Served | None:
        """Kernel inode ``nodeid`` reads backing file ``fd`` (version ``generation``) from
        now on, passed through where the kernel takes it; None (``fd`` closed) where the
        file changed meanwhile or the kernel refused it."""
        if not (node.generation == generation and node.content is None
                and node.staged is None and not node.writers):
            os.close(fd)   # changed meanwhile: the usual path
            return None
        kernel = self.kernel
        try:
            backing_id = kernel.register(fd) if kernel is not None and kernel.granted() else 0
        except OSError as e:
            os.close(fd)
            self.refused += 1
            if self.refused == 1:
                log.warning("%s: the kernel does not pass reads through to the backing file "
                            "(%s); files not in the cache are read through the daemon",
                            node_path(node), e)
            return None
        served = self.serving[nodeid] = Served(node, fd, backing_id, generation)
        return served

    def release(self, nodeid: int, node: Node) -> None:
        """An open ``open`` passed through was closed; the last one of a kernel inode lets
        go of its backing file."""
        served = self.serving[nodeid]
        served.opens -= 1
        left = self.opens_of[node.ino] - 1
        if left:
            self.opens_of[node.ino] = left
        else:
            del self.opens_of[node.ino]
        if served.opens:
            return
        served.idle.set()
        del self.serving[nodeid]
        if served.backing_id:
            try:
                self.kernel.unregister(served.backing_id)
            except OSError as e:
                log.debug("unregistering backing id %d: %s", served.backing_id, e)
        os.close(served.fd)

    def status(self) -> dict:
        return {"files": len(self.opens_of), "opens": sum(self.opens_of.values()),
                "opened": self.opened, "refused": self.refused}
