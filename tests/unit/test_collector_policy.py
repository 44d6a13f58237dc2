"""When the cycle collector runs its full collections (acpfs/daemon/collector.py): only once
the mount is quiet, at most every MIN_GAP_S, and at the latest every FORCE_S under requests
that never stop; never while nothing moved into the old generation. Driven with a clock of
the test's and the real ``gc`` module (whose settings each test puts back)."""

from __future__ import annotations

import gc
import random
import weakref

import pytest

from acpfs.daemon import collector as mod
from acpfs.daemon.collector import Collector


@pytest.fixture
def gc_back():
    """Whatever a test does to the collector's settings and frozen objects is undone."""
    thresholds = gc.get_threshold()
    callbacks = list(gc.callbacks)
    yield
    gc.callbacks[:] = callbacks
    gc.set_threshold(*thresholds)
    gc.unfreeze()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Cycle:
    """Garbage only the cycle collector frees."""
    def __init__(self) -> None:
        self.me = self


def started() -> tuple[Clock, list[int], Collector]:
    """A started collector on a clock of the test's, and the request count it watches."""
    clock = Clock()
    activity = [0]
    col = Collector(lambda: activity[0], now=clock)
    col.start()
    return clock, activity, col


def garbage_in_old_generation() -> weakref.ref:
    """A cycle nothing refers to, moved into the old generation by young collections (which
    also leaves ``gc.get_count()[2]`` above zero: a full collection is due)."""
    c = Cycle()
    ref = weakref.ref(c)
    gc.collect(1)   # survivors of generation 1 move to generation 2 (c is still referenced)
    del c
    return ref


def test_a_full_collection_waits_for_quiet_and_frees_cycles(gc_back):
    clock = Clock()
    activity = [0]
    col = Collector(lambda: activity[0], now=clock)
    before = gc.get_threshold()
    col.start()
    assert gc.get_threshold()[2] == mod.NEVER and gc.get_freeze_count() > 0
    assert col.full == 1   # the collection before the freeze
    ref = garbage_in_old_generation()
    assert gc.get_count()[2] > 0 and ref() is not None
    # requests keep arriving: never, however long it is due (short of FORCE_S)
    for _ in range(int(mod.MIN_GAP_S / mod.CHECK_S) * 3):
        activity[0] += 1
        clock.t += mod.CHECK_S
        assert not col.tick()
    assert ref() is not None and col.full == 1
    # quiet: after QUIET_S, and not before
    clock.t += mod.QUIET_S / 2
    assert not col.tick()
    clock.t += mod.QUIET_S / 2
    assert col.tick()
    assert ref() is None and col.full == 2 and col.forced == 0
    st = col.status()
    assert st["on"] and st["pending"] == 0 and 0 < st["longest_full_s"] <= st["full_s"]
    col.stop()
    assert gc.get_threshold() == before and col._timed not in gc.callbacks
    assert not col.status()["on"]


def test_quiet_collections_are_min_gap_apart_and_nothing_due_means_none(gc_back):
    clock = Clock()
    col = Collector(lambda: 0, now=clock)
    col.start()
    clock.t += mod.MIN_GAP_S
    gc.collect()   # (not one of ``tick``'s) nothing moved into the old generation since
    assert gc.get_count()[2] == 0
    assert not col.tick()
    garbage_in_old_generation()
    clock.t += mod.QUIET_S
    assert col.tick()                      # quiet, a gap of MIN_GAP_S since start's
    garbage_in_old_generation()
    clock.t += mod.MIN_GAP_S - 0.5
    assert not col.tick()                  # quiet, but too soon after the last
    clock.t += 0.5
    assert col.tick()
    col.stop()


def test_requests_that_never_stop_get_a_collection_every_force_s(gc_back):
    clock, activity, col = started()
    ran = []
    rng = random.Random(7)
    while clock.t < 1000.0 + 3 * mod.FORCE_S + 1:
        if rng.random() < 0.01:
            garbage_in_old_generation()
        activity[0] += 1
        clock.t += rng.uniform(0.5, 1.5) * mod.CHECK_S
        if col.tick():
            ran.append(clock.t)
    assert len(ran) == 3 and col.forced == 3
    gaps = [b - a for a, b in zip([1000.0] + ran, ran)]
    assert all(mod.FORCE_S <= g <= mod.FORCE_S + 2 * mod.CHECK_S for g in gaps), gaps
    col.stop()


def test_requests_that_never_stop_get_one_once_many_young_collections_piled_up(gc_back):
    clock, activity, col = started()
    for i in range(mod.FORCE_PENDING):
        gc.collect(1)   # one more collection of generation 1 (the interpreter may add some)
        activity[0] += 1
        clock.t += mod.CHECK_S
        due = gc.get_count()[2] >= mod.FORCE_PENDING
        assert col.tick() == due, i
        if due:
            break
    assert due and col.forced == 1 and gc.get_count()[2] == 0
    col.stop()
