"""The unit tier: the core (cache, flusher, journal, recovery, write-through) driven in
process, without /dev/fuse, over a backing that can fail or hang (``faulty.FaultyBacking``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/trees.py (one tree walker for both tiers) is imported as ``trees``; nothing else of
# tests/ is: the mount tier's conftest.py is not for this tier.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import Parts  # noqa: E402


@pytest.fixture
def make_core(tmp_path):
    cores: list[Parts] = []

    def make(name: str = "c", **kw) -> Parts:
        root = tmp_path / name
        root.mkdir(exist_ok=True)
        c = Parts(root, **kw)
        cores.append(c)
        return c

    yield make
    for c in cores:
        c.close()


@pytest.fixture
def core(make_core) -> Parts:
    return make_core()
