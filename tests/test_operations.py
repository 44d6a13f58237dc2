"""What an operator wires acpfs into (docs/operations.md).

systemd readiness (acpfs/sdnotify.py, systemd/acpfs@.service): a foreground mount under a
real NOTIFY_SOCKET listener says READY=1 only once the mount is live, reports what is
unsaved in STATUS=, and at stop says STOPPING=1 and asks for more time while it persists.
Health checks: the exit status of 'acpfs status --check' in each state."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import threading
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
def test_a_notify_mount_is_ready_only_when_live_and_waits_for_its_data_at_stop(make_mount, faults,
                                                                              tmp_path, kind):
    """READY=1 with a live mount; STATUS= counts what is unsaved; at SIGTERM, STOPPING=1. The
    backing (faultfs) hangs from before the write until well after SIGTERM, so the data can
    only land if the daemon waits for it: meanwhile it stays alive, nothing is in the backing,
    and it asks systemd for more time (EXTEND_TIMEOUT_USEC=) counting the file's operation as
    still to persist; once the backing answers the file lands, whole, and the daemon exits 0."""
    size_of = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    left = re.compile(r"(\d+) files \(([\d.]+) ([KMGT]?i?B)\) unsaved, "
                      r"(\d+) operations \(([\d.]+) ([KMGT]?i?B)\) to persist")

    def counts(msg: dict[str, str]) -> tuple[int, float, int, float] | None:
        """(files unsaved, their bytes, operations to persist, their bytes) as STATUS= says."""
        found = left.search(msg.get("STATUS", ""))
        if found is None:
            return None
        files, fb, fu, ops, ob, ou = found.groups()
        return int(files), float(fb) * size_of[fu], int(ops), float(ob) * size_of[ou]

    def says_f_is_left(msg: dict[str, str]) -> None:
        """f, closed, is no longer an unsaved (open) file: it is one operation of its 100_000
        bytes to persist (97.7 KiB: the rounding is 0.05 KiB)."""
        got = counts(msg)
        assert got is not None, f"no counts in STATUS={msg.get('STATUS')!r}"
        files, fbytes, ops, obytes = got
        assert (files, fbytes, ops) == (0, 0, 1) and abs(obytes - len(data)) <= 52, msg

    data = b"x" * 100_000
    sock, address = listen(kind, tmp_path)
    m = make_mount(mount=False)
    src = tmp_path / "src"
    shim = faults.shim(src, m.back)            # the backing, through faultfs: it can hang
    env = dict(os.environ, NOTIFY_SOCKET=address)
    p = subprocess.Popen(ACPFS + m.args() + ["--foreground"], env=env, stderr=subprocess.PIPE,
                         text=True)
    try:
        first = receive(sock, lambda f: "READY" in f, 60)
        assert is_mounted(m.mnt)              # READY=1 comes with a live mount, never before
        ready = first[-1]
        assert ready["READY"] == "1" and f"serving {m.mnt}" in ready["STATUS"]
        assert counts(ready) == (0, 0, 0, 0), ready    # nothing unsaved yet
        m.pid = p.pid
        os.listdir(m.mnt)                     # the root is listed before the hang
        shim.set("hang")                      # nothing reaches the backing from here
        (m.mnt / "f").write_bytes(data)
        # STATUS= goes on while it serves, counting what is unsaved or being persisted
        later = receive(sock, lambda f: "STATUS" in f and "READY" not in f
                        and (counts(f) or (0, 0, 0))[2] > 0, 10)
        assert "unsaved" in later[-1]["STATUS"] and "to persist" in later[-1]["STATUS"]
        says_f_is_left(later[-1])
        assert "f" not in os.listdir(src)
        p.send_signal(signal.SIGTERM)
        stop = receive(sock, lambda f: "STOPPING" in f, 30)[-1]
        assert stop["STOPPING"] == "1" and int(stop["EXTEND_TIMEOUT_USEC"]) >= 10_000_000
        assert "persisting before exit" in stop["STATUS"]
        says_f_is_left(stop)
        # the drain waits for the hung backing: alive, asking for more time, f still left
        for _ in range(2):
            more = receive(sock, lambda f: "EXTEND_TIMEOUT_USEC" in f, 10)[-1]
            assert "STOPPING" not in more and int(more["EXTEND_TIMEOUT_USEC"]) >= 10_000_000
            assert "persisting before exit" in more["STATUS"]
            says_f_is_left(more)
            assert p.poll() is None, "the daemon exited while its data was not in the backing"
            assert "f" not in os.listdir(src)
        shim.set("ok")                        # the backing answers: the drain can finish
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert (src / "f").read_bytes() == data
    finally:
        shim.set("ok")
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


def stuck_at(pid: int) -> str:
    """Where a process waits: its state, kernel wait channel and kernel stack."""
    found = []
    for name in ("wchan", "stack"):
        try:
            found.append(f"{name}: " + open(f"/proc/{pid}/{name}").read().strip())
        except OSError as e:
            found.append(f"{name}: {e}")
    with open(f"/proc/{pid}/status") as f:
        found += [line.strip() for line in f if line.startswith(("State", "SigPnd", "ShdPnd"))]
    return "; ".join(found)


def test_status_watch_prints_rates_until_interrupted(make_mount, faults):
    """'acpfs status --watch': a line per interval with the bytes queued and persisted per
    second, files per second, the queue and what is unsaved; Ctrl-C ends it with status 0.
    Three 8 MiB files written and synced one after the other, the last one held queued for
    a few intervals first (the backing read-only): the lines' files add up to exactly three,
    counted when they persist, not when they are queued, and their bytes to 24 MiB each way;
    once synced the queue and the unsaved bytes are zero."""
    mnt = make_mount(mount=False)
    faults.tmpfs(mnt.back, "256M")
    faults.mount(mnt)
    interval = 0.5
    # SIGINT as a terminal's foreground job has it: a suite started in the background by a
    # shell without job control inherits it ignored, and Python then keeps it ignored
    w = subprocess.Popen([*ACPFS, "status", "--watch", str(mnt.mnt), "--interval", str(interval)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    printed: queue.Queue[str | None] = queue.Queue()    # the watch's lines as it prints them

    def read() -> None:
        for text in w.stdout:
            printed.put(text.rstrip("\n"))
        printed.put(None)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    lines: list[str] = []

    def files_in(row: re.Match) -> int:
        """The files that landed in a row's interval: its files/s times the interval, to the
        nearest file. The rate is over the time between two status reads, the interval and a
        little more on a loaded machine, and printed to a tenth (a twentieth of a file here):
        one file in a row counts as one until the reads are twice the interval apart, three
        until they are a fifth more."""
        return round(float(row[4]) * interval)

    def rows() -> list[re.Match]:
        """The lines after the header, each a row (the header repeats, as vmstat's does)."""
        return [ROW.fullmatch(line) for line in lines[2:] if line and line != lines[1]]

    try:
        time.sleep(0.7)
        for i in range(3):      # one file at a time, persisted before the next: rows of their own
            if i == 2:          # queued for a few intervals before it can persist
                time.sleep(interval)          # a row apart from the last file's
                faults.remount(mnt.back, "ro")
                (mnt.mnt / f"f{i}").write_bytes(os.urandom(8 << 20))
                time.sleep(4 * interval)
                faults.remount(mnt.back, "rw")
            else:
                (mnt.mnt / f"f{i}").write_bytes(os.urandom(8 << 20))
            mnt.sync(f"f{i}")
            time.sleep(interval)
        # the rows go on until they have counted the three files and show nothing unsaved
        deadline = time.monotonic() + 30
        while True:
            got = rows()
            assert all(got), lines
            if got and sum(map(files_in, got)) >= 3 and got[-1][5] == "0" \
                    and got[-1][7] == "0 B":
                break
            left = deadline - time.monotonic()
            assert left > 0, f"no row after the three files with the queue empty: {lines}"
            try:
                text = printed.get(timeout=left)
            except queue.Empty:
                continue
            assert text is not None, f"the watch ended by itself: {lines}"
            lines.append(text)
    finally:
        w.send_signal(signal.SIGINT)
        try:
            w.wait(timeout=30)
        except subprocess.TimeoutExpired:
            where = stuck_at(w.pid)       # what it waits for, before it is killed
            w.kill()
            w.wait()
            raise AssertionError(f"status --watch did not end 30 s after SIGINT: {where}; "
                                 f"it printed: {lines}") from None
        finally:
            if w.poll() is None:
                w.kill()
                w.wait()
    reader.join(timeout=30)
    while (text := printed.get(timeout=5)) is not None:
        lines.append(text)
    out, err = "\n".join(lines), w.stderr.read()
    assert w.returncode == 0 and err == "", (w.returncode, err)
    assert lines[0] == f"{mnt.mnt}: every {interval:g}s (Ctrl-C to stop)"
    assert lines[1].split() == ["time", "queued/s", "persisted/s", "files/s", "queue", "(change)",
                                "unsaved", "oldest", "errors"]
    got = rows()
    assert got and all(got), lines
    # exactly the three files, each in the row of the interval it landed in: none lost,
    # none counted twice (the rows after the last one landed, SIGINT's included, add none)
    assert sum(map(files_in, got)) == 3, ([files_in(r) for r in got], out)
    # and in each row, the files are its persisted bytes in 8 MiB files: both rates are over
    # the same time, so this holds to the print's rounding (a twentieth of a file per second,
    # a twentieth of a MiB) however long the row's interval was
    for r in got:
        assert abs(float(r[4]) - nbytes(r[3]) / (8 << 20)) <= 0.06, (r[0], out)
    # each rate is over the time between two status reads: the interval, and more on a
    # loaded machine (so the sums may fall short, never go over)
    queued = sum(nbytes(r[2]) for r in got) * interval
    persisted = sum(nbytes(r[3]) for r in got) * interval
    for total in (queued, persisted):
        assert 0.5 * (24 << 20) <= total <= 1.05 * (24 << 20), (total, out)
    held = [r for r in got if nbytes(r[2]) and not nbytes(r[3])]
    assert held and all(files_in(r) == 0 for r in held), \
        ("rows of a file queued and not yet persisted count no file", out)
    last = got[-1]
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
