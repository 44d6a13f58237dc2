"""Applying one op to the backing until it succeeds (``Attempts.until_done``).

The flusher never gives up on an op: skipping one would break the order and lose data. So
every backing call of an op is retried through ``retry.retry`` for as long as it fails; the
op keeps its place, and its last failure shows in ``status`` (``Op.error``, ``attempts``,
``next_retry``). Between two attempts a repair redoes what the failure showed is missing
(a directory, a temporary file), so that an error retrying alone cannot cure does not spin,
and ``meanwhile`` lets later uploads go on. Only a stop without draining ends the attempts
(``Aborted``).

Owns the counters of failures since mount (``failed_calls``: calls of an op that failed at
least once; ``retries``: failed attempts, each followed by another), guarded by the op
log's lock: ``status`` (``errors_since_mount``) and the metrics read them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

from ..errors import Aborted
from ..backing.backing import STALE, Backing
from ..oplog.ops import Op
from ..backing.retry import describe, retry

log = logging.getLogger(__name__)
T = TypeVar("T")


def _always(exc: BaseException) -> bool:
    return isinstance(exc, OSError)


class Attempts:
    def __init__(self, backing: Backing, lock: threading.Condition, abort: threading.Event,
                 meanwhile: Callable[[], None]) -> None:
        self.backing = backing
        self.lock = lock
        self.abort = abort            # set: stop without draining
        self.meanwhile = meanwhile    # called with lock held after each failure
        self.failed_calls = 0         # (lock) calls that failed at least once
        self.retries = 0              # (lock) failed attempts, each retried

    def status(self) -> dict[str, int]:
        """Failures since the mount: calls that failed at least once, attempts retried."""
        with self.lock:
            return {"calls": self.failed_calls, "retries": self.retries}

    def until_done(self, fn: Callable[[], T], op: Op, what: str,
                   repair: Callable[[BaseException], None] | None = None) -> T:
        """``fn()`` until it succeeds; ``repair(exc)`` before the next attempt."""
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
                self.failed_calls += attempt == 1
                self.retries += 1
                self.meanwhile()

        def recovered() -> None:
            op.error = None

        try:
            return retry(fn, f"{what} {op.path!r}", on_failure=failed, on_success=recovered,
                         stop=self.abort, retryable=_always)
        except OSError:
            if self.abort.is_set():
                raise Aborted() from None
            raise
