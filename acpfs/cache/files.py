"""File content: what the cache holds of each regular file, and when it may let it go.

Owns, for every regular file of the view:
- its content as a handle of the content store (``Node.content``, a ``store.api.Store``
  handle), copied up from the backing (``copy_up``, ``read_backing_into``), read, written
  and truncated here;
- the open counts (``open``, ``release``) and the files open for writing that the kernel
  writes itself (``passthrough_writers``: passthrough, ``sync_content``, ``trim``;
  which of them the kernel may write for is ``admission.Admission``'s);
- the dirty files (``dirty_nodes``, ``Node.dirty``), their snapshots queued on the op log
  (``snapshot``, ``cancel``) and their journal states (``record_close``, ``note_change``);
- eviction: the persisted files that may be dropped, least recently used first (``lru``),
  and what a file needs to be evictable (``evictable``).

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
  copies it first (``store.api.Store.write``), or the open does (``Handles.open``, passthrough).
- A file is evictable (in ``lru``) only if clean, not open for writing, without queued
  operations, and present in the backing with its current content.

Threads: the trio thread, except ``note_persisted`` (the sequencer, after a publish) and
``open_backing_copy``/``read_backing_into`` (worker threads). The op log's ``lock`` guards
the store's space and reference counts, assignments of ``Node.content`` and ``lru``
(``touch`` and ``_mark_dirty`` look without it first, then again under it); a backing
path is opened under the inode table's ``position_lock``, taken before the op log's lock,
never after. docs/concurrency.md has the whole picture.
"""

from __future__ import annotations

import collections
import errno
import time
from typing import Any, Callable

from ..backing.backing import Backing
from ..store.api import CacheFull, Content, Store
from .inodes import Inodes
from ..oplog.log import OpLog
from ..oplog.ops import Publish
from ..node import JournalState, Node, Snapshot, err, now_ns


class Files:
    def __init__(self, oplog: OpLog, inodes: Inodes, backing: Backing, store: Store) -> None:
        self.oplog = oplog        # where snapshots are queued; its lock guards (lock) fields
        self.inodes = inodes      # positions of backing copies; a dropped node leaves it
        self.backing = backing
        self.store = store
        self.dirty_nodes: set[Node] = set()
        # Persisted files, least recently used first (lock). Invariant: every evictable file
        # is in it. Eviction drops a file it finds pinned (``evictable`` false), so whatever
        # ends a pin calls ``note_persisted``: the flusher after a publish, the last writer's
        # release, the release of the kernel's last open of it (``release``).
        self.lru: collections.OrderedDict[int, Node] = collections.OrderedDict()
        # files open for writing that the kernel writes itself (passthrough: Handles.open)
        self.passthrough_writers: set[Node] = set()
        # bytes of the free space promised to them and not yet written: the admission's
        # (``Admission.owed``, set when it is built); the daemon's own writes leave them
        self.owed: Callable[[Node | None], int] = lambda skip=None: 0

    def created(self, node: Node) -> None:
        """``node`` is a new regular file: empty, and dirty until its first snapshot."""
        with self.oplog.lock:
            node.content = self.store.empty()
        self._mark_dirty(node)

    # -- opens ---------------------------------------------------------------------------
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
            if trunc and node.staged is None:
                self.sync_content(node)   # another writer's kernel writes, unseen so far
                if node.size or node.content is None:
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
        if passthrough and not node.passthrough_opens and not node.writers:
            self.maybe_evictable(node)   # the kernel's last open of it is gone
        if node.opens == 0 and node.nlink == 0:
            self.drop(node)

    # -- files the kernel reads and writes itself (passthrough: Handles.open) -----------------
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

    def written_unseen(self, node: Node) -> tuple[int, tuple[int, int, int] | None] | None:
        """A file open for writing with passthrough (``sync_content``): a descriptor of its
        memory file (valid until the next call into the store; -1: none) and what was last
        seen of it; None for any other file."""
        if not (node.passthrough_opens and node.writers) or node.content is None:
            return None
        return self.store.descriptor(node.content), node.content.seen

    def unchanged_since_snapshot(self, node: Node) -> bool:
        """A file open for writing with passthrough whose memory file has not changed since
        its last snapshot (it stays dirty after one: ``snapshot``)."""
        if node not in self.passthrough_writers:
            return False
        self.sync_content(node)
        return node.content.snapped is not None and node.content.snapped == node.content.seen

    def trim(self) -> None:
        """Evict persisted files while the cache holds more than its size (writers passed
        through wrote into the room ``Admission.admit`` counted on)."""
        store = self.store
        with self.oplog.lock:
            while store.used > store.limit and self.lru:
                _, victim = self.lru.popitem(last=False)
                if victim.content is not None and self.evictable(victim):
                    store.drop(victim.content)
                    victim.content = None

    def shared_in_kernel(self, node: Node) -> bool:
        """A memory file the kernel passes opens through to, that a snapshot or record
        holds too: its identity cannot change (``unshare.unshared``), nor its bytes in place."""
        return bool(node.passthrough_opens) and self.store.shared(node.content)

    def copy_up(self, node: Node) -> Content:
        """Reserve room for the backing content of ``node`` (raises CacheFull)."""
        with self.oplog.lock:
            self.reserve(node.size)
            return self.store.alloc(node.size)

    def open_backing_copy(self, node: Node, verify: bool = True) -> int:
        """Worker thread: a descriptor of the backing copy of a file; ``verify``: the very
        version the mount knows (``Node.backing_version``), else ESTALE
        (``Backing.open_version``)."""
        inodes = self.inodes
        with inodes.position_lock:
            if node.backing_parent is None:
                raise err(errno.ENOENT, "file has no backing copy")
            return self.backing.open_version(inodes.backing_path(node.backing_parent), node.backing_name,
                                             node.backing_version if verify else None)[0]

    def read_backing_into(self, node: Node, content: Content, fd: int = -1,
                          fast: bool | None = None, progress: Callable[[int, int], None] | None = None,
                          drop: Callable[[], bool] | None = None) -> None:
        """Worker thread: fill ``content`` with the backing content of ``node`` (from ``fd``,
        a descriptor of that version, where given: the backing then sees one open; ``fast``:
        whether the backing is, known already; ``progress(off, n)``: each range copied; ``drop``: whether
        the backing's page cache of what was copied goes: ``Store.fill``)."""
        if fd >= 0:
            self.store.fill(content, fd, node.size, self.backing, fast, progress, drop)
            return
        fd = self.open_backing_copy(node)
        try:
            self.store.fill(content, fd, node.size, self.backing, progress=progress, drop=drop)
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
                self.reserve(need, node)   # CacheFull leaves the file as it was
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
                self.reserve(need, node)
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
    def reserve(self, need: int, node: Node | None = None) -> None:
        """Make ``need`` bytes free for ``node`` beside what the other writers passed through
        were promised (``owed``), evicting persisted files least recently used first
        (CacheFull when they are not enough: ``has_room`` first evicts nothing then)."""
        store = self.store
        need += self.owed(node)   # evicting other files changes nothing the writers owe
        while store.free_bytes() < need:
            if not self.lru:
                raise CacheFull()
            _, victim = self.lru.popitem(last=False)
            if victim.content is not None and self.evictable(victim):
                store.drop(victim.content)
                victim.content = None

    def has_room(self, need: int, skip: Node | None = None) -> bool:
        """Whether ``need`` bytes are free or can be freed by evicting persisted files but
        ``skip``, beside what writers passed through but ``skip`` were promised; evictable
        files are summed only while short (docs/benchmarks.md, "Room for a writer ...")."""
        short = need - (self.store.free_bytes() - self.owed(skip))
        for n in self.lru.values():
            if short <= 0:
                break
            if n is not skip and self.evictable(n):
                short -= self.store.nbytes(n.content)
        return short <= 0

    def evictable(self, node: Node) -> bool:
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
        if self.evictable(node):
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
        """Forget the content of an unlinked, closed file; it leaves the inode table."""
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
        self.inodes.dropped(node)

    def discard_content(self, node: Node) -> None:
        """Another writer replaced the backing copy of a clean file: its cached content is
        stale (``Coherence.replaced_elsewhere``)."""
        if node.content is not None:
            with self.oplog.lock:
                self.store.drop(node.content)
                node.content = None
                self.lru.pop(node.ino, None)

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

    def cancel(self, node: Node) -> None:
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
    def status(self) -> dict[str, Any]:
        """The files' part of the status document (docs/status.md): cached files, dirty
        files and their bytes, and since when the oldest is dirty (``dirty_since``, None
        when none is)."""
        dirty = list(self.dirty_nodes)
        return {"cached_files": sum(1 for i, n in self.inodes.nodes.items()
                                    if i == n.ino and n.content is not None and n.size),
                "writers_passed_through": len(self.passthrough_writers),
                "dirty": {"files": len(dirty), "bytes": sum(n.size for n in dirty)},
                "dirty_since": min((n.dirty_since for n in dirty), default=None)}

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
