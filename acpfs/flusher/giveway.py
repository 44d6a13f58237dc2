"""The flusher gives way to requests: ``GiveWay``.

Owns: when the last request answered in Python arrived (``arrived``: written by the trio
thread, read by the flusher's threads; the extension stamps every request it dispatches,
those answered in C too, and ``below`` reads that stamp), the highest op someone waits for (``wanted``), and
the time given way in the current second and which waiting thread watches the clock
(under its own lock, which nests inside nothing: the callables given to it are never
called with it held).

Why: the flusher's threads and the event loop that answers requests share one interpreter.
On a small machine a burst of created files (a checkpoint of many shards, an unpacked
dataset, a git checkout) ran at a quarter of what the requests alone allow, because every
file's upload and publish (about 1.4 ms of Python and system calls, docs/benchmarks.md,
"What a created file costs while the flusher works") took the interpreter from the request
that came next. So before each upload and each op it applies, a flusher thread waits while
requests are arriving (one arrived within QUIET_S), as Linux's writeback waits before it
writes dirty pages back, and persists in the gaps.

Bounds, so that persisting never stalls: the flusher gives way for at most SHARE of each
WINDOW_S second (counted while any of its threads waits), and never while someone waits for
it (an fsync, ``acpfs sync`` or ``acpfs umount``, which read ``user.acpfs.seq`` first: until
the ops queued when they asked are applied), while the cache is short of room (writers would wait
for the flusher: less than a quarter of the cache free), while it is stopping, or where
nothing arrives.
docs/design.md, "The flusher gives way to requests".

How threads wait: one of them (the watcher) looks at the clock every STEP_S; the others
sleep until it or ``waited_for`` wakes them (or WAKE_S at the latest). A thread that wakes
takes the interpreter from the request loop, and on a VM across vCPUs, so five threads
(the uploads and the sequencer) looking every millisecond cost a burst of creates a fifth of
its speed (docs/benchmarks.md, "The flusher gives way", "One thread watches the clock").
"""

from __future__ import annotations

import threading
import time
from typing import Callable

QUIET_S = 0.002     # a request arrived this recently: programs are at work
WINDOW_S = 1.0      # of each second, at most SHARE is given way
SHARE = 0.9         # docs/benchmarks.md, "The flusher gives way": 0.5 and 0.9 measured
STEP_S = 0.005      # the watcher looks again this often
WAKE_S = 0.05       # the others at the latest (the watcher wakes them when it goes)


class GiveWay:
    def __init__(self, pressed: Callable[[], bool], stopping: Callable[[], bool],
                 applied: Callable[[], int], below: Callable[[], float] = lambda: 0.0) -> None:
        self.pressed = pressed     # the cache is short of room: never give way
        self.stopping = stopping   # the flusher stops: never give way
        self.applied = applied     # the op log's applied_seq
        # time.monotonic() of the last request as the C extension dispatched it (those it
        # answers without Python too: GETATTR, GETXATTR; fastwrite.last_request)
        self.below = below
        self.arrived = 0.0         # time.monotonic() of the last request (the trio thread)
        self.wanted = 0            # (_lock to write) the highest op seq someone waits for
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)   # waiting threads sleep on it
        self._watching = False     # (_lock) a waiting thread watches the clock
        self._window = 0.0         # (_lock) when the current second began
        self._spent = 0.0          # (_lock) seconds of it given way, up to _since
        self._waiting = 0          # (_lock) threads waiting now
        self._since = 0.0          # (_lock) since then at least one has waited
        self.waits = 0             # (_lock) for status: threads that waited
        self.given_s = 0.0         # (_lock) seconds during which at least one waited

    def request(self) -> None:
        """The trio thread, as a request arrives."""
        self.arrived = time.monotonic()

    def waited_for(self, seq: int) -> None:
        """Someone waits until op ``seq`` is applied: no giving way until it is."""
        if seq > self.wanted:
            with self._lock:
                self.wanted = max(self.wanted, seq)
                self._cond.notify_all()   # they stop giving way now, not at their next look

    def _busy(self, now: float) -> bool:
        return (now - max(self.arrived, self.below()) <= QUIET_S and self.applied() >= self.wanted
                and not self.pressed() and not self.stopping())

    def _roll(self, now: float) -> float:
        """(hold _lock) Count the time given way up to ``now``; a new second starts afresh.
        Returns the seconds given way in this second."""
        if self._waiting:
            self._spent += now - self._since
            self.given_s += now - self._since
            self._since = now
        if now - self._window >= WINDOW_S:
            self._window, self._spent = now, 0.0
        return self._spent

    def _used_up(self, now: float) -> bool:
        with self._lock:
            return self._roll(now) >= SHARE * WINDOW_S

    def wait(self) -> None:
        """A flusher thread, before an upload or an op: wait while requests arrive, within
        the bounds above."""
        now = time.monotonic()
        if not self._busy(now) or self._used_up(now):
            return
        with self._lock:
            self._waiting += 1
            if self._waiting == 1:
                self._since = now
            self.waits += 1
        try:
            while True:
                self._sleep()
                now = time.monotonic()
                if not self._busy(now) or self._used_up(now):
                    with self._lock:
                        self._cond.notify_all()   # the others look too, now
                    return
        finally:
            with self._lock:
                self._roll(time.monotonic())
                self._waiting -= 1

    def _sleep(self) -> None:
        """One step of a wait (the GIL is free meanwhile): STEP_S for the watcher, until
        woken for the others."""
        with self._lock:
            watcher = not self._watching
            if watcher:
                self._watching = True
            try:
                self._cond.wait(STEP_S if watcher else WAKE_S)
            finally:
                if watcher:
                    self._watching = False

    def status(self) -> dict:
        with self._lock:
            self._roll(time.monotonic())
            return {"waits": self.waits, "given_s": round(self.given_s, 3)}
