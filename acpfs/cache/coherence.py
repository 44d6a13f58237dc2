"""Coherence: the mount's view against the backing, which other writers (other nodes) change.

Owns how the view learns what the backing holds: loading a directory's listing once
(``list_backing``, ``attach_listing``), merging a later listing of it (``relist_backing``,
``merge_listing``), a name looked up in the backing (``stat_name``, ``attach_found``), a
file compared with its backing copy (``stat_backing``, ``replaced_elsewhere``), names
another writer removed or gave another file (``removed_elsewhere``, ``split``), and the
files met under several names in the backing (``_meet``; the table is ``Inodes.linked``).
The rule that decides what the backing's answer may change: only nodes with nothing of this
mount pending (``quiescent``), as of the applied seq taken with the answer, so that this
mount's own changes always win in its own view (docs/semantics.md, section 10).

Threads: ``list_backing``, ``relist_backing``, ``stat_name`` and ``stat_backing`` run in
worker threads, holding ``Inodes.position_lock`` across the backing calls and the names and
applied seq they go with (lock order: ``position_lock``, then the op log's ``lock``);
everything else runs on the trio thread (or recovery's main thread), without the position
lock: it changes positions only of quiescent nodes, which no queued op names, so the
sequencer does not touch them meanwhile. docs/concurrency.md, "Coherence writes".
"""

from __future__ import annotations

import os
import stat as statmod
import time
from typing import NamedTuple

from ..backing.backing import Backing
from .files import Files
from .inodes import Inodes, stat_times
from .namespace import Namespace
from ..oplog.log import OpLog
from ..node import Children, KernelNotices, Node


class Relisting(NamedTuple):
    """A listing of a loaded directory, taken at one moment (``Coherence.relist_backing``)."""
    listing: list
    known: set[bytes]                      # names this mount has something of its own on
    applied: int                           # the flusher's last applied seq then
    version: tuple[int, int, int] | None   # the directory's, before the listing
    began: float                           # time.monotonic() when the listing began


class Coherence:
    def __init__(self, oplog: OpLog, backing: Backing, inodes: Inodes, files: Files,
                 names: Namespace, kernel: KernelNotices = KernelNotices()) -> None:
        self.oplog = oplog        # the applied seq and the queue (what is pending)
        self.backing = backing
        self.inodes = inodes      # positions, new nodes, files met under several names
        self.files = files        # content that goes stale, files that leave the view
        self.names = names        # link counts of files that lose a name
        self.kernel = kernel      # tells the kernel to forget what another node changed

    # -- loading from the backing ---------------------------------------------------------
    def list_backing(self, node: Node) -> tuple[list, tuple[int, int, int] | None, float]:
        """Runs in a worker thread: the backing listing of a directory not yet loaded, the
        directory's version (``Backing.versioned_listing``) taken before it, and when it began."""
        with self.inodes.position_lock:
            began = time.monotonic()
            version, entries = self.backing.versioned_listing(self.inodes.backing_path(node))
            return entries, version, began

    def attach_listing(self, node: Node, listing: tuple[list, tuple[int, int, int] | None, float]) -> None:
        """A directory's entries as ``list_backing`` found them; ``Node.listed_at`` is when
        that listing began (a name missing from it was missing then)."""
        if node.children is not None:
            return
        node.children = Children()
        entries, node.listed_version, began = listing
        for name, st, target in entries:
            self._attach(node, name, st, target)
        node.listed_at = node.read_at = began

    def _attach(self, node: Node, name: bytes, st: os.stat_result, target: bytes | None) -> Node:
        """A child found in the backing. A file with several names there is one node: a
        name of a file met before (same backing inode, same version) is one more of its
        names (docs/semantics.md, hard links)."""
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        if statmod.S_ISREG(st.st_mode) and st.st_nlink > 1:
            same = self.inodes.linked.get(st.st_ino)
            if same is not None and same.nlink and same.backing_version == version \
                    and same.backing_parent is not None \
                    and self.quiescent(same):
                same.add_name(node, name)     # counted already, as a rule: nlink is the backing's
                same.set_positions(same.positions() + [(node, name)])
                same.nlink = max(same.nlink, st.st_nlink, len(same.names()))
                node.entries()[name] = same
                self.kernel.forget_attrs(same)
                self.kernel.appeared(node.ino, name)
                return same
        child = self.inodes.new_node(st.st_mode, st.st_uid, st.st_gid, node, name)
        child.size = st.st_size
        stat_times(child, st)
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
        node.entries()[name] = child
        self.kernel.appeared(node.ino, name)
        return child

    # -- other writers of the backing (other nodes) ---------------------------------------
    def relist_backing(self, node: Node, unless: tuple[int, int, int] | None = None) -> Relisting | None:
        """Worker thread: the backing's entries of a loaded directory, with the names there
        that belong to nodes this mount knows (its own, a removal or rename of theirs still
        queued), the seq applied and the directory's version before the listing, all at one
        moment (under position_lock, so that no op of this mount lands in between). None
        when the directory's version is still ``unless``: nothing was made or removed in it."""
        with self.inodes.position_lock:
            began = time.monotonic()
            got = self.backing.versioned_listing(self.inodes.backing_path(node), unless)
            if got is None:
                return None
            version, listing = got
            known, applied = self._known_names(node)
            return Relisting(listing, known, applied, version, began)

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
        with self.inodes.position_lock:
            comps = self.inodes.backing_path(parent)
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
                      version: tuple[int, int, int] | None, began: float) -> None:
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
                    and self.subtree_quiescent(child, applied):
                # another writer put another kind of entry under the name
                self.removed_elsewhere(node, name, child)
                self._attach(node, name, st, target)
            elif child.is_reg and child.position_at(node, name) is not None \
                    and child.backing_version is not None and statmod.S_ISREG(st.st_mode) \
                    and self.quiescent(child, applied):
                # the listing's lstat checks each clean file at once (Loader.revalidated then
                # need not look at them one by one)
                same = self.inodes.linked.get(st.st_ino) if st.st_nlink > 1 else None
                if (st.st_ino, st.st_size, st.st_mtime_ns) == child.backing_version:
                    if not child.links:   # a linked file's other names: checked at open
                        child.checked_at = now
                    if st.st_nlink > child.nlink:   # linked elsewhere since it was listed
                        child.nlink = st.st_nlink
                        self.kernel.forget_attrs(child)
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
            if not self.subtree_quiescent(child, applied):
                continue    # something of this mount is pending on it, or under it
            self.removed_elsewhere(node, name, child)
        node.listed_at = node.read_at = began
        node.listed_version = version

    def quiescent(self, node: Node, applied: int | None = None) -> bool:
        """Nothing of this mount is pending on the node (as of op ``applied``, by default the
        flusher's last): its content is the backing copy's."""
        if applied is None:
            applied = self.oplog.applied_seq
        return (not node.dirty and not node.writers and not node.publish_ops and node.staged is None
                and node.last_seq <= applied)

    def subtree_quiescent(self, node: Node, applied: int) -> bool:
        return self.quiescent(node, applied) and all(
            self.subtree_quiescent(c, applied) for c in (node.children or {}).values())

    def stat_backing(self, node: Node) -> tuple[list[tuple[tuple[Node, bytes], os.stat_result | None]], int]:
        """Worker thread: lstat of the node's backing copy under each of its positions (its
        first one first; None where it is gone), with the seq applied at that moment (under
        position_lock, so that no op of this mount lands in between: a stat older than this
        node's own last change must not replace it)."""
        with self.inodes.position_lock:
            applied = self.oplog.applied_seq
            return [(pos, self.backing.stat_entry(self.inodes.backing_path(pos[0]), pos[1]))
                    for pos in node.positions()], applied

    def replaced_elsewhere(self, node: Node, st: os.stat_result) -> None:
        """Another writer put a new version of a clean file in the backing: this mount's
        copy is stale. Its cached content is dropped (it is read from the backing again),
        unless someone has it open (it is dropped at a later open); the attributes follow
        the backing."""
        if node.opens > 0:
            return    # its readers keep the version they opened; looked at again later
        self.files.discard_content(node)
        node.mode, node.uid, node.gid = st.st_mode, st.st_uid, st.st_gid
        node.size = st.st_size
        stat_times(node, st)
        node.backing_version = (st.st_ino, st.st_size, st.st_mtime_ns)
        node.generation += 1    # readers that open it again read the new version
        self._meet(node, st)
        self.kernel.forget_attrs(node)

    def _meet(self, node: Node, st: os.stat_result) -> None:
        """``node`` holds backing inode ``st`` (a file with several names there): names of
        it that listings find later join it (``_attach``), and another node of this mount
        found to hold the same version gives it its names now, so that the mount has one
        node per file. Only between nodes with nothing pending and not open: otherwise they
        meet at a later look (semantics: hard links)."""
        if st.st_nlink <= 1:
            return
        other = self.inodes.linked.get(st.st_ino)
        self.inodes.linked[st.st_ino] = node
        if other is None or other is node or not other.nlink or other.opens \
                or other.backing_version != node.backing_version \
                or not self.quiescent(other) or not self.quiescent(node):
            return
        for d, name in other.names():
            d.entries()[name] = node
            node.add_name(d, name)
            self.kernel.forget_entry(d.ino, name)
        node.set_positions(node.positions() + [p for p in other.positions()
                                               if node.position_at(*p) is None])
        node.nlink = max(node.nlink, other.nlink, st.st_nlink, len(node.names()))
        other.set_names([])
        other.set_positions([])
        other.nlink = 0
        self.files.drop(other)
        self.kernel.forget_attrs(node)

    def split(self, parent: Node, name: bytes, node: Node, st: os.stat_result) -> None:
        """Another writer put another file under ``name``, one of the names of a file with
        several (or one of a file met under other names in the backing): that name is
        another file now. If another node gave every name one new version, the names meet
        again in ``_attach`` as they are looked at."""
        self.removed_elsewhere(parent, name, node)
        self._attach(parent, name, st, None)

    def removed_elsewhere(self, parent: Node, name: bytes, node: Node) -> None:
        """Another writer removed ``node`` (with all below it) from the backing: it leaves
        this mount's view (a file with other names keeps those)."""
        del parent.entries()[name]
        self.kernel.forget_entry(parent.ino, name)
        stack = [(parent, name, node)]
        while stack:
            d, name, n = stack.pop()
            if n.links:   # a file with other names keeps those
                n.rename_name((d, name), None)
                n.move_position((d, name), None)
                self.names.one_name_less(n)
                self.kernel.forget_attrs(n)
                continue
            if n.children:
                stack.extend((n, k, c) for k, c in n.children.items())
                n.children = Children()
            n.parent = None
            n.nlink = 0
            n.set_positions([])
            if n.opens == 0:
                self.files.drop(n)

