"""Contract 7 (a failing backing store is retried, nothing is lost) and contract 6 (a full cache
gives ENOSPC, never a hang), with real faults under real mounts, no mocking:

- a backing that is read-only (a tmpfs of our own, ``mount -o remount,ro``): EROFS;
- a backing that fills up (a 16 MiB tmpfs, enlarged later with ``remount,size=``): ENOSPC;
- a backing that answers EIO, or does not answer at all: ``tests/faultfs.py``, a passthrough
  FUSE filesystem in its own process, told to fail through its control file or SIGSTOPped.

Each test watches the backing while the fault lasts and after it: no file ever appears under
its final name torn or out of order, and once the fault is gone ``acpfs sync`` makes the
backing equal to the mount. Everything mounted here (tmpfs, faultfs, acpfs) is unmounted at
teardown, the faults repaired first so that acpfs can drain.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from conftest import acpfs, listing, wait_for
from trees import tree

MiB = 1 << 20
TEMP_PREFIX = ".acpfs-tmp-"


def sha(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def data_for(tag: str, size: int) -> bytes:
    head = f"<<{tag}>>".encode()
    return head + os.urandom(size - len(head))


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


class Bounded(threading.Thread):
    """``fn()`` in a daemon thread. A call stuck on a hung mount stays stuck in its thread
    (released at teardown), so a hang fails the test instead of hanging it."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.out = fn, []
        self.start_t = time.monotonic()
        self.start()

    def run(self) -> None:
        try:
            self.out.append(self.fn())
        except BaseException as e:  # reported to the caller
            self.out.append(e)

    def result(self, timeout: float) -> tuple[bool, object, float]:
        """(finished in time, result or exception, seconds since start)."""
        self.join(max(0.0, timeout - (time.monotonic() - self.start_t)))
        return (not self.is_alive()), (self.out[0] if self.out else None), \
            time.monotonic() - self.start_t


def bounded(fn, timeout: float) -> tuple[bool, object, float]:
    return Bounded(fn).result(timeout)


def error_with(m, prefix: str):
    """The first status error whose reason starts with ``prefix``, or None."""
    for e in m.status()["errors"]:
        if e["reason"].startswith(prefix):
            return e
    return None


def check_error_entry(e: dict, reason_prefix: str) -> None:
    assert e["reason"].startswith(reason_prefix), e
    assert e["attempts"] >= 1, e
    assert isinstance(e["next_retry_in_s"], (int, float)) and 0 <= e["next_retry_in_s"] <= 30, e
    assert e["since"] <= time.time(), e
    assert e["op"] and e["path"], e


def backing_files(root: Path) -> dict[str, bytes]:
    """Regular files under their final names (acpfs temporary files and staging, and the
    node records of global order, skipped)."""
    return tree(root, skip=lambda d: d.startswith(TEMP_PREFIX) or d == ".acpfs-nodes",
                skip_files=lambda n: n.startswith(TEMP_PREFIX), modes=False, dirs=False,
                vanished_ok=True)


class Watcher(threading.Thread):
    """Polls a backing directory until stopped. Every file under a final name must be one
    complete version registered for it in ``versions`` (name -> set of sha1), and the names in
    ``order`` must land as a prefix: never a later one present while an earlier one is not."""

    def __init__(self, root: Path, versions: dict[str, set[str]], order: list[str]) -> None:
        super().__init__(daemon=True)
        self.root, self.versions, self.order = root, versions, order
        self.stop_ev = threading.Event()
        self.violations: list[str] = []
        self.polls = 0
        self.crash: BaseException | None = None

    def poll(self) -> None:
        seen = backing_files(self.root)
        for name, data in seen.items():
            ok = self.versions.get(name)
            if ok is None:
                self.violations.append(f"unexpected file {name} ({len(data)} bytes)")
            elif sha(data) not in ok:
                self.violations.append(f"{name}: {len(data)} bytes, not a complete version (torn?)")
        landed = [n in seen for n in self.order]
        if False in landed and True in landed[landed.index(False):]:
            self.violations.append("out of order: " + " ".join(
                f"{n}{'+' if x else '-'}" for n, x in zip(self.order, landed)))
        self.polls += 1

    def run(self) -> None:
        try:
            while not self.stop_ev.is_set():
                self.poll()
                time.sleep(0.02)
            self.poll()
        except BaseException as e:
            self.crash = e

    def finish(self) -> None:
        self.stop_ev.set()
        self.join(60)
        assert not self.is_alive(), "watcher did not stop"
        if self.crash is not None:
            raise self.crash
        assert self.polls > 1
        assert not self.violations, self.violations[:10]


def log_lines(m) -> list[str]:
    return m.log.read_text(errors="replace").splitlines() if m.log.exists() else []


def assert_backing_equals_mount(back: Path, m) -> None:
    assert not [p for p in os.listdir(back) if p.startswith(TEMP_PREFIX)], os.listdir(back)
    assert tree(back) == tree(m.mnt)


# -- 1. read-only backing ----------------------------------------------------------------------

def test_read_only_backing_is_retried_and_lands_in_order(make_mount, faults):
    m = make_mount("ro", cache_size="64M", mount=False)
    faults.tmpfs(m.back, "64M")
    faults.mount(m)
    old = data_for("old", 256 << 10)
    write_file(m.mnt / "old", old)
    m.sync()
    faults.remount(m.back, "ro")

    order = [f"step_2/part-{i}" for i in range(5)] + ["latest"]
    content = {name: data_for(name, (1 + i) * MiB) for i, name in enumerate(order[:-1])}
    content["latest"] = b"step_2\n"
    versions = {name: {sha(d)} for name, d in content.items()} | {"old": {sha(old)}}
    watcher = Watcher(m.back, versions, order)
    watcher.start()
    try:
        (m.mnt / "step_2").mkdir()
        for name in order:
            start = time.monotonic()
            write_file(m.mnt / name, content[name])      # write + close
            assert time.monotonic() - start < 2, f"writing {name} waited for the backing"
        for name in order:
            assert (m.mnt / name).read_bytes() == content[name]
        e = wait_for(lambda: error_with(m, "EROFS"), 10, "an EROFS error in status")
        check_error_entry(e, "EROFS")
        assert e["path"] == "step_2" and e["op"] == "mkdir"   # the first op, holding the rest
        assert "Read-only file system" in e["reason"]
        assert m.state("step_2").startswith("error: EROFS")
        st = m.status()
        assert st["queue"]["pending_ops"] == len(order) + 1
        assert st["flushing"]["files"] == len(order)
        r = acpfs("sync", str(m.mnt), "--timeout", "2", check=False)
        assert r.returncode == 1 and "timed out" in r.stderr and "EROFS" in r.stderr
        time.sleep(2)                                    # a few more failed attempts
        assert listing(m.back) == ["old"]     # nothing reached the backing
        faults.remount(m.back, "rw")
        m.sync(timeout=60)
    finally:
        watcher.finish()
    assert m.status()["errors"] == []
    assert_backing_equals_mount(m.back, m)
    for name, data in content.items():
        assert (m.back / name).read_bytes() == data
    assert any("succeeded after" in line for line in log_lines(m))


# -- 2. full backing ---------------------------------------------------------------------------

def test_full_backing_keeps_old_version_and_recovers(make_mount, faults):
    m = make_mount("full", cache_size="64M", mount=False)
    faults.tmpfs(m.back, "16M")
    faults.mount(m)
    model_a = data_for("model-A", 6 * MiB)
    write_file(m.mnt / "model.bin", model_a)
    m.sync()

    model_b = data_for("model-B", 6 * MiB)
    fills = {f"fill{i}": data_for(f"fill{i}", 8 * MiB) for i in (1, 2)}
    latest = b"model-B\n"
    versions = {"model.bin": {sha(model_a), sha(model_b)}, "latest": {sha(latest)}}
    versions |= {n: {sha(d)} for n, d in fills.items()}
    watcher = Watcher(m.back, versions, ["fill1", "fill2", "latest"])
    watcher.start()
    try:
        for name, data in fills.items():
            write_file(m.mnt / name, data)
        write_file(m.mnt / "model.bin", model_b)         # replaces A, after the fills
        write_file(m.mnt / "latest", latest)
        e = wait_for(lambda: error_with(m, "ENOSPC"), 15, "an ENOSPC error in status")
        check_error_entry(e, "ENOSPC")
        assert e["path"] in ("fill1", "fill2", "model.bin")
        assert m.status()["flusher_alive"]
        time.sleep(2)
        # the fault holds: the old good version is intact, nothing later has landed
        assert (m.back / "model.bin").read_bytes() == model_a
        assert not (m.back / "fill2").exists() and not (m.back / "latest").exists()
        assert (m.mnt / "model.bin").read_bytes() == model_b
        faults.remount(m.back, "size=256M")
        m.sync(timeout=60)
    finally:
        watcher.finish()
    assert m.status()["errors"] == []
    assert_backing_equals_mount(m.back, m)
    assert (m.back / "model.bin").read_bytes() == model_b
    assert (m.back / "latest").read_bytes() == latest
    for name, data in fills.items():
        assert (m.back / name).read_bytes() == data


# -- 3. I/O errors -----------------------------------------------------------------------------

RETRY_LINE = re.compile(r" (WARNING|ERROR) acpfs\.backing\.retry\[\d+\]: (.*) failed \((\w+): .*\), "
                        r"attempt (\d+); retrying in ")


def test_eio_backing_escalates_in_the_log_and_recovers(make_mount, faults, tmp_path):
    m = make_mount("eio", cache_size="64M", mount=False)
    src = tmp_path / "eio-src"
    shim = faults.shim(src, m.back)
    faults.mount(m)
    (m.mnt / "ckpt").mkdir()
    write_file(m.mnt / "ckpt" / "base", b"before the fault")
    m.sync()

    order = [f"ckpt/shard-{i}" for i in range(4)] + ["latest"]
    content = {n: data_for(n, 2 * MiB) for n in order[:-1]}
    content["latest"] = b"ckpt\n"
    versions = {n: {sha(d)} for n, d in content.items()} | {"ckpt/base": {sha(b"before the fault")}}
    watcher = Watcher(src, versions, order)
    watcher.start()
    try:
        shim.set("eio")
        for name in order:
            start = time.monotonic()
            write_file(m.mnt / name, content[name])
            assert time.monotonic() - start < 2, f"writing {name} waited for the backing"
        e = wait_for(lambda: error_with(m, "EIO"), 10, "an EIO error in status")
        check_error_entry(e, "EIO")
        assert e["path"] in order[:-1]
        assert m.state(e["path"]).startswith("error: EIO")
        # retry.py: attempt 1 is logged as a warning, every 5th attempt as an error
        wait_for(lambda: any((r := RETRY_LINE.search(line)) and r[1] == "ERROR"
                             for line in log_lines(m)), 20, "an ERROR retry line in the log")
        assert sorted(p.name for p in (src / "ckpt").iterdir()) == ["base"]
        assert not (src / "latest").exists()
        shim.set("ok")
        m.sync(timeout=60)
    finally:
        watcher.finish()
    retries = [r.groups() for line in log_lines(m) if (r := RETRY_LINE.search(line))]
    assert retries and all(code == "EIO" for _, _, code, _ in retries), retries
    for level, what, _, attempt in retries:
        assert int(attempt) == 1 or int(attempt) % 5 == 0, (level, what, attempt)
        assert level == ("WARNING" if int(attempt) < 5 else "ERROR"), (level, what, attempt)
    whats = {what for _, what, _, _ in retries}
    for what in whats:
        firsts = [lv for lv, w, _, a in retries if w == what and a == "1"]
        assert firsts == ["WARNING"], (what, firsts)
    assert any(lv == "ERROR" for lv, *_ in retries)
    assert any(re.search(r" WARNING acpfs\.backing\.retry\[\d+\]: .* succeeded after \d+ failed attempts", line)
               for line in log_lines(m))
    assert m.status()["errors"] == []
    assert tree(src) == tree(m.mnt)
    for name, data in content.items():
        assert (src / name).read_bytes() == data


# -- 4. hung backing ---------------------------------------------------------------------------

def test_hung_backing_does_not_block_cached_work(make_mount, faults, tmp_path):
    m = make_mount("hung", cache_size="64M", mount=False)
    src = tmp_path / "hung-src"
    src.mkdir()
    (src / "uncached.bin").write_bytes(b"only in the backing")
    (src / "unlisted").mkdir()
    (src / "unlisted" / "f").write_bytes(b"in a directory never listed")
    shim = faults.shim(src, m.back)
    faults.mount(m)
    cached = data_for("cached", 2 * MiB)
    (m.mnt / "listed").mkdir()
    write_file(m.mnt / "listed" / "a", cached)
    os.symlink("a", m.mnt / "listed" / "link")
    m.sync()
    names = sorted(os.listdir(m.mnt))
    assert names == ["listed", "uncached.bin", "unlisted"]

    shim.stop()                                          # the backing stops answering
    new = {f"new-{i}": data_for(f"new-{i}", MiB) for i in range(3)}
    checks = {
        "write+close new files": lambda: [write_file(m.mnt / n, d) for n, d in new.items()],
        "mkdir + write in it": lambda: ((m.mnt / "fresh").mkdir(),
                                        write_file(m.mnt / "fresh" / "x", b"x")),
        "rename new file": lambda: os.rename(m.mnt / "fresh" / "x", m.mnt / "fresh" / "y"),
        "read cached file": lambda: (m.mnt / "listed" / "a").read_bytes() == cached or 1 / 0,
        "stat": lambda: [os.stat(m.mnt / p) for p in ("listed", "listed/a", "uncached.bin", "new-0")],
        "readlink": lambda: os.readlink(m.mnt / "listed" / "link") == "a" or 1 / 0,
        "ls listed dirs": lambda: (sorted(os.listdir(m.mnt / "listed")) == ["a", "link"]
                                   and "new-0" in os.listdir(m.mnt)) or 1 / 0,
        "status xattr": lambda: m.status()["flusher_alive"] or 1 / 0,
        "acpfs status --json": lambda: json.loads(acpfs("status", str(m.mnt), "--json",
                                                        timeout=30).stdout)["pid"],
        "acpfs sync --timeout 1 (times out)": lambda: (lambda r: r.returncode == 1
                                                       and "timed out" in r.stderr or 1 / 0)(
            acpfs("sync", str(m.mnt), "--timeout", "1", check=False, timeout=30)),
    }
    # expected to wait for the backing (they need it), probed only to be documented
    waiting = {
        "read uncached file": lambda: (m.mnt / "uncached.bin").read_bytes(),
        "ls never-listed dir": lambda: os.listdir(m.mnt / "unlisted"),
        "statvfs (df)": lambda: os.statvfs(m.mnt),
    }
    problems, blocked, probes = [], [], {}
    for round_ in ("hung", "hung, with blocked readers"):
        for what, fn in checks.items():
            if round_ != "hung" and what in ("mkdir + write in it", "rename new file"):
                continue
            ok, res, secs = bounded(fn, 5)
            if not ok:
                problems.append(f"{round_}: {what}: still blocked after {secs:.1f}s")
            elif isinstance(res, BaseException):
                problems.append(f"{round_}: {what}: {res!r}")
        if round_ == "hung":
            for what, fn in waiting.items():
                probes[what] = Bounded(fn)
                ok, res, secs = probes[what].result(1)
                blocked.append(f"{what}: {'blocks' if not ok else f'returned {res!r}'}")
    print("on a hung backing:", "; ".join(blocked))
    st = m.status() if not problems else None
    if st is not None:
        assert st["flushing"]["files"] >= len(new) and st["queue"]["pending_ops"] > 0
    assert listing(src) == ["listed", "uncached.bin", "unlisted"]   # nothing landed

    shim.cont()
    m.sync(timeout=60)
    # what waited for the backing completes once it answers again
    results = {what: p.result(30) for what, p in probes.items()}
    assert all(ok for ok, _, _ in results.values()), results
    assert results["read uncached file"][1] == b"only in the backing"
    assert results["ls never-listed dir"][1] == ["f"]
    assert isinstance(results["statvfs (df)"][1], os.statvfs_result)
    assert m.status()["errors"] == []
    assert tree(src) == tree(m.mnt)
    for n, d in new.items():
        assert (src / n).read_bytes() == d
    assert (src / "fresh" / "y").read_bytes() == b"x"
    assert not problems, problems


# -- 5. full cache and a failing backing -------------------------------------------------------

@pytest.mark.parametrize("fault", ["read-only", "hung"])
def test_full_cache_with_backing_down_gives_enospc(make_mount, faults, tmp_path, fault):
    m = make_mount("cfull", cache_size="16M", extra=("--cache-full-timeout", "3"), mount=False)
    if fault == "read-only":
        back = faults.tmpfs(m.back, "256M")
        faults.mount(m)
        faults.remount(back, "ro")
        shim = None
    else:
        back = tmp_path / "cfull-src"
        shim = faults.shim(back, m.back)
        faults.mount(m)
        os.listdir(m.mnt)                                # the root is listed before the hang
        shim.stop()
    closed = {f"kept-{i}": data_for(f"kept-{i}", 4 * MiB) for i in range(2)}
    for name, data in closed.items():
        write_file(m.mnt / name, data)

    chunk = os.urandom(MiB)

    def writer() -> tuple[int, BaseException | None]:
        written = 0
        try:
            with open(m.mnt / "big", "wb", buffering=0) as f:
                for i in range(64):                      # 4x the cache
                    written += f.write(i.to_bytes(4, "big") + chunk[4:])
        except OSError as e:
            return written, e
        return written, None

    w = Bounded(writer)
    ok, res, secs = w.result(3 + 30)
    try:
        if ok:
            written, err = res
            assert isinstance(err, OSError) and err.errno == 28, (err, written)   # ENOSPC
            assert 0 < written < 16 * MiB
            # the operator learns why from one ERROR line
            assert any(" ERROR " in line and "ENOSPC" in line for line in log_lines(m))
        st = m.status()
        assert st["cache"]["peak_used_bytes"] <= 16 * MiB
        if fault == "read-only":
            check_error_entry(wait_for(lambda: error_with(m, "EROFS"), 10, "EROFS in status"), "EROFS")
        for name, data in closed.items():                # still served from the cache
            assert (m.mnt / name).read_bytes() == data
    finally:
        if shim is not None:
            shim.cont()
    if not ok:   # let it finish, so that what follows checks that nothing was lost meanwhile
        assert w.result(120)[0], "the writer is still blocked after the backing came back"
    if fault == "read-only":
        faults.remount(back, "rw")
    m.sync(timeout=90)
    for name, data in closed.items():
        assert (back / name).read_bytes() == data
    big = (m.mnt / "big").read_bytes()
    assert (back / "big").read_bytes() == big
    assert tree(back) == tree(m.mnt)
    assert ok, f"the writer was still blocked after {secs:.0f}s (cache full, backing {fault}), " \
               f"instead of getting ENOSPC after --cache-full-timeout 3"
    assert 0 < len(big) < 64 * MiB


# -- 6. many writers, each larger than the cache -------------------------------------------------

def test_ten_parallel_writers_larger_than_the_cache(make_mount):
    m = make_mount("par", cache_size="32M")
    limit = 32 * MiB
    base = os.urandom(MiB)
    digests: dict[str, str] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def writer(w: int) -> None:
        try:
            for k in range(2):
                name = f"w{w}-f{k}"
                h = hashlib.sha256()
                with open(m.mnt / name, "wb", buffering=0) as f:
                    for c in range(48):                  # 48 MiB each, distinct chunks
                        block = f"{w}/{k}/{c}|".encode().ljust(16, b".") + base[16:]
                        assert f.write(block) == MiB
                        h.update(block)
                with lock:
                    digests[name] = h.hexdigest()
        except BaseException as e:
            with lock:
                errors.append(f"writer {w}: {e!r}")

    threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(10)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1, 240 - (time.monotonic() - start)))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"writers {stuck} still running after 240s (deadlock?); status: {m.status()}"
    assert not errors, errors
    assert len(digests) == 20
    m.sync(timeout=240)
    st = m.status()
    assert st["errors"] == []
    assert limit // 2 < st["cache"]["peak_used_bytes"] <= limit
    assert m.store_bytes() <= limit
    for name, digest in digests.items():
        with open(m.back / name, "rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == digest, name
    assert listing(m.back) == sorted(digests)
