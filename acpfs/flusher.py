"""The flusher: replays the mount's mutations onto the backing directory, in order.

One sequencer thread takes ``Op``s strictly in the order ``Cache`` queued them and applies
each to the backing; a pool of upload workers writes file snapshots to temporary files
ahead of the sequencer, in parallel. A snapshot only becomes visible when the sequencer
reaches its op and renames the temporary file over the final name.

Ordering invariant (contract 4): an op is applied only after every op queued before it has
been applied; ``applied_seq`` is the seq of the last applied op, so the backing always
shows a prefix of the mount's history (less uploads cancelled because their file was
deleted or replaced before it was persisted).

Op states: queued -> uploading -> finalizing -> done, or queued/uploading -> void when the
file leaves the namespace first (``Cache._cancel``). A void op's upload stops early and
its temporary file is removed before the sequencer moves past it. Failing backing calls
are retried forever through ``retry.retry``; the op keeps its place and ``status`` shows
the error, so nothing queued after it can overtake it and nothing is ever dropped.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from .backing import TEMP_PREFIX, Backing, iter_extents
from .retry import describe, retry

if TYPE_CHECKING:
    from .cache import Cache, Node, Snapshot

log = logging.getLogger(__name__)


class Aborted(Exception):
    """The daemon was told to stop without draining."""


class Op:
    __slots__ = ("seq", "kind", "node", "parent", "name", "replaced", "src", "snap", "attrs",
                 "path", "state", "future", "dfd", "tmpname", "error", "attempts", "next_retry",
                 "since", "nbytes")

    def __init__(self, seq: int, kind: str, node: Node, *, path: str, parent: Node | None = None,
                 name: bytes = b"", replaced: Node | None = None, src: Node | None = None,
                 snap: Snapshot | None = None, attrs: Any = None) -> None:
        self.seq = seq
        self.kind = kind
        self.node = node
        self.parent = parent
        self.name = name
        self.replaced = replaced
        self.src = src
        self.snap = snap
        self.attrs = attrs
        self.path = path
        self.state = "queued"
        self.future: cf.Future | None = None
        self.dfd = -1
        self.tmpname = b""
        self.error: str | None = None
        self.attempts = 0
        self.next_retry = 0.0
        self.since = time.time()
        self.nbytes = snap.size if snap is not None else 0


def _always(exc: BaseException) -> bool:
    # The flusher never gives up on an op: skipping one would break the order and lose data.
    return isinstance(exc, OSError)


class Flusher:
    def __init__(self, cache: Cache, backing: Backing, workers: int = 4) -> None:
        self.cache = cache
        self.backing = backing
        self.workers = max(1, workers)
        self.window = 4 * self.workers
        self.cond = threading.Condition(cache.lock)
        self.queue: collections.deque[Op] = collections.deque()
        self.applied_seq = 0
        self.abort = threading.Event()
        self._stopping = False
        self.pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="acpfs-upload")
        self.thread = threading.Thread(target=self._run, name="acpfs-sequencer", daemon=True)
        # counters for status (guarded by cond/lock)
        self.queued_bytes = 0
        self.persisted_files = 0
        self.persisted_bytes = 0
        self.uploading = 0
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self.journal_error: str | None = None

    def start(self) -> None:
        self.thread.start()

    # -- called from the FUSE thread ----------------------------------------------------
    def submit(self, op: Op, record: tuple | None = None) -> None:
        with self.cond:
            if record is not None:
                self._journal(record)
            self.queue.append(op)
            if op.kind == "publish":
                op.node.ops.append(op)
                self.queued_bytes += op.nbytes
                sp = op.snap.spill  # type: ignore[union-attr]
                if sp is not None:
                    op.dfd, op.tmpname = sp.dfd, sp.tmpname
            self.cond.notify_all()

    def journal_append(self, record: tuple) -> None:
        with self.cond:
            self._journal(record)

    def _journal(self, record: tuple) -> None:
        """Append to the journal (hold cond). A journal that cannot be written means a crash
        would lose acknowledged data: say so loudly, and keep serving."""
        journal = self.cache.journal
        if journal is None:
            return
        try:
            if journal.reset_wanted and not self.queue:
                journal.reset()
                for rec in self.cache.live_file_records():
                    journal.append(rec)
            journal.reset_wanted = False
            journal.append(record)
            self.journal_error = None
        except OSError as e:
            if self.journal_error is None:
                log.error("cannot write the journal %s (%s): changes are still persisted, but a "
                          "daemon crash now would lose the ones not yet in the backing",
                          journal.path, e)
            self.journal_error = str(e)

    def stop(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Stop the sequencer; with ``drain``, after the queue is empty. True if drained."""
        with self.cond:
            self._stopping = True
            if not drain:
                self.abort.set()
            self.cond.notify_all()
        self.thread.join(timeout)
        if self.thread.is_alive():
            return False
        self.pool.shutdown(wait=not self.abort.is_set(), cancel_futures=True)
        return not self.queue

    def failing_op(self) -> Op | None:
        with self.cond:
            for op in itertools.islice(self.queue, 0, self.window):
                if op.error:
                    return op
        return None

    def rate(self) -> float:
        """Bytes per second persisted over the last 10 seconds."""
        cutoff = time.time() - 10
        with self.cond:
            while self._rate and self._rate[0][0] < cutoff:
                self._rate.popleft()
            return sum(n for _, n in self._rate) / 10.0

    # -- the sequencer thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self._stopping:
                        self.cond.wait()
                    if not self.queue or self.abort.is_set():
                        return
                    self._launch()
                    op = self.queue[0]
                self._apply(op)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("%s %s: %s (seq %d)", op.kind, op.path, op.state, op.seq)
                with self.cond:
                    self.queue.popleft()
                    journal = self.cache.journal
                    if journal is not None:
                        # before _finish drops the block references (journal.py, invariants)
                        journal.applied(op.seq)
                        if not self.queue:
                            journal.reset_wanted = True   # done by the next append
                    self._finish(op)
                    # Invariant: applied_seq moves only after _finish. Waiters read it without
                    # the lock (FS.wait_seq, from the trio thread) and then rely on the op's
                    # bookkeeping being done: a published spill detached from its node, the
                    # node evictable. Set before _finish, a writer opening the file in that
                    # window kept the handed spill, which _finish then took away.
                    self.applied_seq = op.seq
                    self.cond.notify_all()
        except Aborted:
            log.warning("flusher stopped without draining: %d operations left", len(self.queue))
        except BaseException:
            log.exception("flusher crashed; changes are no longer persisted")
            raise

    def _launch(self) -> None:
        """Start uploads of queued snapshots whose directory exists in the backing (hold cond)."""
        running = self.uploading
        for op in itertools.islice(self.queue, 0, self.window):
            if running >= 2 * self.workers:
                break
            if op.kind == "publish" and op.state == "queued" and op.future is None \
                    and self.cache.present(op.parent):  # type: ignore[arg-type]
                op.state = "uploading"
                op.future = self.pool.submit(self._upload, op)
                self.uploading += 1
                running += 1

    def _finish(self, op: Op) -> None:
        """Bookkeeping after an op left the queue (hold cond)."""
        if op.kind != "publish":
            return
        node = op.node
        node.ops.remove(op)
        self.queued_bytes -= op.nbytes
        self.cache.pool.decref(op.snap.blocks)  # type: ignore[union-attr]
        sp = op.snap.spill  # type: ignore[union-attr]
        if sp is not None:
            if node.spill is sp:
                node.spill = None
            sp.close()
        if op.state == "done":
            self.persisted_files += 1
            self.persisted_bytes += op.nbytes
            self._rate.append((time.time(), op.nbytes))
            if self.cache._evictable(node):
                self.cache.lru[node.ino] = node

    def _retry(self, fn, op: Op, what: str):
        def failed(exc: BaseException, attempt: int, delay: float) -> None:
            op.error = describe(exc)
            op.attempts = attempt
            op.next_retry = time.time() + delay

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
        if op.kind == "publish":
            self._apply_publish(op)
            return
        cache, backing = self.cache, self.backing
        node = op.node

        def run() -> None:
            with cache.bpos_lock:
                kind = op.kind
                if kind == "mkdir" or kind == "symlink":
                    comps = cache.bpath(op.parent)  # type: ignore[arg-type]
                    if kind == "mkdir":
                        backing.mkdir(comps, op.name, node.mode, node.uid, node.gid)
                    else:
                        backing.symlink(comps, op.name, node.target, node.uid, node.gid)
                    node.bparent, node.bname = op.parent, op.name
                elif kind in ("unlink", "rmdir"):
                    if node.bparent is not None:
                        backing.unlink(cache.bpath(node.bparent), node.bname, kind == "rmdir")
                        node.bparent = None
                elif kind == "rename":
                    self._rename(op)
                elif kind == "setattr":
                    if node.bparent is not None and not node.bstale:
                        mode, uid, gid, times = op.attrs
                        backing.setattr(cache.bpath(node.bparent), node.bname, node.is_link,
                                        mode, uid, gid, times)
                elif kind == "xattr":
                    if node is cache.root:
                        backing.set_xattr([], b".", *op.attrs)
                    elif node.bparent is not None and not node.bstale:
                        backing.set_xattr(cache.bpath(node.bparent), node.bname, *op.attrs)
                else:
                    raise AssertionError(f"unknown op {kind}")

        self._retry(run, op, op.kind)
        op.state = "done"

    def _rename(self, op: Op) -> None:
        """Apply a rename (hold bpos_lock). See docs/design.md, 'renames of unsaved files'."""
        cache = self.cache
        node, dst, name, replaced = op.node, op.parent, op.name, op.replaced
        if node.bparent is not None and node.bstale:
            # Old bytes of another file stand under this node's name; they must not travel to
            # a name that never held them. Drop them; the node's own snapshot comes later.
            self.backing.unlink(cache.bpath(node.bparent), node.bname, False)
            node.bparent, node.bstale = None, False
            if replaced is not None and replaced.bparent is dst and replaced.bname == name:
                node.bparent, node.bname, node.bstale = dst, name, True
                replaced.bparent = None
        elif node.bparent is not None:
            self.backing.rename(cache.bpath(node.bparent), node.bname, cache.bpath(dst), name)
            node.bparent, node.bname = dst, name
            if replaced is not None and replaced.bparent is dst and replaced.bname == name:
                replaced.bparent = None
        elif replaced is not None and replaced.bparent is dst and replaced.bname == name:
            # The file was never saved: the replaced file's old bytes stay under the name
            # until this one's first snapshot lands over them (never a gap, never torn).
            node.bparent, node.bname, node.bstale = dst, name, True
            replaced.bparent = None

    # -- uploads ------------------------------------------------------------------------
    def _upload(self, op: Op) -> bool:
        """Worker thread: write the snapshot to a temporary file next to its final name."""
        cache = self.cache
        try:
            snap = op.snap
            assert snap is not None
            tmpname = TEMP_PREFIX + f"{op.node.ino}-{op.seq}".encode()

            def stopped() -> bool:
                return op.state == "void" or self.abort.is_set()

            def attempt() -> bool:
                if stopped():
                    return False
                if snap.spill is not None:  # already in the backing: finish it in place
                    self.backing.finish_temp(snap.spill.fd, snap.size, snap.mode, snap.uid, snap.gid,
                                             snap.times, snap.xattrs)
                    return True
                with cache.bpos_lock:
                    dfd = self.backing.open_dir(cache.bpath(op.parent))  # type: ignore[arg-type]
                try:
                    ok = self.backing.write_temp(
                        dfd, tmpname, iter_extents(snap.blocks, snap.size, cache.bs), cache.pool.fd,
                        snap.size, snap.mode, snap.uid, snap.gid, snap.times, snap.xattrs, stopped)
                except BaseException:
                    os.close(dfd)
                    raise
                if not ok:
                    os.close(dfd)
                    return False
                op.dfd, op.tmpname = dfd, tmpname
                return True

            return self._retry(attempt, op, "upload of")
        finally:
            with self.cond:
                self.uploading -= 1
                self.cond.notify_all()

    def _apply_publish(self, op: Op) -> None:
        while True:
            with self.cond:
                if op.future is None and op.state == "queued":
                    op.state = "uploading"
                    op.future = self.pool.submit(self._upload, op)
                    self.uploading += 1
                fut = op.future
            if fut is None:
                break  # void before any upload started
            done, _ = cf.wait([fut], timeout=0.05)
            if done:
                break
            with self.cond:
                self._launch()
        uploaded = fut.result() if fut is not None else False   # raises Aborted on abort
        with self.cond:
            void = op.state == "void" or not uploaded
            if not void:
                op.state = "finalizing"
        spilled = op.snap.spill is not None  # type: ignore[union-attr]
        if void:
            if op.dfd >= 0:
                self.backing.remove_temp(op.dfd, op.tmpname)
                if not spilled:
                    os.close(op.dfd)
                else:
                    self.backing.remove_spill_dir()
            op.state = "void"
            return
        cache = self.cache

        def run() -> None:
            with cache.bpos_lock:
                # a spill file sits where the file was when it spilled; move it to where it is now
                dst = self.backing.open_dir(cache.bpath(op.parent)) if spilled else op.dfd  # type: ignore[arg-type]
                try:
                    self.backing.publish(op.dfd, op.tmpname, dst, op.name)
                finally:
                    if dst != op.dfd:
                        os.close(dst)
                node = op.node
                node.bparent, node.bname, node.bstale = op.parent, op.name, False
                node.bgen += 1

        try:
            self._retry(run, op, "publish of")
        finally:
            if not spilled:
                os.close(op.dfd)
        if spilled:
            self.backing.remove_spill_dir()
        op.state = "done"

    def discard_spill(self, sp) -> None:
        """Remove the spill file of a file deleted before its last close (in a worker)."""
        def run() -> None:
            self.backing.remove_temp(sp.dfd, sp.tmpname)
            with self.cond:
                sp.close()
            self.backing.remove_spill_dir()
        self.pool.submit(run)
