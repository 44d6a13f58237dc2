"""--idle-poll (docs/design.md, "Idle CPUs poll while requests arrive"): while programs send
requests the daemon holds a CPU latency request of 0 us through /dev/cpu_dma_latency, so
idle CPUs poll instead of halting and a reply wakes its program without an interrupt to a
halted CPU; it lets go once no request came for the tail (50 ms), and at unmount. What the
kernel holds is read back from the device itself: the lowest latency any program asks for.

The non-root case (the device is root's alone: the mount serves, `status` says why it is
off) is in test_install.py's mount by another user."""

from __future__ import annotations

import os
import struct
import time

from conftest import wait_for

QOS = "/dev/cpu_dma_latency"
TAIL_S = 0.05


def system_latency() -> int:
    """The CPU latency in us the kernel keeps to now: the lowest request held."""
    with open(QOS, "rb") as f:
        return struct.unpack("i", f.read(4))[0]


def quiet_baseline() -> int:
    """The latency the system holds without acpfs's requests; the tests need one above 0
    (else nothing could tell acpfs's request from another program's)."""
    time.sleep(4 * TAIL_S)
    base = system_latency()
    assert base > 0, f"another program holds {QOS} at 0 us: this test cannot tell acpfs's apart"
    return base


def test_requests_hold_idle_cpus_polling_and_a_quiet_mount_lets_go(make_mount):
    m = make_mount()
    st0 = m.status()["idle_poll"]
    assert st0["on"] is True and st0["tail_ms"] == 50 and st0["errors"] == 0, st0
    base = quiet_baseline()
    checked = 0
    for i in range(60):
        path = m.mnt / f"f{i}"
        path.write_bytes(b"x" * 4096)        # LOOKUP, CREATE, WRITE, FLUSH (and RELEASE)
        done = time.monotonic()
        seen = system_latency()
        if time.monotonic() - done < TAIL_S * 0.6:   # read well within the tail of a request
            assert seen == 0, f"request {i}: {QOS} reads {seen} us right after a request"
            checked += 1
    assert checked >= 30, f"only {checked} of 60 reads came within the tail of a request"
    last = time.monotonic()
    wait_for(lambda: system_latency() == base, 5, "the latency request to be let go")
    assert time.monotonic() - last >= TAIL_S * 0.8, "let go before the tail passed"
    st1 = m.status()["idle_poll"]        # (this status read is a request: held again)
    assert st1["holds"] > st0["holds"] and st1["held_s"] > st0["held_s"], (st0, st1)
    assert st1["errors"] == 0, st1
    m.umount()
    wait_for(lambda: system_latency() == base, 5, "the unmounted daemon's request to go")


def test_idle_poll_off_asks_nothing_of_the_cpus(make_mount):
    m = make_mount(extra=("--idle-poll", "off"))
    assert m.status()["idle_poll"] == {"on": False, "why_not": "off (--idle-poll off)"}
    base = quiet_baseline()
    for i in range(30):
        (m.mnt / f"f{i}").write_bytes(b"x" * 4096)
        assert os.stat(m.mnt / f"f{i}").st_size == 4096
        assert system_latency() == base, f"request {i}: the latency request moved with --idle-poll off"
    assert m.status()["options"]["idle_poll"] == "off"
