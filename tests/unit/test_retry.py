"""The retry helper: which errors are retried, the callbacks, the stop event, the backoff."""

from __future__ import annotations

import errno
import logging
import threading
import time

import pytest

from acpfs.backing.retry import ERROR_AFTER, RETRYABLE, describe, is_retryable, retry

FAST = {"first": 0.001, "cap": 0.004}


def failing(errors: list[BaseException], result="ok"):
    """A callable that raises ``errors`` in turn, then returns ``result``; counts calls."""
    calls = []

    def fn():
        calls.append(time.monotonic())
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result
    fn.calls = calls
    return fn


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                                  errno.ETIMEDOUT, errno.ESTALE, errno.ENOTCONN, errno.EAGAIN])
def test_retryable_errors_are_retried(code):
    assert is_retryable(OSError(code, "x"))
    fn = failing([OSError(code, "x"), OSError(code, "x")])
    assert retry(fn, "op", **FAST) == "ok"
    assert len(fn.calls) == 3


@pytest.mark.parametrize("exc", [OSError(errno.ENOENT, "gone"), OSError(errno.EINVAL, "bad"),
                                 OSError(errno.ENOTDIR, "x"), OSError(errno.EEXIST, "x"),
                                 FileNotFoundError(errno.ENOENT, "gone"), OSError("no errno"),
                                 ValueError("a bug"), KeyError("k")])
def test_other_errors_are_raised_at_once(exc):
    assert not is_retryable(exc)
    fn = failing([exc])
    failures = []
    with pytest.raises(type(exc)) as info:
        retry(fn, "op", on_failure=lambda *a: failures.append(a), **FAST)
    assert info.value is exc
    assert len(fn.calls) == 1 and failures == []


def test_the_retryable_set_excludes_what_no_retry_cures():
    for code in (errno.ENOENT, errno.EINVAL, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
                 errno.ENAMETOOLONG, errno.ENOTEMPTY):
        assert code not in RETRYABLE


def test_a_custom_classifier():
    fn = failing([ValueError("flaky"), ValueError("flaky")])
    assert retry(fn, "op", retryable=lambda e: isinstance(e, ValueError), **FAST) == "ok"
    fn = failing([OSError(errno.EIO, "x")])
    with pytest.raises(OSError):
        retry(fn, "op", retryable=lambda e: False, **FAST)
    assert len(fn.calls) == 1


def test_callbacks_get_attempt_counts_and_capped_delays():
    errors = [OSError(errno.EIO, "io")] * 6
    fn = failing(errors, result=42)
    failures: list[tuple[BaseException, int, float]] = []
    successes = []
    assert retry(fn, "op", on_failure=lambda e, n, d: failures.append((e, n, d)),
                 on_success=lambda: successes.append(len(fn.calls)), first=0.001, cap=0.004) == 42
    assert [n for _, n, _ in failures] == [1, 2, 3, 4, 5, 6]
    assert all(e is errors[0] for e, _, _ in failures)
    assert successes == [7]                                  # once, after the success
    delays = [d for _, _, d in failures]
    # doubling from first, capped, with jitter in [0.5, 1] of the nominal delay
    nominal = [0.001, 0.002, 0.004, 0.004, 0.004, 0.004]
    for d, n in zip(delays, nominal):
        assert n * 0.5 <= d <= n, (delays, nominal)


def test_no_success_callback_without_failures():
    successes = []
    assert retry(lambda: 1, "op", on_success=lambda: successes.append(1)) == 1
    assert successes == []


def test_the_cap_bounds_the_wait_even_with_a_large_first_delay():
    fn = failing([OSError(errno.EIO, "x")] * 3)
    t = time.monotonic()
    failures = []
    retry(fn, "op", first=100.0, cap=0.01, on_failure=lambda e, n, d: failures.append(d))
    assert time.monotonic() - t < 1.0
    assert all(d <= 0.01 for d in failures)


def test_the_stop_event_ends_the_wait_and_reraises():
    stop = threading.Event()
    err = OSError(errno.EIO, "still down")
    fn = failing([err] * 100)
    threading.Timer(0.05, stop.set).start()
    t = time.monotonic()
    with pytest.raises(OSError) as info:
        retry(fn, "op", stop=stop, first=30.0, cap=30.0)    # would wait 15-30 s per attempt
    assert time.monotonic() - t < 2.0
    assert info.value is err
    assert len(fn.calls) == 1


def test_a_stop_set_before_the_failure_reraises_after_one_attempt():
    stop = threading.Event()
    stop.set()
    fn = failing([OSError(errno.ENOSPC, "full")] * 5)
    failures = []
    with pytest.raises(OSError, match="full"):
        retry(fn, "op", stop=stop, on_failure=lambda e, n, d: failures.append(n), **FAST)
    assert len(fn.calls) == 1 and failures == [1]           # told of the failure first


def test_a_stop_set_but_never_needed_does_not_matter():
    stop = threading.Event()
    stop.set()
    assert retry(lambda: "fine", "op", stop=stop) == "fine"


def test_log_levels_escalate_and_recovery_is_logged(caplog):
    caplog.set_level(logging.DEBUG, logger="acpfs.backing.retry")
    fn = failing([OSError(errno.EIO, "io")] * (2 * ERROR_AFTER))
    retry(fn, "upload of 'x'", **FAST)
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "acpfs.backing.retry"]
    failures = [(lvl, m) for lvl, m in logged if " failed (" in m]
    # the first failure, then every ERROR_AFTER-th; from ERROR_AFTER on at ERROR
    assert [m.split("attempt ")[1].split(";")[0] for _, m in failures] == \
        ["1", str(ERROR_AFTER), str(2 * ERROR_AFTER)]
    assert [lvl for lvl, _ in failures] == [logging.WARNING, logging.ERROR, logging.ERROR]
    assert "upload of 'x' failed (EIO: io)" in failures[0][1]
    assert logged[-1] == (logging.WARNING,
                          f"upload of 'x' succeeded after {2 * ERROR_AFTER} failed attempts")


def test_describe():
    assert describe(OSError(errno.ENOSPC, "No space left on device")) == \
        "ENOSPC: No space left on device"
    assert describe(ValueError("bad")) == "ValueError: bad"
    assert describe(OSError("no errno")) == "OSError: no errno"
    assert describe(OSError(99999, "odd")) == "99999: odd"
