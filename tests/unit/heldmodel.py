"""The skeleton both unit-tier model tests share (test_prefix_model.py, test_links_model.py):
a hypothesis state machine drives a ``Cache`` and its ``Flusher`` (harness.py, no mount) with
random operations (each test's own rules and model) while the flusher is held at random
points, and after each step the backing, read while the flusher cannot change it, must be a
state of the model's history at or after the one it showed last.

What is here: holding one backing method (``hold``), the position lock that tells who holds
it (``OwnedLock``), reading the backing at a quiet moment (``HeldMachine.read_backing``), the
walk along the history (``HeldMachine.advance``), and the runner with the settings both use
(``run``: hypothesis draws the operations and the hold points, and reports a failure with its
steps and a blob to replay it)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from harness import Parts
from trees import tree

SCALE = float(os.environ.get("PREFIX_MODEL_SCALE", "1"))
# Whether a step shows a bad state can depend on where the flusher is when the step is checked,
# so a failing example need not fail again when replayed, and shrinking one can take minutes:
# off by default (the failure message has the whole history); PREFIX_MODEL_SHRINK=1 turns it on.
SHRINK = os.environ.get("PREFIX_MODEL_SHRINK", "") not in ("", "0")
TEMP_PREFIX = ".acpfs-tmp-"
WAIT = 20.0   # seconds before a wait on the flusher counts as a hang of the test itself


def backing_tree(root: Path) -> dict[str, tuple]:
    """The backing as trees.tree gives it, acpfs's temporary names aside."""
    return tree(root, skip=lambda n: n.startswith(TEMP_PREFIX))


class OwnedLock:
    """A Lock that knows its holder: the cache's position lock, so that the test can tell
    whether the thread that holds it is the one held by the pause."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: threading.Thread | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ok = self._lock.acquire(blocking, timeout)
        if ok:
            self.owner = threading.current_thread()
        return ok

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


class Countdown(threading.Event):
    """A fault's ``armed`` event that turns on after ``n`` matching calls went by."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def is_set(self) -> bool:   # asked once per call that matches the fault's method
        if self.n > 0:
            self.n -= 1
            return False
        return True


def hold(backing, method: str, skip: int):
    """Hold the next call of ``method`` of a FaultyBacking after ``skip`` of them went by;
    the fault knows the thread it holds (``thread``) and the call (``where``)."""
    f = backing.inject(method, hang=True, times=1, armed=Countdown(skip))
    act = f.act

    def tracked(m, p):
        f.thread = threading.current_thread()
        f.where = f"{m} {p}"
        act(m, p)
    f.act = tracked
    return f


class HeldMachine(RuleBasedStateMachine):
    """The state both machines keep: a core in ``dir``, the position lock, the pause
    (``fault``, ``pause_desc``), the history (each test's own entries) and ``lo``, the index
    of the state the backing matched last; ``violation`` is the first failed check, raised at
    the end of the example, so that whether it happens (which depends on the flusher's
    timing) does not change which steps run."""

    history: list

    def setup(self, dir: Path) -> None:
        self.dir = dir
        self.dir.mkdir()
        self.core = Parts(self.dir, blocks=256, workers=2)
        self.cache = self.core.cache
        self.cache.inodes.position_lock = self.plock = OwnedLock()
        self.violation: str | None = None
        self.lo = 0
        self.fault = None
        self.pause_desc = ""

    def held_thread(self):
        f = self.fault
        if f is not None and f.entered.is_set() and not f._released.is_set():
            return getattr(f, "thread", None)
        return None

    def read_backing(self) -> dict:
        """The backing while the flusher cannot change it: under the position lock, or while
        the lock's holder is the thread the pause holds."""
        deadline = time.monotonic() + WAIT
        while True:
            if self.plock.acquire(timeout=0.005):
                try:
                    return backing_tree(self.core.back)
                finally:
                    self.plock.release()
            held = self.held_thread()
            if held is not None and self.plock.owner is held:
                return backing_tree(self.core.back)   # its holder is held by the pause
            assert time.monotonic() < deadline, "position lock not released"

    def advance(self, matches: Callable[[object], bool]) -> bool:
        """Move ``lo`` to the first entry of the history, from ``lo`` on, that ``matches``;
        False if none does (the backing went back in time, or shows a state never had)."""
        for i in range(self.lo, len(self.history)):
            if matches(self.history[i]):
                self.lo = i
                return True
        return False


def run(machine, max_examples: int, steps: int, suppress: list[HealthCheck]) -> None:
    """Run ``machine`` for ``max_examples`` (times PREFIX_MODEL_SCALE) examples of ``steps``
    steps; shrinking only with PREFIX_MODEL_SHRINK=1."""
    run_state_machine_as_test(machine, settings=settings(
        max_examples=max(1, int(max_examples * SCALE)), stateful_step_count=steps,
        deadline=None, print_blob=True, report_multiple_bugs=False,
        phases=[p for p in Phase if SHRINK or p not in (Phase.shrink, Phase.explain)],
        suppress_health_check=suppress))
