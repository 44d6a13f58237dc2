"""Kernel passthrough (passthrough.py, memfiles.py): cached files read, written and mapped
by the kernel itself, and what the daemon still answers for them.

These run on the data path a mount chooses: as root on Linux 6.9+ (as CI runs them, with
ACPFS_PASSTHROUGH=on so that no mount quietly does without) they check passthrough; on the
daemon's path (./tools/test-daemon-path, or elsewhere) the tests that need it skip, and the
rest check that path gives the same answers.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import subprocess
import time

import pytest

from conftest import ACPFS, acpfs, is_mounted, wait_for


def passthrough_on(m) -> bool:
    return m.status()["passthrough"]["on"]


def need_passthrough(m) -> None:
    if not passthrough_on(m):
        pytest.skip(f"passthrough not in use here: {m.status()['passthrough']['why_not']}")


def test_reads_writes_and_mappings_never_reach_the_daemon(mnt):
    need_passthrough(mnt)
    data = random.Random(1).randbytes(24 << 20)
    first = mnt.status()
    (mnt.mnt / "f").write_bytes(data)     # a new name: its size is not known yet
    opens = mnt.status()["cache"]["writer_opens"]
    assert opens["unknown_size"] == first["cache"]["writer_opens"]["unknown_size"] + 1, opens
    assert mnt.status()["requests"]["write"] > first["requests"].get("write", 0), \
        "a writer of a new name in a store in RAM takes the daemon's path"
    out = subprocess.run([*ACPFS, "status", str(mnt.mnt)], capture_output=True, text=True,
                         check=True).stdout
    assert f"writers by the daemon: {opens['unknown_size']} of new names)" in out, out
    before = mnt.status()
    (mnt.mnt / "f").write_bytes(data)     # its second save: passed through
    assert (mnt.mnt / "f").read_bytes() == data
    with open(mnt.mnt / "f", "r+b") as f:
        with mmap.mmap(f.fileno(), 0) as mm:
            assert mm[5 << 20:(5 << 20) + 10] == data[5 << 20:(5 << 20) + 10]
            mm[0:4] = b"MMAP"
    subprocess.run(["dd", f"if={mnt.mnt / 'f'}", "of=/dev/null", "bs=1M", "status=none"], check=True)
    after = mnt.status()
    for kind in ("read", "write"):
        assert after["requests"].get(kind, 0) == before["requests"].get(kind, 0), \
            f"a {kind.upper()} reached the daemon"
    assert after["passthrough"]["opens"] >= before["passthrough"]["opens"] + 4
    assert after["cache"]["store"] == "memory files"
    mnt.sync()
    assert (mnt.back / "f").read_bytes() == b"MMAP" + data[4:]


def test_stat_size_and_times_follow_writes_the_daemon_did_not_see(mnt):
    """The kernel writes the memory file: a stat right after a write (the file still open)
    shows the new size, and truncate, fallocate and utimens still apply."""
    path = mnt.mnt / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        t0 = os.fstat(fd).st_mtime_ns
        time.sleep(0.01)
        os.pwrite(fd, b"x" * 5000, 0)
        assert os.fstat(fd).st_size == 5000
        assert os.stat(path).st_size == 5000
        assert os.stat(path).st_mtime_ns > t0
        os.pwrite(fd, b"y", (3 << 20) - 1)
        assert os.stat(path).st_size == 3 << 20
        os.ftruncate(fd, 100)
        assert os.fstat(fd).st_size == 100
        os.posix_fallocate(fd, 0, 1 << 20)
        assert os.stat(path).st_size == 1 << 20
        os.utime(fd, ns=(10**18, 10**18))
        assert os.stat(path).st_mtime_ns == 10**18   # kept: no write since
        os.pwrite(fd, b"z", 0)
        assert os.fstat(fd).st_mtime_ns != 10**18
    finally:
        os.close(fd)
    want = b"z" + b"x" * 99 + bytes((1 << 20) - 100)
    assert path.read_bytes() == want
    mnt.sync()
    assert (mnt.back / "f").read_bytes() == want


def test_every_open_of_a_file_open_with_passthrough_works(mnt):
    """The kernel fails an open with EIO when an inode has opens of both kinds: readers,
    writers, appenders and mappings of one file, in any order, all work."""
    path = mnt.mnt / "f"
    path.write_bytes(b"a" * 8192)
    r = open(path, "rb")
    w = open(path, "r+b")
    a = open(path, "ab")
    try:
        w.write(b"W")
        w.flush()
        a.write(b"tail")
        a.flush()
        assert r.read(1) == b"W"
        with mmap.mmap(r.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert mm[-4:] == b"tail"
        r2 = open(path, "rb")
        assert r2.read() == b"W" + b"a" * 8191 + b"tail"
        r2.close()
    finally:
        for f in (r, w, a):
            f.close()
    mnt.sync()
    assert (mnt.back / "f").read_bytes() == b"W" + b"a" * 8191 + b"tail"


def test_o_trunc_cuts_what_a_writer_passed_through_wrote_unseen(mnt):
    """A file held open for writing with passthrough, written by the kernel without the
    daemon seeing it, then opened again with O_TRUNC: the open cuts those bytes too. The
    daemon once went by the size it had last seen (0) and kept them, and an append after it
    landed past them."""
    path = mnt.mnt / "f"
    path.write_bytes(b"")
    held = os.open(path, os.O_RDWR)
    try:
        os.pwrite(held, b"x", 0)                       # the kernel writes; the daemon sees nothing
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.close(fd)
        assert os.fstat(held).st_size == 0
        with open(path, "ab") as f:
            f.write(b"C" * 3)
        assert os.pread(held, 10, 0) == b"CCC"
    finally:
        os.close(held)
    mnt.sync()
    assert path.read_bytes() == b"CCC" and (mnt.back / "f").read_bytes() == b"CCC"


def test_a_file_read_from_the_backing_and_then_written_works(mnt):
    """An uncached file is read through the daemon (from the backing); a writer that opens
    it meanwhile takes the daemon's path too, not EIO."""
    (mnt.back / "old").write_bytes(b"backing content\n")
    r = open(mnt.mnt / "old", "rb")
    try:
        assert r.read(7) == b"backing"
        with open(mnt.mnt / "old", "r+b") as w:
            w.write(b"BACKING")
        assert open(mnt.mnt / "old", "rb").read() == b"BACKING content\n"
    finally:
        r.close()
    # with every open closed, the next opens are passed through again
    with open(mnt.mnt / "old", "ab") as w:
        w.write(b"more\n")
    mnt.sync()
    assert (mnt.back / "old").read_bytes() == b"BACKING content\nmore\n"


def test_a_reopen_for_writing_while_the_last_close_uploads_keeps_that_version_whole(faults, make_mount, tmp_path):
    """The upload of a file's last close must not see the bytes of the next writer: the
    writer gets its own copy of the memory file (beside a reader the kernel passes through,
    it waits for the upload instead). Held in the middle of writing v1's temporary file
    while v2 is written, the upload still lands v1 whole; then v2 lands."""
    m = make_mount("m", mount=False)
    src = tmp_path / "src"
    shim = faults.shim(src, m.back)
    faults.mount(m)
    v1 = random.Random(2).randbytes(8 << 20)
    v2 = random.Random(3).randbytes(8 << 20)
    shim.set("hang write")                           # v1's upload stops at its first write
    (m.mnt / "f").write_bytes(v1)
    wait_for(lambda: m.status()["flushing"]["in_flight"] == 1, what="v1's upload under way")
    fd = os.open(m.mnt / "f", os.O_RDWR)             # no O_TRUNC: v1's bytes, rewritten
    try:
        os.pwrite(fd, v2, 0)
        assert os.pread(fd, 16, 0) == v2[:16]
    finally:
        os.close(fd)
    shim.set("hang rename")                          # v1's temporary file completes, no more

    def whole_temporary_files() -> list[bytes]:
        """The temporary files written to their full size: v1's upload's, and v2's, which
        may run beside it (uploads run in parallel; only their publishes are in order)."""
        found = []
        for p in src.glob(".acpfs-tmp-*"):
            with contextlib.suppress(FileNotFoundError):
                if p.stat().st_size == len(v1):
                    found.append(p.read_bytes())
        return found

    temps = wait_for(lambda: (t := whole_temporary_files()) and v1 in t and t,
                     what="v1's temporary file written whole")
    assert all(t in (v1, v2) for t in temps)
    shim.set("ok")
    m.sync(timeout=120)
    assert (src / "f").read_bytes() == v2
    assert (m.mnt / "f").read_bytes() == v2


def serves_by_the_daemon(m) -> None:
    """``m`` (mounted with passthrough off) says so in its status, ``acpfs status`` and its
    log, keeps its content in the pool, and its reads and writes reach the daemon."""
    st = m.status()
    assert st["passthrough"] == {"on": False, "why_not": "turned off (--passthrough off)"}
    assert st["cache"]["store"] == "pool"
    assert (m.cache_dir / "pool").exists()
    assert "kernel passthrough off: turned off (--passthrough off)" in m.log.read_text()
    out = subprocess.run([*ACPFS, "status", str(m.mnt)], capture_output=True, text=True,
                         check=True).stdout
    assert "through the daemon, pool (turned off (--passthrough off))" in out
    (m.mnt / "f").write_bytes(b"served by the daemon")
    assert (m.mnt / "f").read_bytes() == b"served by the daemon"
    assert m.status()["requests"]["write"] >= 1 and m.status()["requests"]["read"] >= 1


def serves_by_the_kernel(m) -> None:
    """``m`` has passthrough and says so in its status, ``acpfs status`` and its log, keeps
    its content in memory files, not the pool, and its reads and writes never reach the
    daemon: their opens are passed through."""
    st = m.status()
    assert st["passthrough"]["on"] is True and st["passthrough"]["why_not"] == "", st["passthrough"]
    assert st["cache"]["store"] == "memory files"
    assert not (m.cache_dir / "pool").exists()
    log = m.log.read_text()
    assert "content store: memory files" in log and "kernel passthrough off" not in log
    out = subprocess.run([*ACPFS, "status", str(m.mnt)], capture_output=True, text=True,
                         check=True).stdout
    assert "data path  kernel passthrough into memory files" in out, out
    (m.mnt / "f").write_bytes(b"served by the daemon, its name new")   # size known from here
    st = m.status()
    (m.mnt / "f").write_bytes(b"served by the kernel")
    assert (m.mnt / "f").read_bytes() == b"served by the kernel"
    after = m.status()
    for kind in ("read", "write"):
        assert after["requests"].get(kind, 0) == st["requests"].get(kind, 0), \
            f"a {kind.upper()} reached the daemon"
    assert after["passthrough"]["opens"] >= st["passthrough"]["opens"] + 2


def test_status_and_log_say_which_path_serves(make_mount):
    """Both data paths, wherever the suite runs, each said alike by the status document,
    ``acpfs status`` and the log: a mount with --passthrough off is served by the daemon
    from the pool, one with --passthrough on by the kernel from memory files, and a mount
    as the environment has it (ACPFS_PASSTHROUGH on, off, or unset: auto) takes the path
    that setting gives (auto: passthrough wherever it can be had). The passthrough half is
    skipped, with the reason, only where --passthrough on refuses the mount or the kernel
    does not grant it; never where ACPFS_PASSTHROUGH=on insists on it."""
    asked = (os.environ.get("ACPFS_PASSTHROUGH") or "auto").lower()
    assert asked in ("auto", "on", "off"), f"ACPFS_PASSTHROUGH={asked!r}"
    default = make_mount("default")            # the data path the environment gives
    serves_by_the_daemon(make_mount("off", extra=("--passthrough", "off")))
    if asked == "off":
        serves_by_the_daemon(default)
    if asked == "on":
        on = default                           # refused if it could not have passthrough
    else:
        on = make_mount("on", mount=False, extra=("--passthrough", "on"))
        r = acpfs(*on.args(), check=False)
        refused = "acpfs: --passthrough on: kernel passthrough is not possible here: "
        if r.returncode == 2 and r.stderr.startswith(refused):
            why_not = r.stderr[len(refused):].split(" (--passthrough auto")[0]
            if asked == "auto":                # auto did without it, for the same reason
                assert default.status()["passthrough"] == {"on": False, "why_not": why_not}
            assert not is_mounted(on.mnt)
            pytest.skip(f"passthrough cannot be had here: {why_not}")
        assert r.returncode == 0, r.stderr
        on.pid = on.status()["pid"]
        st = on.status()["passthrough"]
        if not st["on"] and "did not grant" in st["why_not"]:
            pytest.skip(f"passthrough cannot be had here: {st['why_not']}")
    serves_by_the_kernel(on)
    if asked == "auto":
        serves_by_the_kernel(default)


def test_memory_files_are_private_and_go_with_their_files(mnt):
    need_passthrough(mnt)
    files = mnt.cache_dir / "files"
    assert os.stat(files).st_mode & 0o777 == 0o700
    (mnt.mnt / "a").write_bytes(b"1" * 100_000)
    (mnt.mnt / "b").write_bytes(b"2" * 100_000)
    assert len(os.listdir(files)) == 2
    assert all(os.stat(files / n).st_mode & 0o777 == 0o600 for n in os.listdir(files))
    mnt.sync()
    os.unlink(mnt.mnt / "a")
    wait_for(lambda: len(os.listdir(files)) == 1, what="the memory file of a deleted file removed")


def test_a_mapping_that_writes_after_close_is_persisted_when_it_goes(make_mount):
    """close() with a shared writable mapping still alive keeps the file open (no RELEASE).
    What it held was persisted meanwhile (here by fsync with --fsync backing), and what the
    mapping writes afterwards lands when it is unmapped (the kernel's RELEASE), on either
    path: the daemon never saw those writes on the passthrough path."""
    mnt = make_mount(extra=("--fsync", "backing"))
    path = mnt.mnt / "f"
    path.write_bytes(b"a" * 65536)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 65536)
    mm[0:6] = b"BEFORE"
    mm.flush()
    os.fsync(fd)                                   # queued and persisted while open
    assert (mnt.back / "f").read_bytes()[:6] == b"BEFORE"
    os.close(fd)                                   # FLUSH; no RELEASE while mapped
    mm[0:5] = b"AFTER"
    mm.close()                                     # the last reference: RELEASE
    mnt.sync()
    assert (mnt.back / "f").read_bytes() == b"AFTER" + b"E" + b"a" * (65536 - 6)
    assert path.read_bytes() == (mnt.back / "f").read_bytes()


def test_passthrough_on_refuses_a_mount_that_cannot_have_it(tmp_path):
    """--passthrough on: where the kernel cannot pass files through (here: a daemon that is
    root only in a user namespace of its own, not in the initial one), the mount fails with
    one line instead of quietly taking the daemon's path; auto mounts on that path."""
    mnt, back, cache = tmp_path / "mnt", tmp_path / "back", tmp_path / "cache"
    mnt.mkdir()
    back.mkdir()
    r = subprocess.run(["unshare", "--user", "--map-root-user", *ACPFS, "mount", str(mnt),
                        "--backing", str(back), "--cache-dir", str(cache), "--cache-size", "16M",
                        "--passthrough", "on"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("acpfs: --passthrough on: ") \
        and "lacks CAP_SYS_ADMIN in the initial user namespace" in r.stderr, r.stderr
    assert not is_mounted(mnt)
    bad = subprocess.run([*ACPFS, "mount", str(mnt), "--backing", str(back), "--cache-dir",
                          str(cache)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "ACPFS_PASSTHROUGH": "sometimes"})
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 \
        and "invalid --passthrough 'sometimes': use auto, on or off" in bad.stderr, bad.stderr
    assert not is_mounted(mnt)


def test_a_change_of_owner_clears_setuid_and_setgid_of_anything_but_a_directory(mnt):
    """With FUSE_HANDLE_KILLPRIV_V2 (granted with passthrough) the kernel leaves clearing
    setuid/setgid at chown(2) to the daemon: for a regular file, a fifo or a device alike,
    as on a local filesystem; a directory keeps them."""
    made = {"file": lambda p: p.write_bytes(b"x"), "fifo": os.mkfifo,
            "dir": lambda p: p.mkdir()}
    for kind, make in made.items():
        p = mnt.mnt / kind
        make(p)
        os.chmod(p, 0o6755)
        os.chown(p, 65534, 65533)
        expect = 0o6755 if kind == "dir" else 0o755
        assert os.stat(p).st_mode & 0o7777 == expect, (kind, oct(os.stat(p).st_mode))
