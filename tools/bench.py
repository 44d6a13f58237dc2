"""tools/bench: checkpoint workloads against /dev/shm, the backing disk, acpfs and rclone.

Run `./tools/bench --help`. Every workload runs against every target in the same run,
interleaved (for each workload: for each repetition: for each target), repetition 0 is a
warm-up and is discarded, and the table shows medians. Raw samples go to results.json, the
table to table.md and the chart to chart.png, under --out (default
/tmp/bench-results/<timestamp>/). docs/benchmarks.md explains every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
WORKER = str(REPO / "tools" / "bench_worker.py")
GiB = 1 << 30
MiB = 1 << 20

TARGETS = ["shm", "disk", "acpfs", "acpfs-disk", "acpfs-daemon", "rclone", "c-floor"]
TARGET_LABEL = {
    "shm": "/dev/shm",
    "disk": "disk+fsync",
    "acpfs": "acpfs",
    "acpfs-disk": "acpfs, store on disk",   # --cache-dir on the backing disk: page cache bounds RAM
    "acpfs-daemon": "acpfs, daemon path",   # --passthrough off: the pool, every request through the daemon
    "rclone": "rclone",
    "c-floor": "C floor",   # tools/fuse_floor.c: a FUSE daemon in C that keeps only names
    "backing": "backing, direct",   # the cold workload: the same loader on the mount's backing
}
COLUMNS = TARGETS + ["backing"]   # targets and the references recorded beside them
WORKLOADS = ["torch", "safetensors", "dcp", "dd", "writers", "admission", "cold", "small",
             "close_flush", "peers", "replicas"]
WRITERS = (1, 2, 4, 8, 16)   # the scaling line of the writers workload (--writers picks)

REPLICA_WAYS = {"none": "no replicas", "async": "--replicas 1 (node B holds the copy)",
                "wait": "--replicas 1 --replica-wait"}
# metric -> (workload, unit, higher_is_better, description)
METRICS = {
    "torch_save": ("torch", "GB/s", True, "torch.save of the state dict"),
    "torch_load": ("torch", "GB/s", True, "torch.load of the file just written (cached)"),
    "torch_load_mmap": ("torch", "GB/s", True, "torch.load(mmap=True) + touch every page"),
    "st_save": ("safetensors", "GB/s", True, "safetensors save_file"),
    "st_load": ("safetensors", "GB/s", True, "safetensors load_file + touch every page (cached)"),
    "np_memmap": ("safetensors", "GB/s", True, "np.memmap of the same file + touch every page (cached)"),
    "dcp_save": ("dcp", "GB/s", True, "dcp.save, FileSystemWriter, no_dist"),
    "dcp_load": ("dcp", "GB/s", True, "dcp.load, FileSystemReader, no_dist"),
    "dd_1m": ("dd", "GB/s", True, "dd bs=1M of the checkpoint size"),
    **{f"writers{n}": ("writers", "GB/s", True, f"{n} processes torch.save 1/{n} each, at once")
       for n in WRITERS},
    "torch_save_new": ("admission", "GB/s", True, "torch.save to a name not seen before "
                       "(acpfs: the daemon's path on a store in RAM)"),
    "writers8_new": ("admission", "GB/s", True, "8 processes torch.save 1/8 each, names not seen before"),
    "loop_save": ("admission", "GB/s", True, "8 ranks x 5 steps of 2/3 of the cache, rotating "
                  "step directories, persisted between steps: steps 2-5"),
    "loop_passed": ("admission", "%", True, "opens for writing of steps 2-5 passed through"),
    "loop_b2b_save": ("admission", "GB/s", True, "the same loop, steps back to back (the "
                      "flusher behind): steps 2-5"),
    "loop_b2b_passed": ("admission", "%", True, "opens of steps 2-5 passed through, back to back"),
    "cold_read": ("cold", "GB/s", True, "read() in 8 MiB pieces of a file the cache does not hold"),
    "cold_read_again": ("cold", "GB/s", True, "the same file read again (second open; "
                        "/dev/shm: a copy there)"),
    "cold_np_memmap": ("cold", "GB/s", True, "np.memmap + touch every page, file not in the cache"),
    "cold_np_memmap_again": ("cold", "GB/s", True, "np.memmap + touch of that file again, "
                             "kept in the cache (/dev/shm: a copy there; backing: directly)"),
    "cold_torch_mmap": ("cold", "GB/s", True, "torch.load(mmap=True) + touch every page, "
                        "file not in the cache"),
    "cold_st_load": ("cold", "GB/s", True, "safetensors load_file + touch, file not in the cache"),
    "cold_small": ("cold", "files/s", True, "small files not in the cache: stat, open, read, close "
                   "(--small-files/5 of --small-size, a directory another node wrote)"),
    "cold_small_again": ("cold", "files/s", True, "the same files read again (kept in the cache; "
                         "backing: the warm direct read before)"),
    "slow_read": ("cold", "GB/s", True, "read() of a file not in the cache over a backing that "
                  "answers each read 2 ms late (faultfs); backing: one stream read directly"),
    "slow_preload": ("cold", "GB/s", True, "acpfs preload of such a file; backing: one stream "
                     "reading another directly, just before"),
    "slow_8_ranks": ("cold", "x", False, "bytes the slow backing served while 8 processes read "
                     "one such file at once, / those for one reader of another"),
    "slow_np_memmap": ("cold", "GB/s", True, "np.memmap + touch every page of a file not in the "
                       "cache over the latency backing; backing: the same on another file there"),
    "slow_8_ranks_read": ("cold", "GB/s", True, "8 processes read() one file not in the cache at "
                          "once over the latency backing, all bytes / time to the last; backing: "
                          "the same 8 on another file there"),
    "cold_8_ranks": ("cold", "GB/s", True, "8 processes np.memmap + touch one file not in the "
                     "cache at once, all bytes / time to the last; backing: the same 8 directly"),
    "small_create": ("small", "files/s", True, "small files: create+write+close"),
    "small_stat": ("small", "files/s", True, "small files: stat"),
    "small_unlink": ("small", "files/s", True, "small files: unlink"),
    "small_persist": ("small", "files/s", True, "small files persisted: cp -r of --small-files "
                      "files, then until durable (acpfs sync; others: sync -f)"),
    "sqlite_query": ("small", "queries/s", True, "SQLite point queries, DELETE journal mode "
                     "(each probes the missing -journal name)"),
    "sqlite_insert": ("small", "inserts/s", True, "SQLite single-row transactions, DELETE "
                      "journal mode"),
    "sqlite_wal_query": ("small", "queries/s", True, "SQLite point queries, WAL journal mode"),
    "sqlite_wal_insert": ("small", "inserts/s", True, "SQLite single-row transactions, WAL "
                          "journal mode"),
    "write_1m": ("close_flush", "GB/s", True, "python os.write 1 MiB chunks (before close)"),
    "close_ms": ("close_flush", "ms", False, "close() of the file just written, alone"),
    "durable_s": ("close_flush", "s", False, "close() returned -> file complete in the backing"),
    "drain_s": ("close_flush", "s", False, "`acpfs sync MOUNT` started at close(): run time"),
    "flush": ("close_flush", "GB/s", True, "bytes / durable_s (disk: plain copy+fsync of the same bytes)"),
    "peers_load": ("peers", "GB/s", True, "4 nodes load one cold checkpoint at once over the "
                   "latency backing (--peers-listen), all bytes / time to the last; backing: "
                   "each node reads its own view of it directly"),
    "peers_backing_x": ("peers", "x", False, "bytes the backing served while 4 nodes loaded "
                        "it, / the checkpoint's size (backing: each node read it itself)"),
    **{f"replicas_save_{way}": ("replicas", "GB/s", True, f"torch.save into node A, {what} "
                                "(tools/bench_replicas.py)") for way, what in REPLICA_WAYS.items()},
    **{f"replicas_close_{way}": ("replicas", "ms", False, f"close() of a file of --size just "
                                 f"written into node A, alone, {what}")
       for way, what in REPLICA_WAYS.items()},
    "rss_mib": ("daemon", "MiB", False, "daemon RSS without the cache pool (max over the run)"),
    "rss_total_mib": ("daemon", "MiB", False, "daemon VmRSS including mapped pool pages (max)"),
    "cache_peak_gib": ("daemon", "GiB", False, "acpfs cache.peak_used_bytes"),
    "rss_100k_mib": ("rss100k", "MiB", False, "daemon RSS without the pool, N cached small files"),
}


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)i?B?", s.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def fs_type(path: str) -> str:
    best, typ = "", "?"
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, t = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, typ = mnt, f"{t} ({dev} on {mnt})"
    return typ


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v.split()[0]) * 1024
    return out


def proc_rss(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    return out


def is_mounted(path: str) -> bool:
    path = os.path.realpath(path)
    with open("/proc/mounts") as f:
        return any(line.split()[1] == path for line in f)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def rm_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# targets


class Target:
    name = "?"
    fsync = False  # fsync before close: what careful users do against a plain disk
    pid: int | None = None
    workloads: tuple[str, ...] | None = None   # None: every workload

    def __init__(self, root: str) -> None:
        self.root = root

    def start(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def stop(self) -> None:
        pass

    def settle(self, path: str) -> None:
        """Wait, untimed, until what was written under path has reached the backing."""

    def remove(self, path: str) -> None:
        rm_tree(path)
        self.settle(os.path.dirname(path))

    def backing_of(self, path: str) -> str:
        return path


class Shm(Target):
    name = "shm"


class Disk(Target):
    name = "disk"
    fsync = True


class Acpfs(Target):
    name = "acpfs"

    def __init__(self, root: str, backing: str, cache_dir: str, cache_size: int, log_file: str,
                 extra: list[str] | None = None, name: str = "acpfs",
                 env: dict[str, str] | None = None) -> None:
        super().__init__(root)
        self.name = name
        self.backing, self.cache_dir, self.cache_size = backing, cache_dir, cache_size
        self.log_file, self.extra = log_file, extra or []
        self.env = {**os.environ, **env} if env else None

    def acpfs(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        return run([PY, "-m", "acpfs", *args], cwd=str(REPO), timeout=timeout, env=self.env)

    def start(self) -> None:
        for d in (self.root, self.backing):
            os.makedirs(d, exist_ok=True)
        t = time.perf_counter()
        self.acpfs("mount", self.root, "--backing", self.backing, "--cache-size", str(self.cache_size),
                   "--cache-dir", self.cache_dir, "--log-file", self.log_file, *self.extra, timeout=600)
        self.pid = self.status()["pid"]
        log(f"acpfs mounted at {self.root} (pid {self.pid}, cache {self.cache_size / GiB:.1f} GiB, "
            f"{time.perf_counter() - t:.1f}s)")

    def status(self) -> dict:
        return json.loads(os.getxattr(self.root, "user.acpfs.status"))

    def sync(self) -> None:
        self.acpfs("sync", self.root, timeout=1800)

    def settle(self, path: str) -> None:
        self.sync()

    def stop(self) -> None:
        if not is_mounted(self.root):
            return
        try:
            self.acpfs("umount", self.root, timeout=1800)
        except Exception as e:
            log(f"acpfs umount failed ({e}); lazy unmount")
            subprocess.run(["fusermount3", "-u", "-z", self.root])
        if self.pid:
            for _ in range(600):
                if not os.path.exists(f"/proc/{self.pid}"):
                    break
                time.sleep(0.1)

    def backing_of(self, path: str) -> str:
        return os.path.join(self.backing, os.path.relpath(path, self.root))


@contextlib.contextmanager
def idle_polling(on: bool):
    """Idle CPUs poll for the block, as acpfs asks while requests arrive (``--idle-poll
    auto``, acpfs/fuse/_idlepoll.c): the C floor runs under the same idle policy as acpfs,
    unless the run turned acpfs's off (ACPFS_IDLE_POLL=off) or may not (not root)."""
    fd = -1
    if on and os.environ.get("ACPFS_IDLE_POLL", "auto").lower() != "off":
        try:
            fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY | os.O_CLOEXEC)
            os.write(fd, (0).to_bytes(4, sys.byteorder, signed=True))
        except OSError:
            pass
    try:
        yield
    finally:
        if fd >= 0:
            os.close(fd)   # the kernel drops the request with its file


class CFloor(Target):
    """tools/fuse_floor.c mounted: a libfuse daemon in C that answers every request at
    once from a table of names and sizes (one directory, nothing kept). The small-file
    workload only: the ceiling of any FUSE daemon on this kernel and machine, measured in
    the same run as acpfs, under the same idle policy (``idle_polling``; docs/benchmarks.md)."""
    name = "c-floor"
    workloads = ("small",)

    def __init__(self, root: str, build_dir: str) -> None:
        super().__init__(root)
        self.build_dir = build_dir
        self.mount = None

    def start(self) -> None:
        from fuse_floor import CFloor as Mounted, build_c   # tools/, this script's directory
        os.makedirs(self.root, exist_ok=True)
        os.makedirs(self.build_dir, exist_ok=True)
        self.mount = Mounted(build_c(self.build_dir), self.root)
        log(f"C floor mounted at {self.root} (pid {self.mount.proc.pid})")

    def stop(self) -> None:
        if self.mount is not None:
            self.mount.stop()
            self.mount = None

    def remove(self, path: str) -> None:
        pass   # nothing is left: the workload unlinks what it makes, and mkdir is not served


class Rclone(Target):
    name = "rclone"

    def __init__(self, root: str, backing: str, cache_dir: str, log_file: str) -> None:
        super().__init__(root)
        self.backing, self.cache_dir, self.log_file = backing, cache_dir, log_file
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        for d in (self.root, self.backing, self.cache_dir):
            os.makedirs(d, exist_ok=True)
        cmd = ["rclone", "mount", self.backing, self.root, "--vfs-cache-mode", "writes",
               "--vfs-write-back", "0s", "--cache-dir", self.cache_dir, "--config", "/dev/null",
               "--log-file", self.log_file, "--log-level", "NOTICE"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self.pid = self.proc.pid
        for _ in range(300):
            if is_mounted(self.root):
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"rclone mount exited with {self.proc.returncode}; see {self.log_file}")
            time.sleep(0.1)
        else:
            raise RuntimeError("rclone mount did not come up in 30s")
        log(f"rclone mounted at {self.root} (pid {self.pid})")

    def settle(self, path: str, timeout: float = 1800, stall: float = 30) -> None:
        """Until every file under path (on the mount) has its full size in the backing.

        Gives up when nothing in the backing grew for `stall` seconds: rclone can lose a
        file (seen with DCP's write-then-rename of .metadata) and would never upload it.
        """
        deadline = time.monotonic() + timeout
        want = {}
        if os.path.isdir(path):
            for root, _d, files in os.walk(path):
                for f in files:
                    p = os.path.join(root, f)
                    want[self.backing_of(p)] = os.stat(p).st_size
        elif os.path.exists(path):
            want[self.backing_of(path)] = os.stat(path).st_size
        last, last_change = -1, time.monotonic()
        while want and time.monotonic() < deadline:
            have = 0
            for p, size in list(want.items()):
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(p).st_size
                    have += st
                    if st == size:
                        del want[p]
            if have != last:
                last, last_change = have, time.monotonic()
            elif time.monotonic() - last_change > stall:
                break
            time.sleep(0.01)
        if want:
            raise TimeoutError(f"rclone never uploaded {', '.join(os.path.relpath(p, self.backing) for p in want)}")
        time.sleep(0.2)  # let rclone set times and drop its open handles

    def remove(self, path: str) -> None:
        rm_tree(path)
        b = self.backing_of(path)
        for _ in range(600):
            if not os.path.exists(b):
                return
            time.sleep(0.05)
        rm_tree(b)

    def stop(self) -> None:
        if is_mounted(self.root):
            r = subprocess.run(["fusermount3", "-u", self.root], capture_output=True)
            if r.returncode:
                subprocess.run(["fusermount3", "-u", "-z", self.root])
        if self.proc:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                self.proc.wait(timeout=30)

    def backing_of(self, path: str) -> str:
        return os.path.join(self.backing, os.path.relpath(path, self.root))


def ratio2(m: Callable[[str, str], float | None], a: str, b: str, target: str) -> float | None:
    """Metric ``a`` over metric ``b``, both of ``target`` (medians)."""
    x, y = m(a, target), m(b, target)
    return None if x is None or y is None or y == 0 else x / y


def fill(path: str, size: int, block: bytes, fsync: bool = False) -> None:
    """A file of ``size`` bytes (whole blocks) made of ``block`` repeated."""
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        if fsync:
            os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------
# the worker process


class WorkerProc:
    def __init__(self, size: int) -> None:
        self.p = subprocess.Popen([PY, WORKER, "serve", str(size)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd="/")
        hello = json.loads(self.p.stdout.readline())
        self.size = hello["size"]

    def call(self, cmd: str, **args) -> dict:
        self.send(cmd, **args)
        return self.answer(cmd)

    def send(self, cmd: str, **args) -> None:
        self.p.stdin.write(json.dumps({"cmd": cmd, "args": args}) + "\n")
        self.p.stdin.flush()

    def answer(self, cmd: str) -> dict:
        """The result of the command sent last (``cmd``: for the error)."""
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("worker died")
        res = json.loads(line)
        if not res["ok"]:
            raise RuntimeError(f"{cmd}: {res['error']}")
        return res["result"]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.p.stdin.close()
            self.p.wait(timeout=60)


class LoaderRanks:
    """``n`` worker processes that hold no state dict (``serve 0``), for loads at once: each
    runs the same command on its path, started together; the seconds until the last is done."""

    def __init__(self, n: int) -> None:
        self.procs = [WorkerProc(0) for _ in range(n)]

    def at_once(self, cmd: str, path: str, **args) -> float:
        t0 = time.perf_counter()
        for w in self.procs:
            w.send(cmd, path=path, **args)
        for w in self.procs:
            w.answer(cmd)
        return time.perf_counter() - t0

    def close(self) -> None:
        for w in self.procs:
            w.close()


# ---------------------------------------------------------------------------------------
# the benchmark


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.samples: list[dict] = []
        self.notes: list[str] = []
        self.extra: dict = {}
        self.rss_max: dict[str, dict] = {}
        self._ranks: LoaderRanks | None = None
        self.profilers: dict = {}

    # -- recording ------------------------------------------------------------------------
    def record(self, metric: str, target: str, rep: int, value: float | None, **kw) -> None:
        if value is None:
            return
        s = {"metric": metric, "target": target, "rep": rep, "warmup": rep == 0,
             "value": value, "unit": METRICS[metric][1], **kw}
        self.samples.append(s)
        log(f"  {metric:16s} {TARGET_LABEL[target]:11s} rep {rep}{' (warm-up)' if rep == 0 else ''}: "
            f"{value:.4g} {s['unit']}")

    def sample_rss(self, t: Target, label: str) -> None:
        if not t.pid or not os.path.exists(f"/proc/{t.pid}"):
            return
        r = proc_rss(t.pid)
        r["no_pool"] = r["VmRSS"] - r.get("RssShmem", 0)
        r["at"] = label
        cur = self.rss_max.get(t.name)
        if cur is None or r["no_pool"] > cur["no_pool"]:
            self.rss_max[t.name] = r
        self.extra.setdefault("rss_samples", {}).setdefault(t.name, []).append(r)

    def save(self) -> None:
        doc = {"meta": self.meta, "samples": self.samples, "notes": self.notes, "extra": self.extra,
               "rss_max": self.rss_max}
        (self.out / "results.json").write_text(json.dumps(doc, indent=1))

    # -- setup ----------------------------------------------------------------------------
    def setup(self) -> None:
        a = self.args
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.id = f"bench-{stamp}-{os.getpid()}"
        self.shm = f"/dev/shm/{self.id}"
        self.tmp = f"/tmp/{self.id}"
        self.bdir = os.path.join(a.backing_dir, self.id)
        for d in (self.shm, self.tmp, self.bdir):
            os.makedirs(d, exist_ok=True)
        self.meta = {
            "started": stamp, "args": {k: v for k, v in vars(a).items()},
            "machine": {
                "nproc": os.cpu_count(), "mem_total_gib": round(meminfo()["MemTotal"] / GiB, 1),
                "kernel": platform.release(), "python": platform.python_version(),
                "backing_fs": fs_type(a.backing_dir), "shm_fs": fs_type("/dev/shm"),
                "cpu": self._cpu_model(),
            },
        }
        with contextlib.suppress(Exception):
            head = run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]).stdout.strip()
            dirty = run(["git", "-C", str(REPO), "status", "--porcelain", "acpfs"]).stdout.strip()
            self.meta["acpfs_commit"] = head + (" + uncommitted changes in acpfs/" if dirty else "")
        with contextlib.suppress(Exception):
            import torch
            self.meta["machine"]["torch"] = torch.__version__
        self.meta["machine"]["rclone"] = (shutil.which("rclone") and
                                          run(["rclone", "version"]).stdout.splitlines()[0]) or None
        self.targets: dict[str, Target] = {}
        for name in a.targets:
            if name == "shm":
                self.targets[name] = Shm(os.path.join(self.shm, "shm"))
            elif name == "disk":
                self.targets[name] = Disk(os.path.join(self.bdir, "disk"))
            elif name in ("acpfs", "acpfs-disk", "acpfs-daemon"):
                cache_parent = self.bdir if name == "acpfs-disk" else self.shm
                self.targets[name] = Acpfs(os.path.join(self.tmp, f"mnt-{name}"),
                                           os.path.join(self.bdir, f"{name}-backing"),
                                           os.path.join(cache_parent, f"{name}-cache"), a.cache_size,
                                           os.path.join(self.tmp, f"{name}.log"), name=name,
                                           env={"ACPFS_PASSTHROUGH": "off"}
                                           if name == "acpfs-daemon" else None)
            elif name == "c-floor":
                if "small" in a.workloads:   # its only workload
                    self.targets[name] = CFloor(os.path.join(self.tmp, "mnt-c-floor"),
                                                os.path.join(self.tmp, "c-floor-build"))
            elif name == "rclone":
                if not shutil.which("rclone"):
                    self.note("rclone is not installed: the rclone target is skipped "
                              "(Debian/Ubuntu: apt-get install -y rclone)")
                    continue
                self.targets[name] = Rclone(os.path.join(self.tmp, "mnt-rclone"),
                                            os.path.join(self.bdir, "rclone-backing"),
                                            os.path.join(a.rclone_cache_dir or self.shm, "rclone-cache"),
                                            os.path.join(self.tmp, "rclone.log"))

    @staticmethod
    def _cpu_model() -> str:
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        return "?"

    def note(self, msg: str) -> None:
        log("NOTE:", msg)
        self.notes.append(msg)

    # -- profiling (py-spy on the acpfs daemon) --------------------------------------------
    @contextlib.contextmanager
    def profiled(self, t: Target, label: str):
        if not (self.args.profile and t.name == "acpfs" and t.pid):
            yield
            return
        spy = shutil.which("py-spy", path=str(REPO / ".venv" / "bin") + os.pathsep + os.environ["PATH"])
        if not spy:
            self.note("--profile needs py-spy: .venv/bin/pip install py-spy")
            self.args.profile = False
            yield
            return
        path = self.out / f"profile-{label}.txt"
        p = subprocess.Popen([spy, "record", "--pid", str(t.pid), "--threads", "--rate", "250",
                              "--format", "raw", "--output", str(path), "--nonblocking"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        try:
            yield
        finally:
            p.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=60)

    # -- workloads ------------------------------------------------------------------------
    def fresh(self, t: Target, wl: str, rep: int) -> str:
        d = os.path.join(t.root, f"{wl}-r{rep}")
        os.makedirs(d)
        return d

    def size_gb(self) -> float:
        return self.w.size / 1e9

    def wl_torch(self, t: Target, rep: int) -> None:
        d = self.fresh(t, "torch", rep)
        p = os.path.join(d, "model.pt")
        with self.profiled(t, f"torch_save-r{rep}"):
            r = self.w.call("torch_save", path=p, fsync=t.fsync)
        self.record("torch_save", t.name, rep, self.size_gb() / r["s"])
        t.settle(d)
        self.sample_rss(t, "torch_save")
        with self.profiled(t, f"torch_load-r{rep}"):
            r = self.w.call("torch_load", path=p, mmap=False)
        if not r["ok"]:
            self.note(f"torch.load from {t.name} returned wrong data")
        self.record("torch_load", t.name, rep, self.size_gb() / r["s"] if r["s"] else None)
        r = self.w.call("torch_load", path=p, mmap=True)
        self.extra.setdefault("mmap_ok", {}).setdefault(t.name, []).append(r.get("ok"))
        if not r["ok"]:
            self.note(f"torch.load(mmap=True) from {t.name} failed: {r.get('error', 'wrong data')}")
        self.record("torch_load_mmap", t.name, rep, self.size_gb() / r["s"] if r["s"] else None)
        t.remove(d)

    def wl_safetensors(self, t: Target, rep: int) -> None:
        d = self.fresh(t, "st", rep)
        p = os.path.join(d, "model.safetensors")
        with self.profiled(t, f"st_save-r{rep}"):
            r = self.w.call("st_save", path=p, fsync=t.fsync)
        self.record("st_save", t.name, rep, self.size_gb() / r["s"])
        t.settle(d)
        r = self.w.call("st_load", path=p)
        self.record("st_load", t.name, rep, self.size_gb() / r["s"])
        r = self.w.call("np_memmap", path=p)
        self.record("np_memmap", t.name, rep, r["bytes"] / 1e9 / r["s"])
        t.remove(d)

    def wl_dcp(self, t: Target, rep: int) -> None:
        d = self.fresh(t, "dcp", rep)
        p = os.path.join(d, "ckpt")
        with self.profiled(t, f"dcp_save-r{rep}"):
            r = self.w.call("dcp_save", path=p, fsync=t.fsync)
        self.record("dcp_save", t.name, rep, self.size_gb() / r["s"])
        t.settle(d)
        r = self.w.call("dcp_load", path=p)
        self.record("dcp_load", t.name, rep, self.size_gb() / r["s"])
        t.remove(d)

    def wl_dd(self, t: Target, rep: int) -> None:
        d = self.fresh(t, "dd", rep)
        count = self.w.size // MiB
        cmd = ["dd", "if=/dev/zero", f"of={os.path.join(d, 'dd.bin')}", "bs=1M", f"count={count}"]
        if t.fsync:
            cmd.append("conv=fsync")
        with self.profiled(t, f"dd-r{rep}"):
            res = run(cmd)
        m = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", res.stderr, re.M)
        self.record("dd_1m", t.name, rep, int(m.group(1)) / float(m.group(2)) / 1e9)
        t.settle(d)
        t.remove(d)

    def wl_writers(self, t: Target, rep: int) -> None:
        for n in self.args.writers:
            self.writers(t, rep, n)

    def writers(self, t: Target, rep: int, n: int) -> None:
        """n fresh processes (ranks of one node) each torch.save 1/n of the size at once."""
        d = self.fresh(t, f"w{n}", rep)
        with self.ranks(n, self.w.size // n, t.fsync) as procs:
            with self.profiled(t, f"writers{n}-r{rep}"):
                s = self.save_all(procs, [os.path.join(d, f"rank{i}.pt") for i in range(n)])
        self.record(f"writers{n}", t.name, rep, n * (self.w.size // n) / 1e9 / s)
        t.settle(d)
        self.sample_rss(t, f"writers{n}")
        t.remove(d)

    @contextlib.contextmanager
    def ranks(self, n: int, shard: int, fsync: bool):
        """n rank processes, each holding a state dict of ``shard`` bytes, ready to save."""
        procs = [subprocess.Popen([PY, WORKER, "rank", str(shard), "/dev/null",
                                   "1" if fsync else "0"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd="/") for i in range(n)]
        try:
            for p in procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError("rank writer failed to start")
            yield procs
        finally:
            for p in procs:
                p.stdin.close()
                p.wait()

    @staticmethod
    def save_all(procs: list, paths: list[str]) -> float:
        """Each rank saves to its path at once: the seconds until the last one is done."""
        t0 = time.perf_counter()
        for p, path in zip(procs, paths):
            p.stdin.write(f"go {path}\n")
            p.stdin.flush()
        for p in procs:
            json.loads(p.stdout.readline())
        return time.perf_counter() - t0

    def wl_admission(self, t: Target, rep: int) -> None:
        """What the admission of writers costs (docs/semantics.md, section 6): torch.save and 8
        writers to names never seen (on a store in RAM they take the daemon's path), and a
        checkpoint loop of 8 ranks over 5 steps in rotating directories, whose names repeat
        from step 2 on: its speed and the share of its opens passed through."""
        if t.name not in ("shm", "acpfs", "acpfs-disk"):
            return
        d = self.fresh(t, "adm", rep)
        p = os.path.join(d, f"new-{self.id}-{rep}.pt")
        r = self.w.call("torch_save", path=p, fsync=t.fsync)
        self.record("torch_save_new", t.name, rep, self.size_gb() / r["s"])
        t.settle(d)
        n, shard = 8, self.w.size // 8
        with self.ranks(n, shard, t.fsync) as procs:
            s = self.save_all(procs, [os.path.join(d, f"new-{self.id}-{rep}-rank{i}.pt")
                                      for i in range(n)])
            self.record("writers8_new", t.name, rep, n * shard / 1e9 / s)
            t.settle(d)
        # the loop: a step is 1/1.5 of the cache, as in the issue; each step's files are
        # new names at step 1 and the same names, in a new directory, at steps 2-5
        shard = self.args.cache_size * 2 // 3 // n
        with self.ranks(n, shard, t.fsync) as procs:
            for mode in ("loop", "loop_b2b"):
                took, opens = 0.0, {}
                for step in range(5):
                    if step == 1 and isinstance(t, Acpfs):
                        opens = dict(t.status()["cache"]["writer_opens"])
                    sd = os.path.join(d, f"{mode}_{step:04d}")
                    os.makedirs(sd)
                    s = self.save_all(procs, [os.path.join(sd, f"{mode}{rep}-{self.id}__{i}_0.distcp")
                                              for i in range(n)])
                    took += s if step else 0.0
                    if mode == "loop":
                        t.settle(sd)          # the flusher keeps up: training runs meanwhile
                    if step >= 2:             # the job keeps its last two checkpoints
                        t.remove(os.path.join(d, f"{mode}_{step - 2:04d}"))
                if isinstance(t, Acpfs):
                    now = t.status()["cache"]["writer_opens"]
                    why = {k: v - opens.get(k, 0) for k, v in now.items()}
                    self.extra.setdefault("loop_writer_opens", {}).setdefault(
                        f"{t.name} {mode}", []).append(why)
                    self.record(f"{mode}_passed", t.name, rep, 100.0 * why["passed_through"] / (4 * n))
                self.record(f"{mode}_save", t.name, rep, 4 * n * shard / 1e9 / took)
                t.settle(d)
        t.remove(d)

    def wl_cold(self, t: Target, rep: int) -> None:
        """A resume on a node whose cache does not hold the checkpoint: files written straight
        into the mount's backing and fsynced, read there once untimed (so in its page cache,
        clean, as after a read there), each loaded through the mount once (a fresh name: never
        cached) and the same loader run directly on the backing file, side by side; then the
        second read, against a copy in /dev/shm."""
        if not isinstance(t, Acpfs):
            return
        d = os.path.join(t.backing, f"cold-r{rep}")
        os.makedirs(d)
        loaders = [("cold_read", "read_file", {}), ("cold_np_memmap", "np_memmap", {}),
                   ("cold_torch_mmap", "torch_load", {"mmap": True})]
        for metric, op, kw in loaders:
            back = os.path.join(d, f"{metric}.pt")
            self.w.call("torch_save", path=back, fsync=True)
            gb = os.path.getsize(back) / 1e9
            self.w.call(op, path=back, **kw)     # untimed: both then read a warm page cache
            r = self.w.call(op, path=back, **kw)
            self.record(metric, "backing", rep, gb / r["s"])
            through = os.path.join(t.root, f"cold-r{rep}", f"{metric}.pt")
            r = self.w.call(op, path=through, **kw)
            self.record(metric, t.name, rep, gb / r["s"])
            self.kept(t)
            if metric == "cold_np_memmap":   # the kept copy, mapped: against both references
                self.w.call(op, path=back, **kw)
                r = self.w.call(op, path=back, **kw)
                self.record("cold_np_memmap_again", "backing", rep, gb / r["s"])
                r = self.w.call(op, path=through, **kw)
                self.record("cold_np_memmap_again", t.name, rep, gb / r["s"])
                if t.name == "acpfs":
                    self.on_shm_copy("cold_np_memmap_again", op, back, rep, warm=True)
            if metric == "cold_read":
                r = self.w.call(op, path=through)
                self.record("cold_read_again", t.name, rep, gb / r["s"])
                if t.name == "acpfs":
                    self.on_shm_copy("cold_read_again", op, back, rep, warm=False)
        back = os.path.join(d, "cold_st_load.safetensors")
        self.w.call("st_save", path=back, fsync=True)
        gb = os.path.getsize(back) / 1e9
        self.w.call("st_load", path=back)
        r = self.w.call("st_load", path=back)
        self.record("cold_st_load", "backing", rep, gb / r["s"])
        r = self.w.call("st_load", path=os.path.join(t.root, f"cold-r{rep}", os.path.basename(back)))
        self.record("cold_st_load", t.name, rep, gb / r["s"])
        self.kept(t)
        self.cold_small(t, rep, d)
        self.cold_ranks(t, rep, d)
        self.extra.setdefault("cold_reads", {}).setdefault(t.name, []).append(t.status()["cold_reads"])
        t.remove(os.path.join(t.root, f"cold-r{rep}"))
        if t.name in ("acpfs", "acpfs-daemon"):
            self.cold_over_latency(t, rep)

    RANKS = 8

    def ranks_at_once(self) -> LoaderRanks:
        """The loader processes of the 8-rank rows (torch imported once per run)."""
        if self._ranks is None:
            self._ranks = LoaderRanks(self.RANKS)
        return self._ranks

    def cold_ranks(self, t: Acpfs, rep: int, d: str) -> None:
        """8 processes load one file the cache does not hold at once (np.memmap + touch: every
        inference process of a node mapping the same new weights), against the same 8 on the
        backing file directly (its page cache warm, as for the other loaders)."""
        back = os.path.join(d, "cold_8_ranks.bin")
        fill(back, self.w.size, os.urandom(MiB), fsync=True)
        gb = self.RANKS * os.path.getsize(back) / 1e9
        ranks = self.ranks_at_once()
        ranks.at_once("np_memmap", back)   # untimed: into the backing's page cache
        self.record("cold_8_ranks", "backing", rep, gb / ranks.at_once("np_memmap", back))
        through = os.path.join(t.root, f"cold-r{rep}", os.path.basename(back))
        self.record("cold_8_ranks", t.name, rep, gb / ranks.at_once("np_memmap", through))
        self.kept(t)

    def cold_small(self, t: Acpfs, rep: int, d: str) -> None:
        """Many small files written into the backing (a directory of the cold one), read
        there once untimed, then read directly and through the mount side by side; then
        again through the mount once kept, against the backing read directly again."""
        small = os.path.join(d, "small")
        os.makedirs(small)
        n = max(self.args.small_files // 5, 1)
        for i in range(n):
            with open(os.path.join(small, f"s{i:05}"), "wb") as f:
                f.write(os.urandom(self.args.small_size))
        through = os.path.join(t.root, f"cold-r{rep}", "small")
        self.w.call("read_small", path=small)
        r = self.w.call("read_small", path=small)
        direct = r["files"] / r["s"]
        self.record("cold_small", "backing", rep, direct)
        r = self.w.call("read_small", path=through)
        self.record("cold_small", t.name, rep, r["files"] / r["s"])
        # the reference stays the warm read above: a copy into the cache drops the backing's
        # pages (docs/design.md, "One copy in RAM"), and a read there now would meet the disk
        self.record("cold_small_again", "backing", rep, direct)
        self.kept(t)
        r = self.w.call("read_small", path=through)
        self.record("cold_small_again", t.name, rep, r["files"] / r["s"])

    def on_shm_copy(self, metric: str, op: str, back: str, rep: int, warm: bool) -> None:
        """``metric``'s /dev/shm reference: ``op`` on a copy of ``back`` there (``warm``: run
        once untimed first, as the mapped loads are)."""
        copy = os.path.join(self.shm, "cold-copy.pt")
        shutil.copyfile(back, copy)
        try:
            if warm:
                self.w.call(op, path=copy)
            r = self.w.call(op, path=copy)
            self.record(metric, "shm", rep, os.path.getsize(back) / 1e9 / r["s"])
        finally:
            os.unlink(copy)

    @staticmethod
    def kept(t: Acpfs) -> None:
        """Untimed: until the copies of files read from the backing are made (they would
        take CPU from the next measurement)."""
        deadline = time.monotonic() + 300
        while t.status()["cold_reads"]["keeping"] and time.monotonic() < deadline:
            time.sleep(0.05)

    def cold_over_latency(self, t: Acpfs, rep: int) -> None:
        """The same over a backing with a per-request latency, as a network filesystem has:
        tests/faultfs.py mirrors a directory and answers each READ 2 ms late; a second mount
        of the target's kind is made over it. read() and `acpfs preload` through it against
        one stream reading the faultfs directory directly."""
        sys.path.insert(0, str(REPO / "tests"))
        from faultfs import Shim
        size = min(self.w.size, 256 * MiB)
        base = os.path.join(self.tmp, f"slow-{t.name}-r{rep}")
        src, shim_dir = os.path.join(self.bdir, f"slow-src-{t.name}-r{rep}"), base + "-backing"
        for d in (src, shim_dir):
            os.makedirs(d)
        block = os.urandom(MiB)
        for name in ("direct.bin", "read.bin", "preload.bin", "preload-direct.bin", "eight.bin",
                     "eight-direct.bin", "np.bin", "np-direct.bin"):
            fill(os.path.join(src, name), size, block)
        shim = Shim(Path(src), Path(shim_dir), Path(base + ".ctl"))
        m = Acpfs(base + "-mnt", shim_dir, os.path.join(self.shm, f"slow-{t.name}-cache"),
                  self.args.cache_size, base + ".log", name=t.name, env=t.env)
        try:
            shim.set("slow 0.002 read")
            m.start()
            gb = size / 1e9
            r = self.w.call("read_file", path=os.path.join(shim_dir, "direct.bin"))
            self.record("slow_read", "backing", rep, gb / r["s"])
            served = self.backing_reads(shim, m)
            r = self.w.call("read_file", path=os.path.join(m.root, "read.bin"))
            self.record("slow_read", t.name, rep, gb / r["s"])
            after_one = self.backing_reads(shim, m)
            ranks = self.ranks_at_once()
            r = ranks.at_once("read_file", os.path.join(m.root, "eight.bin"))
            self.record("slow_8_ranks_read", t.name, rep, self.RANKS * gb / r)
            after_eight = self.backing_reads(shim, m)
            one = [a - b for a, b in zip(after_one, served)]
            eight = [a - b for a, b in zip(after_eight, after_one)]
            self.record("slow_8_ranks", t.name, rep, eight[1] / max(1, one[1]))
            # the requests too: they split where readers meet, so they may grow when bytes do not
            self.extra.setdefault("slow_8_ranks_requests", {}).setdefault(t.name, []).append(
                {"one": one[0], "eight": eight[0], "one_bytes": one[1], "eight_bytes": eight[1]})
            # a mapping loader: its page faults read the backing file (passed through)
            r = self.w.call("np_memmap", path=os.path.join(shim_dir, "np-direct.bin"))
            self.record("slow_np_memmap", "backing", rep, gb / r["s"])
            r = self.w.call("np_memmap", path=os.path.join(m.root, "np.bin"))
            self.record("slow_np_memmap", t.name, rep, gb / r["s"])
            self.kept(m)
            # the preload's reference right before it: on a VM whose host takes back free
            # memory, both then fill fresh pages in the same state (docs/benchmarks.md)
            r = self.w.call("read_file", path=os.path.join(shim_dir, "preload-direct.bin"))
            self.record("slow_preload", "backing", rep, gb / r["s"])
            s0 = time.perf_counter()
            m.acpfs("preload", os.path.join(m.root, "preload.bin"), timeout=600)
            self.record("slow_preload", t.name, rep, gb / (time.perf_counter() - s0))
            # last: the 8 readers' reference (faultfs counts its reads too, and nothing
            # measured through the mount runs after it)
            r = ranks.at_once("read_file", os.path.join(shim_dir, "eight-direct.bin"))
            self.record("slow_8_ranks_read", "backing", rep, self.RANKS * gb / r)
        finally:
            with contextlib.suppress(Exception):
                shim.set("ok")
                m.stop()
            shim.close()
            rm_tree(src)

    def backing_reads(self, shim, m: Acpfs) -> tuple[int, int]:
        """READ requests faultfs served so far and their bytes, once the copies kept after
        reads are made (faultfs writes its counts every 0.1 s)."""
        self.kept(m)
        time.sleep(0.5)
        c = shim.counts()
        return c.get("read", 0), c.get("read_bytes", 0)

    def wl_peers(self, t: Target, rep: int) -> None:
        """tools/bench_peers.py: 4 nodes (mounts over views of one latency backing) load one
        cold checkpoint at once, against each reading the backing itself."""
        if not isinstance(t, Acpfs) or t.name not in ("acpfs", "acpfs-daemon"):
            return
        import bench_peers

        # room for the checkpoint (a copy takes at most half the cache) and no more: four
        # nodes' pools of --cache-size each (the daemon's path pre-faults them) do not fit
        cache = 2 * self.args.size + (256 << 20)

        def mount(root: str, backing: str, i: int) -> Acpfs:
            return Acpfs(root, backing, os.path.join(self.shm, f"{os.path.basename(root)}-cache"),
                         cache, root + ".log", name=t.name, env=t.env,
                         extra=["--peers-listen", "127.0.0.1:0"])
        got = bench_peers.run(self, t, rep, mount, self.record, fill)
        self.extra.setdefault("peers", {}).setdefault(t.name, []).append(got)

    def wl_replicas(self, t: Target, rep: int) -> None:
        """tools/bench_replicas.py: node A saves with and without replicas on node B."""
        if not isinstance(t, Acpfs) or t.name not in ("acpfs", "acpfs-daemon"):
            return
        import bench_replicas
        cache = 2 * self.args.size + (256 << 20)

        def mount(root: str, backing: str, extra: list[str]) -> Acpfs:
            return Acpfs(root, backing, os.path.join(self.shm, f"{os.path.basename(root)}-cache"),
                         cache, root + ".log", name=t.name, env=t.env, extra=extra)
        got = bench_replicas.run(self, t, rep, mount, self.record)
        self.extra.setdefault("replicas", {}).setdefault(t.name, []).append(got)

    def wl_small(self, t: Target, rep: int) -> None:
        # the C floor serves one directory, and keeps no data: create, stat, unlink only
        d = t.root if isinstance(t, CFloor) else self.fresh(t, "small", rep)
        n = self.args.small_files
        with self.profiled(t, f"small-r{rep}"), idle_polling(isinstance(t, CFloor)):
            r = self.w.call("small", path=d, n=n, size=self.args.small_size, fsync=t.fsync)
        self.record("small_create", t.name, rep, n / r["create_s"])
        self.record("small_stat", t.name, rep, n / r["stat_s"])
        self.record("small_unlink", t.name, rep, n / r["unlink_s"])
        if isinstance(t, CFloor):
            return
        d = self.fresh(t, "persist", rep)
        src = self.small_source(n)
        with self.profiled(t, f"small_persist-r{rep}"):
            start = time.perf_counter()
            run(["cp", "-r", src, os.path.join(d, "files")])
            if isinstance(t, Acpfs):
                t.acpfs("sync", d, timeout=1800)
            elif isinstance(t, Rclone):
                t.settle(d)
            else:
                run(["sync", "-f", d])
            self.record("small_persist", t.name, rep, n / (time.perf_counter() - start))
        t.remove(d)
        d = self.fresh(t, "sqlite", rep)
        for mode, prefix in (("delete", "sqlite"), ("wal", "sqlite_wal")):
            with self.profiled(t, f"{prefix}-r{rep}"):
                r = self.w.call("sqlite", path=d, mode=mode)
            self.record(f"{prefix}_query", t.name, rep, r["queries"] / r["query_s"])
            self.record(f"{prefix}_insert", t.name, rep, r["inserts"] / r["insert_s"])
        self.sample_rss(t, "small")
        t.remove(d)

    def small_source(self, n: int) -> str:
        """A directory of ``n`` files of --small-size in /dev/shm, made once per run: what
        ``small_persist`` copies."""
        src = os.path.join(self.shm, f"small-source-{n}")
        if not os.path.isdir(src):
            os.makedirs(src + ".part")
            data = os.urandom(self.args.small_size)
            for i in range(n):
                with open(os.path.join(src + ".part", f"f{i:06d}"), "wb") as f:
                    f.write(data)
            os.rename(src + ".part", src)
        return src

    def wl_close_flush(self, t: Target, rep: int) -> None:
        d = self.fresh(t, "close", rep)
        p = os.path.join(d, "big.bin")
        poll = ("acpfs" if t.name.startswith("acpfs") else t.name) \
            if t.name.startswith("acpfs") or t.name == "rclone" else None
        sync_cmd = [PY, "-m", "acpfs", "sync", t.root] if t.name.startswith("acpfs") else None
        with self.profiled(t, f"close_flush-r{rep}"):
            r = self.w.call("write_close", path=p, size=self.w.size, fsync=t.fsync, poll=poll,
                            backing_path=t.backing_of(p), sync_cmd=sync_cmd)
        gb = r["bytes"] / 1e9
        self.record("write_1m", t.name, rep, gb / r["write_s"])
        self.record("close_ms", t.name, rep, r["close_s"] * 1e3)
        if "durable_s" in r:
            self.record("durable_s", t.name, rep, r["durable_s"])
            self.record("flush", t.name, rep, gb / r["durable_s"])
        if "drain_s" in r:
            self.record("drain_s", t.name, rep, r["drain_s"])
        self.sample_rss(t, "close_flush")
        if t.name == "disk":
            # the baseline for flush throughput: copy the same bytes from RAM, with fsync
            src = os.path.join(self.shm, "copy-src.bin")
            if not os.path.exists(src):
                shutil.copyfile(p, src)
            r = self.w.call("copy_fsync", src=src, dst=os.path.join(d, "copy.bin"))
            self.record("flush", t.name, rep, os.path.getsize(src) / 1e9 / r["s"])
        t.settle(d)
        t.remove(d)

    # -- daemon RSS with many cached small files ------------------------------------------
    def rss100k(self) -> None:
        a = self.args
        n = a.rss_files
        bs = 64 << 10
        cache = max(n * bs + GiB, 2 * GiB)
        if cache > meminfo()["MemAvailable"] * 0.8:
            self.note(f"rss100k skipped: {n} files need a {cache / GiB:.1f} GiB pool (one 64 KiB block each)")
            return
        t = Acpfs(os.path.join(self.tmp, "mnt-rss"), os.path.join(self.bdir, "rss-backing"),
                  os.path.join(self.shm, "rss-cache"), cache, os.path.join(self.tmp, "acpfs-rss.log"))
        log(f"rss100k: {n} small files into a fresh acpfs mount (cache {cache / GiB:.1f} GiB)")
        try:
            t.start()
            base = proc_rss(t.pid)
            t0 = time.perf_counter()
            self.w.call("small", path=os.path.join(t.root, "many"), n=n, size=a.small_size,
                        fsync=False, unlink=False, per_dir=1000)
            create_s = time.perf_counter() - t0
            dirty = proc_rss(t.pid)
            t0 = time.perf_counter()
            t.sync()
            sync_s = time.perf_counter() - t0
            after = proc_rss(t.pid)
            st = t.status()
            res = {"files": n, "create_s": create_s, "sync_s": sync_s,
                   "cached_files": st["cache"]["cached_files"], "cache_used_bytes": st["cache"]["used_bytes"],
                   "rss_empty": base, "rss_dirty": dirty, "rss_persisted": after}
            self.extra["rss100k"] = res
            worst = max(r["VmRSS"] - r.get("RssShmem", 0) for r in (dirty, after))
            self.record("rss_100k_mib", "acpfs", 1, worst / MiB, files=n)
            log(f"rss100k: {n} files created in {create_s:.1f}s ({n / create_s:.0f}/s), synced in "
                f"{sync_s:.1f}s; RSS without pool: dirty {(dirty['VmRSS'] - dirty.get('RssShmem', 0)) / MiB:.0f} MiB, "
                f"persisted {(after['VmRSS'] - after.get('RssShmem', 0)) / MiB:.0f} MiB; "
                f"{st['cache']['cached_files']} files cached")
        finally:
            t.stop()
            rm_tree(t.cache_dir)

    # -- the run --------------------------------------------------------------------------
    def check_memory(self) -> None:
        a = self.args
        need = 2 * a.size + a.size + a.cache_size  # worker dict + loaded copy, /dev/shm file, pool
        if "rclone" in self.targets and not a.rclone_cache_dir:
            need += a.size
        if "peers" in a.workloads:   # 4 nodes: a copy each; the daemon's path pre-faults pools
            need += 4 * (2 * a.size + (256 << 20) if "acpfs-daemon" in self.targets else a.size)
        avail = meminfo()["MemAvailable"]
        shm_free = shutil.disk_usage("/dev/shm").free
        shm_need = a.size + a.cache_size + (a.size if "rclone" in self.targets and not a.rclone_cache_dir else 0)
        log(f"memory: need ~{need / GiB:.1f} GiB of {avail / GiB:.1f} GiB available; "
            f"/dev/shm: need ~{shm_need / GiB:.1f} GiB of {shm_free / GiB:.1f} GiB free")
        if need > avail * 0.95 or shm_need > shm_free:
            sys.exit(f"bench: --size {a.size / GiB:g}G needs ~{need / GiB:.0f} GiB RAM and {shm_need / GiB:.0f} GiB "
                     f"of /dev/shm; this machine has {avail / GiB:.0f} GiB available and {shm_free / GiB:.0f} GiB "
                     f"free; use a smaller --size (and --cache-size)")

    def main(self) -> int:
        a = self.args
        self.setup()
        self.check_memory()
        log(f"results: {self.out}")
        started = []
        try:
            log(f"building a {a.size / GiB:.2f} GiB state dict in the worker")
            self.w = WorkerProc(a.size)
            for name, t in list(self.targets.items()):
                try:
                    t.start()
                except RuntimeError as e:
                    if not isinstance(t, CFloor):
                        raise
                    self.note(f"the C floor is skipped: {e}")   # no cc or libfuse3 headers
                    del self.targets[name]
                    continue
                started.append(t)
                self.sample_rss(t, "start")
            self.save()
            t_run = time.perf_counter()
            for wl in a.workloads:
                if wl == "rss100k":
                    continue
                fn = getattr(self, f"wl_{wl}")
                for rep in range(a.reps + 1):
                    log(f"{wl}: repetition {rep}{' (warm-up)' if rep == 0 else ''}")
                    for t in self.targets.values():
                        if t.workloads is not None and wl not in t.workloads:
                            continue
                        try:
                            fn(t, rep)
                            if isinstance(t, Acpfs):
                                # untimed: what it still persists (the removal of the files
                                # it just wrote) does not run under the next target's
                                # measurement (docs/benchmarks.md, "Method")
                                t.sync()
                        except Exception as e:
                            self.note(f"{wl} on {TARGET_LABEL[t.name]}, repetition {rep}, failed: "
                                      f"{type(e).__name__}: {e}")
                            self.extra.setdefault("failures", []).append(
                                {"workload": wl, "target": t.name, "rep": rep, "error": str(e)})
                            self.cleanup(t)
                        self.save()
            for t in self.targets.values():
                self.sample_rss(t, "end")
                if isinstance(t, Acpfs):
                    self.extra.setdefault("acpfs_status_end", {})[t.name] = t.status()
            self.extra["run_s"] = time.perf_counter() - t_run
        finally:
            for t in reversed(started):
                with contextlib.suppress(Exception):
                    t.stop()
        try:
            if "rss100k" in a.workloads:
                self.rss100k()
        finally:
            if hasattr(self, "w"):
                self.w.close()
            if self._ranks is not None:
                self._ranks.close()
        self.daemon_metrics()
        self.save()
        table = self.report()
        (self.out / "table.md").write_text(table + "\n")
        print(table)
        self.chart()
        self.save()
        if not a.keep:
            for d in (self.shm, self.tmp, self.bdir):
                rm_tree(d)
        print(f"\nresults: {self.out}/results.json, {self.out}/table.md" +
              (f", {self.out}/chart.png" if (self.out / "chart.png").exists() else ""))
        return 0

    def cleanup(self, t: Target) -> None:
        """After a failed measurement: empty the target's directory for the next one."""
        for name in os.listdir(t.root):
            with contextlib.suppress(Exception):
                t.remove(os.path.join(t.root, name))
        if isinstance(t, Rclone):
            for name in os.listdir(t.backing):
                rm_tree(os.path.join(t.backing, name))

    def daemon_metrics(self) -> None:
        for name, r in self.rss_max.items():
            self.record("rss_mib", name, 1, r["no_pool"] / MiB)
            self.record("rss_total_mib", name, 1, r["VmRSS"] / MiB)
        for name, st in self.extra.get("acpfs_status_end", {}).items():
            self.record("cache_peak_gib", name, 1, st["cache"]["peak_used_bytes"] / GiB)

    # -- reporting ------------------------------------------------------------------------
    def medians(self) -> dict[tuple[str, str], dict]:
        groups: dict[tuple[str, str], list[float]] = {}
        for s in self.samples:
            if not s["warmup"]:
                groups.setdefault((s["metric"], s["target"]), []).append(s["value"])
        return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
                for k, v in groups.items()}

    def checks(self, med) -> list[dict]:
        def m(metric, target):
            return med.get((metric, target), {}).get("median")

        def ratio(metric, a, b):
            x, y = m(metric, a), m(metric, b)
            return None if x is None or y is None or y == 0 else x / y

        out = []

        def add(metric, goal, value, ok, shown):
            out.append({"metric": metric, "goal": goal, "value": value,
                        "result": "n/a" if ok is None else ("PASS" if ok else "MISS"), "shown": shown})

        r1, r2 = ratio("torch_save", "acpfs", "shm"), ratio("torch_save", "acpfs", "rclone")
        add("torch_save", ">=0.9x shm", r1, None if r1 is None else r1 >= 0.9, f"{r1:.2f}x" if r1 else "-")
        add("torch_save", ">=4x rclone", r2, None if r2 is None else r2 >= 4, f"{r2:.2f}x" if r2 else "-")
        r = ratio("torch_save", "acpfs-disk", "shm")
        add("torch_save", ">=0.9x shm, store on disk", r, None if r is None else r >= 0.9,
            f"{r:.2f}x" if r else "-")
        for name in ("acpfs", "acpfs-disk"):
            r = m("loop_passed", name)
            add("loop_passed", f"100% ({TARGET_LABEL[name]})", r,
                None if r is None else r >= 100, f"{r:.0f}%" if r is not None else "-")
        r = ratio("dd_1m", "acpfs", "shm")
        add("dd_1m", ">=1.0x shm", r, None if r is None else r >= 1.0, f"{r:.2f}x" if r else "-")
        c = med.get(("close_ms", "acpfs"))
        add("close_ms", "<10 ms", c and c["median"], None if c is None else c["median"] < 10,
            f"{c['median']:.2f} ms (max {c['max']:.2f})" if c else "-")
        r = ratio("flush", "acpfs", "disk")
        add("flush", ">=0.8x copy+fsync", r, None if r is None else r >= 0.8, f"{r:.2f}x" if r else "-")
        r = ratio("torch_load", "acpfs", "shm")
        add("torch_load", ">=0.8x shm", r, None if r is None else r >= 0.8, f"{r:.2f}x" if r else "-")
        ok = self.extra.get("mmap_ok", {}).get("acpfs")
        add("torch_load_mmap", "mmap=True works", None, None if ok is None else all(ok),
            "works" if ok and all(ok) else ("fails" if ok else "-"))
        for metric in ("cold_read", "cold_np_memmap", "cold_torch_mmap", "cold_st_load"):
            r = ratio(metric, "acpfs", "backing")
            add(metric, ">=0.9x backing, direct", r, None if r is None else r >= 0.9,
                f"{r:.2f}x" if r else "-")
        for metric in ("cold_small", "cold_small_again"):   # no goal: the issue names none
            r = ratio(metric, "acpfs", "backing")
            add(metric, "(backing, direct)", r, None, f"{r:.2f}x" if r else "-")
        for metric in ("slow_read", "slow_preload"):
            r = ratio(metric, "acpfs", "backing")
            add(metric, ">=2x one stream direct", r, None if r is None else r >= 2,
                f"{r:.2f}x" if r else "-")
        for metric in ("cold_8_ranks", "slow_np_memmap", "slow_8_ranks_read"):   # no goal named
            r = ratio(metric, "acpfs", "backing")
            add(metric, "(backing, direct)", r, None, f"{r:.2f}x" if r else "-")
        v = m("slow_8_ranks", "acpfs")
        add("slow_8_ranks", "<=1.2x one reader", v, None if v is None else v <= 1.2,
            f"{v:.2f}x" if v is not None else "-")
        r = ratio("cold_read_again", "acpfs", "shm")
        add("cold_read_again", ">=0.9x shm", r, None if r is None else r >= 0.9, f"{r:.2f}x" if r else "-")
        r = ratio("cold_np_memmap_again", "acpfs", "shm")
        add("cold_np_memmap_again", ">=0.9x shm", r, None if r is None else r >= 0.9,
            f"{r:.2f}x" if r else "-")
        r = ratio("small_create", "acpfs", "rclone")
        add("small_create", ">=1.0x rclone", r, None if r is None else r >= 1.0, f"{r:.2f}x" if r else "-")
        for target in ("acpfs", "acpfs-daemon"):   # issue 31: against cp + sync; no goal
            r = ratio("small_persist", target, "disk")
            add("small_persist", f"(cp + sync -f on disk; {target})", r, None,
                f"{r:.2f}x" if r else "-")
        for metric, goal in (("small_create", 0.03), ("small_stat", 0.10), ("small_unlink", 0.03),
                             ("sqlite_query", 0.2)):   # issue 31: sqlite within 5x of shm
            for target in ("acpfs", "acpfs-daemon"):
                r = ratio(metric, target, "shm")
                add(metric, f">={goal}x shm ({target})", r, None if r is None else r >= goal,
                    f"{r:.3f}x" if r else "-")
        for metric in ("small_create", "small_stat", "small_unlink"):   # issue 31: no goal
            for target in ("c-floor", "acpfs", "acpfs-daemon"):
                other = "shm" if target == "c-floor" else "c-floor"
                r = ratio(metric, target, other)
                add(metric, f"({target} / {TARGET_LABEL[other]})", r, None,
                    f"{r:.3f}x" if r else "-")
        for target in ("acpfs", "acpfs-daemon"):   # issue 32
            r = ratio("peers_load", target, "backing")
            add("peers_load", f">=2x each node reading the backing ({target})", r,
                None if r is None else r >= 2, f"{r:.2f}x" if r else "-")
            v = m("peers_backing_x", target)
            add("peers_backing_x", f"<=1.2x the checkpoint ({target})", v,
                None if v is None else v <= 1.2, f"{v:.2f}x" if v is not None else "-")
        for target in ("acpfs", "acpfs-daemon"):   # issue 32: replicas
            r = ratio2(m, "replicas_save_async", "replicas_save_none", target)
            add("replicas_save_async", f">=0.9x no replicas ({target})", r,
                None if r is None else r >= 0.9, f"{r:.2f}x" if r else "-")
            r = ratio2(m, "replicas_save_wait", "replicas_save_none", target)
            add("replicas_save_wait", f"(/ no replicas, {target})", r, None, f"{r:.2f}x" if r else "-")
            c = m("replicas_close_wait", target)
            add("replicas_close_wait", f"(close() with --replica-wait, {target})", c, None,
                f"{c:.1f} ms" if c is not None else "-")
        v = m("rss_100k_mib", "acpfs")
        files = self.extra.get("rss100k", {}).get("files", self.args.rss_files)
        add("rss_100k_mib", f"<200 MiB ({files} files)", v, None if v is None else v < 200,
            f"{v:.0f} MiB" if v else "-")
        return out

    def report(self) -> str:
        med = self.medians()
        checks = self.checks(med)
        self.extra["medians"] = {f"{k[0]}|{k[1]}": v for k, v in med.items()}
        self.extra["checks"] = checks
        names = [n for n in COLUMNS if any(k[1] == n for k in med)]
        by_metric: dict[str, list[dict]] = {}
        for c in checks:
            by_metric.setdefault(c["metric"], []).append(c)
        a = self.args
        lines = [f"acpfs benchmark, {self.meta['started']}: {'--quick' if a.quick else 'full'}, "
                 f"size {self.w.size / GiB:.2f} GiB, {a.small_files} small files of {a.small_size} B, "
                 f"median of {a.reps} repetitions after 1 warm-up",
                 f"machine: {self.meta['machine']['nproc']} CPUs ({self.meta['machine']['cpu']}), "
                 f"{self.meta['machine']['mem_total_gib']} GiB RAM, kernel {self.meta['machine']['kernel']}, "
                 f"backing {a.backing_dir} on {self.meta['machine']['backing_fs']}; "
                 f"acpfs {self.meta.get('acpfs_commit', '?')}", ""]
        hdr = ["metric", "unit"] + [TARGET_LABEL[n] for n in names] + \
            ["acpfs/shm", "acpfs/disk", "acpfs/rclone", "store on disk/shm", "daemon path/shm",
             "acpfs/backing", "daemon path/backing", "acpfs/C floor", "target"]
        lines.append("| " + " | ".join(hdr) + " |")
        lines.append("|" + "|".join("---" for _ in hdr) + "|")
        for metric, (_wl, unit, higher, _desc) in METRICS.items():
            if not any(k[0] == metric for k in med):
                continue
            row = [metric, unit]
            for n in names:
                v = med.get((metric, n))
                row.append(fmt(v["median"]) if v else "-")
            for mine, other in (("acpfs", "shm"), ("acpfs", "disk"), ("acpfs", "rclone"),
                                ("acpfs-disk", "shm"), ("acpfs-daemon", "shm"),
                                ("acpfs", "backing"), ("acpfs-daemon", "backing"),
                                ("acpfs", "c-floor")):
                x, y = med.get((metric, mine)), med.get((metric, other))
                row.append(f"{x['median'] / y['median']:.2f}" if x and y and y["median"] else "-")
            row.append("; ".join(f"{c['goal']}: {c['shown']} {c['result']}" for c in by_metric.get(metric, [])))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        lines.append("ratios are acpfs/other of the medians (for s, ms and MiB lower is better).")
        for c in checks:
            lines.append(f"{c['result']:4s}  {c['metric']:16s} {c['goal']:28s} {c['shown']}")
        if self.extra.get("rss100k"):
            r = self.extra["rss100k"]
            lines.append(f"rss100k: {r['files']} files, {r['cached_files']} cached, created in {r['create_s']:.1f}s, "
                         f"synced in {r['sync_s']:.1f}s")
        for name, r in self.rss_max.items():
            lines.append(f"peak RSS of {name} daemon: VmRSS {r['VmRSS'] / MiB:.0f} MiB = RssAnon "
                         f"{r.get('RssAnon', 0) / MiB:.0f} + RssFile {r.get('RssFile', 0) / MiB:.0f} + RssShmem "
                         f"{r.get('RssShmem', 0) / MiB:.0f} MiB (at {r['at']})")
        for key, found in self.extra.get("loop_writer_opens", {}).items():
            lines.append(f"writers' opens of steps 2-5 by decision, {key}: "
                         + "; ".join(", ".join(f"{k} {v}" for k, v in d.items()) for d in found))
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)

    def chart(self) -> None:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("bench: no chart: matplotlib is missing (.venv/bin/pip install matplotlib)", file=sys.stderr)
            self.notes.append("no chart: matplotlib missing")
            return
        med = self.medians()
        metrics = [m for m in METRICS if any(k[0] == m for k in med)]
        names = [n for n in TARGETS if any(k[1] == n for k in med)]
        cols = 4
        rows = (len(metrics) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
        colors = {"shm": "#888888", "disk": "#d62728", "acpfs": "#1f77b4", "acpfs-disk": "#2ca02c",
                  "acpfs-daemon": "#9ecae1",
                  "rclone": "#ff7f0e", "c-floor": "#444444"}
        for ax, metric in zip(axes.flat, metrics):
            unit, higher = METRICS[metric][1], METRICS[metric][2]
            xs, ys, lo, hi, cs = [], [], [], [], []
            for n in names:
                v = med.get((metric, n))
                if v:
                    xs.append(TARGET_LABEL[n])
                    ys.append(v["median"])
                    lo.append(v["median"] - v["min"])
                    hi.append(v["max"] - v["median"])
                    cs.append(colors[n])
            ax.bar(xs, ys, yerr=[lo, hi], color=cs, capsize=3)
            if unit == "files/s" and ys and min(ys) > 0:
                ax.set_yscale("log")
            ax.set_title(f"{metric} ({unit}, {'higher' if higher else 'lower'} is better)", fontsize=9)
            ax.tick_params(axis="x", labelsize=8)
        for ax in list(axes.flat)[len(metrics):]:
            ax.axis("off")
        fig.suptitle(f"acpfs bench {self.meta['started']} ({'quick' if self.args.quick else 'full'}, "
                     f"{self.w.size / GiB:.1f} GiB; median, bars min..max)")
        fig.tight_layout()
        fig.savefig(self.out / "chart.png", dpi=90)


def fmt(v: float) -> str:
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def main() -> int:
    ap = argparse.ArgumentParser(prog="tools/bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 GiB checkpoints, 2,000 small files")
    ap.add_argument("--size", type=parse_size, help="checkpoint size (default 8G, 2G with --quick)")
    ap.add_argument("--small-files", type=int, help="small-file count (default 10000, 2000 with --quick)")
    ap.add_argument("--small-size", type=int, default=4096, help="bytes per small file")
    ap.add_argument("--writers", default="1,2,4,8",
                    help="process counts of the writers workload (a subset of 1,2,4,8,16)")
    ap.add_argument("--rss-files", type=int, default=100_000, help="cached files for the rss100k workload")
    ap.add_argument("--reps", type=int, default=3, help="measured repetitions (after one warm-up)")
    ap.add_argument("--backing-dir", default="/var/tmp", help="a directory on the real disk for backings")
    ap.add_argument("--cache-size", type=parse_size, help="acpfs --cache-size (default 2.5 x size, rounded up)")
    ap.add_argument("--rclone-cache-dir", help="parent of rclone's --cache-dir (default: under /dev/shm, like acpfs)")
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset of " + ",".join(TARGETS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS + ["rss100k"]),
                    help="comma-separated subset of " + ",".join(WORKLOADS + ["rss100k"]))
    ap.add_argument("--out", help="results directory (default /tmp/bench-results/<timestamp>)")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy record the acpfs daemon during each acpfs measurement (skews them)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directories")
    a = ap.parse_args()
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        sys.exit("bench: needs /dev/fuse")
    a.size = a.size or (2 * GiB if a.quick else 8 * GiB)
    a.small_files = a.small_files or (2000 if a.quick else 10000)
    a.cache_size = a.cache_size or -(-int(2.5 * a.size) // GiB) * GiB
    a.targets = [t for t in a.targets.split(",") if t]
    a.workloads = [w for w in a.workloads.split(",") if w]
    for t in a.targets:
        if t not in TARGETS:
            sys.exit(f"bench: unknown target {t!r}")
    for w in a.workloads:
        if w not in WORKLOADS + ["rss100k"]:
            sys.exit(f"bench: unknown workload {w!r}")
    try:
        a.writers = [int(n) for n in a.writers.split(",") if n]
    except ValueError:
        sys.exit(f"bench: --writers takes process counts, e.g. 1,2,4,8, not {a.writers!r}")
    if not a.writers or any(n not in WRITERS for n in a.writers):
        sys.exit(f"bench: --writers must be a subset of {','.join(map(str, WRITERS))}")
    if a.reps < 1:
        sys.exit("bench: --reps must be at least 1")
    if "tmpfs" in fs_type(a.backing_dir).split()[0]:
        print(f"bench: warning: --backing-dir {a.backing_dir} is on tmpfs, not a disk", file=sys.stderr)
    a.out = a.out or f"/tmp/bench-results/{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench: matplotlib is missing, no chart will be drawn: .venv/bin/pip install matplotlib",
              file=sys.stderr)
    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)   # unmount in the finally blocks, as on Ctrl-C
    return Bench(a).main()


if __name__ == "__main__":
    sys.exit(main())
