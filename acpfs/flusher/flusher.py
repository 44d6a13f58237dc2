"""The flusher: replays the mount's mutations onto the backing directory, in order.

One sequencer thread takes the ops off the op log strictly in the order the cache queued
them and applies each to the backing, each kind by its own method (``APPLY``); upload
threads (``Uploads``) write file snapshots to temporary files ahead of the sequencer, in
parallel. A snapshot only becomes visible when the sequencer reaches its op and renames the
temporary file over the final name (``Publisher``). What another writer of the backing
left in the way is met by ``Repairs``; every backing call is retried until it succeeds
(``Attempts``).

Ordering invariant (contract 4): an op is applied only after every op queued before it has
been applied; ``OpLog.applied_seq`` is the seq of the last applied op, so the backing
always shows a state of the mount's history. The only uploads skipped are snapshots whose
very next op removes their file (``Files.cancel``), which takes the backing from the state
before the snapshot straight to the one after the removal. The one exception: a new version
of a file with several names (hard links) lands under them one after the other
(``Publisher.publish_links``), so names still to come hold the version before for that
while.

Op states: queued -> uploading -> finalizing -> done, or queued/uploading -> void (that
skip). A void op's upload stops early and its temporary file is removed before the
sequencer moves past it. A failing op keeps its place and ``status`` shows the error, so
nothing queued after it can overtake it and nothing is ever dropped.

Owns the sequencer thread and the counters of what was persisted, with the time each
published version took from its snapshot (the file's last close) to durable in the backing
(``close_to_durable``); the op log's lock guards them (lock). Before it applies an op, the
sequencer waits for global order (``GlobalOrder.hold``).
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import stat as statmod
import threading
import time
from typing import Any, Callable

from ..errors import Aborted
from .attempts import Attempts
from .giveway import GiveWay
from .groups import Group
from ..backing.backing import STALE, Backing, MissingDir
from ..cache.cache import Cache
from ..config import DEFAULT_FLUSH_WORKERS
from ..oplog.log import OpLog
from ..oplog.ops import Link, Make, Mknod, Mkdir, Op, Publish, Remove, Rename, Rmdir, SetAttr, SetXattr, \
    Symlink, Unlink
from ..cluster.globalorder import GlobalOrder
from .histogram import Histogram
from .publishing import Publisher
from .repairs import Repairs, kind_of, version_of
from ..backing.retry import describe
from ..node import Node, OpState
from .uploads import Uploads

log = logging.getLogger(__name__)


class Flusher:
    """Applies the op log's queue to the backing; owns the sequencer and the counters of
    what was persisted."""

    def __init__(self, oplog: OpLog, cache: Cache, backing: Backing, order: GlobalOrder | None,
                 workers: int = DEFAULT_FLUSH_WORKERS,
                 requests_below: Callable[[], float] = lambda: 0.0) -> None:
        self.oplog = oplog
        self.cache = cache
        self.backing = backing
        self.order = order   # global order (globalorder.py); None: off, this node orders its own
        self.workers = max(1, workers)
        self.window = 4 * self.workers   # queued ops whose uploads may run ahead of the head
        self.lock = oplog.lock
        self.abort = threading.Event()
        self._stopping = False
        self.give_way = GiveWay(self._short_of_room, lambda: self._stopping or self.abort.is_set(),
                                lambda: oplog.applied_seq, requests_below)
        self.attempts = Attempts(backing, self.lock, self.abort, self._launch)
        self.repairs = Repairs(cache, backing)
        self.uploads = Uploads(cache, backing, self.lock, self.abort, self.attempts,
                               self.repairs, self.workers, self.give_way)
        self.group = Group()   # publishes waiting for their directory's fsync (sequencer's)
        self.publisher = Publisher(cache, backing, self.lock, self.attempts, self.repairs,
                                   self.uploads, self._launch, self.group)
        self.thread = threading.Thread(target=self._run, name="acpfs-sequencer", daemon=True)
        # counters for status (guarded by lock)
        self.persisted_files = 0
        self.persisted_bytes = 0
        self.close_to_durable = Histogram()   # s from a snapshot queued to its version durable
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self._rate_bytes = 0   # the sum of _rate's bytes

    def start(self) -> None:
        self.thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Stop the sequencer; with ``drain``, after the queue is empty. True if drained."""
        with self.lock:
            self._stopping = True
            if not drain:
                self.abort.set()
            self.lock.notify_all()
        self.thread.join(timeout)
        if self.thread.is_alive():
            return False
        self.uploads.shutdown(wait=not self.abort.is_set())
        return not self.oplog.queue

    def failing_op(self) -> Op | None:
        return self.oplog.failing_op(self.window)

    def status(self) -> dict[str, Any]:
        """The flusher's part of the status document (docs/status.md): uploads in flight,
        what was persisted and how long it took, failures, the failing ops at the head of
        the queue, conflicts, global order, and whether the sequencer lives."""
        gave_way = self.give_way.status()   # its lock nests with nothing (docs/concurrency.md)
        with self.lock:
            errors = self.errors()
            return {"in_flight": self.uploads.running,
                    "persisted_since_mount": {"files": self.persisted_files,
                                              "bytes": self.persisted_bytes},
                    "grouped_publishes": {"files": self.group.grouped,
                                          "directory_fsyncs": self.group.commits},
                    "close_to_durable_s": self.close_to_durable.as_dict(),
                    "errors_since_mount": self.attempts.status(),
                    "flush_rate_bytes_per_s": round(self.rate()),
                    "errors": errors,
                    "conflicts": self.repairs.conflicts.status(),
                    "peers": self.order.status() if self.order is not None else None,
                    "gave_way_to_requests": gave_way,
                    "flusher_alive": self.thread.is_alive()}

    def errors(self) -> list[dict[str, Any]]:
        """The ops at the head of the queue whose last attempt failed, for status (hold lock)."""
        now = time.time()
        return [{"path": op.path, "op": op.kind, "reason": op.error,
                 "attempts": op.attempts, "since": round(op.since, 3),
                 "next_retry_in_s": round(max(0.0, op.next_retry - now), 1)}
                for op in itertools.islice(self.oplog.queue, 0, self.window) if op.error]

    def rate(self) -> float:
        """Bytes per second persisted over the last 10 seconds."""
        cutoff = time.time() - 10
        with self.lock:
            while self._rate and self._rate[0][0] < cutoff:
                self._rate_bytes -= self._rate.popleft()[1]
            return self._rate_bytes / 10.0

    # -- the sequencer thread -----------------------------------------------------------
    def _run(self) -> None:
        queue = self.oplog.queue
        group = self.group
        try:
            while True:
                with self.lock:
                    while True:
                        self._launch()   # and the discards
                        if len(queue) > len(group.ops) or group.ops or self._stopping:
                            break
                        self.lock.wait()
                    if self.abort.is_set() or not queue:
                        return
                    # the head's op, or the next after a group of publishes applied but not
                    # yet durable (groups.py): it joins them, or their fsync comes first
                    op = queue[len(group.ops)] if len(queue) > len(group.ops) else None
                    if group.ops and (op is None or not self._joins(op)):
                        op = None
                    elif self.order is not None and op.state != OpState.VOID and not group.ops:
                        self.order.hold(op, self.abort, self._launch)
                if op is None:
                    self._commit()
                    continue
                if not group.ops:
                    self.give_way.wait()
                self._apply(op)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("%s %s: %s (seq %d)", op.kind, op.path, op.state, op.seq)
                group.ops.append(op)
                if not group.fds:   # nothing to fsync: popped at once
                    self._commit()
        except Aborted:
            log.warning("flusher stopped without draining: %d operations left", len(queue))
        except BaseException:
            log.exception("flusher crashed; changes are no longer persisted")
            raise

    def _joins(self, op: Op) -> bool:
        """Whether ``op`` may be applied before the fsync of the group of publishes applied
        before it (hold lock): a publish into the same directory, of a file not staged (its
        temporary file is in that directory) and with one name, whose upload is done, that
        global order lets land now (never a wait while the group holds this node's frontier
        back), and room in the group."""
        group = self.group
        if not isinstance(op, Publish) or group.full() or op.snap.staged is not None \
                or op.links or op.parent is not group.ops[-1].parent or op.future is None \
                or not op.future.done():
            return False
        return self.order is None or op.state == OpState.VOID or self.order.clear(op)

    def _commit(self) -> None:
        """The group's directories fsynced (groups.py), then its ops popped and applied, in
        queue order; with nothing to fsync, the op just applied, at once."""
        group = self.group
        if group.fds:
            def repair(exc: BaseException) -> None:
                if isinstance(exc, OSError) and exc.errno in STALE:
                    # the directory is gone from a remounted backing (NFS: a server restart);
                    # its renames were committed by the server before it answered them
                    group.forget_first(self.backing.close_fd)
            self.attempts.until_done(lambda: group.sync(self.backing.fsync, self.backing.close_fd),
                                     group.ops[-1], "publish of", repair)
        ops = group.committed()
        with self.lock:
            for op in ops:
                self.oplog.pop(op)
                self._finish(op)
            self.oplog.applied(ops[-1])   # after _finish: OpLog.applied says why
        for op in ops:
            self.cache.kernel.landed(op.node)   # answers held until it landed

    def _short_of_room(self) -> bool:
        """Less than a quarter of the cache is free: writers may be waiting for persisted
        files to evict (GiveWay never waits then)."""
        store = self.cache.store
        return store.free_bytes() < store.limit // 4

    def _launch(self) -> None:
        """Start uploads of queued snapshots whose directory exists in the backing, and the
        removal of staged files no op publishes (hold lock)."""
        for sp in self.oplog.discards:
            self.uploads.discard(sp)
        self.oplog.discards.clear()
        running = self.uploads.running
        for op in itertools.islice(self.oplog.queue, 0, self.window):
            if running >= 2 * self.workers:
                break
            if isinstance(op, Publish) and op.state == OpState.QUEUED and op.future is None \
                    and self.cache.inodes.present(op.parent):
                self.uploads.start(op)
                running += 1

    def _finish(self, op: Op) -> None:
        """Bookkeeping after an op left the queue (hold lock)."""
        if not isinstance(op, Publish):
            return
        node = op.node
        if op.snap.content is not None:
            self.cache.store.drop(op.snap.content)
        sp = op.snap.staged
        if sp is not None:
            if node.staged is sp:
                node.staged = None
            sp.close(self.backing.close_fd)
        if op.state == OpState.DONE:
            self.persisted_files += 1
            self.persisted_bytes += op.nbytes
            now = time.time()
            self.close_to_durable.observe(now - op.since)
            self._rate.append((now, op.nbytes))
            self._rate_bytes += op.nbytes
            self.cache.files.note_persisted(node)

    # -- applying each kind of op (hold position_lock while the backing changes) ----------
    def _apply(self, op: Op) -> None:
        self.APPLY[type(op)](self, op)

    def _in_place(self, op: Op, run: Callable[[], None],
                  repair: Callable[[BaseException], None]) -> None:
        """Apply an op other than a publish: ``run`` (under position_lock) until it succeeds."""
        def locked() -> None:
            with self.cache.inodes.position_lock:
                run()
        self.attempts.until_done(locked, op, op.kind, repair)
        op.state = OpState.DONE

    def _make(self, op: Make) -> None:
        """A directory, symlink or special file made, with its mode and owner as made."""
        cache, backing, node = self.cache, self.backing, op.node

        def run() -> None:
            comps = cache.inodes.backing_path(op.parent)
            self.repairs.make_way(op, comps, op.name, None)
            if isinstance(op, Mkdir):
                backing.mkdir(comps, op.name, op.mode, op.uid, op.gid)
            elif isinstance(op, Mknod):
                try:
                    backing.mknod(comps, op.name, op.mode, node.rdev, op.uid, op.gid)
                except PermissionError as e:
                    if e.errno != errno.EPERM:
                        raise
                    # the backing forbids the kind (root_squash): no retry can help, and
                    # the queue must move on (a conflict, docs/semantics.md)
                    self.repairs.conflicts.note("refused", op.path, f"makes a {kind_of(node)}",
                                                f"a backing that refuses it ({describe(e)})",
                                                "kept in this mount only")
                    return
            else:
                backing.symlink(comps, op.name, node.target, op.uid, op.gid)
            node.set_positions([(op.parent, op.name)])
        self._in_place(op, run, lambda exc: self.repairs.restore_dirs(op.parent, exc))

    def _remove_name(self, op: Remove) -> None:
        """An unlink or rmdir: the node's copy at that name leaves the backing."""
        node = op.node
        links = op.links if isinstance(op, Unlink) else None

        def run() -> None:
            pos = node.position_at(op.parent, op.name)
            if pos is not None and links and node.positions() == [pos] \
                    and self._holds(node, pos):
                self._move_last_copy(op, pos, links[0])
            elif pos is not None:
                self.repairs.remove(op.path, self.cache.inodes.backing_path(pos[0]), pos[1], node)
                node.move_position(pos, None)

        def repair(exc: BaseException) -> None:
            if links:   # _move_last_copy's destination
                self.repairs.restore_dirs(links[0][0], exc)
        self._in_place(op, run, repair)

    def _apply_rename(self, op: Rename) -> None:
        self._in_place(op, lambda: self._rename(op),
                       lambda exc: self.repairs.restore_dirs(op.parent, exc))

    def _apply_link(self, op: Link) -> None:
        self._in_place(op, lambda: self.publisher.link(op, op.node.positions(), op.parent, op.name),
                       lambda exc: self.repairs.restore_dirs(op.parent, exc))

    def _apply_attrs(self, op: SetAttr | SetXattr) -> None:
        """A setattr or xattr op: applied at the node's place in the backing, if it has one."""
        node = op.node

        def run() -> None:
            if node is self.cache.inodes.root:
                assert isinstance(op, SetXattr)   # the root's attributes are the backing's own
                self.backing.set_xattr([], b".", op.key, op.value)
            elif node.backing_parent is not None:
                try:
                    self._set_attrs(op, node.backing_parent)
                except FileNotFoundError as e:
                    if isinstance(e, MissingDir):
                        raise    # its directory: the repair makes it again
                    self.repairs.gone(node, op.path)
                    if node.backing_parent is not None:   # a directory, made again,
                        self._set_attrs(op, node.backing_parent)   # or a file's next name

        def repair(exc: BaseException) -> None:
            if node.backing_parent is not None:
                self.repairs.restore_dirs(node.backing_parent, exc)
        self._in_place(op, run, repair)

    def _set_attrs(self, op: SetAttr | SetXattr, parent: Node) -> None:
        """Apply a setattr or xattr op to the node's place in the backing (hold position_lock)."""
        node = op.node
        comps = self.cache.inodes.backing_path(parent)
        if isinstance(op, SetAttr):
            self.backing.setattr(comps, node.backing_name, node.is_link or node.is_special,
                                 op.mode, op.uid, op.gid, op.times)
            if op.times is not None and node.is_reg and node.backing_version is not None:
                # its own copy's new mtime; another node's version there stays another's
                # (same inode and size: the copy this node knew), so that coherence sees it
                st = self.backing.stat_entry(comps, node.backing_name)
                if st is not None and (st.st_ino, st.st_size) == node.backing_version[:2]:
                    node.backing_version = (st.st_ino, st.st_size, st.st_mtime_ns)
        else:
            self.backing.set_xattr(comps, node.backing_name, op.key, op.value)

    # each kind of op and the method that applies it (ops.py: adding a kind)
    APPLY: dict[type[Op], Callable[[Flusher, Any], None]] = {
        Mkdir: _make, Symlink: _make, Mknod: _make,
        Unlink: _remove_name, Rmdir: _remove_name,
        Rename: _apply_rename, Link: _apply_link,
        SetAttr: _apply_attrs, SetXattr: _apply_attrs,
        Publish: lambda self, op: self.publisher.apply(op),
    }

    def _rename(self, op: Rename) -> None:
        """A rename (hold position_lock).

        The sequencer applies a rename only after every op before it, so the backing holds
        at the destination what the mount had there just before the rename: the replaced
        node's last persisted version, or nothing. A node absent from the backing (a file
        never closed before the rename) has no visible content yet: the name then holds
        nothing in the backing until the file's first snapshot lands there, as in the mount's
        history of closed files (docs/semantics.md, section 4).
        """
        cache = self.cache
        node, dst, name, replaced = op.node, op.parent, op.name, op.replaced
        there = replaced is not None and replaced.position_at(dst, name) is not None
        dcomps = cache.inodes.backing_path(dst)
        pos = node.position_at(op.src, op.src_name)
        if pos is not None:
            src = cache.inodes.backing_path(pos[0])
            self.repairs.make_way(op, dcomps, name, replaced if there else None)
            try:
                self.backing.rename(src, pos[1], dcomps, name)
            except OSError as e:
                if e.errno != errno.ENOENT or (isinstance(e, MissingDir) and e.comps is not src):
                    raise   # a missing destination directory: Repairs.restore_dirs makes it
                if not isinstance(e, MissingDir) and self.backing.exists(src, pos[1]):
                    raise   # not the source: the destination went away meanwhile; retried
                # The source is gone from the backing, removed by something else. Everything
                # below is safe to redo: the node changes only once it is all done.
                self.repairs.conflicts.note("gone", op.path, f"renames this {kind_of(node)} from "
                                    f"{os.fsdecode(b'/'.join(src + [pos[1]]))!r}",
                                    "nothing at the source",
                                    "the directory is made again at the new name" if node.is_dir
                                    else "it is gone; it leaves this node's view at the next "
                                    "listing, unless written again")
                if there:
                    self.repairs.remove(op.path, dcomps, name, replaced)
                if node.is_dir:   # the mount still has it, and ops into it follow: make it again
                    self.backing.mkdir(dcomps, name, node.mode, node.uid, node.gid)
                    node.move_position(pos, (dst, name))
                else:             # absent: leaves the view at the next listing
                                  # (Coherence.merge_listing), unless a snapshot lands it again
                    node.move_position(pos, None)
            else:
                node.move_position(pos, (dst, name))
        elif there:
            self.repairs.remove(op.path, dcomps, name, replaced)
        if replaced is not None and there:
            replaced.move_position((dst, name), None)

    def _holds(self, node: Node, pos: tuple[Node, bytes]) -> bool:
        """Does the backing hold this node's version at ``pos`` (hold position_lock)? Not when
        another writer replaced it there since: that file is theirs, never moved as ours."""
        st = self.backing.stat_entry(self.cache.inodes.backing_path(pos[0]), pos[1])
        return st is not None and statmod.S_ISREG(st.st_mode) and version_of(st) == node.backing_version

    def _move_last_copy(self, op: Unlink, pos: tuple[Node, bytes], keep: tuple[Node, bytes]) -> None:
        """Unlink of the only name the backing has of a file that keeps other names there
        too in the mount (names whose link the backing refused): its copy moves to the name
        it keeps, which is the state the mount has after the unlink; removed, the file would
        be in the mount alone (hold position_lock)."""
        cache = self.cache
        dcomps = cache.inodes.backing_path(keep[0])
        self.repairs.make_way(op, dcomps, keep[1], None)
        self.backing.rename(cache.inodes.backing_path(pos[0]), pos[1], dcomps, keep[1])
        op.node.move_position(pos, keep)
