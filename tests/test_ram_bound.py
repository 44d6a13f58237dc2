"""Contract 6 (bounded), measured where the RAM is: the content store's real size is sampled
*while* several large writers run, on each store (docs/semantics.md, section 6).

- On a store in RAM (tmpfs, the default) the memory files never hold more than
  `--cache-size` plus 64 MiB per writer passed through: a writer is passed through only when
  its size is known (its name's last version), so 4 writers of 512 MiB of new names through
  a 128 MiB cache take the daemon's path, and a checkpoint loop whose steps rewrite the same
  names is passed through from its second step on, within the cache's size at every sample.
- On a store on a disk the kernel bounds the RAM: the node's dirty pages stay under the
  kernel's limit (set low for the test), the store takes no tmpfs memory and the daemon
  holds none of the data in its own.
Every writer succeeds and every byte lands exact."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time

import pytest

from acpfs.config import ram_filesystem

from conftest import wait_for

MiB = 1 << 20


class Sampler:
    """Samples ``what()`` every 20 ms in a thread while the block runs: ``peak``, and every
    sample taken (``samples``)."""

    def __init__(self, what) -> None:
        self.what = what
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(FileNotFoundError):   # a memory file dropped meanwhile
                self.samples.append(self.what())
            time.sleep(0.02)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def write_all(paths: dict, size: int, pace: float = 0.0) -> dict:
    """Write ``size`` bytes into each path at once, one thread each, in 1 MiB writes of
    bytes unique to the file, ``pace`` seconds apart (a serializer's work between them, so
    that the samples see the files open); the sha256 of each."""
    digests = {}
    chunk = os.urandom(MiB)

    def one(path) -> None:
        h = hashlib.sha256()
        with open(path, "wb") as f:
            for i in range(size // MiB):
                block = path.name.encode()[:16].ljust(16) + i.to_bytes(8, "little") + chunk[24:]
                f.write(block)
                h.update(block)
                time.sleep(pace)
        digests[path] = h.hexdigest()

    threads = [threading.Thread(target=one, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(digests) == len(paths), "every writer succeeded"
    return digests


def landed_exact(m, digests: dict) -> None:
    m.sync()
    for path, digest in digests.items():
        rel = path.relative_to(m.mnt)
        assert hashlib.sha256((m.back / rel).read_bytes()).hexdigest() == digest, rel


def memory_files_only(m) -> None:
    if m.status()["cache"]["store"] != "memory files":
        pytest.skip("the pool is one file of --cache-size, allocated at mount: it cannot grow")


def ram_sample(m):
    """(bytes the store holds in RAM, writers passed through now)."""
    return m.store_bytes(), m.status()["cache"]["writers_passed_through"]


def test_four_writers_of_512_mib_of_new_names_through_a_128_mib_cache(make_mount):
    m = make_mount(cache_size="128M")
    limit = 128 * MiB
    with Sampler(lambda: ram_sample(m)) as s:
        digests = write_all({m.mnt / f"rank{i}.pt": None for i in range(4)}, 512 * MiB)
    assert s.samples, "sampled while they wrote"
    worst = max(held - limit - 64 * MiB * passed for held, passed in s.samples)
    assert worst <= 0, f"the store held {worst / MiB:.0f} MiB more than the bound allows"
    opens = m.status()["cache"]["writer_opens"]
    if m.status()["cache"]["store"] == "memory files" and m.status()["passthrough"]["on"]:
        assert opens["unknown_size"] == 4 and opens["passed_through"] == 0, opens
    landed_exact(m, digests)


def test_writers_of_names_seen_before_are_passed_through_within_the_cache(make_mount):
    m = make_mount(cache_size="128M")
    memory_files_only(m)
    if not m.status()["passthrough"]["on"]:
        pytest.skip(f"passthrough not in use here: {m.status()['passthrough']['why_not']}")
    limit = 128 * MiB
    (m.mnt / "step1").mkdir()
    (m.mnt / "step2").mkdir()
    first = write_all({m.mnt / "step1" / f"rank{i}.pt": None for i in range(4)}, 24 * MiB)
    before = m.status()["cache"]["writer_opens"]
    assert before["unknown_size"] >= 4 and before["passed_through"] == 0, before
    landed_exact(m, first)
    second: dict = {}
    with Sampler(lambda: ram_sample(m)) as s:
        ranks = threading.Thread(target=lambda: second.update(write_all(
            {m.mnt / "step2" / f"rank{i}.pt": None for i in range(4)}, 24 * MiB, pace=0.02)))
        ranks.start()
        wait_for(lambda: m.status()["cache"]["writers_passed_through"] == 4, 30,
                 "the four writers passed through")
        # beside them a writer of a new name, on the daemon's path, wants the whole cache:
        # it may have what the four were not promised, and waits or writes through for more
        extra = write_all({m.mnt / "step2" / "optimizer.pt": None}, 128 * MiB)
        ranks.join()
    second.update(extra)
    opens = m.status()["cache"]["writer_opens"]
    assert opens["passed_through"] - before["passed_through"] == 4, opens
    assert max(passed for _, passed in s.samples) >= 1, "sampled while writers were passed through"
    assert max(held for held, _ in s.samples) <= limit, "within the cache's size at every sample"
    assert len(second) == 5
    landed_exact(m, second)


def test_a_writer_grown_past_its_names_size_is_trimmed_back(make_mount):
    """A file passed through as its name's 8 MiB writes 48 MiB while open: persisted files
    are evicted for what it wrote past its reservation (``Files.trim``, every 0.5 s), so the
    cache is back within its size while the file is still open, and its bytes land."""
    m = make_mount(cache_size="64M")
    memory_files_only(m)
    if not m.status()["passthrough"]["on"]:
        pytest.skip(f"passthrough not in use here: {m.status()['passthrough']['why_not']}")
    (m.mnt / "g").write_bytes(os.urandom(40 * MiB))
    (m.mnt / "f").write_bytes(os.urandom(8 * MiB))
    m.sync()
    before = m.status()["cache"]["writer_opens"]["passed_through"]
    grown = os.urandom(48 * MiB)
    with open(m.mnt / "f", "wb") as f:
        f.write(grown)
        f.flush()
        assert m.status()["cache"]["writer_opens"]["passed_through"] == before + 1
        # f's pages are counted every 0.5 s: a count taken while the kernel still wrote them
        # may show part of them beside g, so the store itself is what is waited for
        wait_for(lambda: 48 * MiB <= m.status()["cache"]["used_bytes"] <= 64 * MiB
                 and m.store_bytes() <= 64 * MiB, 10, "f's 48 MiB counted and g evicted for them")
        assert m.store_bytes() >= 48 * MiB
    m.sync()
    assert (m.back / "f").read_bytes() == grown


def test_a_writer_of_an_uncached_file_in_a_cache_held_by_writers_passed_through(make_mount):
    """The cache is over its size, held by a writer passed through that grew past its
    name's size and is still open: nothing can be evicted or written through. A writer of a
    file not in the cache then copies it into the backing instead of waiting for room that
    nothing will free (it used to get ENOSPC after --cache-full-timeout; the model test
    with a 64K cache found it)."""
    m = make_mount(cache_size="4M", extra=("--cache-full-timeout", "5"))
    memory_files_only(m)
    if not m.status()["passthrough"]["on"]:
        pytest.skip(f"passthrough not in use here: {m.status()['passthrough']['why_not']}")
    (m.mnt / "k").write_bytes(b"k" * 4096)     # its name's size: 4 KiB
    m.sync()
    (m.back / "u").write_bytes(b"u" * 1000)    # in the backing, not in the cache
    grown = os.urandom(8 * MiB)
    with open(m.mnt / "k", "wb") as k:
        k.write(grown)                          # passed through: 8 MiB in a 4 MiB cache
        k.flush()
        wait_for(lambda: m.status()["cache"]["used_bytes"] > 4 * MiB, 10, "the cache over its size")
        start = time.monotonic()
        with open(m.mnt / "u", "ab") as u:
            u.write(b"tail")
        assert time.monotonic() - start < 4, "the append waited for room nothing frees"
    assert (m.mnt / "u").read_bytes() == b"u" * 1000 + b"tail"
    m.sync()
    assert (m.back / "u").read_bytes() == b"u" * 1000 + b"tail"
    assert (m.back / "k").read_bytes() == grown


def test_a_checkpoint_loop_is_passed_through_from_its_second_step_within_its_cache(make_mount):
    """8 ranks save 16 MiB each per step, 5 steps in rotating directories, through a cache of
    1.5 steps; each step is persisted before the next (the flusher keeps up)."""
    ranks, shard = 8, 16 * MiB
    limit = ranks * shard * 3 // 2
    m = make_mount(cache_size=str(limit))
    memory_files_only(m)
    passing = m.status()["passthrough"]["on"]
    passed = []
    with Sampler(lambda: ram_sample(m)) as s:
        for step in range(5):
            d = m.mnt / f"step_{step:04d}"
            d.mkdir()
            before = m.status()["cache"]["writer_opens"]["passed_through"]
            digests = write_all({d / f"__{r}_0.distcp": None for r in range(ranks)}, shard,
                                pace=0.005)
            passed.append(m.status()["cache"]["writer_opens"]["passed_through"] - before)
            landed_exact(m, digests)
    assert passed == ([0] + [ranks] * 4 if passing else [0] * 5), passed
    worst = max(held for held, _ in s.samples)
    assert worst <= limit, f"the store held {worst / MiB:.0f} MiB through a {limit / MiB:.0f} MiB cache"


def meminfo() -> dict:
    with open("/proc/meminfo") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}


def daemon_ram(pid: int) -> int:
    """The daemon's own RAM: anonymous and shared memory pages it has mapped."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))


@contextlib.contextmanager
def dirty_limits(dirty: int, background: int):
    """vm.dirty_bytes and vm.dirty_background_bytes set for the block, then as they were."""
    names = ("dirty_bytes", "dirty_background_bytes", "dirty_ratio", "dirty_background_ratio")
    old = {n: open(f"/proc/sys/vm/{n}").read().strip() for n in names}
    try:
        for name, value in (("dirty_background_bytes", background), ("dirty_bytes", dirty)):
            with open(f"/proc/sys/vm/{name}", "w") as f:
                f.write(str(value))
        yield
    finally:
        for name in ("dirty_bytes", "dirty_background_bytes"):   # a ratio is restored by
            ratio = name.replace("bytes", "ratio")               # writing it: bytes go to 0
            key, value = (name, old[name]) if old[name] != "0" else (ratio, old[ratio])
            with open(f"/proc/sys/vm/{key}", "w") as f:
                f.write(value)


def test_a_disk_store_leaves_its_ram_to_the_kernels_limits(make_mount, tmp_path):
    area = tmp_path / "local-disk"
    area.mkdir()
    if ram_filesystem(str(area)):
        pytest.skip(f"{area} is on {ram_filesystem(str(area))}: no disk filesystem to test on here")
    if os.geteuid() != 0:
        pytest.skip("setting the kernel's dirty limits needs root")
    m = make_mount(cache_size="128M", cache_area=str(area))
    memory_files_only(m)
    dirty_limit = 64 * MiB
    shmem = meminfo()["Shmem"]

    def sample() -> dict:
        return {**meminfo(), "daemon": daemon_ram(m.pid)}
    with dirty_limits(dirty_limit, dirty_limit // 2):
        with Sampler(sample) as s:
            digests = write_all({m.mnt / f"rank{i}.pt": None for i in range(4)}, 512 * MiB)
            landed_exact(m, digests)
    held = max(x["daemon"] for x in s.samples)
    assert held < 256 * MiB, f"the daemon held {held / MiB:.0f} MiB of its own (anonymous, shared)"
    dirty = max(x["Dirty"] + x["Writeback"] for x in s.samples)
    # the kernel lets each CPU run a little past the limit before it throttles
    assert dirty <= dirty_limit * 5 // 4 + 8 * MiB * os.cpu_count(), \
        f"dirty and writeback pages reached {dirty / MiB:.0f} MiB over a {dirty_limit / MiB:.0f} MiB limit"
    grown = max(x["Shmem"] for x in s.samples) - shmem
    assert grown < 64 * MiB, f"the store took {grown / MiB:.0f} MiB of shared memory"
    assert m.status()["cache"]["writer_opens"]["passed_through"] >= 1 \
        or not m.status()["passthrough"]["on"]
