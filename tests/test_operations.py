"""What an operator wires acpfs into (docs/operations.md).

systemd readiness (acpfs/sdnotify.py, systemd/acpfs@.service): a foreground mount under a
real NOTIFY_SOCKET listener says READY=1 only once the mount is live, reports what is
unsaved in STATUS=, and at stop says STOPPING=1 and asks for more time while it persists.
Health checks: the exit status of 'acpfs status --check' in each state."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import pytest

from conftest import ACPFS, is_mounted, mounted_soon


def listen(kind: str, tmp_path) -> tuple[socket.socket, str]:
    """A datagram socket as systemd opens one, and the NOTIFY_SOCKET value naming it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if kind == "abstract":
        name = f"acpfs-test-{os.getpid()}-{time.monotonic_ns()}"
        sock.bind("\0" + name)
        return sock, "@" + name
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    return sock, path


def fields(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().split("\n") if line)


def receive(sock: socket.socket, until, timeout: float) -> list[dict[str, str]]:
    """Messages until one satisfies ``until`` (that one included)."""
    got = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no such message in {timeout} s; got {got}"
        sock.settimeout(left)
        msg = fields(sock.recv(4096))
        got.append(msg)
        if until(msg):
            return got


@pytest.mark.parametrize("kind", ["abstract", "path"])
def test_a_notify_mount_is_ready_only_when_live_and_waits_for_its_data_at_stop(make_mount,
                                                                              tmp_path, kind):
    sock, address = listen(kind, tmp_path)
    m = make_mount(mount=False)
    env = dict(os.environ, NOTIFY_SOCKET=address)
    p = subprocess.Popen(ACPFS + m.args() + ["--foreground"], env=env, stderr=subprocess.PIPE,
                         text=True)
    try:
        first = receive(sock, lambda f: "READY" in f, 60)
        assert is_mounted(m.mnt)              # READY=1 comes with a live mount, never before
        ready = first[-1]
        assert ready["READY"] == "1" and f"serving {m.mnt}" in ready["STATUS"]
        m.pid = p.pid
        (m.mnt / "f").write_bytes(b"x" * 100_000)
        # STATUS= goes on while it serves, saying what is unsaved or being persisted
        later = receive(sock, lambda f: "STATUS" in f and "READY" not in f, 10)
        assert "unsaved" in later[-1]["STATUS"] and "to persist" in later[-1]["STATUS"]
        p.send_signal(signal.SIGTERM)
        stop = receive(sock, lambda f: "STOPPING" in f, 30)[-1]
        assert stop["STOPPING"] == "1" and int(stop["EXTEND_TIMEOUT_USEC"]) >= 10_000_000
        assert "persisting before exit" in stop["STATUS"]
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert (m.back / "f").read_bytes() == b"x" * 100_000
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        sock.close()


def test_a_notify_socket_nobody_listens_on_does_not_stop_the_mount(make_mount, tmp_path):
    m = make_mount(mount=False)
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "nobody.sock"))
    p = subprocess.Popen(ACPFS + m.args() + ["--foreground"], env=env, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert mounted_soon(m.mnt)
        m.pid = p.pid
        (m.mnt / "g").write_bytes(b"y" * 1000)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0
        assert err.count("cannot notify systemd") == 1     # said once, then quiet
        assert (m.back / "g").read_bytes() == b"y" * 1000
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# -- 'acpfs status --check': the exit status of each state ------------------------------------

def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(ACPFS + ["status", "--check", *args], capture_output=True, text=True)


def test_status_check_exit_status_in_each_state(make_mount, tmp_path):
    """0 healthy, 1 degraded (unsaved data older than --max-unsaved-age), 2 not an acpfs
    mount or stale; one line each, saying why."""
    m = make_mount()
    r = check(str(m.mnt))
    assert r.returncode == 0 and r.stdout.startswith(f"OK {m.mnt}:"), r
    with open(m.mnt / "open.log", "wb") as f:          # unsaved while it stays open
        f.write(b"x" * 1000)
        f.flush()
        time.sleep(1.5)
        r = check(str(m.mnt), "--max-unsaved-age", "1")
        assert r.returncode == 1 and r.stdout.startswith(f"DEGRADED {m.mnt}:"), r
        assert "unsaved data" in r.stdout and len(r.stdout.splitlines()) == 1
        r = check(str(m.mnt), "--max-unsaved-age", "60")
        assert r.returncode == 0, r
    r = check(str(tmp_path))
    assert r.returncode == 2 and "not an acpfs mount" in r.stdout, r
    os.kill(m.pid, signal.SIGKILL)                      # the daemon dies: a stale mount
    deadline = time.time() + 10
    while (r := check(str(m.mnt))).returncode != 2 and time.time() < deadline:
        time.sleep(0.1)
    assert r.returncode == 2 and "stale" in r.stdout, r
    r = subprocess.run(ACPFS + ["umount", str(m.mnt)], capture_output=True, text=True)


def test_status_check_is_degraded_while_an_operation_fails(make_mount, faults, tmp_path):
    from test_faults import error_with, wait_for
    m = make_mount("eio", cache_size="64M", mount=False)
    shim = faults.shim(tmp_path / "eio-src", m.back)
    faults.mount(m)
    with open(m.mnt / "f", "wb") as f:     # made before the fault: its publish fails
        shim.set("eio")
        f.write(b"y" * 10_000)
    wait_for(lambda: error_with(m, "EIO"), 10, "an EIO error in status")
    r = check(str(m.mnt))
    assert r.returncode == 1 and "failing" in r.stdout and "EIO" in r.stdout, r
    shim.set("ok")
    m.sync()
    assert check(str(m.mnt)).returncode == 0


def test_status_check_refuses_what_it_cannot_print(make_mount):
    r = subprocess.run(ACPFS + ["status", "--max-unsaved-age", "5"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--check" in r.stderr
    r = check("--json")
    assert r.returncode == 2 and r.stderr.count("\n") == 1


ROW = re.compile(r"(\d\d:\d\d:\d\d) +([\d.]+ [KMGT]?i?B) +([\d.]+ [KMGT]?i?B) +([\d.]+) +(\d+) "
                 r"+([+-]\d+) +([\d.]+ [KMGT]?i?B) +(\S+)  (.*)")
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def nbytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


def test_status_watch_prints_rates_until_interrupted(mnt):
    """'acpfs status --watch': a line per interval with the bytes queued and persisted per
    second, files per second, the queue and what is unsaved; Ctrl-C ends it with status 0.
    Three 8 MiB files written and synced add up, over the lines, to three files and 24 MiB
    each way; once synced the queue and the unsaved bytes are zero."""
    interval = 0.5
    w = subprocess.Popen([*ACPFS, "status", "--watch", str(mnt.mnt), "--interval", str(interval)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.7)
    for i in range(3):
        (mnt.mnt / f"f{i}").write_bytes(os.urandom(8 << 20))
        time.sleep(0.3)
    mnt.sync()
    time.sleep(3 * interval)
    w.send_signal(signal.SIGINT)
    out, err = w.communicate(timeout=30)
    assert w.returncode == 0 and err == "", (w.returncode, err)
    lines = out.splitlines()
    assert lines[0] == f"{mnt.mnt}: every {interval:g}s (Ctrl-C to stop)"
    assert lines[1].split() == ["time", "queued/s", "persisted/s", "files/s", "queue", "(change)",
                                "unsaved", "oldest", "errors"]
    rows = [ROW.fullmatch(line) for line in lines[2:] if line]
    assert rows and all(rows), lines
    # each rate is over the time between two status reads: the interval, and more on a
    # loaded machine (so the sums may fall short, never go over)
    files = sum(float(r[4]) for r in rows) * interval
    queued = sum(nbytes(r[2]) for r in rows) * interval
    persisted = sum(nbytes(r[3]) for r in rows) * interval
    assert 1.5 <= files <= 3.2, (files, out)
    for total in (queued, persisted):
        assert 0.5 * (24 << 20) <= total <= 1.05 * (24 << 20), (total, out)
    last = rows[-1]
    assert last[5] == "0" and last[7] == "0 B" and last[8] == "-" and last[9] == "none", out


def test_status_watch_refuses_what_it_cannot_do(make_mount):
    m = make_mount()
    for args, line in (
            (("--watch", "--json"), "--watch prints a line per interval: not with --json or --files"),
            (("--watch", "--check"), "--check prints one line per mount: not with --json, --files, "
                                     "--watch or --prometheus"),
            (("--watch", "--prometheus"), "--watch prints a line per interval: not with --prometheus"),
            (("--watch", "--interval", "0"), "--interval must be more than 0"),
            (("--count", "3"), "--interval and --count go with --watch")):
        r = subprocess.run([*ACPFS, "status", str(m.mnt), *args], capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr == f"acpfs: {line}\n", (args, r.stderr)
