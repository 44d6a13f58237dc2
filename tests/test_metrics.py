"""Prometheus metrics (docs/operations.md, "Monitoring"): the daemon's ``--metrics`` endpoint
scraped over real HTTP and ``acpfs status --prometheus``, both parsed with the Prometheus
client's own text parser; the values follow what the mount does (a file written and synced,
a file larger than the cache, a backing that answers EIO, a daemon killed and recovered,
an unmount while the backing is read-only); bad ``--metrics`` values refuse the mount in
one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from conftest import ACPFS, acpfs, gone, is_mounted, wait_for

MiB = 1 << 20
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Series = dict[tuple[str, frozenset], float]


def parse(text: str) -> Series:
    """Every sample of a text, by name and labels; each family's HELP and TYPE once."""
    out: Series = {}
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), f"a family is split: {names}"
    for fam in families:
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def scrape(address: str, path: str = "/metrics") -> tuple[str, Series]:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as r:
        assert r.status == 200
        return r.headers["Content-Type"], parse(r.read().decode())


def value(series: Series, name: str, mount, **labels: str) -> float:
    return series[(name, frozenset({"mountpoint": str(mount.mnt), **labels}.items()))]


def of_mount(series: Series, mount) -> Series:
    """The series of one mount (``status --prometheus`` without a mount point names all)."""
    return {k: v for k, v in series.items() if ("mountpoint", str(mount.mnt)) in k[1]}


def listening_on(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if int(p, 16) == port and state == "0A":
                    found.append(addr)
    return found


def every_mount() -> str:
    """``acpfs status --prometheus`` of every mount on the host. Other mounts (other tests
    running beside this one) may go away between the mount table and their status being
    read, which fails the command: tried up to three times."""
    for _ in range(3):
        r = acpfs("status", "--prometheus", check=False)
        if r.returncode == 0:
            return r.stdout
    raise AssertionError(f"acpfs status --prometheus failed: {r.stderr}")


def dirty_bytes_reach(address: str, mount, want: int, timeout: float) -> Series:
    """The first scrape whose ``acpfs_dirty_bytes`` is ``want``; fails after ``timeout``
    seconds, naming the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        _, s = scrape(address)
        seen = value(s, "acpfs_dirty_bytes", mount)
        if seen == want:
            return s
        assert time.monotonic() < deadline, \
            f"acpfs_dirty_bytes is {seen:g} after {timeout:g}s, not the {want} bytes written"
        time.sleep(0.05)


def test_endpoint_counts_what_was_written_and_persisted(make_mount):
    """A real scrape: the endpoint is on loopback by default; 3 MiB written and held open
    are one dirty file of exactly 3 MiB in the gauges and in the daemon's status (on either
    data path); synced, they move the persisted counters by exactly that, the
    close-to-durable histogram by one file, and the dirty gauges back to 0; other paths are
    404."""
    m = make_mount(extra=("--metrics", ":0"))
    (m.mnt / "shard.bin").write_bytes(b"its last version")   # its name seen: passed through
    m.sync()                                               # from here where it can be
    address = m.status()["metrics"]
    host, port = address.rsplit(":", 1)
    assert host == "127.0.0.1"
    assert listening_on(int(port)) == ["0100007F"]      # 127.0.0.1 only, nothing else
    ctype, before = scrape(address)
    assert ctype == CONTENT_TYPE
    assert value(before, "acpfs_up", m) == 1 and value(before, "acpfs_healthy", m) == 1
    assert value(before, "acpfs_cache_size_bytes", m) == m.status()["cache"]["limit_bytes"]
    data = os.urandom(3 * MiB)
    with open(m.mnt / "shard.bin", "wb") as f:     # held open: dirty, every byte of it
        f.write(data)
        f.flush()
        _, open_now = scrape(address)
        if m.status()["passthrough"]["on"]:
            # the kernel writes the file itself: the daemon counts its size at its next look
            # (every half second), so the gauge must come to every byte written, within a
            # deadline; on the daemon's path every write came through it: exact at once
            open_now = dirty_bytes_reach(address, m, len(data), timeout=10)
        assert value(open_now, "acpfs_dirty_files", m) == 1
        assert value(open_now, "acpfs_dirty_bytes", m) == len(data)
        assert m.status()["dirty"] == {"files": 1, "bytes": len(data)}   # the same daemon's word
    m.sync()
    _, after = scrape(address)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, m, **labels) - value(before, name, m, **labels)
    assert grew("acpfs_persisted_bytes_total") == len(data)
    assert grew("acpfs_persisted_files_total") == 1
    passed = 1 if m.status()["passthrough"]["on"] else 0
    assert grew("acpfs_writer_opens_total", decision="passed_through") == passed
    assert value(after, "acpfs_cache_over_size_bytes", m) == 0
    (m.back / "cold.bin").write_bytes(b"c" * 4096)   # not in the cache: read from the backing file
    with open(m.mnt / "cold.bin", "rb") as f:
        assert f.read() == b"c" * 4096
        _, reading = scrape(address)
        assert value(reading, "acpfs_cold_read_files", m) == 1
    _, read = scrape(address)
    assert value(read, "acpfs_cold_read_opens_total", m) - value(after, "acpfs_cold_read_opens_total", m) == 1
    assert value(read, "acpfs_cold_read_files", m) == 0
    assert grew("acpfs_close_to_durable_seconds_count") == 1
    assert grew("acpfs_close_to_durable_seconds_bucket", le="+Inf") == 1
    assert grew("acpfs_close_to_durable_seconds_bucket", le="3600.0") == 1   # within the hour
    assert value(after, "acpfs_close_to_durable_seconds_sum", m) > 0
    for gauge in ("acpfs_dirty_files", "acpfs_dirty_bytes", "acpfs_flushing_files",
                  "acpfs_flushing_bytes", "acpfs_queued_operations",
                  "acpfs_oldest_unsaved_seconds", "acpfs_failing_operations"):
        assert value(after, gauge, m) == 0, gauge
    assert value(after, "acpfs_publish_errors_total", m) == 0
    doc = m.status()
    assert doc["persisted_since_mount"]["bytes"] == value(after, "acpfs_persisted_bytes_total", m)
    assert doc["close_to_durable_s"]["count"] == \
        value(after, "acpfs_close_to_durable_seconds_count", m)
    for path, code in (("/", 404), ("/metricsx", 404)):
        try:
            urllib.request.urlopen(f"http://{address}{path}", timeout=10)
        except urllib.error.HTTPError as e:
            assert e.code == code, (path, e.code)
        else:
            raise AssertionError(f"{path} answered 200")


def test_status_prometheus_agrees_with_the_endpoint(make_mount):
    """``acpfs status --prometheus [MOUNT]`` prints the endpoint's series (a quiet mount:
    everything but the uptime, the FUSE requests that status itself makes and the idle
    polling those requests hold, ``--idle-poll``, is equal);
    with no mount point, every mount's, ours among them; a stale mount is acpfs_up 0 and
    exit status 1."""
    m = make_mount(extra=("--metrics", "127.0.0.1:0"))
    (m.mnt / "ckpt").mkdir()
    (m.mnt / "ckpt" / "a").write_bytes(b"a" * 100_000)
    m.sync()
    moving = {"acpfs_uptime_seconds", "acpfs_requests_total", "acpfs_requests_answered_in_c_total",
              "acpfs_idle_poll_holds_total", "acpfs_idle_poll_held_seconds_total"}
    named = parse(acpfs("status", "--prometheus", str(m.mnt)).stdout)
    _, scraped = scrape(m.status()["metrics"])
    everyone = of_mount(parse(every_mount()), m)
    for other in (scraped, everyone):
        assert {k for k in named} == {k for k in other}
        assert {k: v for k, v in named.items() if k[0] not in moving} == \
               {k: v for k, v in other.items() if k[0] not in moving}
    assert value(named, "acpfs_persisted_files_total", m) == 1
    r = subprocess.run(ACPFS + ["status", "--prometheus", "--json"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("acpfs: "), r
    os.kill(m.pid, signal.SIGKILL)                      # the daemon dies: a stale mount
    wait_for(lambda: subprocess.run(ACPFS + ["status", "--check", str(m.mnt)],
                                    capture_output=True).returncode == 2, 10, "a stale mount")
    r = subprocess.run(ACPFS + ["status", "--prometheus", str(m.mnt)], capture_output=True,
                       text=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "gone" in r.stderr, r
    stale = parse(r.stdout)
    assert value(stale, "acpfs_up", m) == 0 and value(stale, "acpfs_healthy", m) == 0


def test_failing_backing_raises_the_error_counters(make_mount, faults, tmp_path):
    """A backing that answers EIO: the failing gauge, publish errors and retries rise and
    the mount is not healthy; once it answers again, the file lands and the gauges settle
    while the counters keep what happened. The endpoint is set by ACPFS_METRICS here."""
    m = make_mount("eio", cache_size="64M", mount=False, env={"ACPFS_METRICS": ":0"})
    shim = faults.shim(tmp_path / "eio-src", m.back)
    faults.mount(m)
    address = m.status()["metrics"]
    assert address.startswith("127.0.0.1:")
    with open(m.mnt / "f", "wb") as f:     # made before the fault: its publish fails
        shim.set("eio")
        f.write(b"y" * 10_000)
    failing = wait_for(lambda: (s := scrape(address)[1]) and
                       value(s, "acpfs_retries_total", m) >= 2 and s, 20, "retries counted")
    assert value(failing, "acpfs_publish_errors_total", m) >= 1
    assert value(failing, "acpfs_failing_operations", m) >= 1
    assert value(failing, "acpfs_healthy", m) == 0
    assert value(failing, "acpfs_oldest_unsaved_seconds", m) > 0
    shim.set("ok")
    m.sync()
    _, after = scrape(address)
    assert value(after, "acpfs_failing_operations", m) == 0
    assert value(after, "acpfs_healthy", m) == 1
    assert value(after, "acpfs_retries_total", m) >= value(failing, "acpfs_retries_total", m)
    assert value(after, "acpfs_publish_errors_total", m) >= 1
    assert value(after, "acpfs_persisted_files_total", m) == 1
    doc = m.status()
    assert doc["errors_since_mount"]["retries"] == value(after, "acpfs_retries_total", m)


def test_write_through_is_counted(make_mount):
    """A file three times the cache, written by one open: the cache fills, the file is
    written through to the backing, and the write-through counters hold every byte of it."""
    m = make_mount(cache_size="16M", extra=("--metrics", ":0"))
    size = 48 * MiB
    with open(m.mnt / "big.bin", "wb") as f:
        for _ in range(size // MiB):
            f.write(os.urandom(MiB))
    m.sync()
    _, s = scrape(m.status()["metrics"])
    assert value(s, "acpfs_write_through_files_total", m) == 1
    assert value(s, "acpfs_write_through_bytes_total", m) == size
    assert value(s, "acpfs_persisted_bytes_total", m) == size
    assert m.status()["write_through"] == {"files": 1, "bytes": size}


def test_recovery_is_counted(make_mount, faults):
    """A daemon killed with a file not yet in the (read-only) backing: the next mount
    recovers the directory made and the file from the journal, and its endpoint counts
    both."""
    m = make_mount("crash", cache_size="64M", mount=False, extra=("--metrics", ":0"))
    faults.tmpfs(m.back, "64M")
    faults.mount(m)
    faults.remount(m.back, "ro")
    (m.mnt / "ckpt").mkdir()                         # an operation, then a file's content
    (m.mnt / "ckpt" / "saved").write_bytes(b"s" * 5000)   # close() returned: never lost
    wait_for(lambda: m.status()["errors"], 10, "the publish failing")
    os.kill(m.pid, signal.SIGKILL)
    faults.remount(m.back, "rw")
    r = acpfs(*m.args())
    assert "stale mount" in r.stderr
    m.pid = m.status()["pid"]
    m.sync()
    _, s = scrape(m.status()["metrics"])
    assert value(s, "acpfs_recovered_files_total", m) == 1
    assert value(s, "acpfs_recovered_operations_total", m) == 1
    assert value(s, "acpfs_persisted_files_total", m) == 1
    assert (m.back / "ckpt" / "saved").read_bytes() == b"s" * 5000
    recovery = m.status()["recovery"]
    assert (recovery["files"], recovery["replayed_ops"]) == (1, 1)


def test_endpoint_answers_during_the_drain_and_closes_after(make_mount, faults):
    """Unmounted while its backing is read-only, the daemon drains: the endpoint still
    answers, showing what is left; once the backing takes it and the daemon exits, nothing
    listens."""
    m = make_mount("ro", cache_size="64M", mount=False, extra=("--metrics", ":0"))
    faults.tmpfs(m.back, "64M")
    faults.mount(m)
    address = m.status()["metrics"]
    faults.remount(m.back, "ro")
    (m.mnt / "last").write_bytes(b"z" * 5000)
    wait_for(lambda: m.status()["errors"], 10, "the publish failing")
    subprocess.run(["fusermount3", "-u", str(m.mnt)], check=True)
    assert not is_mounted(m.mnt)
    _, draining = scrape(address)
    assert value(draining, "acpfs_queued_operations", m) == 1
    assert value(draining, "acpfs_failing_operations", m) == 1
    faults.remount(m.back, "rw")
    wait_for(lambda: (m.back / "last").exists(), 60, "the drain to land the file")
    pid = m.pid
    wait_for(lambda: gone(pid), 30, "the daemon to exit")
    try:
        urllib.request.urlopen(f"http://{address}/metrics", timeout=5)
    except urllib.error.URLError as e:
        assert isinstance(e.reason, ConnectionRefusedError), e
    else:
        raise AssertionError("the endpoint still answers after the daemon exited")


def test_bad_metrics_values_refuse_the_mount_in_one_line(make_mount):
    """A malformed --metrics (or ACPFS_METRICS) is a usage error (exit 2); a port in use or
    an address not on this host refuses the mount (exit 1); one line each, nothing mounted."""
    m = make_mount(mount=False)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        cases = [(["--metrics", "nine"], {}, 2, "--metrics"),
                 (["--metrics", "::1:9100"], {}, 2, "brackets"),
                 (["--metrics", "70000"], {}, 2, "port"),
                 ([], {"ACPFS_METRICS": "host:port"}, 2, "--metrics"),
                 (["--metrics", str(taken.getsockname()[1])], {}, 1, "EADDRINUSE"),
                 (["--metrics", "192.0.2.1:9100"], {}, 1, "EADDRNOTAVAIL")]
        for extra, env, code, word in cases:
            r = subprocess.run(ACPFS + m.args() + extra, capture_output=True, text=True,
                               env={**os.environ, **env}, timeout=120)
            assert r.returncode == code, (extra, env, r)
            assert r.stderr.count("\n") == 1 and r.stderr.startswith("acpfs: "), (extra, r)
            assert word in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr)
            assert not is_mounted(m.mnt), extra
    finally:
        taken.close()
