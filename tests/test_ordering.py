"""Ordering and atomicity of what the backing directory shows while the flusher runs.

A watcher thread polls the backing directory as fast as it can while the test writes on the
mount; everything it sees must be a prefix of the mount's history, with every file either
absent or complete (acpfs temporary files ``.acpfs-tmp-*`` excepted).

The large-file tests run twice: with a cache big enough for everything (``ram``), and with a
cache smaller than one checkpoint (``spill``), where large files are written through to a
temporary file in the backing and finished (fsync, rename) in order at publish time.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

from conftest import listing

TEMP_PREFIX = ".acpfs-tmp-"
MiB = 1 << 20

# cache sizes: everything fits / checkpoints larger than the cache (write-through spill)
CACHES = pytest.mark.parametrize("cache_size", ["1G", "96M"], ids=["ram", "spill"])


def path_for(cache_size: str) -> dict[str, str] | None:
    """Spilling (write-through) is the daemon's path: a writer the kernel passes through
    writes its memory file whatever the cache holds (semantics, section 6)."""
    return {"ACPFS_PASSTHROUGH": "off"} if cache_size == "96M" else None


def digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def fd_digest(fd: int, size: int) -> tuple[str, int]:
    """sha1 and byte count of the first ``size`` bytes of ``fd`` (reads past it too, to catch growth)."""
    h = hashlib.sha1()
    off = 0
    while True:
        chunk = os.pread(fd, 8 * MiB, off)
        if not chunk:
            break
        h.update(chunk)
        off += len(chunk)
    return h.hexdigest(), off


class RandomSource:
    """Random-ish content without paying for os.urandom on every file: distinct slices of one
    random buffer, each stamped with a unique header so that no two files share a digest."""

    def __init__(self, size: int) -> None:
        self.buf = os.urandom(size)

    def make(self, tag: str, size: int, offset: int) -> bytes:
        head = f"<<{tag}>>".encode()
        assert offset + size <= len(self.buf)
        return head + self.buf[offset + len(head):offset + size]


def sync_noraise(m) -> Exception | None:
    """``m.sync()``, returning its failure so that the watcher's findings are reported first."""
    try:
        m.sync()
    except Exception as e:  # AssertionError, or subprocess.TimeoutExpired
        return e
    return None


class Poller(threading.Thread):
    """Runs ``poll`` in a tight loop until stopped, then once more; records exceptions."""

    def __init__(self, poll) -> None:
        super().__init__(daemon=True)
        self.poll = poll
        self.stop_ev = threading.Event()
        self.polls = 0
        self.crash: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_ev.is_set():
                self.poll()
                self.polls += 1
            self.poll()
            self.polls += 1
        except BaseException as e:  # surfaced by finish()
            self.crash = e

    def finish(self) -> None:
        self.stop_ev.set()
        self.join(120)
        assert not self.is_alive(), "watcher did not stop"
        if self.crash is not None:
            raise self.crash


# -- checkpoint then pointer, many steps ---------------------------------------------------------

@CACHES
def test_pointer_never_ahead_of_checkpoint(make_mount, cache_size):
    m = make_mount(cache_size=cache_size, extra=("--flush-workers", "4"), env=path_for(cache_size))
    back = m.back
    sizes_mb = [200, 64, 136, 96, 180, 72, 120]
    src = RandomSource(210 * MiB)

    lock = threading.Lock()
    expected: dict[str, tuple[int, str]] = {}     # checkpoint name -> (size, sha1), registered before writing
    order: list[str] = []                         # checkpoint names in write order
    violations: list[str] = []
    verified: set[tuple] = set()                  # (name, ino, size, mtime, ctime) already hashed
    stats = {"latest_seen": 0, "latest_values": set(), "ckpt_verified_via_latest": 0,
             "max_latest_idx": -1, "seen_ckpts": set()}

    def violation(msg: str) -> None:
        with lock:
            violations.append(f"{time.monotonic():.3f} {msg}")

    def check_file(name: str, required: bool) -> bool:
        """True if ``name`` is in the backing, complete and byte-exact."""
        with lock:
            exp = expected.get(name)
        try:
            fd = os.open(back / name, os.O_RDONLY)
        except FileNotFoundError:
            if required:
                violation(f"'latest' names {name} but it is not in the backing")
            return False
        try:
            st = os.fstat(fd)
            if exp is None:
                violation(f"{name} in the backing before it was written on the mount")
                return False
            size, want = exp
            if st.st_size != size:
                violation(f"{name} torn: size {st.st_size}, final size {size}")
                return False
            key = (name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if key in verified:
                return True
            got, n = fd_digest(fd, size)
            st2 = os.fstat(fd)
            if (st2.st_size, st2.st_mtime_ns, st2.st_ctime_ns) != (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
                violation(f"{name} changed in place while being read")
                return False
            if n != size or got != want:
                violation(f"{name} torn: {n} bytes read, digest {got} != {want}")
                return False
            verified.add(key)
            return True
        finally:
            os.close(fd)

    def poll() -> None:
        # 1. every file in the backing is either absent or complete
        present = set()
        for ent in os.scandir(back):
            if ent.name.startswith(".acpfs-") or ent.name == "latest":   # acpfs's own names
                continue
            if check_file(ent.name, required=False):
                present.add(ent.name)
        # checkpoints, once there, stay (nothing deletes them); a torn one is reported above
        gone = stats["seen_ckpts"] - present
        for name in gone:
            if not (back / name).exists():
                violation(f"{name} vanished from the backing")
        stats["seen_ckpts"] |= present
        with lock:
            idx = [order.index(n) for n in present if n in order]
        newest_present = max(idx, default=-1)
        # 2. the pointer, read after the listing
        try:
            with open(back / "latest", "rb") as f:
                content = f.read()
        except FileNotFoundError:
            if newest_present >= 1:
                violation(f"{order[newest_present]} in the backing but no 'latest' (written before it)")
            return
        stats["latest_seen"] += 1
        name = content.decode(errors="replace").strip()
        with lock:
            known = name in expected and content == f"{name}\n".encode()
            li = order.index(name) if name in order else -1
        if not known:
            violation(f"'latest' torn or unknown: {content[:80]!r}")
            return
        stats["latest_values"].add(name)
        if li < stats["max_latest_idx"]:
            violation(f"'latest' went back from {order[stats['max_latest_idx']]} to {name}")
        stats["max_latest_idx"] = max(stats["max_latest_idx"], li)
        # prefix of history: checkpoint k+1 is written after 'latest' names checkpoint k
        if newest_present >= 1 and li < newest_present - 1:
            violation(f"{order[newest_present]} in the backing while 'latest' still names {name}")
        # 3. what 'latest' names is there and complete
        if check_file(name, required=True):
            stats["ckpt_verified_via_latest"] += 1

    watcher = Poller(poll)
    watcher.start()
    try:
        offset = 0
        for step, mb in enumerate(sizes_mb):
            name = f"ckpt-{step:03d}.bin"
            size = mb * MiB + 4093 * step + 17
            data = src.make(name, size, (offset % (8 * MiB)))
            offset += 1_234_567
            with lock:
                expected[name] = (size, digest(data))
                order.append(name)
            with open(m.mnt / name, "wb") as f:
                f.write(data)
            del data
            with open(m.mnt / "latest", "w") as f:
                f.write(name + "\n")
            assert (m.mnt / "latest").read_text() == name + "\n"
        sync_error = sync_noraise(m)
    finally:
        watcher.finish()

    assert violations == [], "\n".join(violations[:20])
    assert sync_error is None, sync_error
    # the test saw the protocol in action, not just the end state
    assert stats["latest_seen"] >= 3, stats
    assert len(stats["latest_values"]) >= 2, stats
    assert stats["ckpt_verified_via_latest"] >= 3, stats
    # final state: everything, byte-exact, and 'latest' names the last step
    assert (back / "latest").read_text() == order[-1] + "\n"
    assert listing(back) == sorted(order + ["latest"])
    for name, (size, want) in expected.items():
        data = (back / name).read_bytes()
        assert len(data) == size and digest(data) == want, name


# -- overwrite with O_TRUNC: old or new, never anything else ---------------------------------------

def _version_reader(path: Path, versions: list[tuple[int, str]], lock: threading.Lock,
                    violations: list[str], seen: list[int]):
    """A poll function: read ``path`` whole; it must be one of ``versions``, never going back."""
    def poll() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            violations.append("file missing from the backing")
            return
        try:
            st = os.fstat(fd)
            got, n = fd_digest(fd, st.st_size)
        finally:
            os.close(fd)
        with lock:
            table = list(versions)
        idx = next((i for i, (size, d) in enumerate(table) if size == n and d == got), None)
        if idx is None:
            violations.append(f"read {n} bytes (st_size {st.st_size}) matching no complete version")
            return
        if seen and idx < seen[-1]:
            violations.append(f"went back from version {seen[-1]} to {idx}")
        seen.append(idx)
    return poll


@CACHES
def test_overwrite_large_file_old_or_new(make_mount, cache_size):
    m = make_mount(mount=False, cache_size=cache_size, extra=("--flush-workers", "4"),
                   env=path_for(cache_size))
    src = RandomSource(180 * MiB)
    v = [src.make("v0", 128 * MiB + 5, 0), src.make("v1", 80 * MiB + 77, 3 * MiB + 1),
         src.make("v2", 170 * MiB + 3, 7 * MiB + 11)]
    # v3: v2 modified in place (open r+, no truncation): two patches, one past the middle
    patch_a, patch_b = os.urandom(MiB + 1), os.urandom(3 * MiB)
    v3 = bytearray(v[2])
    v3[0:len(patch_a)] = patch_a
    v3[100 * MiB:100 * MiB + len(patch_b)] = patch_b
    v.append(bytes(v3))
    del v3
    (m.back / "model.bin").write_bytes(v[0])
    m.mount()

    lock = threading.Lock()
    versions = [(len(v[0]), digest(v[0]))]
    violations: list[str] = []
    seen: list[int] = []
    reader = Poller(_version_reader(m.back / "model.bin", versions, lock, violations, seen))
    reader.start()
    try:
        deadline = time.time() + 30
        while not seen and time.time() < deadline:
            time.sleep(0.01)
        assert seen, "reader never read the backing"
        with lock:
            versions.append((len(v[1]), digest(v[1])))
            versions.append((len(v[2]), digest(v[2])))
            versions.append((len(v[3]), digest(v[3])))
        with open(m.mnt / "model.bin", "wb") as f:      # O_TRUNC
            f.write(v[1])
        assert (m.mnt / "model.bin").read_bytes() == v[1]
        fd = os.open(m.mnt / "model.bin", os.O_WRONLY | os.O_TRUNC)
        try:
            mv = memoryview(v[2])
            for off in range(0, len(v[2]), 16 * MiB):   # written in pieces, like a streaming writer
                os.write(fd, mv[off:off + 16 * MiB])
        finally:
            os.close(fd)
        assert (m.mnt / "model.bin").read_bytes() == v[2]
        with open(m.mnt / "model.bin", "r+b") as f:     # no O_TRUNC: the file is copied up first
            f.write(patch_a)
            f.seek(100 * MiB)
            f.write(patch_b)
        assert (m.mnt / "model.bin").read_bytes() == v[3]
        sync_error = sync_noraise(m)
        n = len(seen)
        deadline = time.time() + 30
        while len(seen) < n + 2 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        reader.finish()

    assert violations == [], violations[:20]
    assert sync_error is None, sync_error
    assert seen[0] == 0 and seen[-1] == 3, seen
    assert len(seen) >= 4, seen
    assert (m.back / "model.bin").read_bytes() == v[3]
    assert listing(m.back) == ["model.bin"]


def test_overwrite_small_pointer_many_times(make_mount):
    """A small file rewritten hundreds of times (O_TRUNC, or r+ then truncate) while a reader
    reads the backing copy in a tight loop: only complete versions, in order."""
    m = make_mount(extra=("--flush-workers", "4"))
    back = m.back / "latest"
    contents = [(f"global_step{i}\n" * (1 + (i * 7) % 13)).encode() for i in range(300)]
    (m.back / "latest").write_bytes(contents[0])
    m.mount()

    lock = threading.Lock()
    versions = [(len(c), digest(c)) for c in contents]   # all known up front; order is checked
    violations: list[str] = []
    seen: list[int] = []
    reader = Poller(_version_reader(back, versions, lock, violations, seen))
    reader.start()
    try:
        for i in range(1, len(contents)):
            p = m.mnt / "latest"
            if i % 3 == 0:
                with open(p, "r+b") as f:
                    f.seek(0)
                    f.write(contents[i])
                    f.truncate()
            else:
                fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
                try:
                    os.write(fd, contents[i])
                finally:
                    os.close(fd)
            if i % 50 == 0:
                time.sleep(0.05)   # let the flusher catch up now and then
        sync_error = sync_noraise(m)
        n = len(seen)
        deadline = time.time() + 30
        while len(seen) < n + 2 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        reader.finish()

    assert violations == [], violations[:20]
    assert sync_error is None, sync_error
    assert seen[-1] == len(contents) - 1
    assert len(set(seen)) >= 3, "the reader saw too few versions to prove anything"
    assert back.read_bytes() == contents[-1]
    assert listing(m.back) == ["latest"]


# -- created and deleted before it was persisted ----------------------------------------------------

@CACHES
def test_file_deleted_before_persist_never_reaches_backing(make_mount, faults, tmp_path, cache_size):
    """Files deleted before their publish never appear in the backing. The backing is a faultfs
    mirror whose renames hang while the files are made and deleted: the first publish (the
    blocker's rename into place) cannot end, so by the strict prefix nothing queued after it
    can reach the backing before the deletions, whatever the speed of the flusher. Uploads
    (the temporary files' contents) run meanwhile: a deletion cancels work under way.

    The blocker lands in a directory of its own: its hung rename holds that directory's lock
    in the kernel, which any creation there waits for, and the backing's root must stay free
    for the staging directory of the file written through below (with the blocker at the
    root, the test hung whenever the flusher reached the blocker's rename before that file)."""
    m = make_mount(cache_size=cache_size, extra=("--flush-workers", "4"), env=path_for(cache_size),
                   mount=False)
    shim = faults.shim(tmp_path / "src", m.back)
    faults.mount(m)
    src = RandomSource(201 * MiB)
    seen_names: set[str] = set()

    def poll() -> None:
        for dirpath, dirnames, filenames in os.walk(m.back):
            for n in dirnames + filenames:
                if not n.startswith(TEMP_PREFIX):
                    seen_names.add(str(Path(dirpath, n).relative_to(m.back)))
            if dirpath == str(m.back) and "hold" in dirnames:
                dirnames.remove("hold")   # locked while the blocker's rename hangs

    watcher = Poller(poll)
    watcher.start()
    # names that must never be seen in the backing: files deleted before their first close
    # always; closed files deleted while the blocker is provably not yet applied (see gone())
    never: list[str] = []
    unproven: list[str] = []
    blocker_seq = 0

    def seq_of(rel: str) -> int:
        return json.loads(os.getxattr(m.mnt / rel, "user.acpfs.seq"))["seq"]
    (m.mnt / "hold").mkdir()
    m.sync()
    shim.set("hang rename")
    try:
        try:
            # everything queued after the blocker waits for its publish, held by the shim
            (m.mnt / "hold" / "blocker.bin").write_bytes(src.make("blocker", 16 * MiB, 0))
            blocker_seq = seq_of("hold/blocker.bin")
            (m.mnt / "sub").mkdir()

            def gone(*names: str, closed: bool = True) -> None:
                """Unlink names[-1] (the others are earlier names of the same file). Operations
                are applied in order, so if the blocker is still not applied after the unlink,
                nothing queued after it (this file's publish) reached the backing before it."""
                os.unlink(m.mnt / names[-1])
                applied = m.status()["queue"]["applied_seq"]
                (never if not closed or applied < blocker_seq else unproven).extend(names)

            def gone_while_open(name: str, data: bytes, tail: bytes) -> None:
                """Written, deleted while still open, written more, then closed."""
                with open(m.mnt / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    assert m.state(name) == "dirty"
                    gone(name, closed=False)
                    f.write(tail)

            gone_while_open("eph-open.bin", src.make("o", 3 * MiB, 2), b"more after unlink")

            # created, written, closed, deleted
            (m.mnt / "eph-closed.bin").write_bytes(src.make("c", 8 * MiB, 1))
            assert m.state("eph-closed.bin") in ("dirty", "flushing")
            gone("eph-closed.bin")

            # written under a temporary name, renamed, then deleted: the mount had the file
            # under its final name for a while, so the backing may show it (strict prefix); it
            # is gone after the sync like the others
            (m.mnt / "eph-renamed.tmp").write_bytes(src.make("r", 5 * MiB, 3))
            os.replace(m.mnt / "eph-renamed.tmp", m.mnt / "eph-renamed.bin")
            os.unlink(m.mnt / "eph-renamed.bin")

            # in a new directory that stays
            (m.mnt / "sub" / "eph-in-dir.bin").write_bytes(src.make("d", 2 * MiB, 5))
            gone("sub/eph-in-dir.bin")

            # large (in a small cache it is being written through)
            gone_while_open("eph-open-big.bin", src.make("ob", 150 * MiB, 7), b"tail")

            # big enough that its upload is under way when it is deleted
            (m.mnt / "eph-closed2.bin").write_bytes(src.make("c2", 3 * MiB, 9))
            gone("eph-closed2.bin")
            (m.mnt / "eph-big.bin").write_bytes(src.make("b", 48 * MiB, 4))
            time.sleep(0.05)
            gone("eph-big.bin")
            assert m.status()["queue"]["applied_seq"] < blocker_seq, "the shim did not hold the publish"
        finally:
            shim.set("ok")

        # something after them, so the flusher provably went past their place in the order
        keeper = src.make("keeper", 1 * MiB + 3, 6)
        (m.mnt / "sub" / "keeper.bin").write_bytes(keeper)
        sync_error = sync_noraise(m)
    finally:
        watcher.finish()

    # held, every deletion is proven to come before the publish it cancels
    assert sorted(never) == sorted(["eph-open.bin", "eph-closed.bin", "sub/eph-in-dir.bin",
                                    "eph-open-big.bin", "eph-closed2.bin", "eph-big.bin"]), \
        f"proven {never}, not proven {unproven}"
    assert watcher.polls >= 5
    leaked = sorted(seen_names & set(never))
    assert leaked == [], f"deleted-before-persist files appeared in the backing: {leaked}"
    assert sync_error is None, sync_error
    assert {"hold", "sub", "sub/keeper.bin"} <= seen_names
    # whatever was deleted is gone after sync, and no temporary files are left either
    assert listing(m.back) == ["hold", "sub"]
    assert listing(m.back / "hold") == ["blocker.bin"]
    assert os.listdir(m.back / "sub") == ["keeper.bin"]
    assert (m.back / "sub" / "keeper.bin").read_bytes() == keeper
    assert (m.back / "hold" / "blocker.bin").read_bytes() == src.make("blocker", 16 * MiB, 0)
    assert m.status()  # the daemon is alive and answering


def test_unlink_after_persist_removes_from_backing(make_mount):
    m = make_mount(mount=False)
    (m.back / "old.bin").write_bytes(b"from before the mount" * 1000)
    (m.back / "olddir").mkdir()
    (m.back / "olddir" / "x").write_bytes(b"x" * 5000)
    m.mount()

    data = os.urandom(6 * MiB + 1)
    (m.mnt / "new.bin").write_bytes(data)
    (m.mnt / "d").mkdir()
    (m.mnt / "d" / "inner.bin").write_bytes(data[:12345])
    (m.mnt / "stays.bin").write_bytes(b"stays")
    m.sync()
    assert (m.back / "new.bin").read_bytes() == data
    assert (m.back / "d" / "inner.bin").read_bytes() == data[:12345]
    assert m.state("new.bin") == "persisted"

    os.unlink(m.mnt / "new.bin")
    os.unlink(m.mnt / "old.bin")
    os.unlink(m.mnt / "d" / "inner.bin")
    os.rmdir(m.mnt / "d")
    os.unlink(m.mnt / "olddir" / "x")
    os.rmdir(m.mnt / "olddir")
    assert sorted(os.listdir(m.mnt)) == ["stays.bin"]
    m.sync()
    assert listing(m.back) == ["stays.bin"]
    assert (m.back / "stays.bin").read_bytes() == b"stays"
