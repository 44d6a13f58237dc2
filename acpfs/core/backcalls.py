"""Where a lookup's or an open's call to the backing runs: ``BackingCalls``.

A request that must ask the backing (a lookup's lstat, the revalidation at an open, the open
of a backing file the cache does not hold) used to hand the call to a worker thread and wait
for it: a hang of the backing (an NFS server gone) then holds that thread, never the event
loop that serves everything else. The trip costs two thread wakeups: 60 us with both threads
on one CPU, 100-300 us across CPUs of a VM (docs/benchmarks.md, "What one open costs"),
where the call itself, on a local filesystem's cached entry, costs 2-10 us. A checkpoint
load opens each file twice, so a resume paid the trip four times per file.

So where the backing is a local filesystem (``mounttable.local_fstype``: ext4, xfs, btrfs,
tmpfs... and nothing mounted below it) and ``--backing-calls`` is ``auto``, the call runs on
the event loop itself, but only if ``Inodes.position_lock`` is free at that moment: the
flusher holds it while it changes the backing (a rename, a publish, an fsync of a directory),
and the event loop must never wait for that; the call then takes a worker thread as before.
Everything else (NFS, Lustre, FUSE, CIFS, ``--backing-calls threads``) always does.

Owns: the choice (``inline``) and the counts ``status`` shows. Threads: the trio thread.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import trio

T = TypeVar("T")


class BackingCalls:
    def __init__(self, fstype: str | None, lock: threading.RLock) -> None:
        self.fstype = fstype   # the local filesystem's type, or None: worker threads always
        self.lock = lock       # Inodes.position_lock: the calls take it again (reentrant)
        self.inline = 0        # calls made on the event loop
        self.threaded = 0      # calls made in a worker thread

    async def run(self, fn: Callable[..., T], *args: object,
                  limiter: trio.CapacityLimiter | None = None, abandon_on_cancel: bool = False) -> T:
        """``fn(*args)``: on the event loop where the backing is local and the lock is free,
        else in a worker thread (``limiter`` and ``abandon_on_cancel`` as for
        ``trio.to_thread.run_sync``). Always a cancellation point."""
        if self.fstype is not None:
            await trio.lowlevel.checkpoint_if_cancelled()
            done, got = self._now(fn, args)
            if done:
                return got   # type: ignore[return-value]
        self.threaded += 1
        return await trio.to_thread.run_sync(fn, *args, limiter=limiter,
                                             abandon_on_cancel=abandon_on_cancel)

    def run_now(self, fn: Callable[..., T], *args: object) -> T | None:
        """``fn(*args)`` on the event loop where ``run`` would run it there, without a
        checkpoint (for a request answered at once: ``core.opennow``); None, and ``fn`` not
        called, where ``run`` would take a worker thread."""
        return self.try_now(fn, *args)[1]

    def try_now(self, fn: Callable[..., T], *args: object) -> tuple[bool, T | None]:
        """As ``run_now``, for an ``fn`` that may return None: (True, what it returned), or
        (False, None) where it was not called."""
        return self._now(fn, args) if self.fstype is not None else (False, None)

    def _now(self, fn: Callable[..., T], args: tuple) -> tuple[bool, T | None]:
        if not self.lock.acquire(blocking=False):
            return False, None
        try:
            self.inline += 1
            return True, fn(*args)
        finally:
            self.lock.release()

    def status(self) -> dict:
        return {"where": "inline" if self.fstype is not None else "threads",
                "fstype": self.fstype, "inline": self.inline, "threaded": self.threaded}
