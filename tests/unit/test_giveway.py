"""The flusher gives way to requests (acpfs/flusher/giveway.py): it waits while requests
arrive, never past its share of each second, never while someone waits for it, when the
cache is short of room or the flusher stops, and not at all when programs are quiet."""

from __future__ import annotations

import threading
import time

from acpfs.flusher import giveway
from acpfs.flusher.giveway import GiveWay


def arriving(gw: GiveWay, seconds: float) -> threading.Thread:
    """A thread that tells ``gw`` of a request every 0.5 ms for ``seconds``."""
    def run() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            gw.request()
            time.sleep(0.0005)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_quiet_programs_are_not_waited_for():
    gw = GiveWay(lambda: False, lambda: False, lambda: 0)
    for _ in range(100):
        gw.wait()
    assert gw.status() == {"waits": 0, "given_s": 0.0}
    gw.request()
    time.sleep(giveway.QUIET_S * 2)   # the last request is older than QUIET_S
    gw.wait()
    assert gw.status()["waits"] == 0


def test_requests_arriving_are_given_way_within_the_share_of_each_second():
    """A flusher thread that waits before each 1 ms piece of work, while requests arrive
    without a pause for 1.5 s: it waits, and still works in the rest of each second."""
    gw = GiveWay(lambda: False, lambda: False, lambda: 0)
    t = arriving(gw, 1.6)
    start = time.monotonic()
    waited = worked = 0.0
    while time.monotonic() - start < 1.5:
        before = time.monotonic()
        gw.wait()
        after = time.monotonic()
        time.sleep(0.001)   # a piece of the flusher's work
        waited += after - before
        worked += time.monotonic() - after
    t.join()
    st = gw.status()
    assert st["waits"] > 0 and waited > 0.3, (waited, st)
    # two seconds at most began in 1.5 s: never more than SHARE of each (and a step over)
    assert st["given_s"] <= 2 * (giveway.SHARE * giveway.WINDOW_S + 0.01), st
    # and worked in the rest of the first second at least (the second ended early)
    assert worked > 0.8 * (1 - giveway.SHARE) * giveway.WINDOW_S, (worked, waited, st)


def test_no_give_way_when_the_cache_is_short_of_room_or_the_flusher_stops():
    for pressed, stopping in ((True, False), (False, True)):
        gw = GiveWay(lambda: pressed, lambda: stopping, lambda: 0)
        t = arriving(gw, 0.3)
        for _ in range(50):
            gw.wait()
        t.join()
        assert gw.status()["waits"] == 0, (pressed, stopping)


def test_threads_waiting_at_once_spend_the_share_once():
    """Five threads waiting at once spend the second's share once between them, not five
    times: they wait as long as one thread alone would."""
    gw = GiveWay(lambda: False, lambda: False, lambda: 0)
    t = arriving(gw, 0.2)
    time.sleep(0.01)
    waiters = [threading.Thread(target=gw.wait) for _ in range(5)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join()
    t.join()
    st = gw.status()
    assert 0 < st["waits"] and st["given_s"] <= giveway.SHARE * giveway.WINDOW_S + 1e-6, st


def test_no_give_way_while_someone_waits_for_the_flusher():
    """An fsync or ``acpfs sync`` waits for op 7: no thread gives way until op 7 is applied,
    then requests are given way again."""
    applied = [5]
    busy_until = time.monotonic() + 0.5   # requests for 0.5 s, whatever the scheduler does
    gw = GiveWay(lambda: False, lambda: False, lambda: applied[0], below=lambda: busy_until)
    gw.waited_for(7)
    gw.waited_for(6)   # a lower mark changes nothing
    for _ in range(50):
        gw.wait()
    assert gw.status()["waits"] == 0 and gw.wanted == 7
    applied[0] = 7
    gw.wait()
    assert gw.status()["waits"] == 1


def test_requests_stamped_below_python_are_given_way_too():
    """Requests the C extension answers never reach Python: its stamp of the last request
    (``below``, fastwrite.last_request) counts as one told by ``request``, and a stale stamp
    does not. (A stamp 0.3 s ahead: requests that go on arriving for 0.3 s.)"""
    stamp = [time.monotonic() + 0.3]
    gw = GiveWay(lambda: False, lambda: False, lambda: 0, below=lambda: stamp[0])
    start = time.monotonic()
    gw.wait()
    took = time.monotonic() - start
    st = gw.status()
    assert st["waits"] == 1 and 0.25 < took < 0.8 and st["given_s"] > 0.25, (took, st)
    time.sleep(giveway.QUIET_S * 2)   # the stamp is older than QUIET_S
    gw.wait()
    assert gw.status()["waits"] == 1


def test_one_waiting_thread_watches_the_clock_and_wakes_the_others(monkeypatch):
    """Five threads give way to 0.3 s of requests: only one of them looks at the clock
    (every STEP_S), the others sleep until it goes and wakes them (WAKE_S is set far beyond
    the test: a thread left asleep would hold the join). Threads that each looked every step
    took the interpreter from the request loop five times as often."""
    monkeypatch.setattr(giveway, "STEP_S", 0.01)
    monkeypatch.setattr(giveway, "WAKE_S", 30.0)
    busy_until = time.monotonic() + 0.3   # requests for 0.3 s, whatever the scheduler does
    gw = GiveWay(lambda: False, lambda: False, lambda: 0, below=lambda: busy_until)
    looks = [0]
    busy = gw._busy

    def counted(now: float) -> bool:
        looks[0] += 1
        return busy(now)

    gw._busy = counted
    waiters = [threading.Thread(target=gw.wait, daemon=True) for _ in range(5)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join(timeout=5)
    assert not any(w.is_alive() for w in waiters), "a waiting thread was never woken"
    assert gw.status()["waits"] == 5
    # one look on entry per thread, one per step of the watcher, one each at the end
    assert looks[0] <= 5 + 2 * 0.3 / giveway.STEP_S + 5 + 5, looks[0]


def test_a_thread_giving_way_stops_at_once_when_someone_waits_for_the_flusher(monkeypatch):
    """``waited_for`` (an fsync, ``acpfs sync``) wakes the threads giving way: they do not
    sleep out their step (set to 30 s here)."""
    monkeypatch.setattr(giveway, "STEP_S", 30.0)
    monkeypatch.setattr(giveway, "WAKE_S", 30.0)
    # requests go on for 2 s (a stamp ahead, as the extension's: a thread telling of one
    # every 0.5 ms could be descheduled past QUIET_S on a loaded machine, and then the
    # waiters would not wait at all)
    busy_until = time.monotonic() + 2.0
    gw = GiveWay(lambda: False, lambda: False, lambda: 5, below=lambda: busy_until)
    waiters = [threading.Thread(target=gw.wait, daemon=True) for _ in range(2)]
    for w in waiters:
        w.start()
    time.sleep(0.1)
    assert all(w.is_alive() for w in waiters) and gw.status()["waits"] == 2
    gw.waited_for(7)
    for w in waiters:
        w.join(timeout=1.5)
    assert not any(w.is_alive() for w in waiters), "waited_for did not end the wait"
