"""The cache: the mount's namespace and file contents, independent of FUSE.

Owns the tree of ``Node`` objects (the mount's view: the backing tree, loaded one directory
at a time on first use, overlaid with every change made through the mount), the content
of cached files as handles of the content store (``content.Store``) and eviction. Every
change it makes is queued on the op log (``oplog.OpLog``), which journals it and hands it
to the flusher. It does no I/O on the backing but listing and reading through
``Backing``, and knows nothing of FUSE or trio: ``core`` and ``writethrough`` call it, the
unit tests drive it directly.

Threads: every method here runs on the FUSE (trio) thread, except what the flusher calls,
and that goes through the op log's ``lock`` (a ``threading.Condition``: the sequencer waits
on it). Here it guards the content store's space and reference counts, ``Op.state``,
``lru`` and the counters; ``position_lock`` guards the backing positions
(``Node.backing_parent``/``backing_name``) and is held while a path in the backing is
computed and used, so that the flusher never moves a directory under a reader's feet.
Lock order: ``position_lock``, then the op log's ``lock``. docs/concurrency.md has the
whole picture.

States of a regular file (``state_of``):
    dirty      content changed since the last snapshot (open for writing, or not closed)
    flushing   one or more snapshots are queued or being uploaded (``Node.publish_ops``)
    persisted  the backing holds the current content; it may be evicted
    error      a queued operation on it is failing; the reason comes from the backing
Transitions: write/truncate -> dirty; last close of a dirty file -> snapshot -> flushing;
flusher publishes the last snapshot -> persisted; eviction drops the content of a
persisted file (it is then read from the backing); open for writing copies it back in.

Invariants:
- Content shared with a snapshot or a journal record is never written in place: the store
  copies it first (``content.Store.write``), or the open does (``Core.open``, passthrough).
- A file is evictable (in ``lru``) only if clean, not open for writing, without queued
  operations, and present in the backing with its current content.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import stat as statmod
import threading
import time
from typing import NamedTuple

from .backing import Backing, check_name, is_internal_name
from .content import CacheFull, Content, Store
from .oplog import OpLog
from .ops import Link, Mkdir, Mknod, Publish, Rename, Rmdir, SetAttr, SetXattr, Symlink, Unlink
from .types import ROOT_INODE, Children, JournalState, KernelNotices, Node, Snapshot, \
    err, mount_path, name_path, now_ns

log = logging.getLogger(__name__)

PASS_WRITER_RESERVE = 64 << 20   # bytes kept free for each writer the kernel writes for


def check_not_reserved(name: bytes) -> None:
    """Names of acpfs's own temporary files cannot be created through the mount."""
    if is_internal_name(name):
        raise err(errno.EPERM, "names starting with .acpfs- are reserved")


class Relisting(NamedTuple):
    """A listing of a loaded directory, taken at one moment (``Cache.relist_backing``)."""
    listing: list
    known: set[bytes]                      # names this mount has something of its own on
    applied: int                           # the flusher's last applied seq then
    version: tuple[int, int, int] | None   # the directory's, before the listing


class Cache:
    def __init__(self, oplog: OpLog, backing: Backing, store: Store,
                 kernel: KernelNotices = KernelNotices()) -> None:
        self.oplog = oplog        # where every change is queued; its lock guards (lock) fields
        self.backing = backing
        self.store = store
        self.kernel = kernel      # tells the kernel to forget what another node changed
        self.position_lock = threading.Lock()
        st = backing.stat_root()
        root = Node(ROOT_INODE, st.st_mode, st.st_uid, st.st_gid, None, b"")
        root.nlink = 2
        root.lookups = 1
        self._stat_times(root, st)
        self.root = root
        self.nodes: dict[int, Node] = {ROOT_INODE: root}
        self._next_ino = ROOT_INODE + 1
        self.dirty_nodes: set[Node] = set()
        self.lru: collections.OrderedDict[int, Node] = collections.OrderedDict()
        # files found in the backing with more than one name, by backing inode: a second
        # name listed later is the same node (hard links, ``_attach``)
        self.linked: dict[int, Node] = {}
        # files open for writing that the kernel writes itself (passthrough: Core.open)
        self.passthrough_writers: set[Node] = set()

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

    # -- loading from the backing ---------------------------------------------------------
    def list_backing(self, node: Node) -> tuple[list, tuple[int, int, int] | None]:
        """Runs in a worker thread: the backing listing of a directory not yet loaded, and
        the directory's version (``Backing.dir_version``) taken before it."""
        with self.position_lock:
            comps = self.backing_path(node)
            version = self.backing.dir_version(comps)
            return self.backing.listdir(comps), version

    def attach_listing(self, node: Node, listing: tuple[list, tuple[int, int, int] | None]) -> None:
        if node.children is not None:
            return
        node.children = Children()
        entries, node.listed_version = listing
        for name, st, target in entries:
            self._attach(node, name, st, target)
        node.listed_at = time.monotonic()

    def _attach(self, node: Node, name: bytes, st: os.stat_result, target: bytes | None) -> Node:
        """A child found in the backing. A file with several names there is one node: a
        name of a file met before (same backing inode, same version) is one more of its
        names (docs/semantics.md, hard links)."""
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        if statmod.S_ISREG(st.st_mode) and st.st_nlink > 1:
            same = self.linked.get(st.st_ino)
            if same is not None and same.nlink and same.backing_version == version \
                    and same.backing_parent is not None \
                    and self.quiescent(same):
                same.add_name(node, name)     # counted already, as a rule: nlink is the backing's
                same.set_positions(same.positions() + [(node, name)])
                same.nlink = max(same.nlink, st.st_nlink, len(same.names()))
                node.children[name] = same  # type: ignore[index]
                self.kernel.forget_attrs(same.ino)
                return same
        child = self._new_node(st.st_mode, st.st_uid, st.st_gid, node, name)
        child.size = st.st_size
        self._stat_times(child, st)
        child.backing_parent, child.backing_name = node, name
        child.backing_version = version
        child.checked_at = time.monotonic()
        if statmod.S_ISREG(st.st_mode) and st.st_nlink > 1:
            child.nlink = st.st_nlink   # its names in directories not listed yet count too
            self._meet(child, st)
        if target is not None:
            child.target = target
        child.rdev = st.st_rdev
        if statmod.S_ISDIR(st.st_mode):
            child.nlink = 2
        node.children[name] = child  # type: ignore[index]
        return child

    # -- other writers of the backing (other nodes) -----------------------------------------
    def relist_backing(self, node: Node, unless: tuple[int, int, int] | None = None) -> Relisting | None:
        """Worker thread: the backing's entries of a loaded directory, with the names there
        that belong to nodes this mount knows (its own, a removal or rename of theirs still
        queued), the seq applied and the directory's version before the listing, all at one
        moment (under position_lock, so that no op of this mount lands in between). None
        when the directory's version is still ``unless``: nothing was made or removed in it."""
        with self.position_lock:
            comps = self.backing_path(node)
            version = self.backing.dir_version(comps)
            if unless is not None and version == unless:
                return None
            listing = self.backing.listdir(comps)
            known, applied = self._known_names(node)
            return Relisting(listing, known, applied, version)

    def _known_names(self, node: Node) -> tuple[set[bytes], int]:
        """The names in directory ``node`` of the backing that belong to nodes this mount
        knows (its own, a removal or rename of theirs still queued), and the seq applied,
        at one moment (hold position_lock)."""
        log_ = self.oplog
        with log_.lock:                  # lock order: position_lock, then lock
            queued = [n for op in log_.queue for n in op.moves()]
            applied = log_.applied_seq
        mine = list((node.children or {}).values()) + queued
        return {name for n in mine for d, name in n.positions() if d is node}, applied

    def _name_known(self, node: Node, name: bytes) -> bool:
        """``name in self._known_names(node)[0]`` without walking the directory (hold
        position_lock): a node whose backing position is not its name in the view has an
        op queued (a rename, link or removal not yet applied; ops leave the queue once
        applied), so only the child of that name and the queued ops' nodes can hold it."""
        log_ = self.oplog
        with log_.lock:                  # lock order: position_lock, then lock
            mine = [n for op in log_.queue for n in op.moves()]
        child = node.children.get(name) if node.children else None
        if child is not None:
            mine.append(child)
        return any(d is node and nm == name for n in mine for d, nm in n.positions())

    def stat_name(self, parent: Node, name: bytes) -> tuple[os.stat_result, bytes | None] | None:
        """Worker thread: the backing's entry ``name`` of a loaded directory (lstat, and a
        symlink's target), or None when it is not there or this mount has a change of its own
        pending on it (whose result its view shows already)."""
        with self.position_lock:
            comps = self.backing_path(parent)
            st = self.backing.stat_entry(comps, name)
            if st is None or self._name_known(parent, name):
                return None
            target = self.backing.read_link(comps, name) if statmod.S_ISLNK(st.st_mode) else None
            if statmod.S_ISLNK(st.st_mode) and target is None:
                return None
            return st, target

    def attach_found(self, parent: Node, name: bytes, found: tuple[os.stat_result, bytes | None]) -> Node:
        """A name ``stat_name`` found in the backing joins the view, as a listing would
        add it (``merge_listing``)."""
        assert parent.children is not None and name not in parent.children
        return self._attach(parent, name, *found)

    def merge_listing(self, node: Node, listing: list, known: set[bytes], applied: int,
                      version: tuple[int, int, int] | None = None) -> None:
        """Close-to-open coherence: merge the backing's current entries (``relist_backing``)
        into a loaded directory. Entries another writer made appear; entries another writer
        removed disappear, if this mount has nothing of its own pending on them. This mount's
        own changes always win in its own view (docs/semantics.md, section 10)."""
        kids = node.children
        assert kids is not None, "directory not loaded"
        seen = {}
        now = time.monotonic()
        for name, st, target in listing:
            seen[name] = st
            child = kids.get(name)
            if child is None:
                if name not in known:
                    self._attach(node, name, st, target)
            elif statmod.S_IFMT(child.mode) != statmod.S_IFMT(st.st_mode) \
                    and child.position_at(node, name) is not None \
                    and self._subtree_quiescent(child, applied):
                # another writer put another kind of entry under the name
                self._removed_elsewhere(node, name, child)
                self._attach(node, name, st, target)
            elif child.is_reg and child.position_at(node, name) is not None \
                    and child.backing_version is not None and statmod.S_ISREG(st.st_mode) \
                    and self.quiescent(child, applied):
                # the listing's lstat checks each clean file at once (Core.revalidated then
                # need not look at them one by one)
                same = self.linked.get(st.st_ino) if st.st_nlink > 1 else None
                if (st.st_ino, st.st_size, st.st_mtime_ns) == child.backing_version:
                    if not child.links:   # a linked file's other names: checked at open
                        child.checked_at = now
                    if st.st_nlink > child.nlink:   # linked elsewhere since it was listed
                        child.nlink = st.st_nlink
                        self.kernel.forget_attrs(child.ino)
                    if same is not child:
                        self._meet(child, st)
                elif same is not None or (child.links and st.st_nlink < len(child.names())):
                    self.split(node, name, child, st)   # another file, or one met elsewhere
                else:   # a new version (of a linked file: under every name, as far as told)
                    self.replaced_elsewhere(child, st)
                    if not child.links:
                        child.checked_at = now
        for name, child in list(kids.items()):
            if name in seen:
                continue
            # a file with no copy in the backing and nothing pending: its source was gone
            # when this mount renamed it (the "gone" conflict): another writer removed it
            orphan = child.backing_parent is None and not child.is_dir
            if not orphan and child.position_at(node, name) is None:
                continue
            if not self._subtree_quiescent(child, applied):
                continue    # something of this mount is pending on it, or under it
            self._removed_elsewhere(node, name, child)
        node.listed_at = time.monotonic()
        node.listed_version = version

    def quiescent(self, node: Node, applied: int | None = None) -> bool:
        """Nothing of this mount is pending on the node (as of op ``applied``, by default the
        flusher's last): its content is the backing copy's."""
        if applied is None:
            applied = self.oplog.applied_seq
        return (not node.dirty and not node.writers and not node.publish_ops and node.staged is None
                and node.last_seq <= applied)

    def _subtree_quiescent(self, node: Node, applied: int) -> bool:
        return self.quiescent(node, applied) and all(
            self._subtree_quiescent(c, applied) for c in (node.children or {}).values())

    def stat_backing(self, node: Node) -> tuple[list[tuple[tuple[Node, bytes], os.stat_result | None]], int]:
        """Worker thread: lstat of the node's backing copy under each of its positions (its
        first one first; None where it is gone), with the seq applied at that moment (under
        position_lock, so that no op of this mount lands in between: a stat older than this
        node's own last change must not replace it)."""
        with self.position_lock:
            applied = self.oplog.applied_seq
            return [(pos, self.backing.stat_entry(self.backing_path(pos[0]), pos[1]))
                    for pos in node.positions()], applied

    def replaced_elsewhere(self, node: Node, st: os.stat_result) -> None:
        """Another writer put a new version of a clean file in the backing: this mount's
        copy is stale. Its cached content is dropped (it is read from the backing again),
        unless someone has it open (it is dropped at a later open); the attributes follow
        the backing."""
        if node.opens > 0:
            return    # its readers keep the version they opened; looked at again later
        if node.content is not None:
            with self.oplog.lock:
                self.store.drop(node.content)
                node.content = None
                self.lru.pop(node.ino, None)
        node.mode, node.uid, node.gid = st.st_mode, st.st_uid, st.st_gid
        node.size = st.st_size
        self._stat_times(node, st)
        node.backing_version = (st.st_ino, st.st_size, st.st_mtime_ns)
        node.versions += 1    # readers that open it again read the new version
        self._meet(node, st)
        self.kernel.forget_attrs(node.ino)

    def _meet(self, node: Node, st: os.stat_result) -> None:
        """``node`` holds backing inode ``st`` (a file with several names there): names of
        it that listings find later join it (``_attach``), and another node of this mount
        found to hold the same version gives it its names now, so that the mount has one
        node per file. Only between nodes with nothing pending and not open: otherwise they
        meet at a later look (semantics: hard links)."""
        if st.st_nlink <= 1:
            return
        other = self.linked.get(st.st_ino)
        self.linked[st.st_ino] = node
        if other is None or other is node or not other.nlink or other.opens \
                or other.backing_version != node.backing_version \
                or not self.quiescent(other) or not self.quiescent(node):
            return
        for d, name in other.names():
            d.children[name] = node  # type: ignore[index]
            node.add_name(d, name)
            self.kernel.forget_entry(d.ino, name)
        node.set_positions(node.positions() + [p for p in other.positions()
                                               if node.position_at(*p) is None])
        node.nlink = max(node.nlink, other.nlink, st.st_nlink, len(node.names()))
        other.set_names([])
        other.set_positions([])
        other.nlink = 0
        self.drop(other)
        self.kernel.forget_attrs(node.ino)

    def split(self, parent: Node, name: bytes, node: Node, st: os.stat_result) -> None:
        """Another writer put another file under ``name``, one of the names of a file with
        several (or one of a file met under other names in the backing): that name is
        another file now. If another node gave every name one new version, the names meet
        again in ``_attach`` as they are looked at."""
        self._removed_elsewhere(parent, name, node)
        self._attach(parent, name, st, None)

    def _removed_elsewhere(self, parent: Node, name: bytes, node: Node) -> None:
        """Another writer removed ``node`` (with all below it) from the backing: it leaves
        this mount's view (a file with other names keeps those)."""
        del parent.children[name]  # type: ignore[union-attr]
        self.kernel.forget_entry(parent.ino, name)
        stack = [(parent, name, node)]
        while stack:
            d, name, n = stack.pop()
            if n.links:   # a file with other names keeps those
                n.rename_name((d, name), None)
                n.move_position((d, name), None)
                self._one_name_less(n)
                self.kernel.forget_attrs(n.ino)
                continue
            if n.children:
                stack.extend((n, k, c) for k, c in n.children.items())
                n.children = Children()
            n.parent = None
            n.nlink = 0
            n.set_positions([])
            if n.opens == 0:
                self.drop(n)

    def _stat_times(self, node: Node, st: os.stat_result) -> None:
        node.atime, node.mtime, node.ctime = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns

    def _new_node(self, mode: int, uid: int, gid: int, parent: Node, name: bytes) -> Node:
        ino = self._next_ino
        self._next_ino += 1
        node = Node(ino, mode, uid, gid, parent, name)
        self.nodes[ino] = node
        return node

    # -- namespace -----------------------------------------------------------------------
    def lookup(self, parent: Node, name: bytes) -> Node:
        kids = parent.children
        assert kids is not None, "directory not loaded"
        node = kids.get(name)
        if node is None:
            raise err(errno.ENOENT)
        return node

    def _free_name(self, parent: Node, name: bytes) -> dict[bytes, Node]:
        check_name(name)
        check_not_reserved(name)
        if len(name) > 255:
            raise err(errno.ENAMETOOLONG)
        self._check_linked(parent)
        kids = parent.children
        assert kids is not None, "directory not loaded"
        if name in kids:
            raise err(errno.EEXIST)
        return kids

    def _check_linked(self, parent: Node) -> None:
        """A directory removed (here, or by another node: ``_removed_elsewhere``) takes no
        new entries; the kernel refuses that only for removals it saw."""
        if parent is not self.root and parent.parent is None:
            raise err(errno.ENOENT)

    def create(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        kids = self._free_name(parent, name)
        node = self._new_node(statmod.S_IFREG | statmod.S_IMODE(mode), uid, gid, parent, name)
        with self.oplog.lock:
            node.content = self.store.empty()
        node.xattrs = {}
        kids[name] = node
        self._mark_dirty(node)
        parent.mtime = parent.ctime = node.mtime
        return node

    def mkdir(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        kids = self._free_name(parent, name)
        node = self._new_node(statmod.S_IFDIR | statmod.S_IMODE(mode), uid, gid, parent, name)
        node.children = Children()
        node.xattrs = {}
        node.nlink = 2
        node.listed_at = time.monotonic()
        kids[name] = node
        parent.mtime = parent.ctime = node.mtime
        # the mode and owner it was made with: a later chmod is an op of its own, after it
        self.oplog.push(Mkdir(node, parent, name, uid, gid))
        return node

    def symlink(self, parent: Node, name: bytes, target: bytes, uid: int, gid: int) -> Node:
        kids = self._free_name(parent, name)
        node = self._new_node(statmod.S_IFLNK | 0o777, uid, gid, parent, name)
        node.target = target
        node.size = len(target)
        node.xattrs = {}
        kids[name] = node
        parent.mtime = parent.ctime = node.mtime
        self.oplog.push(Symlink(node, parent, name, uid, gid))
        return node

    def mknod(self, parent: Node, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Node:
        """A FIFO, socket or device node: a name with a mode, persisted by MKNOD."""
        kids = self._free_name(parent, name)
        node = self._new_node(mode, uid, gid, parent, name)
        node.rdev = rdev
        node.xattrs = {}
        kids[name] = node
        parent.mtime = parent.ctime = node.mtime
        self.oplog.push(Mknod(node, parent, name, uid, gid))
        return node

    def unlink(self, parent: Node, name: bytes) -> None:
        node = self.lookup(parent, name)
        if node.is_dir:
            raise err(errno.EISDIR)
        path = name_path(parent, name)
        self._remove(parent, name, node)
        self.oplog.push(Unlink(node, parent, name, path, node.names() or None))

    def rmdir(self, parent: Node, name: bytes) -> None:
        node = self.lookup(parent, name)
        if not node.is_dir:
            raise err(errno.ENOTDIR)
        assert node.children is not None, "directory not loaded"
        if node.children:
            raise err(errno.ENOTEMPTY)
        path = mount_path(node)
        self._remove(parent, name, node)
        self.oplog.push(Rmdir(node, parent, name, path))

    def _remove(self, parent: Node, name: bytes, node: Node) -> None:
        del parent.children[name]  # type: ignore[union-attr]
        parent.mtime = parent.ctime = now_ns()
        if node.links:   # one of several names: the file stays, under the others
            node.rename_name((parent, name), None)
            node.ctime = parent.ctime
            self._one_name_less(node)
            return
        node.nlink = 0
        node.parent = None
        self._cancel(node)
        if node.opens == 0:
            self.drop(node)

    def _one_name_less(self, node: Node) -> None:
        """A file with several names lost one of them (already gone from ``node.names()``).
        Invariant: its link count never falls below the names the mount has (it may count
        more: names in the backing in directories not listed yet)."""
        node.nlink = max(node.nlink - 1, len(node.names()))
        self.oplog.rejournal(node)   # its record may give the name it lost

    def rename(self, p1: Node, n1: bytes, p2: Node, n2: bytes, noreplace: bool = False) -> None:
        node = self.lookup(p1, n1)
        self._check_linked(p2)
        kids2 = p2.children
        assert kids2 is not None, "directory not loaded"
        check_name(n2)
        check_not_reserved(n2)
        if len(n2) > 255:
            raise err(errno.ENAMETOOLONG)
        target = kids2.get(n2)
        if target is node:
            return
        if target is not None:
            if noreplace:
                raise err(errno.EEXIST)
            if node.is_dir and not target.is_dir:
                raise err(errno.ENOTDIR)
            if target.is_dir and not node.is_dir:
                raise err(errno.EISDIR)
            if target.is_dir:
                assert target.children is not None, "directory not loaded"
                if target.children:
                    raise err(errno.ENOTEMPTY)
            self._remove(p2, n2, target)
        src_path = name_path(p1, n1)
        del p1.children[n1]  # type: ignore[union-attr]
        kids2[n2] = node
        node.rename_name((p1, n1), (p2, n2))
        t = now_ns()
        p1.mtime = p1.ctime = p2.mtime = p2.ctime = node.ctime = t
        self.oplog.push(Rename(node, p2, n2, p1, n1, target, src_path))

    def link(self, node: Node, parent: Node, name: bytes) -> None:
        """One more name for a file, symlink or special file (a hard link): the same node,
        persisted as a link to its inode in the backing."""
        if node.is_dir:
            raise err(errno.EPERM, "hard links to directories are not allowed")
        if not node.nlink:
            raise err(errno.ENOENT)
        kids = self._free_name(parent, name)
        src_path = mount_path(node)
        kids[name] = node
        node.add_name(parent, name)
        node.nlink += 1
        parent.mtime = parent.ctime = node.ctime = now_ns()
        self.oplog.push(Link(node, parent, name, src_path))
        self.oplog.rejournal(node)   # a "flushed" record names every name of the file

    def setattr(self, node: Node, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, atime: int | None = None, mtime: int | None = None) -> None:
        """Owner, mode and times. Size changes go through ``truncate``."""
        if mode is not None:
            node.mode = statmod.S_IFMT(node.mode) | statmod.S_IMODE(mode)
        if uid is not None:
            node.uid = uid
        if gid is not None:
            node.gid = gid
        if atime is not None:
            node.atime = atime
        if mtime is not None:
            node.mtime = mtime
        node.ctime = now_ns()
        if node.is_reg and node.dirty:
            return  # the coming snapshot carries the new attributes
        times = (node.atime, node.mtime) if (atime is not None or mtime is not None) else None
        self.oplog.push(SetAttr(node, None if mode is None else node.mode, uid, gid, times))

    def set_xattr(self, node: Node, key: bytes, value: bytes | None) -> None:
        assert node.xattrs is not None, "xattrs not loaded"
        if value is None:
            if key not in node.xattrs:
                raise err(errno.ENODATA)
            del node.xattrs[key]
        else:
            node.xattrs[key] = value
        node.ctime = now_ns()
        if node.is_link or (node.is_reg and node.dirty):
            return
        self.oplog.push(SetXattr(node, key, value))

    # -- file content --------------------------------------------------------------------
    def open(self, node: Node, writable: bool, trunc: bool, append: bool = False,
             passthrough: bool = False) -> None:
        """Account an open; the caller made sure a writable file is cached or staged
        (``WriteThrough.cached``)."""
        node.opens += 1
        node.passthrough_opens += passthrough
        if passthrough and writable:
            self.passthrough_writers.add(node)
        if writable:
            node.writers += 1   # before truncating: a truncate without writers is published
            node.appenders += append
            if trunc and node.staged is not None:
                node.staged = None if node.staged.queued else node.staged
            if trunc and node.staged is None and (node.size or node.content is None):
                self.truncate(node, 0)
            assert node.content is not None or node.staged is not None
            with self.oplog.lock:
                self.lru.pop(node.ino, None)

    def release(self, node: Node, writable: bool, append: bool = False,
                passthrough: bool = False) -> None:
        node.opens -= 1
        node.passthrough_opens -= passthrough
        if not node.passthrough_opens or not node.writers - writable:
            self.passthrough_writers.discard(node)
        if writable:
            node.writers -= 1
            node.appenders -= append
            if node.writers == 0:
                if node.dirty and node.nlink:
                    self.snapshot(node)
                else:
                    if self.oplog.acked:
                        with self.oplog.lock:
                            self.oplog.acked.pop(node.ino, None)
                    sp = node.staged
                    if sp is not None and not sp.queued:   # opened for writing, never written
                        node.staged = None
                        self.oplog.discard(sp)
                    self.maybe_evictable(node)
        if node.opens == 0 and node.nlink == 0:
            self.drop(node)

    # -- files the kernel reads and writes itself (passthrough: Core.open) -----------------
    def sync_content(self, node: Node) -> None:
        """A file open for writing with passthrough: the kernel wrote it without asking, so
        its size and times come from its memory file (once they changed there: a time set
        by utimens since stays)."""
        if not (node.passthrough_opens and node.writers) or node.content is None:
            return
        st = self.store.sync(node.content)
        seen = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if seen != node.content.seen:
            node.content.seen = seen
            node.size = st.st_size
            node.mtime = st.st_mtime_ns
            node.ctime = max(node.ctime, st.st_ctime_ns)

    def unchanged_since_snapshot(self, node: Node) -> bool:
        """A file open for writing with passthrough whose memory file has not changed since
        its last snapshot (it stays dirty after one: ``snapshot``)."""
        if node not in self.passthrough_writers:
            return False
        self.sync_content(node)
        return node.content.snapped is not None and node.content.snapped == node.content.seen

    def headroom(self, node: Node) -> bool:
        """Whether a writer of ``node`` may be passed through: the free space, with what
        persisted files hold, has room for a reservation for it and for every writer passed
        through that is still open (each ``_reservation``). The kernel writes their files
        without asking, so this, at the open, is what bounds them: a writer passed through
        may write past its reservation, and the cache then holds more than its size until
        the file is closed and persisted (docs/semantics.md). Elsewhere writers take the
        daemon's path, where a full cache makes them wait or write through."""
        want = sum(map(self._reservation, self.passthrough_writers)) + self._reservation(node)
        store = self.store
        with self.oplog.lock:
            self.lru.pop(node.ino, None)   # not counted for itself (Cache.open takes a
            room = store.free_bytes()      # writer's file out of the LRU anyway)
            if room >= want:
                return True
            # persisted files count as room, evicted only once written bytes need it (trim):
            # a reservation is a guess, and evicting for it would send readers to the backing
            for victim in self.lru.values():
                if self._evictable(victim):
                    room += store.nbytes(victim.content)
                    if room >= want:
                        return True
        return False

    def trim(self) -> None:
        """Evict persisted files while the cache holds more than its size (writers passed
        through wrote into the room ``headroom`` counted on)."""
        store = self.store
        with self.oplog.lock:
            while store.used > store.limit and self.lru:
                _, victim = self.lru.popitem(last=False)
                if victim.content is not None and self._evictable(victim):
                    store.drop(victim.content)
                    victim.content = None

    def _reservation(self, node: Node) -> int:
        held = self.store.nbytes(node.content) if node.content is not None else 0
        return max(0, max(PASS_WRITER_RESERVE, node.size) - held)

    def shared_in_kernel(self, node: Node) -> bool:
        """A memory file the kernel passes opens through to, that a snapshot or record
        holds too: its identity cannot change (``Core._unshared``), nor its bytes in place."""
        return bool(node.passthrough_opens) and self.store.shared(node.content)

    def copy_up(self, node: Node) -> Content:
        """Reserve room for the backing content of ``node`` (raises CacheFull)."""
        with self.oplog.lock:
            self._reserve(node.size)
            return self.store.alloc(node.size)

    def open_backing_copy(self, node: Node, verify: bool = True) -> int:
        """Worker thread: a descriptor of the backing copy of a file; ``verify``: the very
        version the mount knows (``Node.backing_version``), else ESTALE
        (``Backing.open_version``)."""
        with self.position_lock:
            if node.backing_parent is None:
                raise err(errno.ENOENT, "file has no backing copy")
            return self.backing.open_version(self.backing_path(node.backing_parent), node.backing_name,
                                             node.backing_version if verify else None)[0]

    def read_backing_into(self, node: Node, content: Content) -> None:
        """Worker thread: fill ``content`` with the backing content of ``node``."""
        fd = self.open_backing_copy(node)
        try:
            self.store.fill(content, fd, node.size, self.backing)
        finally:
            self.backing.close_fd(fd)

    def attach_content(self, node: Node, content: Content) -> None:
        with self.oplog.lock:
            if node.content is not None:
                self.store.drop(content)
                return
            node.content = content

    def release_content(self, content: Content) -> None:
        with self.oplog.lock:
            self.store.drop(content)

    def read(self, node: Node, off: int, size: int):
        """Bytes of a cached file, or None when its content lives only in the backing."""
        content = node.content
        if content is None:
            return None
        end = min(off + size, node.size)
        if off >= end:
            return b""
        return self.store.read(content, off, end)

    def touch(self, node: Node) -> None:
        if node.ino in self.lru:
            with self.oplog.lock:
                if node.ino in self.lru:
                    self.lru.move_to_end(node.ino)

    def write(self, node: Node, off: int, data: bytes) -> int:
        """Copy ``data`` into the file at ``off``; raises CacheFull without writing anything."""
        n = len(data)
        if n == 0:
            return 0
        assert node.content is not None, "write to an uncached file"
        store = self.store
        with self.oplog.lock:
            need = store.need(node.content, off, off + n)
            if need:
                self._reserve(need)   # CacheFull leaves the file as it was
            node.content = store.write(node.content, off, data)
        end = off + n
        if end > node.size:
            node.size = end
        node.mtime = node.ctime = now_ns()
        if not node.dirty or node.journal_state != JournalState.DIRTY:
            self._mark_dirty(node)
        return n

    def truncate(self, node: Node, size: int) -> None:
        """Set the size of a cached file (or of any file, to zero); raises CacheFull."""
        store = self.store
        with self.oplog.lock:
            if node.content is None:
                assert size == 0, "truncate of an uncached file"
                node.content = store.empty()
                self.lru.pop(node.ino, None)
            need = store.need_truncate(node.content, node.size, size)
            if need:
                self._reserve(need)
            node.content = store.truncate(node.content, node.size, size)
        node.size = size
        node.mtime = node.ctime = now_ns()
        node.truncated = True
        self._mark_dirty(node)
        if node.writers == 0 and node.nlink:
            self.snapshot(node)

    def fsync_snapshot(self, node: Node) -> int:
        """For ``--fsync backing``: queue the current content now; returns the seq to wait for.

        A file being written through is published at its last close; its fsync
        only makes the data written so far durable in its staged file (``WriteThrough.fsync``).
        """
        if node.dirty and node.nlink and node.staged is None:
            self.snapshot(node)
        return node.last_seq

    # -- space and eviction (hold self.oplog.lock) ------------------------------------------------
    def _reserve(self, need: int) -> None:
        """Make ``need`` bytes free, evicting persisted files least recently used first."""
        store = self.store
        while store.free_bytes() < need:
            if not self.lru:
                raise CacheFull()
            _, victim = self.lru.popitem(last=False)
            if victim.content is not None and self._evictable(victim):
                store.drop(victim.content)
                victim.content = None

    def _evictable(self, node: Node) -> bool:
        # a file open with passthrough stays: the kernel holds its memory file anyway
        return (node.is_reg and node.content is not None and not node.dirty and not node.publish_ops
                and node.writers == 0 and node.nlink > 0 and node.backing_parent is not None
                and node.passthrough_opens == 0)

    def maybe_evictable(self, node: Node) -> None:
        with self.oplog.lock:
            self.note_persisted(node)

    def note_persisted(self, node: Node) -> None:
        """The node may have become evictable: its last version landed, or its last writer
        closed it clean (hold lock; the flusher calls this after a publish)."""
        if self._evictable(node):
            self.lru[node.ino] = node
            self.lru.move_to_end(node.ino)

    def mark_written(self, node: Node, end: int) -> None:
        """Bookkeeping for a write that went to the staged file of a written-through file."""
        if end > node.size:
            node.size = end
        node.mtime = node.ctime = now_ns()
        self._mark_dirty(node)

    def write_through_candidate(self, exclude=()) -> Node | None:
        """The largest file open for writing whose cached content could go to the backing
        (not one the kernel writes itself: passthrough)."""
        best, most = None, 0
        for node in self.dirty_nodes:
            if node.writers and node.staged is None and node.content is not None \
                    and not node.passthrough_opens and node.ino not in exclude:
                held = self.store.nbytes(node.content)
                if held > most:
                    best, most = node, held
        return best

    def _mark_dirty(self, node: Node) -> None:
        if not node.dirty:
            node.dirty = True
            node.dirty_since = time.time()
            self.dirty_nodes.add(node)
        if node.journal_state != JournalState.DIRTY and self.oplog.journal is not None and node.nlink:
            self.oplog.journal_state(node, JournalState.DIRTY)
        if node.ino in self.lru:
            with self.oplog.lock:
                self.lru.pop(node.ino, None)

    def drop(self, node: Node) -> None:
        """Forget the content of an unlinked, closed file."""
        sp = node.staged
        if sp is not None:
            node.staged = None
            if not sp.queued:
                self.oplog.discard(sp)
        with self.oplog.lock:
            if node.content is not None:
                self.store.drop(node.content)
            node.content = None
            self.lru.pop(node.ino, None)
        node.dirty = False
        self.dirty_nodes.discard(node)
        if node.journal_state != JournalState.NONE:
            self.oplog.journal_state(node, JournalState.NONE)
        if node.backing_version is not None and self.linked.get(node.backing_version[0]) is node:
            del self.linked[node.backing_version[0]]
        if node.lookups <= 0:
            self.nodes.pop(node.ino, None)

    def forget(self, node: Node, n: int) -> None:
        node.lookups -= n
        if node.lookups <= 0 and node.nlink == 0 and node.opens == 0:
            self.nodes.pop(node.ino, None)

    # -- the ordered stream of mutations --------------------------------------------------
    def snapshot(self, node: Node) -> None:
        """Queue the current content of ``node`` for persistence (its last close). A file
        removed from the mount (still open, written after its removal) has no name to land
        under: nothing is queued."""
        if node.parent is None:
            return
        self.sync_content(node)
        with self.oplog.lock:
            if node.content is None:
                content = None
            elif node in self.passthrough_writers:   # the kernel may write it on: a copy
                content = self.store.copy(node.content, node.size)
            else:
                content = self.store.share(node.content)
            snap = Snapshot(node, content)
            if node.staged is not None:
                node.staged.queued = True   # the op owns it now; reads still use it
            # the acknowledgement stays in ``acked`` until the op that covers it is queued
            # (OpLog.push): this node's frontier must not pass it in between
            floor, stamp = self.oplog.acked.get(node.ino, (0.0, 0.0))   # 0: stamped when queued
        node.dirty = False
        node.truncated = False
        self.dirty_nodes.discard(node)
        if node.journal_state != JournalState.NONE:
            self.oplog.journal_state(node, JournalState.NONE, record=False)   # the publish record says it
        self.oplog.push(Publish(node, node.parent, node.name, snap,
                                list(node.links) if node.links else None), (stamp, floor))
        if node in self.passthrough_writers:
            # the kernel may write on without telling: dirty again, and what was queued is
            # remembered so that an unchanged file is not queued again (unchanged_since_snapshot)
            node.content.snapped = node.content.seen
            self._mark_dirty(node)

    def snapshot_open_files(self) -> int:
        """At shutdown: queue every file with unsaved changes, open or not. Returns the count."""
        nodes = [n for n in self.dirty_nodes if n.nlink and n.is_reg]
        for node in nodes:
            self.snapshot(node)
        return len(nodes)

    def _cancel(self, node: Node) -> None:
        """The node leaves the namespace; the op that removes it is queued next.

        Strict prefix (contract 4): a snapshot may be dropped only when the op right after
        it is the one that removes its file. Then no state of the mount had the snapshot
        and anything applied after it, so the backing can go from the state before the
        snapshot straight to the state after the removal. A snapshot with other ops
        between it and the removal is published like any other and removed again in
        order: skipping it would show those ops without the file they followed (a
        ``latest`` naming a checkpoint whose model file never landed).
        """
        self.oplog.void_last(node)
        node.dirty = False
        self.dirty_nodes.discard(node)
        if node.journal_state != JournalState.NONE:
            self.oplog.journal_state(node, JournalState.NONE)

    # -- the journal (see journal.py) ----------------------------------------------------
    def record_close(self, node: Node) -> None:
        """The last writer of ``node`` called close(): journal its content now.

        FUSE answers close() at FLUSH and sends RELEASE (where the snapshot is taken) without
        waiting, so a daemon killed in between must still find the content that close()
        acknowledged. The content is held (shared) until the snapshot or the next change.
        """
        if self.oplog.journal is None or not node.dirty or not node.nlink or not node.is_reg \
                or node.journal_state == JournalState.FLUSHED:
            return
        with self.oplog.lock:
            content = None if node.content is None else self.store.share(node.content)
        self.oplog.journal_state(node, JournalState.FLUSHED, content=content)

    def note_change(self, node: Node) -> None:
        """Before bytes of a written-through file change: a "flushed" record naming its
        staged file must not outlive the bytes it describes."""
        if node.journal_state != JournalState.DIRTY:
            self._mark_dirty(node)

    # -- state, for xattrs and status ----------------------------------------------------
    def state_of(self, node: Node) -> str:
        # a file the kernel writes is dirty again after each snapshot: unchanged, it is not
        unchanged = self.unchanged_since_snapshot(node)
        with self.oplog.lock:
            for op in node.publish_ops:
                if op.error:
                    return f"error: {op.error}"
            if node.dirty and not unchanged:
                return "dirty"
            if node.publish_ops:
                return "flushing"
        if node.last_seq > self.oplog.applied_seq:
            error = self.oplog.head_error(node)
            return f"error: {error}" if error else "flushing"
        return "persisted"

    def subtree_seq(self, node: Node) -> tuple[int, int]:
        """(highest seq of a change under node, files under it still open with unsaved data)."""
        seq, open_dirty = node.last_seq, 0
        stack = [node]
        while stack:
            n = stack.pop()
            seq = max(seq, n.last_seq)
            if n.dirty and n.writers:
                open_dirty += 1
            if n.children:
                stack.extend(n.children.values())
        return seq, open_dirty
