"""The flusher: replays the mount's mutations onto the backing directory, in order.

One sequencer thread takes ``Op``s strictly in the order ``Cache`` queued them and applies
each to the backing; a pool of upload workers writes file snapshots to temporary files
ahead of the sequencer, in parallel. A snapshot only becomes visible when the sequencer
reaches its op and renames the temporary file over the final name.

Ordering invariant (contract 4): an op is applied only after every op queued before it has
been applied; ``applied_seq`` is the seq of the last applied op, so the backing always
shows a state of the mount's history. The only uploads skipped are snapshots whose very
next op removes their file (``Cache._cancel``), which takes the backing from the state
before the snapshot straight to the one after the removal. The one exception: a new version
of a file with several names (hard links) lands under them one after the other
(``_publish_links``), so names still to come hold the version before for that while.

Op states: queued -> uploading -> finalizing -> done, or queued/uploading -> void (that
skip). A void op's upload stops early and its temporary file is removed before the
sequencer moves past it. Failing backing calls
are retried forever through ``retry.retry``; the op keeps its place and ``status`` shows
the error, so nothing queued after it can overtake it and nothing is ever dropped.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import errno
import itertools
import logging
import os
import stat as statmod
import threading
import time
from typing import Callable, TypeVar

from .backing import STALE, Backing, Comps, MissingDir, NotEmpty, flat_name
from .cache import Cache
from .oplog import OpLog
from .config import DEFAULT_FLUSH_WORKERS
from .conflicts import Conflicts, describe_entry
from .peers import UP, Peers
from .retry import describe, retry
from .types import Node, Op, OpKind, OpState, Staged

log = logging.getLogger(__name__)
T = TypeVar("T")


class Aborted(Exception):
    """The daemon was told to stop without draining."""


def _always(exc: BaseException) -> bool:
    # The flusher never gives up on an op: skipping one would break the order and lose data.
    return isinstance(exc, OSError)


class Flusher:
    """Applies the op log's queue to the backing; owns the sequencer, the upload threads and
    the counters of what was persisted."""

    def __init__(self, oplog: OpLog, cache: Cache, backing: Backing, peers: Peers | None,
                 workers: int = DEFAULT_FLUSH_WORKERS) -> None:
        self.oplog = oplog
        self.cache = cache
        self.backing = backing
        self.peers = peers   # global order (peers.py); None: off, this node orders its own
        self.workers = max(1, workers)
        self.window = 4 * self.workers   # queued ops whose uploads may run ahead of the head
        self.lock = oplog.lock
        self.abort = threading.Event()
        self._stopping = False
        self.uploads = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="acpfs-upload")
        self.thread = threading.Thread(target=self._run, name="acpfs-sequencer", daemon=True)
        # counters for status (guarded by lock)
        self.persisted_files = 0
        self.persisted_bytes = 0
        self.uploading = 0
        self.conflicts = Conflicts(backing.instance)
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self.held: dict | None = None   # (lock) the op waiting for other nodes, for status

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
        self.uploads.shutdown(wait=not self.abort.is_set(), cancel_futures=True)
        return not self.oplog.queue

    def failing_op(self) -> Op | None:
        return self.oplog.failing_op(self.window)

    def rate(self) -> float:
        """Bytes per second persisted over the last 10 seconds."""
        cutoff = time.time() - 10
        with self.lock:
            while self._rate and self._rate[0][0] < cutoff:
                self._rate.popleft()
            return sum(n for _, n in self._rate) / 10.0

    # -- the sequencer thread -----------------------------------------------------------
    def _run(self) -> None:
        queue = self.oplog.queue
        try:
            while True:
                with self.lock:
                    while True:
                        self._launch()   # and the discards
                        if queue or self._stopping:
                            break
                        self.lock.wait()
                    if not queue or self.abort.is_set():
                        return
                    op = queue[0]
                    if self.peers is not None and op.state != OpState.VOID:
                        self._hold(op)
                self._apply(op)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("%s %s: %s (seq %d)", op.kind, op.path, op.state, op.seq)
                with self.lock:
                    self.oplog.pop(op)
                    self._finish(op)
                    self.oplog.applied(op)   # after _finish: OpLog.applied says why
        except Aborted:
            log.warning("flusher stopped without draining: %d operations left", len(queue))
        except BaseException:
            log.exception("flusher crashed; changes are no longer persisted")
            raise

    def _hold(self, op: Op) -> None:
        """Global order (hold lock): wait until no live peer can still have to persist
        something it acknowledged before ``op`` (``Peers.cleared``); uploads go on meanwhile."""
        peers = self.peers
        assert peers is not None
        since = time.time()
        warned = False
        # Invariant (no waiting in a circle): a node's frontier is never behind the stamp
        # its head op is held to. Changes are queued in the order they were acknowledged
        # (Core.flush), so the head holds the oldest stamp but (1) for a file written
        # through, queued at its RELEASE after a change made meanwhile, and (2) for a file
        # closed more than once before it was queued (a copy of its descriptor closed
        # first, as a shell's redirection does): its frontier is its first close, its
        # stamp the last. Either way the head waits only for what the other nodes
        # acknowledged before this node's oldest pending change (docs/design.md). Held to
        # its last close instead, two such files on two nodes waited for each other.
        stamp = min(op.stamp, self.oplog.frontier()[0])
        while True:
            ok = peers.cleared(stamp)
            if ok is True:
                break
            if self.abort.is_set():
                raise Aborted()
            now = time.time()
            if now - since > peers.lease:
                # a safety valve: the rule admits no circle, but a hold is never longer than
                # a lease, whatever holds it (docs/semantics.md, section 11)
                log.warning("global order: %s %r held for %.0f s, longer than the lease: it "
                            "goes on without waiting further", op.kind, op.path, now - since)
                break
            self.held = {"op": str(op.kind), "path": op.path, "since": since,
                         "waiting_for": None if ok is None else ok.record.label,
                         "instance": None if ok is None else ok.record.instance}
            if ok is not None and not warned and now - since > 10:
                warned = True
                r = ok.record
                # an idle record acknowledged nothing pending: its promise ran out, and it
                # has not been renewed since
                why = (f"which has not persisted what it acknowledged {now - r.frontier:.0f} s "
                       "ago" if r.state == UP else f"whose record (idle: nothing pending) has "
                       f"not been renewed for {now - r.heartbeat:.0f} s")
                log.warning("global order: %s %r has waited %.0f s for node %s (%s), %s; it "
                            "goes on once that node catches up, or after its lease (%.0f s) if "
                            "it stops renewing its record", op.kind, op.path, now - since,
                            r.label, r.instance, why, peers.lease)
            peers.kick()
            self._launch()
            self.lock.wait(0.5)
        if self.held is not None:
            self.held = None
            if warned:
                log.warning("global order: %s %r goes on after %.1f s", op.kind, op.path,
                            time.time() - since)

    def _launch(self) -> None:
        """Start uploads of queued snapshots whose directory exists in the backing, and the
        removal of staged files no op publishes (hold cond)."""
        for sp in self.oplog.discards:
            self.uploads.submit(self._discard_staged, sp)
        self.oplog.discards.clear()
        running = self.uploading
        for op in itertools.islice(self.oplog.queue, 0, self.window):
            if running >= 2 * self.workers:
                break
            if op.kind == OpKind.PUBLISH and op.state == OpState.QUEUED and op.future is None \
                    and self.cache.present(op.parent):  # type: ignore[arg-type]
                op.state = OpState.UPLOADING
                op.future = self.uploads.submit(self._upload, op)
                self.uploading += 1
                running += 1

    def _finish(self, op: Op) -> None:
        """Bookkeeping after an op left the queue (hold cond)."""
        if op.kind != OpKind.PUBLISH:
            return
        node = op.node
        if op.snap.content is not None:  # type: ignore[union-attr]
            self.cache.store.drop(op.snap.content)  # type: ignore[union-attr]
        sp = op.snap.staged  # type: ignore[union-attr]
        if sp is not None:
            if node.staged is sp:
                node.staged = None
            sp.close(self.backing.close_fd)
        if op.state == OpState.DONE:
            self.persisted_files += 1
            self.persisted_bytes += op.nbytes
            self._rate.append((time.time(), op.nbytes))
            self.cache.note_persisted(node)

    def _retry(self, fn: Callable[[], T], op: Op, what: str,
               repair: Callable[[BaseException], None] | None = None) -> T:
        """``fn`` until it succeeds. Every failure shows in ``status``; ``repair(exc)`` runs
        before the next attempt and redoes what the failure showed is missing (a directory,
        a temporary file), so that an error retrying alone cannot cure does not spin."""
        def failed(exc: BaseException, attempt: int, delay: float) -> None:
            op.error = describe(exc)
            op.attempts = attempt
            op.next_retry = time.time() + delay
            if isinstance(exc, OSError) and exc.errno in STALE:
                self.backing.reopen(exc)   # a remounted backing: its root again, by path
            if repair is not None:
                try:
                    repair(exc)
                except OSError as e:
                    log.warning("%s %r: repair failed (%s); retrying", what, op.path, describe(e))
            with self.lock:   # while an op waits for its next attempt, later uploads go on
                self._launch()

        def recovered() -> None:
            op.error = None

        try:
            return retry(fn, f"{what} {op.path!r}", on_failure=failed, on_success=recovered,
                         stop=self.abort, retryable=_always)
        except OSError:
            if self.abort.is_set():
                raise Aborted() from None
            raise

    def _apply(self, op: Op) -> None:
        if op.kind == OpKind.PUBLISH:
            self._apply_publish(op)
            return
        cache, backing = self.cache, self.backing
        node = op.node

        def run() -> None:
            with cache.position_lock:
                kind = op.kind
                if kind in (OpKind.MKDIR, OpKind.SYMLINK, OpKind.MKNOD):
                    comps = cache.backing_path(op.parent)  # type: ignore[arg-type]
                    mode, uid, gid = op.attrs   # as made: later changes are ops of their own
                    self._make_way(op, comps, op.name, None)
                    if kind == OpKind.MKDIR:
                        backing.mkdir(comps, op.name, mode, uid, gid)
                    elif kind == OpKind.MKNOD:
                        try:
                            backing.mknod(comps, op.name, mode, node.rdev, uid, gid)
                        except PermissionError as e:
                            if e.errno != errno.EPERM:
                                raise
                            # the backing forbids the kind (root_squash): no retry can help,
                            # and the queue must move on (a conflict, docs/semantics.md)
                            self.conflicts.note("refused", op.path, f"makes a {_kind(node)}",
                                                f"a backing that refuses it ({describe(e)})",
                                                "kept in this mount only")
                            return
                    else:
                        backing.symlink(comps, op.name, node.target, uid, gid)
                    node.set_positions([(op.parent, op.name)])  # type: ignore[list-item]
                elif kind in (OpKind.UNLINK, OpKind.RMDIR):
                    pos = node.position_at(op.parent, op.name)
                    if pos is not None and op.links and node.positions() == [pos] \
                            and self._holds(node, pos):
                        self._move_last_copy(op, pos, op.links[0])
                    elif pos is not None:
                        self._remove(op.path, cache.backing_path(pos[0]), pos[1], node)
                        node.move_position(pos, None)
                elif kind == OpKind.RENAME:
                    self._rename(op)
                elif kind == OpKind.LINK:
                    self._link(op, node.positions(), op.parent, op.name)  # type: ignore[arg-type]
                elif kind in (OpKind.SETATTR, OpKind.XATTR):
                    if node is cache.root:
                        backing.set_xattr([], b".", *op.attrs)
                    elif node.backing_parent is not None:
                        try:
                            self._set_attrs(op)
                        except FileNotFoundError as e:
                            if isinstance(e, MissingDir):
                                raise    # its directory: the repair makes it again
                            self._gone(node, op.path)
                            if node.backing_parent is not None:   # a directory, made again,
                                self._set_attrs(op)               # or a file's next name
                else:
                    raise AssertionError(f"unknown op {kind}")

        def repair(exc: BaseException) -> None:
            if op.kind in (OpKind.MKDIR, OpKind.SYMLINK, OpKind.MKNOD, OpKind.RENAME, OpKind.LINK):
                self._restore_dirs(op.parent, exc)  # type: ignore[arg-type]
            elif op.kind in (OpKind.SETATTR, OpKind.XATTR) and node.backing_parent is not None:
                self._restore_dirs(node.backing_parent, exc)
            elif op.kind == OpKind.UNLINK and op.links:   # _move_last_copy's destination
                self._restore_dirs(op.links[0][0], exc)
        self._retry(run, op, op.kind, repair)
        op.state = OpState.DONE

    def _set_attrs(self, op: Op) -> None:
        """Apply a setattr or xattr op to the node's place in the backing (hold position_lock)."""
        node = op.node
        comps = self.cache.backing_path(node.backing_parent)  # type: ignore[arg-type]
        if op.kind == OpKind.SETATTR:
            mode, uid, gid, times = op.attrs
            self.backing.setattr(comps, node.backing_name, node.is_link or node.is_special, mode,
                                 uid, gid, times)
            if times is not None and node.is_reg and node.backing_version is not None:
                # its own copy's new mtime; another node's version there stays another's
                # (same inode and size: the copy this node knew), so that coherence sees it
                st = self.backing.stat_entry(comps, node.backing_name)
                if st is not None and (st.st_ino, st.st_size) == node.backing_version[:2]:
                    node.backing_version = (st.st_ino, st.st_size, st.st_mtime_ns)
        else:
            self.backing.set_xattr(comps, node.backing_name, *op.attrs)

    def _gone(self, node: Node, path: str) -> None:
        """The node's copy is gone from the backing, removed by something other than this
        mount (hold position_lock). A directory is made again in its place (ops into it
        follow); a file counts as absent there, and its next snapshot lands again."""
        self.conflicts.note("gone", path, f"changes the attributes of this {_kind(node)}", "nothing",
                            "the directory is made again" if node.is_dir
                            else "changed under another of its names" if node.backing_links
                            else "its next snapshot lands again")
        if node.is_dir:
            self.backing.mkdir(self.cache.backing_path(node.backing_parent), node.backing_name,  # type: ignore[arg-type]
                               node.mode, node.uid, node.gid)
        else:   # that name only: a file with others is changed there (the caller goes on)
            node.move_position((node.backing_parent, node.backing_name), None)  # type: ignore[arg-type]

    def _restore_dirs(self, where: Node, exc: BaseException) -> None:
        """A directory the mount has, and the flusher put in the backing, is missing there
        (MissingDir): removed or moved behind acpfs's back. Changes made through the mount
        still go into it, so it is made again, from the mount's view (mode, owner), with
        every directory below it on the way to ``where``. What else it held in the backing
        went with it; the mount is the truth for what it acknowledged."""
        if not isinstance(exc, MissingDir):
            return
        cache = self.cache
        with cache.position_lock:
            chain: list[Node] = []
            n: Node | None = where
            while n is not cache.root:
                if n is None:
                    return   # not in the backing yet: an earlier op makes it
                chain.append(n)
                n = n.backing_parent
            chain.reverse()
            comps = [c.backing_name for c in chain]
            if comps[:exc.depth + 1] != exc.comps[:exc.depth + 1]:
                return       # moved meanwhile: the next attempt sees afresh
            for i in range(exc.depth, len(chain)):
                d = chain[i]
                path = os.fsdecode(b"/".join(comps[:i + 1]))
                if i == exc.depth and exc.blocked:   # another kind of entry stands there
                    self._make_way_for_dir(path, comps[:i], comps[i])
                if not self.backing.mkdir(comps[:i], comps[i], d.mode, d.uid, d.gid):
                    continue   # another upload into it made it again first: one conflict
                self.conflicts.note("dir_recreated", path, "writes into this directory",
                                    "nothing there (removed or moved by another writer)",
                                    "made again from this node's view")

    # -- conflicts: the backing changed by another writer (conflicts.py) -------------------
    def _make_way(self, op: Op, comps: Comps, name: bytes, known: Node | None,
                  seen: tuple[int, int, int] | None = None) -> None:
        """Before ``op`` puts its node's entry at ``comps``/``name`` (hold position_lock):
        resolve what another writer left there. ``known`` is the node whose backing copy
        this node expects at the name (the one it replaces), or None; ``seen`` a version
        of a file this node expects there."""
        node = op.node
        st = self.backing.stat_entry(comps, name)
        if st is None:
            return
        path = op.path
        theirs_dir = statmod.S_ISDIR(st.st_mode)
        if node.is_dir and theirs_dir:
            # mkdir adopts a directory that is there (ranks make the same one); a directory
            # renamed over another replaces it only if it is empty, as rename(2) does
            if op.kind == OpKind.RENAME and not self.backing.remove_empty_dir(comps, name):
                self._move_aside(op.path, comps, name, st, f"renames a directory to {path!r}")
            return
        if node.is_dir or theirs_dir:
            self._move_aside(path, comps, name, st, f"puts a {_kind(node)} at {path!r}")
            return
        # a file or symlink over a file or symlink: the last publisher wins, whole files only
        if (known is not None and known.backing_version in (None, _version(st))) \
                or (seen is not None and seen == _version(st)):
            return        # its own copy, or one it saw
        if node.is_link and statmod.S_ISLNK(st.st_mode) and op.kind == OpKind.SYMLINK:
            if self.backing.read_link(comps, name) == node.target:
                return    # the same symlink, made by another node too
        ours = f"{'publishes' if op.kind == OpKind.PUBLISH else 'puts'} a {_kind(node)}"
        if op.kind == OpKind.PUBLISH:
            ours += f" of {op.nbytes} bytes"
        self.conflicts.note("replaced", path, ours, f"{describe_entry(st)} it never saw",
                            "the last publisher wins: this node's replaces it")
        if op.kind in (OpKind.SYMLINK, OpKind.MKNOD):
            self.backing.unlink(comps, name, False)    # symlink(2) and mknod(2) do not replace

    def _make_way_for_dir(self, path: str, comps: Comps, name: bytes) -> None:
        st = self.backing.stat_entry(comps, name)
        if st is not None and not statmod.S_ISDIR(st.st_mode):
            self._move_aside(path, comps, name, st, "writes into a directory of this name")

    def _move_aside(self, path: str, comps: Comps, name: bytes, st: os.stat_result, ours: str) -> None:
        aside = self.backing.move_aside(comps, name, self.conflicts.aside_stamp,
                                        flat_name(os.fsdecode(b"/".join(comps + [name]))))
        self.conflicts.note("moved_aside", path, ours, describe_entry(st),
                            f"it was moved to {aside!r}")

    def _remove(self, path: str, comps: Comps, name: bytes, node: Node) -> None:
        """Remove ``node``'s backing copy at ``comps``/``name`` (hold position_lock), unless
        another writer changed that name meanwhile: what this node never saw is kept."""
        st = self.backing.stat_entry(comps, name)
        what = f"removes this {_kind(node)}"
        if st is None:
            self.conflicts.note("gone", path, what, "nothing (removed by another writer)",
                                "nothing to remove")
            return
        if statmod.S_IFMT(st.st_mode) != statmod.S_IFMT(node.mode) \
                or (node.is_reg and node.backing_version is not None
                    and _version(st) != node.backing_version) \
                or (node.is_link and self.backing.read_link(comps, name) != node.target):
            self.conflicts.note("kept", path, what, f"{describe_entry(st)} it never saw",
                                "left in place: newer than what this node removed")
            return
        try:
            self.backing.unlink(comps, name, node.is_dir)
        except NotEmpty as e:
            names = ", ".join(repr(os.fsdecode(n)) for n in e.entries[:5])
            more = f" and {len(e.entries) - 5} more" if len(e.entries) > 5 else ""
            self.conflicts.note("not_empty", path, what,
                                f"{len(e.entries)} entries it never had in it: {names}{more}",
                                "the directory stays, holding them")

    def _rename(self, op: Op) -> None:
        """Apply a rename (hold position_lock).

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
        dcomps = cache.backing_path(dst)  # type: ignore[arg-type]
        pos = node.position_at(op.src, op.src_name)
        if pos is not None:
            src = cache.backing_path(pos[0])
            self._make_way(op, dcomps, name, replaced if there else None)
            try:
                self.backing.rename(src, pos[1], dcomps, name)
            except OSError as e:
                if e.errno != errno.ENOENT or (isinstance(e, MissingDir) and e.comps is not src):
                    raise   # a missing destination directory: _restore_dirs makes it
                if not isinstance(e, MissingDir) and self.backing.exists(src, pos[1]):
                    raise   # not the source: the destination went away meanwhile; retried
                # The source is gone from the backing, removed by something else. Everything
                # below is safe to redo: the node changes only once it is all done.
                self.conflicts.note("gone", op.path, f"renames this {_kind(node)} from "
                                    f"{os.fsdecode(b'/'.join(src + [pos[1]]))!r}",
                                    "nothing at the source",
                                    "the directory is made again at the new name" if node.is_dir
                                    else "it is gone; it leaves this node's view at the next "
                                    "listing, unless written again")
                if there:
                    self._remove(op.path, dcomps, name, replaced)  # type: ignore[arg-type]
                if node.is_dir:   # the mount still has it, and ops into it follow: make it again
                    self.backing.mkdir(dcomps, name, node.mode, node.uid, node.gid)
                    node.move_position(pos, (dst, name))  # type: ignore[arg-type]
                else:             # absent: leaves the view at the next listing
                                  # (Cache.merge_listing), unless a snapshot lands it again
                    node.move_position(pos, None)
            else:
                node.move_position(pos, (dst, name))  # type: ignore[arg-type]
        elif there:
            self._remove(op.path, dcomps, name, replaced)  # type: ignore[arg-type]
        if there:
            replaced.move_position((dst, name), None)  # type: ignore[union-attr, arg-type]

    def _link(self, op: Op, sources: list[tuple[Node, bytes]], dst: Node, name: bytes,
              seen: tuple[int, int, int] | None = None) -> None:
        """Give ``op``'s node the name ``dst``/``name`` in the backing too (hold position_lock):
        a hard link to its copy at the first of ``sources`` still there, made under a
        temporary name and renamed into place, so that the name goes from what stood there
        straight to the file. ``seen``: the version this node left at the name itself. With
        no source left (none yet, or all removed by another writer) nothing is done: the
        node's next publish lands under every name it has then (``Op.links``)."""
        node = op.node
        dcomps = self.cache.backing_path(dst)
        for pos in sources:
            src = self.cache.backing_path(pos[0])
            self._make_way(op, dcomps, name, None, seen)
            try:
                self.backing.link(src, pos[1], dcomps, name)
            except FileNotFoundError as e:
                if isinstance(e, MissingDir) and e.comps is not src:
                    raise       # the destination's directory: _restore_dirs makes it
                if self.backing.exists(src, pos[1]):
                    raise
                self.conflicts.note("gone", op.path, f"links this {_kind(node)} from "
                                    f"{os.fsdecode(b'/'.join(src + [pos[1]]))!r}",
                                    "nothing at the source", "linked from another of its names, "
                                    "or landed by its next snapshot")
                node.move_position(pos, None)
                continue
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                # the backing forbids the link: no retry can help, the queue must move on
                self.conflicts.note("refused", op.path, f"links this {_kind(node)}",
                                    f"a backing that refuses it ({describe(e)})",
                                    "this name is kept in this mount only")
                return
            if node.position_at(dst, name) is None:
                node.set_positions(node.positions() + [(dst, name)])
            if node.is_reg and node.backing_version is not None:
                self.cache.linked[node.backing_version[0]] = node   # as in _apply_publish
            return

    # -- uploads ------------------------------------------------------------------------
    def _upload(self, op: Op) -> bool:
        """Worker thread: write the snapshot to a temporary file next to its final name."""
        def repair(exc: BaseException) -> None:
            sp = op.snap.staged  # type: ignore[union-attr]
            if sp is not None and isinstance(exc, OSError) and exc.errno in STALE:
                self._reopen_staged(op, sp)    # a remounted backing: the same file, by name
            else:
                self._restore_dirs(op.parent, exc)  # type: ignore[arg-type]
        try:
            return self._retry(lambda: self._write_upload(op), op, "upload of", repair)
        finally:
            with self.lock:
                self.uploading -= 1
                self.lock.notify_all()

    def _write_upload(self, op: Op) -> bool:
        """One attempt at the temporary file of a publish; False if the op went void (or
        the daemon is stopping) meanwhile."""
        cache = self.cache
        snap = op.snap
        assert snap is not None

        def stopped() -> bool:
            return op.state == OpState.VOID or self.abort.is_set()

        # Invariant: an upload cut short by an abort raises Aborted, never returns False:
        # False means void, and the sequencer would record a void op as applied (its
        # content then lost at the next start).
        if self.abort.is_set():
            raise Aborted()
        if stopped():
            return False
        if snap.staged is not None:  # already in the backing: finish it in place
            if snap.staged.read_only:   # as a recovery over a read-only backing opened it
                self._writable_staged(op, snap.staged)
            self.backing.finish_temp(snap.staged.fd, snap.size, snap.mode, snap.uid, snap.gid,
                                     snap.times, snap.xattrs)
            return True
        with cache.position_lock:
            dfd = self.backing.open_dir(cache.backing_path(op.parent))  # type: ignore[arg-type]
        tmpname = self.backing.temp_name()   # fresh each attempt: created exclusively
        try:
            with cache.store.source(snap.content, snap.size) as (src_fd, extents):
                ok = self.backing.write_temp(dfd, tmpname, extents, src_fd, snap.size, snap.mode,
                                             snap.uid, snap.gid, snap.times, snap.xattrs, stopped)
        except BaseException:
            self.backing.close_fd(dfd)
            raise
        if not ok:
            self.backing.close_fd(dfd)
            if self.abort.is_set():
                raise Aborted()
            return False
        op.dir_fd, op.temp_name = dfd, tmpname
        return True

    def _redo_upload(self, op: Op) -> None:
        """The temporary file of a publish is gone (removed behind acpfs's back, or with its
        directory, or on a backing that was remounted): write it again from the snapshot,
        which is still here. A staged file is reopened by its name, or copied back under it
        from the descriptor this op holds (the journal names it)."""
        snap = op.snap
        assert snap is not None
        log.warning("publish of %r: its temporary file is gone from the backing; writing it again",
                    op.path)
        sp = snap.staged
        if sp is None:
            if op.dir_fd >= 0:
                self.backing.close_fd(op.dir_fd)
                op.dir_fd = -1
                try:   # still there by name if only its descriptor went stale (a remount)
                    with self.cache.position_lock:
                        dfd = self.backing.open_dir(self.cache.backing_path(op.parent))  # type: ignore[arg-type]
                    try:
                        self.backing.remove_temp(dfd, op.temp_name)
                    finally:
                        self.backing.close_fd(dfd)
                except OSError:
                    pass
            if not self._write_upload(op):
                raise Aborted()
            return
        if self._reopen_staged(op, sp):
            return
        # copied complete under a fresh name, then renamed over its own: a copy cut short
        # never stands under the name the journal gives
        fds = self.backing.restage(sp.fd, sp.name, snap.size)
        try:
            self.backing.finish_temp(fds[1], snap.size, snap.mode, snap.uid, snap.gid,
                                     snap.times, snap.xattrs)
        except BaseException:
            for fd in fds:
                self.backing.close_fd(fd)
            raise
        self._swap_staged(op, sp, fds)

    def _writable_staged(self, op: Op, sp: Staged) -> None:
        """Open ``sp`` for writing (it was opened read-only): again by name, or, if it is
        gone from the backing, copied back under its name from the descriptor held. Raises
        while the backing still refuses (the upload is retried, shown in status)."""
        if not self._reopen_staged(op, sp):
            fds = self.backing.restage(sp.fd, sp.name, op.snap.size)  # type: ignore[union-attr]
            self._swap_staged(op, sp, fds)
        sp.read_only = False

    def _reopen_staged(self, op: Op, sp: Staged) -> bool:
        """Open the staged file again by name (its descriptors went stale); False if gone."""
        fds = self.backing.open_staged(sp.name)
        if fds is None:
            return False
        self._swap_staged(op, sp, fds)
        return True

    def _swap_staged(self, op: Op, sp: Staged, fds: tuple[int, int]) -> None:
        with self.lock:
            old = (sp.fd, sp.dir_fd)
            sp.dir_fd, sp.fd = fds
            if not sp.users:          # a reader pinned to the old descriptor closes nothing
                for fd in old:
                    self.backing.close_fd(fd)
        op.dir_fd, op.temp_name = sp.dir_fd, sp.name

    def _apply_publish(self, op: Op) -> None:
        while True:
            with self.lock:
                if op.future is None and op.state == OpState.QUEUED:
                    op.state = OpState.UPLOADING
                    op.future = self.uploads.submit(self._upload, op)
                    self.uploading += 1
                fut = op.future
            if fut is None:
                break  # void before any upload started
            done, _ = cf.wait([fut], timeout=0.05)
            if done:
                break
            with self.lock:
                self._launch()
        uploaded = fut.result() if fut is not None else False   # raises Aborted on abort
        with self.lock:
            void = op.state == OpState.VOID or not uploaded
            if not void:
                op.state = OpState.FINALIZING
        staged = op.snap.staged is not None  # type: ignore[union-attr]
        if void:
            if op.dir_fd >= 0:
                try:
                    self.backing.remove_temp(op.dir_fd, op.temp_name)
                except OSError as e:   # our own leftover: 'acpfs temps' finds it
                    log.warning("%r: cannot remove its temporary file %r (%s)", op.path,
                                os.fsdecode(op.temp_name), describe(e))
                if not staged:
                    self.backing.close_fd(op.dir_fd)
                else:
                    self.backing.remove_staging_dir(op.temp_name)
            op.state = OpState.VOID
            return
        cache = self.cache
        redo = False
        seen = op.node.backing_version   # the version before this one, at every name
        unknown: list[tuple[Comps, bytes]] | None = None   # its names this node does not know

        def run() -> None:
            nonlocal redo, unknown
            if redo:
                self._redo_upload(op)
                redo = False
            with cache.position_lock:
                node = op.node
                comps = cache.backing_path(op.parent)  # type: ignore[arg-type]
                mine = node.position_at(op.parent, op.name) is not None
                self._make_way(op, comps, op.name, node if mine else None)
                if mine and unknown is None:
                    # whatever this node counts: another node may have linked it since
                    unknown = self._unknown_names(op, comps)
                # the directory where the file is now, by path: the one the temporary file
                # was written in may have been moved away meanwhile
                dst = self.backing.open_dir(comps)
                try:
                    # the version as written, taken before the rename (which keeps it): read
                    # at the name after it, it may already be another node's, published
                    # right after ours, and this node would take that for its own
                    version = self.backing.version(op.dir_fd, op.temp_name)
                    self.backing.publish(op.dir_fd, op.temp_name, dst, op.name)
                finally:
                    self.backing.close_fd(dst)
                # its other names still hold the version before, until _publish_links
                first = (op.parent, op.name)
                node.set_positions([first] + [p for p in node.positions()  # type: ignore[list-item]
                                              if p[0] is not first[0] or p[1] != first[1]])
                node.backing_version, node.checked_at = version, time.monotonic()
                node.versions += 1
                if op.links:   # names of it that listings meet later join it (Cache._attach)
                    cache.linked[version[0]] = node

        def repair(exc: BaseException) -> None:
            nonlocal redo
            if isinstance(exc, MissingDir):
                self._restore_dirs(op.parent, exc)  # type: ignore[arg-type]
            elif isinstance(exc, OSError) and not self.backing.temp_exists(op.dir_fd, op.temp_name):
                redo = True

        try:
            self._retry(run, op, "publish of", repair)
        finally:
            if not staged and op.dir_fd >= 0:
                self.backing.close_fd(op.dir_fd)
        if staged:
            self.backing.remove_staging_dir(op.temp_name)
        if op.links:
            self._publish_links(op, seen)
        if unknown:
            self._publish_unknown_names(op, unknown, seen)
        op.state = OpState.DONE

    def _holds(self, node: Node, pos: tuple[Node, bytes]) -> bool:
        """Does the backing hold this node's version at ``pos`` (hold position_lock)? Not when
        another writer replaced it there since: that file is theirs, never moved as ours."""
        st = self.backing.stat_entry(self.cache.backing_path(pos[0]), pos[1])
        return st is not None and statmod.S_ISREG(st.st_mode) and _version(st) == node.backing_version

    def _move_last_copy(self, op: Op, pos: tuple[Node, bytes], keep: tuple[Node, bytes]) -> None:
        """Unlink of the only name the backing has of a file that keeps other names there
        too in the mount (names whose link the backing refused): its copy moves to the name
        it keeps, which is the state the mount has after the unlink; removed, the file would
        be in the mount alone (hold position_lock)."""
        cache = self.cache
        dcomps = cache.backing_path(keep[0])
        self._make_way(op, dcomps, keep[1], None)
        self.backing.rename(cache.backing_path(pos[0]), pos[1], dcomps, keep[1])
        op.node.move_position(pos, keep)

    def _unknown_names(self, op: Op, comps: Comps) -> list[tuple[Comps, bytes]]:
        """Before a new version of a file with several names replaces the one at its first
        name (hold position_lock): the names of it in the backing that this node does not
        know (another node or program linked them in directories this node has not listed
        since), found by their inode in the backing tree. The new version lands under them
        too (``_publish_unknown_names``); a name that cannot be found (outside the backing)
        keeps the version before: the link is split there, a conflict, so that it shows."""
        node = op.node
        st = self.backing.stat_entry(comps, op.name)
        known = node.positions()
        if st is None or not statmod.S_ISREG(st.st_mode) or st.st_nlink <= len(known) \
                or _version(st) != node.backing_version:
            return []
        mine = {(tuple(self.cache.backing_path(d)), name) for d, name in known}
        found = self.backing.find_names(st.st_ino, st.st_nlink - len(known), mine)
        if len(found) + len(known) < st.st_nlink:
            missing = st.st_nlink - len(known) - len(found)
            self.conflicts.note("split", op.path, f"publishes a new version of this file of "
                                f"{len(known) + len(found)} names found",
                                f"the file under {st.st_nlink} names (the others outside the "
                                f"backing directory)", f"the names it cannot reach ({missing}) "
                                "keep the version before: the link is split there")
        return found

    def _publish_unknown_names(self, op: Op, names: list[tuple[Comps, bytes]],
                               seen: tuple[int, int, int] | None) -> None:
        """The new version of a linked file, now under its first name, goes under each of its
        names that this node does not know (``_unknown_names``), one after the other as in
        ``_publish_links``; a name that no longer holds the version before (``seen``) was
        changed by another writer meanwhile and is left to it."""
        cache = self.cache
        todo = list(names)

        def run() -> None:
            with cache.position_lock:
                src = cache.backing_path(op.parent)  # type: ignore[arg-type]
                while todo:
                    dcomps, name = todo[0]
                    st = self.backing.stat_entry(dcomps, name)
                    if st is not None and statmod.S_ISREG(st.st_mode) and _version(st) == seen:
                        self.backing.link(src, op.name, dcomps, name)
                    todo.pop(0)

        self._retry(run, op, "publish of", lambda exc: None)

    def _publish_links(self, op: Op, seen: tuple[int, int, int] | None) -> None:
        """A file with hard links: its new version, now under its first name, goes under each
        other name it had when queued, one name after the other, each in one step (a link
        renamed over the version before, ``seen``). Until the last one, the names still to
        come hold the version before: the one exception to "the backing is a state the
        mount had" (docs/semantics.md, hard links)."""
        cache = self.cache
        first = [(op.parent, op.name)]
        todo = list(op.links or ())

        def run() -> None:
            with cache.position_lock:
                while todo:
                    d, name = todo[0]
                    # the name keeps its position (the version before) until it is replaced
                    self._link(op, first, d, name, seen)  # type: ignore[arg-type]
                    todo.pop(0)

        def repair(exc: BaseException) -> None:
            if todo:
                self._restore_dirs(todo[0][0], exc)
        self._retry(run, op, "publish of", repair)

    def _discard_staged(self, sp: Staged) -> None:
        """Remove the staged file of a file deleted, or never written, before its last
        close (an upload thread; OpLog.discard)."""
        self.backing.remove_temp(sp.dir_fd, sp.name)
        with self.lock:
            sp.close(self.backing.close_fd)
        self.backing.remove_staging_dir(sp.name)


def _version(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


def _kind(node: Node) -> str:
    return "directory" if node.is_dir else "symlink" if node.is_link else \
        "file" if node.is_reg else "special file"
