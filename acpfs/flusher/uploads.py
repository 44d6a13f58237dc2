"""Uploads: the temporary files of publishes, written by a pool of threads ahead of the
sequencer (docs/design.md, data flow).

Owns the upload threads and the count of uploads running (``running``, under the op log's
lock). ``start`` hands a queued publish to a thread, which writes its snapshot to a
temporary file next to its final name (``upload``; a staged file, already in the backing,
is finished in place); the sequencer renames it over the name when it reaches the op
(``Publisher``). The same threads remove staged files no op publishes (``discard_staged``).

Invariant: an upload cut short by an abort raises ``Aborted``, never returns False. False
means the op went void, and the sequencer records a void op as applied.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading

from ..errors import Aborted
from .attempts import Attempts
from .giveway import GiveWay
from ..backing.backing import STALE, Backing
from ..cache.cache import Cache
from ..oplog.ops import Publish
from .repairs import Repairs
from ..node import OpState, Staged

log = logging.getLogger(__name__)


class Uploads:
    def __init__(self, cache: Cache, backing: Backing, lock: threading.Condition,
                 abort: threading.Event, attempts: Attempts, repairs: Repairs, workers: int,
                 give_way: GiveWay) -> None:
        self.cache = cache
        self.backing = backing
        self.lock = lock
        self.abort = abort
        self.attempts = attempts
        self.repairs = repairs
        self.give_way = give_way   # waited for before each upload
        self.threads = cf.ThreadPoolExecutor(workers, thread_name_prefix="acpfs-upload")
        self.running = 0   # (lock) uploads handed to a thread and not finished

    def start(self, op: Publish) -> None:
        """Hand ``op``'s upload to a thread (hold lock)."""
        op.state = OpState.UPLOADING
        op.future = self.threads.submit(self.upload, op)
        self.running += 1

    def discard(self, sp: Staged) -> None:
        self.threads.submit(self.discard_staged, sp)

    def shutdown(self, wait: bool) -> None:
        self.threads.shutdown(wait=wait, cancel_futures=True)

    def upload(self, op: Publish) -> bool:
        """An upload thread: write the snapshot to a temporary file next to its final name."""
        def repair(exc: BaseException) -> None:
            sp = op.snap.staged
            if sp is not None and isinstance(exc, OSError) and exc.errno in STALE:
                self.reopen_staged(op, sp)    # a remounted backing: the same file, by name
            else:
                self.repairs.restore_dirs(op.parent, exc)
        try:
            self.give_way.wait()
            return self.attempts.until_done(lambda: self.write(op), op, "upload of", repair)
        finally:
            with self.lock:
                self.running -= 1
                self.lock.notify_all()

    def write(self, op: Publish) -> bool:
        """One attempt at the temporary file of a publish; False if the op went void (or
        the daemon is stopping) meanwhile."""
        cache = self.cache
        snap = op.snap

        def stopped() -> bool:
            return op.state == OpState.VOID or self.abort.is_set()

        # Invariant (module docstring): cut short by an abort, Aborted, never False
        if self.abort.is_set():
            raise Aborted()
        if stopped():
            return False
        if snap.staged is not None:  # already in the backing: finish it in place
            if snap.staged.read_only:   # as a recovery over a read-only backing opened it
                self.writable_staged(op, snap.staged)
            self.backing.finish_temp(snap.staged.fd, snap.size, snap.mode, snap.uid, snap.gid,
                                     snap.times, snap.xattrs)
            return True
        with cache.inodes.position_lock:
            dfd = self.backing.open_dir(cache.inodes.backing_path(op.parent))
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

    def redo(self, op: Publish) -> None:
        """The temporary file of a publish is gone (removed behind acpfs's back, or with its
        directory, or on a backing that was remounted): write it again from the snapshot,
        which is still here. A staged file is reopened by its name, or copied back under it
        from the descriptor this op holds (the journal names it)."""
        snap = op.snap
        log.warning("publish of %r: its temporary file is gone from the backing; writing it again",
                    op.path)
        sp = snap.staged
        if sp is None:
            if op.dir_fd >= 0:
                self.backing.close_fd(op.dir_fd)
                op.dir_fd = -1
                try:   # still there by name if only its descriptor went stale (a remount)
                    with self.cache.inodes.position_lock:
                        dfd = self.backing.open_dir(self.cache.inodes.backing_path(op.parent))
                    try:
                        self.backing.remove_temp(dfd, op.temp_name)
                    finally:
                        self.backing.close_fd(dfd)
                except OSError:
                    pass
            if not self.write(op):
                raise Aborted()
            return
        if self.reopen_staged(op, sp):
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
        self.swap_staged(op, sp, fds)

    def writable_staged(self, op: Publish, sp: Staged) -> None:
        """Open ``sp`` for writing (it was opened read-only): again by name, or, if it is
        gone from the backing, copied back under its name from the descriptor held. Raises
        while the backing still refuses (the upload is retried, shown in status)."""
        if not self.reopen_staged(op, sp):
            fds = self.backing.restage(sp.fd, sp.name, op.snap.size)
            self.swap_staged(op, sp, fds)
        sp.read_only = False

    def reopen_staged(self, op: Publish, sp: Staged) -> bool:
        """Open the staged file again by name (its descriptors went stale); False if gone."""
        fds = self.backing.open_staged(sp.name)
        if fds is None:
            return False
        self.swap_staged(op, sp, fds)
        return True

    def swap_staged(self, op: Publish, sp: Staged, fds: tuple[int, int]) -> None:
        with self.lock:
            old = (sp.fd, sp.dir_fd)
            sp.dir_fd, sp.fd = fds
            if not sp.users:          # a reader pinned to the old descriptor closes nothing
                for fd in old:
                    self.backing.close_fd(fd)
        op.dir_fd, op.temp_name = sp.dir_fd, sp.name

    def discard_staged(self, sp: Staged) -> None:
        """Remove the staged file of a file deleted, or never written, before its last
        close (an upload thread; OpLog.discard)."""
        self.backing.remove_temp(sp.dir_fd, sp.name)
        with self.lock:
            sp.close(self.backing.close_fd)
        self.backing.remove_staging_dir(sp.name)
