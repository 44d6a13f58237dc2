"""The unit tier: the core (cache, flusher, journal, recovery, write-through) driven in
process, without /dev/fuse, over a backing that can fail or hang (``faulty.FaultyBacking``)."""

from __future__ import annotations

import pytest

from harness import Parts


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
