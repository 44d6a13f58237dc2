"""The cycle collector's full collections wait for a quiet mount (acpfs/daemon/collector.py;
docs/design.md, "The cycle collector"), on a real mount: a burst of created files moves
objects into the old generation, requests that keep arriving get no full collection, and
once they stop one runs after QUIET_S; ``status`` says so."""

from __future__ import annotations

import os
import time

from acpfs.daemon import collector
from conftest import Mount


def test_full_collections_wait_until_requests_stop(make_mount):
    m: Mount = make_mount()
    st = m.status()["collector"]
    assert st["on"] and st["full"] >= 1 and st["frozen"] > 0, st   # the one before the freeze
    (m.mnt / "d").mkdir()
    for i in range(3000):   # about 20 tracked objects each: young collections move some on
        (m.mnt / "d" / f"f{i}").write_bytes(b"x")
    m.sync()   # the flusher, which makes objects too, is done with them
    before = m.status()["collector"]
    assert before["pending"] > 0 and before["young"] > 0, before
    # requests that reach Python every 50 ms, past the gap a quiet mount would wait for
    until = time.monotonic() + collector.MIN_GAP_S + 2 * collector.QUIET_S
    while time.monotonic() < until:
        try:
            os.getxattr(m.mnt / "d", "user.nothing")
        except OSError:
            pass
        time.sleep(0.05)
    busy = m.status()["collector"]
    assert busy["full"] == before["full"], (before, busy)
    stopped = time.monotonic()
    time.sleep(collector.QUIET_S + 4.0)   # no request meanwhile: reading the status is one
    after = m.status()["collector"]
    looked = time.monotonic()
    assert after["full"] == busy["full"] + 1, (busy, after)
    # it ran once the mount had been quiet for QUIET_S, not before
    assert after["last_full_ago_s"] <= looked - stopped - collector.QUIET_S + 0.2, after
    assert after["pending"] == 0, after
    m.sync()
    assert len(os.listdir(m.back / "d")) == 3000
