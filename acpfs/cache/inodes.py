"""The inode table (``Inodes``): every node the kernel or the view may name, by inode number
and by each node id the kernel holds for it (``nodes``; a node leaves it once unlinked, closed
and forgotten by the kernel; an alias leaves it once the kernel forgot it), the
``root``, the files met under several names in the backing, by backing inode (``linked``:
written by ``Coherence`` as listings meet names, and by the flusher after a publish of a
linked file; a dropped node leaves it), and the backing positions of the nodes
(``Node.backing_parent``/``backing_name``/``backing_links``, ``Node.generation``) with the
lock that guards them (``position_lock``). A path in the backing is computed
(``backing_path``) and used with it held, so that the flusher never moves a directory
under a reader's feet. Lock order: ``position_lock``, then the op log's ``lock``.

Threads: the trio thread and recovery's replay; ``backing_path`` and the positions also from
worker threads and the sequencer, under ``position_lock``. No I/O.
"""

from __future__ import annotations

import errno
import os
import threading

from ..node import ROOT_INODE, Node, err


def stat_times(node: Node, st: os.stat_result) -> None:
    """The times of ``node`` as the backing has them."""
    node.atime, node.mtime, node.ctime = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns


# Aliases: a kernel inode passed through to a backing file must never get another kind of open
# (the kernel fails it with EIO), so new lookups of that file get another node id,
# ``ino | n << ALIAS_SHIFT``; the C extension shows ``ino`` as st_ino in entry replies
# (acpfs/fuse/_fastwrite.c, ACPFS_ALIAS_SHIFT).
ALIAS_SHIFT = 40


class Inodes:
    def __init__(self, root_st: os.stat_result) -> None:
        # reentrant: core/backcalls.py holds it around a call that takes it again
        self.position_lock = threading.RLock()
        root = Node(ROOT_INODE, root_st.st_mode, root_st.st_uid, root_st.st_gid, None, b"")
        root.nlink = 2
        root.lookups = 1
        stat_times(root, root_st)
        self.root = root
        self.nodes: dict[int, Node] = {ROOT_INODE: root}
        self._next_ino = ROOT_INODE + 1
        self._aliases = 0
        # files found in the backing with more than one name, by backing inode: a second
        # name listed later is the same node (hard links, ``Coherence._attach``)
        self.linked: dict[int, Node] = {}

    def new_node(self, mode: int, uid: int, gid: int, parent: Node, name: bytes) -> Node:
        ino = self._next_ino
        self._next_ino += 1
        node = Node(ino, mode, uid, gid, parent, name)
        self.nodes[ino] = node
        return node

    def known(self, ino: int) -> Node:
        """The node of inode ``ino``; ENOENT once the kernel forgot it."""
        node = self.nodes.get(ino)
        if node is None:
            raise err(errno.ENOENT, f"inode {ino} is not known (forgotten)")
        return node

    def dropped(self, node: Node) -> None:
        """``node`` left the view for good (``Files.drop``): it is no longer met under its
        backing inode, and leaves the table once the kernel holds no reference to it."""
        if node.backing_version is not None and self.linked.get(node.backing_version[0]) is node:
            del self.linked[node.backing_version[0]]
        if node.lookups <= 0:
            self._remove(node)

    def _remove(self, node: Node) -> None:
        self.nodes.pop(node.ino, None)
        for nodeid in node.kernel_ids or ():
            self.nodes.pop(nodeid, None)

    def looked_up(self, node: Node) -> int:
        """The kernel takes a reference to ``node`` under the node id it gets now (an entry
        reply): that id."""
        node.lookups += 1
        nodeid = node.nodeid
        if nodeid != node.ino:
            node.kernel_ids[nodeid] += 1
        return nodeid

    def forget(self, node: Node, n: int, nodeid: int | None = None) -> None:
        """The kernel let go of ``n`` references to ``node`` held under ``nodeid``."""
        node.lookups -= n
        if nodeid is not None and nodeid != node.ino and node.kernel_ids is not None:
            left = node.kernel_ids.get(nodeid, 0) - n
            node.kernel_ids[nodeid] = left
            if left <= 0 and nodeid != node.nodeid:
                del node.kernel_ids[nodeid]
                self.nodes.pop(nodeid, None)
        if node.lookups <= 0 and node.nlink == 0 and node.opens == 0:
            self._remove(node)

    def realias(self, node: Node) -> int:
        """New lookups of ``node`` get a node id the kernel has never seen, so a new kernel
        inode (the kernel inode the old one names stays with the opens it has): the new id."""
        self._aliases += 1
        nodeid = node.ino | self._aliases << ALIAS_SHIFT
        old = node.nodeid
        if node.kernel_ids is None:
            node.kernel_ids = {}
        elif old != node.ino and node.kernel_ids.get(old, 0) <= 0:   # never handed out
            del node.kernel_ids[old]
            self.nodes.pop(old, None)
        node.kernel_ids[nodeid] = 0
        self.nodes[nodeid] = node
        node.nodeid = nodeid
        return nodeid

    def kernel_ids(self, node: Node) -> list[int]:
        """Every node id the kernel may hold for ``node``."""
        return [node.ino, *(node.kernel_ids or ())]

    # -- positions -----------------------------------------------------------------------
    def present(self, node: Node) -> bool:
        return node is self.root or node.backing_parent is not None

    def backing_path(self, node: Node) -> list[bytes]:
        """Names from the backing root to ``node``'s current place there (hold position_lock)."""
        comps = []
        while node is not self.root:
            if node.backing_parent is None:
                raise err(errno.ENOENT, "not in the backing yet")
            comps.append(node.backing_name)
            node = node.backing_parent
        comps.reverse()
        return comps
