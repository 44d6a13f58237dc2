"""The one retry helper: capped exponential backoff with jitter and classified errors.

Every operation on the backing store goes through ``retry``. Errors that another attempt
can cure (the store is full, read-only for a while, down, hung, out of quota) are retried
forever with a delay doubling from ``first`` up to ``cap``; errors that no retry can cure
(the name is gone or invalid) are raised at once. The log level escalates: the first
failure is a warning, failures after ``ERROR_AFTER`` attempts are errors, and recovery is
logged too, so an operator sees when and why the backing store stopped and came back.
"""

from __future__ import annotations

import errno
import logging
import random
import threading
import time
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors worth another attempt: the backing store may come back, get space, be remounted rw.
RETRYABLE = frozenset({
    errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
    errno.ETIMEDOUT, errno.ESTALE, errno.EAGAIN, errno.EBUSY, errno.ENOTCONN,
    errno.ECONNRESET, errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETDOWN,
    errno.ENETUNREACH, errno.ENOMEM, errno.EINTR, errno.ENXIO, errno.ENODEV,
})
ERROR_AFTER = 5


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in RETRYABLE


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


def retry(fn: Callable[[], T], what: str, *,
          on_failure: Callable[[BaseException, int, float], None] | None = None,
          on_success: Callable[[], None] | None = None,
          stop: threading.Event | None = None,
          retryable: Callable[[BaseException], bool] = is_retryable,
          first: float = 0.1, cap: float = 30.0) -> T:
    """Call ``fn`` until it succeeds or raises a non-retryable error.

    ``retryable(exc)`` classifies errors (default: ``is_retryable``).
    ``on_failure(exc, attempt, delay)`` is told of each failure before the wait (to show it
    in ``status``); ``on_success`` after a success that followed failures. If ``stop`` is
    set during a wait, the last error is raised.
    """
    attempt = 0
    delay = first
    while True:
        try:
            result = fn()
        except Exception as exc:
            if not retryable(exc):
                raise
            attempt += 1
            wait = min(cap, delay) * random.uniform(0.5, 1.0)
            level = logging.WARNING if attempt < ERROR_AFTER else logging.ERROR
            if attempt == 1 or attempt % ERROR_AFTER == 0:
                log.log(level, "%s failed (%s), attempt %d; retrying in %.1fs", what, describe(exc),
                        attempt, wait)
            if on_failure:
                on_failure(exc, attempt, wait)
            if stop is not None:
                if stop.wait(wait):
                    raise
            else:
                time.sleep(wait)
            delay = min(cap, delay * 2)
            continue
        if attempt and on_success:
            on_success()
        if attempt:
            log.warning("%s succeeded after %d failed attempts", what, attempt)
        return result
