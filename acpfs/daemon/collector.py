"""The interpreter's cycle collector, kept out of the way of requests: ``Collector``.

Owns the ``gc`` module's settings in the daemon and when its full collections run, and
counts what every collection cost (``status``: the status document's ``collector``).

Why: CPython's cycle collector stops the interpreter while it runs, so every request waits
for it, and a full collection (generation 2) walks every object the daemon tracks: each
cached file's node, its memory file, its journal state. With 60,000 small files created
(in process, docs/benchmarks.md, "The cycle collector"), six full collections took 770 ms
in all and the longest 222-300 ms, during which no request was answered; they come rarer but
longer as the cache grows, and a request that meets one waits for all of it.

What:
- Young collections (generations 0 and 1) stay automatic: each walks only objects made
  since the last, and takes a few ms at most.
- Full collections never start on their own (their threshold is out of reach). ``tick``
  runs one once young collections have moved objects into the old generation since the
  last full one (``gc.get_count()[2]``: collections of generation 1 since) and the mount
  has been quiet for QUIET_S (no request reached Python or the extension), at most every
  MIN_GAP_S; or, where requests never stop, once FORCE_S have passed since the last full
  collection or FORCE_PENDING collections of generation 1 happened since (each follows
  about 7,000 objects made and kept), so that garbage in cycles cannot grow without bound.
- At start (``start``) a full collection runs and what survives it is frozen
  (``gc.freeze``): the modules, the mount's setup and what recovery loaded; later full
  collections skip them (a cycle among them that became garbage later stays: bounded by
  what there was at mount).

Threads: ``tick`` and ``start`` on the trio thread; the callback ``gc`` calls runs on
whichever thread triggered a collection, with the GIL held (which is all that guards its
counters).
"""

from __future__ import annotations

import gc
import time
from typing import Callable

QUIET_S = 1.0      # no request for this long: a full collection delays none
MIN_GAP_S = 10.0   # between full collections run when quiet
FORCE_S = 600.0    # a full collection at least this often, quiet or not, where one is due
FORCE_PENDING = 500   # ... or once this many collections of generation 1 happened since
CHECK_S = 0.25     # how often the trio task looks while one is due
NEVER = 1 << 30    # a threshold young collections never reach


class Collector:
    def __init__(self, activity: Callable[[], object],
                 now: Callable[[], float] = time.monotonic) -> None:
        # anything that changes whenever a request arrives (Daemon: Python's request counts
        # and the extension's stamp of the last request it dispatched)
        self.activity = activity
        self.now = now
        self._seen: object = None
        self._changed = now()          # when ``activity`` last changed, as ``tick`` saw it
        self._last_full = now()
        self._began = 0.0              # perf_counter() when the running collection began
        self.full = 0                  # full collections (generation 2), any trigger
        self.full_s = 0.0
        self.longest_full_s = 0.0
        self.young = 0                 # collections of generations 0 and 1
        self.young_s = 0.0
        self.longest_young_s = 0.0
        self.forced = 0                # full collections run while requests kept coming
        self.on = False                # (start .. stop) full collections are ours
        self._threshold2 = 10          # the interpreter's, put back by ``stop``

    def start(self) -> None:
        """Once the mount is set up: collect, freeze the survivors, and take full
        collections over from the interpreter."""
        gc.callbacks.append(self._timed)
        gc.collect()
        gc.freeze()
        young0, young1, self._threshold2 = gc.get_threshold()
        gc.set_threshold(young0, young1, NEVER)
        self._last_full = self.now()
        self.on = True

    def stop(self) -> None:
        """Hand full collections back to the interpreter (the daemon is done serving)."""
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)
        if self.on:
            young0, young1, _ = gc.get_threshold()
            gc.set_threshold(young0, young1, self._threshold2)
        self.on = False

    def tick(self) -> bool:
        """A full collection where one is due (see the module's docstring); whether it ran."""
        now = self.now()
        seen = self.activity()
        if seen != self._seen:
            self._seen, self._changed = seen, now
        pending = gc.get_count()[2]
        if not pending:
            return False   # nothing moved into the old generation since the last one
        quiet = now - self._changed >= QUIET_S
        since = now - self._last_full
        if (quiet and since >= MIN_GAP_S) or since >= FORCE_S or pending >= FORCE_PENDING:
            gc.collect()
            if gc.get_count()[2]:
                return False   # another thread's collection was running: none was made
            if not quiet:
                self.forced += 1
            self._last_full = self.now()
            return True
        return False

    async def run(self) -> None:
        """The trio task: ``tick`` every CHECK_S while a full collection is due, else every
        QUIET_S (an idle daemon is woken no more often than that for it)."""
        import trio
        while True:
            await trio.sleep(CHECK_S if gc.get_count()[2] else QUIET_S)
            self.tick()

    def _timed(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        if info.get("generation") == 2:
            self.full += 1
            self.full_s += took
            self.longest_full_s = max(self.longest_full_s, took)
        else:
            self.young += 1
            self.young_s += took
            self.longest_young_s = max(self.longest_young_s, took)

    def status(self) -> dict:
        return {"on": self.on, "full": self.full, "full_s": round(self.full_s, 4),
                "longest_full_s": round(self.longest_full_s, 4), "forced": self.forced,
                "last_full_ago_s": round(self.now() - self._last_full, 1),
                "pending": gc.get_count()[2], "young": self.young,
                "young_s": round(self.young_s, 4),
                "longest_young_s": round(self.longest_young_s, 4),
                "frozen": gc.get_freeze_count()}
