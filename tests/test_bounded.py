"""Contract 6 (bounded) and contract 9 (safe): RAM use stays under --cache-size; the daemon
never writes outside the backing root; the cache directory is private."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import threading
import time

from conftest import acpfs, wait_for


def test_1gib_through_a_64mib_cache(make_mount):
    m = make_mount(cache_size="64M")
    limit = 64 << 20
    peak_seen = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak_seen[0] = max(peak_seen[0], m.status()["cache"]["used_bytes"])
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    digests = {}
    try:
        chunk = os.urandom(1 << 20)
        for i in range(64):                       # 64 files x 16 MiB = 1 GiB
            h = hashlib.sha256()
            with open(m.mnt / f"part-{i:02d}", "wb") as f:
                for j in range(16):
                    block = bytes([i, j]) + chunk[2:]
                    f.write(block)
                    h.update(block)
            digests[f"part-{i:02d}"] = h.hexdigest()
    finally:
        stop.set()
        sampler.join()
    m.sync(timeout=300)
    st = m.status()
    assert st["cache"]["limit_bytes"] == limit
    assert st["cache"]["peak_used_bytes"] <= limit
    assert peak_seen[0] <= limit
    if st["cache"]["store"] == "pool":
        assert st["cache"]["peak_used_bytes"] > limit // 2   # the cache was really used up
    else:
        # with passthrough a writer is admitted only with 64 MiB free (semantics, section 6):
        # here one file at a time is written by the kernel, the rest through the daemon
        assert st["cache"]["peak_used_bytes"] >= 16 << 20
    # the content store never holds more than the limit
    assert m.store_bytes() <= limit
    for name, digest in digests.items():
        with open(m.back / name, "rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == digest, name
    # and the mount still serves every byte (mostly from the backing after eviction)
    with open(m.mnt / "part-00", "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == digests["part-00"]


def test_files_larger_than_the_cache_are_written_through(make_mount, tmp_path):
    m = make_mount(cache_size="4M")
    srcs = []
    for i in range(4):
        src = tmp_path / f"src{i}"
        src.write_bytes(os.urandom((24 + 8 * i) << 20))
        srcs.append(src)
    big = tmp_path / "big"
    big.write_bytes(os.urandom(96 << 20))
    # one file 24x the cache, then 4 writers in parallel, each larger than the cache
    subprocess.run(["dd", f"if={big}", f"of={m.mnt / 'big'}", "bs=1M", "status=none"], check=True)
    procs = [subprocess.Popen(["cp", str(s), str(m.mnt / s.name)]) for s in srcs]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0]
    assert (m.mnt / "big").read_bytes() == big.read_bytes()
    with open(m.mnt / "big", "ab") as f:          # reopened for appending: still larger than the cache
        f.write(b"tail")
    m.sync(timeout=300)
    assert (m.back / "big").read_bytes() == big.read_bytes() + b"tail"
    for s in srcs:
        assert (m.back / s.name).read_bytes() == s.read_bytes()
    assert m.status()["cache"]["peak_used_bytes"] <= 4 << 20
    # staging files were all renamed into place, and the empty staging directory removed
    assert not [n for n in os.listdir(m.back) if n.startswith(".acpfs-tmp-")]


def test_cache_full_with_nothing_to_free_gives_enospc_not_a_hang(make_mount):
    m = make_mount(cache_size="4M", extra=("--cache-full-timeout", "2"))
    # The backing refuses the write-through (its staging directory cannot be created), so
    # the cache cannot make room for a file larger than itself: the writer gets ENOSPC
    # after --cache-full-timeout, it does not hang.
    (m.back / f".acpfs-tmp-{m.status()['instance']}-staging").write_bytes(b"in the way")
    start = time.monotonic()
    err = None
    try:
        with open(m.mnt / "huge", "wb") as f:
            for _ in range(16):
                f.write(os.urandom(1 << 20))
                f.flush()
    except OSError as e:
        err = e
    assert err is not None and err.errno == 28   # ENOSPC
    assert time.monotonic() - start < 60
    # the mount stays usable afterwards; what the writer got in is persisted
    (m.mnt / "small").write_bytes(b"ok")
    assert (m.mnt / "small").read_bytes() == b"ok"
    m.sync()
    assert (m.back / "small").read_bytes() == b"ok"
    assert (m.back / "huge").read_bytes() == (m.mnt / "huge").read_bytes()
    assert 0 < (m.back / "huge").stat().st_size < 16 << 20


def test_a_file_read_while_the_cache_was_full_gives_its_space_back(make_mount):
    """Eviction passes over a cached file the kernel is reading (passthrough: the kernel holds
    its memory file) and takes it off the list of files to evict. Its close must put it back:
    else its space is lost to the cache until unmount, and a later truncate waited for the
    cache-full timeout and failed with ENOSPC. Without passthrough the daemon serves x's reads
    and x is evicted for y at once: there the preload while x is open succeeds."""
    m = make_mount(cache_size="1M")
    passthrough = m.status()["passthrough"]["on"]
    (m.back / "x").write_bytes(b"x" * (600 << 10))
    (m.back / "y").write_bytes(b"y" * (600 << 10))
    acpfs("preload", str(m.mnt / "x"))
    with open(m.mnt / "x", "rb") as f:
        assert f.read(1) == b"x"
        r = acpfs("preload", str(m.mnt / "y"), check=False)
        if passthrough:   # the kernel holds x's memory file: x stays, y does not fit (ENOSPC)
            assert r.returncode == 1, r
            assert f"not loaded: {m.mnt / 'y'}: the cache is full" in r.stderr, r.stderr
            assert "preloaded 0 files (0 B); 1 did not fit in the cache" in r.stderr, r.stderr
        else:             # the daemon reads x for the kernel: x is evicted, y fits
            assert r.returncode == 0 and "preloaded 1 files (600.0 KiB)" in r.stderr, r
    # the kernel releases x after close() returns: y fits once the release is handled
    wait_for(lambda: acpfs("preload", str(m.mnt / "y"), check=False).returncode == 0,
             timeout=10, what="y to fit in the cache once x is closed")
    assert m.status()["cache"]["used_bytes"] <= 1 << 20
    assert (m.mnt / "y").read_bytes() == b"y" * (600 << 10)
    assert (m.mnt / "x").read_bytes() == b"x" * (600 << 10)   # from the backing, or cached again


def test_cache_dir_is_private(mnt):
    assert stat.S_IMODE(os.stat(mnt.cache_dir).st_mode) == 0o700
    store = mnt.cache_dir / ("pool" if mnt.status()["cache"]["store"] == "pool" else "files")
    assert stat.S_IMODE(os.stat(store).st_mode) == (0o600 if store.name == "pool" else 0o700)


def test_daemon_never_follows_a_symlink_out_of_the_backing(make_mount, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    m = make_mount()
    (m.mnt / "d").mkdir()
    m.sync()
    # Behind acpfs's back, the backing directory "d" is replaced by a symlink leading out.
    os.rename(m.back / "d", m.back / "d.real")
    os.symlink(outside, m.back / "d")
    (m.mnt / "d" / "secret").write_bytes(b"must not escape")
    m.sync(timeout=60)
    # never followed: moved out of the way (a conflict), the directory made again in its place
    assert os.listdir(outside) == []
    assert (m.back / "d" / "secret").read_bytes() == b"must not escape"
    assert not (m.back / "d").is_symlink()
    [aside] = (m.back / ".acpfs-conflicts").glob("*/d")
    assert os.readlink(aside) == str(outside)
    st = m.status()
    assert st["errors"] == []
    assert {k: n for k, n in st["conflicts"]["by_kind"].items() if n} == \
        {"moved_aside": 1, "dir_recreated": 1}


def test_symlinks_in_the_mount_are_stored_not_followed(mnt, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.symlink(str(outside), mnt.mnt / "escape")
    os.symlink("../../..", mnt.mnt / "up")
    mnt.sync()
    assert os.readlink(mnt.back / "escape") == str(outside)
    assert os.readlink(mnt.back / "up") == "../../.."
    assert os.listdir(outside) == []
