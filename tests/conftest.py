"""Fixtures: real acpfs mounts, always unmounted (also when a test fails)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from acpfs import mounttable
from acpfs.commands.mount import pid_alive
from faultfs import Shim
from hangguard import guard

ACPFS = [sys.executable, "-m", "acpfs"]
TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Every test, its fixtures included, under the hang guard (tests/hangguard.py)."""
    factory = getattr(item.config, "_tmp_path_factory", None)   # pytest's, since 3.9
    with guard(item.nodeid, factory.getbasetemp() if factory else Path(tempfile.gettempdir())):
        yield


def acpfs(*args: str, check: bool = True, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(ACPFS + list(args), capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"acpfs {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


def gone(pid: int) -> bool:
    """Whether the process ``pid`` has exited. A daemon's parent exits at once, so its exit
    leaves a zombie until the machine's init reaps it (up to 2 s in this sandbox): counted
    as gone, as ``acpfs umount`` counts it."""
    return not pid_alive(pid)


def wait_gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` exits within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def is_mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


def mounted_soon(path: Path, timeout: float = 60) -> bool:
    """Whether ``path`` is mounted within ``timeout`` seconds (a foreground mount starting)."""
    deadline = time.time() + timeout
    while not is_mounted(path) and time.time() < deadline:
        time.sleep(0.05)
    return is_mounted(path)


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` made read-only for the block (a read-only bind mount over itself): writes to
    it fail with EROFS, so whatever a mount over it queues stays pending."""
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def drop_cache_tmpfs(cache_dir: Path) -> None:
    """A daemon that did not persist everything leaves its cache directory's own tmpfs
    mounted, for the next daemon (acpfs/daemon/hugecache.py): gone with the test."""
    while mounttable.mount_at(str(cache_dir)) is not None:
        if subprocess.run(["umount", "-l", str(cache_dir)], capture_output=True).returncode:
            break


class Mount:
    """One acpfs mount over its own backing directory, with its own cache directory."""

    def __init__(self, root: Path, cache_size: str = "256M", extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, cache_area: str = "/dev/shm") -> None:
        self.root = root
        self.mnt = root / "mnt"
        self.back = root / "back"
        # the cache directory's parent: /dev/shm as by default, or a directory on a disk
        self.cache_dir = Path(tempfile.mkdtemp(prefix="acpfs-test-", dir=cache_area)) / "cache"
        self.log = root / "acpfs.log"
        self.cache_size = cache_size
        self.extra = extra
        self.env = env   # extra environment of the daemon
        self.mnt.mkdir(exist_ok=True)
        self.back.mkdir(exist_ok=True)
        self.pid: int | None = None

    def args(self) -> list[str]:
        return ["mount", str(self.mnt), "--backing", str(self.back), "--cache-size", self.cache_size,
                "--cache-dir", str(self.cache_dir), "--log-file", str(self.log),
                "--log-level", "debug", *self.extra]

    def mount(self) -> "Mount":
        acpfs(*self.args(), env={**os.environ, **self.env} if self.env else None)
        self.pid = self.status()["pid"]
        return self

    def store_bytes(self) -> int:
        """Bytes of RAM the content store holds in the cache directory: the pool file's size,
        or what the memory files hold (passthrough)."""
        pool = self.cache_dir / "pool"
        if pool.exists():
            return pool.stat().st_size
        files = self.cache_dir / "files"
        return sum((files / n).stat().st_blocks * 512 for n in os.listdir(files))

    def status(self) -> dict:
        return json.loads(os.getxattr(self.mnt, "user.acpfs.status"))

    def state(self, rel: str) -> str:
        return os.getxattr(self.mnt / rel, "user.acpfs.state", follow_symlinks=False).decode()

    def sync(self, rel: str | None = None, timeout: float = 120) -> None:
        args = ["sync"] + ([str(self.mnt / rel)] if rel else [str(self.mnt)]) + ["--timeout", str(timeout)]
        acpfs(*args, timeout=timeout + 30)

    def umount(self) -> subprocess.CompletedProcess:
        return acpfs("umount", str(self.mnt), "--timeout", "120", timeout=200)

    def cleanup(self) -> None:
        if is_mounted(self.mnt):
            r = acpfs("umount", str(self.mnt), "--timeout", "60", "--lazy", check=False, timeout=120)
            if r.returncode != 0 and is_mounted(self.mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        if self.pid and not wait_gone(self.pid, 30):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        drop_cache_tmpfs(self.cache_dir)
        shutil.rmtree(self.cache_dir.parent, ignore_errors=True)

    def print_log_problems(self, limit: int = 60) -> None:
        print_log_problems(self.log, limit)


def print_log_problems(log: Path, limit: int = 60) -> None:
    """Print the daemon's warnings and errors (with tracebacks). pytest shows a test's
    captured output only when it fails, so a CI failure comes with the daemon's side."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return
    keep, in_problem = [], False
    for line in lines:
        if line[:4].isdigit():    # a new record: "2026-11-21 06:49:44,847 LEVEL ..."
            in_problem = line.split(" ", 3)[2:3] in (["WARNING"], ["ERROR"], ["CRITICAL"])
        if in_problem:
            keep.append(line)
    if keep:
        print(f"--- {log}: {len(keep)} warning/error lines, the last {limit}:")
        print("\n".join(keep[-limit:]))


@pytest.fixture
def make_mount(tmp_path):
    mounts: list[Mount] = []

    def make(name: str = "m", mount: bool = True, **kw) -> Mount:
        root = tmp_path / name
        root.mkdir(exist_ok=True)
        m = Mount(root, **kw)
        mounts.append(m)
        return m.mount() if mount else m

    yield make
    for m in mounts:
        m.cleanup()
        m.print_log_problems()


@pytest.fixture
def mnt(make_mount) -> Mount:
    return make_mount()


def wait_for(pred, timeout: float = 30.0, what: str = "condition", every: float = 0.05):
    """``pred()``'s first true value, polled every ``every`` seconds; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(every)


def listing(path) -> list[str]:
    """The names in a backing directory, sorted, without acpfs's own (``.acpfs-*``: temporary
    files, the node records of global order, conflicts and recovered files)."""
    return sorted(n for n in os.listdir(path) if not n.startswith(".acpfs-"))


def sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


class Faults:
    """Mounts made by a test, repaired and unmounted at teardown in a safe order: faults
    repaired, acpfs unmounted (it drains into the repaired backing), faultfs, then tmpfs."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.tmpfs_dirs: list[Path] = []
        self.shims: list[Shim] = []
        self.mounts: list = []

    def tmpfs(self, path: Path, size: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        sh("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
        self.tmpfs_dirs.append(path)
        return path

    def remount(self, path: Path, opts: str) -> None:
        sh("mount", "-o", f"remount,{opts}", str(path))

    def shim(self, source: Path, mountpoint: Path) -> Shim:
        source.mkdir(parents=True, exist_ok=True)
        s = Shim(source, mountpoint, self.tmp / f"faultfs-{len(self.shims)}.ctl")
        self.shims.append(s)
        return s

    def mount(self, m):
        m.mount()
        self.mounts.append(m)
        return m

    def close(self) -> None:
        for s in self.shims:
            try:
                if s.proc.poll() is None:
                    s.cont()
                    s.set("ok")
            except OSError:
                pass
        for p in self.tmpfs_dirs:
            subprocess.run(["mount", "-o", "remount,rw,size=1G", str(p)], capture_output=True)
        for m in self.mounts:
            m.cleanup()
        for s in self.shims:
            s.close()
        for p in reversed(self.tmpfs_dirs):
            if is_mounted(p):
                r = subprocess.run(["umount", str(p)], capture_output=True)
                if r.returncode:
                    subprocess.run(["umount", "-l", str(p)], capture_output=True)


@pytest.fixture
def faults(make_mount, tmp_path):
    """Faulty backings for a test's mounts: tmpfs it can fill or make read-only, faultfs
    shims it can make fail or hang (``Faults``)."""
    # requested after make_mount, so torn down before it: our mounts go first, in order
    f = Faults(tmp_path)
    yield f
    f.close()


def staged_files(back: Path) -> list[Path]:
    """The staged files (written through) in every daemon's staging directory of a backing
    (``.acpfs-tmp-<instance>-staging``), sorted by name."""
    return sorted(p for d in back.glob(".acpfs-tmp-*-staging") for p in d.iterdir())


class Node:
    """A simulated node of a job: its own mount namespace (``unshare --mount --propagation
    private``) with its own /run/acpfs and cache directory, mounting acpfs at ``mnt`` (the same
    path on every node, as on a real cluster) over a ``backing`` that all nodes share.

    A holder process keeps the namespace; ``run`` executes a command inside it (nsenter), and
    ``path`` reaches the node's mount from the test through ``/proc/<holder>/root``."""

    def __init__(self, name: str, root: Path, backing: Path, mnt: Path, cache_size: str = "256M",
                 extra: tuple[str, ...] = ()) -> None:
        self.name, self.backing, self.mnt = name, backing, mnt
        self.cache_dir = Path(tempfile.mkdtemp(prefix=f"acpfs-node-{name}-", dir="/dev/shm")) / "cache"
        self.log = root / f"{name}.log"
        self.cache_size, self.extra = cache_size, extra
        self.pid: int | None = None          # the daemon's
        os.makedirs("/run/acpfs", exist_ok=True)
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             # other acpfs mounts copied into the namespace would be held by it (their
             # unmount would wait for this node to end): let go of them at once
             "awk '/ - fuse\\.acpfs / {print $5}' /proc/self/mountinfo | xargs -r -n1 umount -l;"
             "mount -t tmpfs -o mode=0700 tmpfs /run/acpfs && echo ready && exec sleep infinity"],
            stdout=subprocess.PIPE, text=True)
        assert self.holder.stdout is not None and self.holder.stdout.readline() == "ready\n", \
            f"node {name}: its mount namespace did not start"

    def run(self, *cmd: str, check: bool = True, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run(self.enter() + list(cmd), capture_output=True, text=True,
                           timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"node {self.name}: {' '.join(cmd)} failed ({r.returncode}): {r.stderr}")
        return r

    def popen(self, *cmd: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.enter() + list(cmd), **kw)

    def enter(self) -> list[str]:
        """The command prefix that runs inside the node (in the test's working directory:
        ``python -m acpfs`` then runs this checkout's acpfs)."""
        return ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", f"--wd={os.getcwd()}", "--"]

    def path(self, rel: str = "") -> Path:
        """A path on this node's mount, as the test can use it."""
        return Path(f"/proc/{self.holder.pid}/root{self.mnt}") / rel

    def mount(self) -> "Node":
        self.run(*ACPFS, "mount", str(self.mnt), "--backing", str(self.backing), "--cache-size",
                 self.cache_size, "--cache-dir", str(self.cache_dir), "--log-file", str(self.log),
                 "--log-level", "debug", *self.extra)
        self.pid = self.status()["pid"]
        return self

    def status(self) -> dict:
        return json.loads(os.getxattr(self.path(), "user.acpfs.status"))

    def sync(self, timeout: float = 120) -> None:
        self.run(*ACPFS, "sync", str(self.mnt), "--timeout", str(timeout), timeout=timeout + 30)

    def mounted(self) -> bool:
        try:
            with open(f"/proc/{self.holder.pid}/mountinfo") as f:
                return any(line.split()[4] == str(self.mnt) for line in f)
        except OSError:
            return False

    def cleanup(self) -> None:
        if self.holder.poll() is None and self.mounted():
            r = self.run(*ACPFS, "umount", str(self.mnt), "--timeout", "60", "--lazy", check=False,
                         timeout=120)
            if r.returncode != 0 and self.mounted():
                self.run("fusermount3", "-u", "-z", str(self.mnt), check=False)
        if self.pid and not wait_gone(self.pid, 30):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.holder.kill()
        self.holder.wait()
        shutil.rmtree(self.cache_dir.parent, ignore_errors=True)


@pytest.fixture
def make_nodes(tmp_path):
    """``make_nodes(n)``: n simulated nodes (``Node``), each mounted over one shared backing
    directory; unmounted and their namespaces ended at teardown, also when a test fails."""
    made: list[Node] = []

    def make(n: int, mount: bool = True, **kw) -> list[Node]:
        backing = tmp_path / "shared"
        backing.mkdir(exist_ok=True)
        mnt = tmp_path / "ckpt"
        mnt.mkdir(exist_ok=True)
        nodes = []
        for i in range(n):
            node = Node(f"node{len(made)}", tmp_path, backing, mnt, **kw)
            made.append(node)
            nodes.append(node)
        if mount:
            for node in nodes:
                node.mount()
        return nodes

    yield make
    for node in made:
        node.cleanup()
    for node in made:
        print_log_problems(node.log)


# A process of the job on one node, driven line by line from the test:
#   write PATH TAG UNITS   a file of UNITS x 32 bytes derived from TAG (makes its directory)
#   point PATH TEXT        a pointer file such as `latest`, written in place as frameworks do
#   rmtree PATH            shutil.rmtree, as a trainer's checkpoint rotation does
#   append PATH TAG UNITS  UNITS x 32 bytes derived from TAG appended (open mode "ab", as `>>`)
#   rename SRC DST / unlink PATH / mkdir PATH / link SRC DST
#   stat PATH              the size this node reports for PATH
#   sha PATH / cat PATH / ls PATH   what this node reads there
#   tree .                 every entry below PATH as JSON: {path: "dir" or sha256 of the file}
#                          (trees.tree; argv[2] is tests/, where trees.py is)
# Each answers "ok [RESULT]", or "error ..." if the call failed.
WORKER = textwrap.dedent("""
    import hashlib, json, os, shutil, sys
    mnt = sys.argv[1]
    for line in sys.stdin:
        cmd, rel, *args = line.split()
        path = os.path.join(mnt, rel)
        try:
            out = ""
            if cmd == "write":
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(hashlib.sha256(args[0].encode()).digest() * int(args[1]))
            elif cmd == "append":
                with open(path, "ab") as f:
                    f.write(hashlib.sha256(args[0].encode()).digest() * int(args[1]))
            elif cmd == "stat":
                out = str(os.stat(path).st_size)
            elif cmd == "probe":     # how many of N stats found the name
                out = str(sum(os.path.exists(path) for _ in range(int(args[0]))))
            elif cmd == "point":
                with open(path, "w") as f:
                    f.write(args[0])
            elif cmd == "rmtree":
                shutil.rmtree(path)
            elif cmd == "sha":
                with open(path, "rb") as f:
                    out = hashlib.sha256(f.read()).hexdigest()
            elif cmd == "cat":
                with open(path) as f:
                    out = f.read()
            elif cmd == "ls":
                out = ",".join(sorted(os.listdir(path)))
            elif cmd == "rename":
                os.rename(path, os.path.join(mnt, args[0]))
            elif cmd == "unlink":
                os.unlink(path)
            elif cmd == "link":
                os.link(path, os.path.join(mnt, args[0]))
            elif cmd == "mkdir":
                os.mkdir(path)
            elif cmd == "tree":
                sys.path.insert(0, sys.argv[2])
                from trees import NOTHING, sha256, tree
                out = json.dumps(tree(path, skip=NOTHING, modes=False, contents=sha256), sort_keys=True)
            print("ok", out, flush=True)
        except Exception as e:
            print("error", cmd, rel, repr(e).replace(chr(10), " "), flush=True)
""")


def content(tag: str, units: int) -> bytes:
    return hashlib.sha256(tag.encode()).digest() * units


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Worker:
    """A ``WORKER`` process running inside ``node``."""

    def __init__(self, node) -> None:
        self.node = node
        self.proc = node.popen(sys.executable, "-c", WORKER, str(node.mnt), str(TESTS),
                               stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)

    def send(self, *words) -> None:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> str:
        line = self.proc.stdout.readline()
        assert line.startswith("ok"), f"node {self.node.name}: {line or 'no answer'}"
        return line[3:].rstrip("\n")

    def do(self, *words) -> str:
        self.send(*words)
        return self.answer()

    def attempt(self, *words) -> tuple[bool, str]:
        """Like ``do``, but a failed call is an answer too: (succeeded, result or error)."""
        self.send(*words)
        line = self.proc.stdout.readline()
        assert line, f"node {self.node.name}: no answer"
        ok, _, rest = line.rstrip("\n").partition(" ")
        return ok == "ok", rest

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def workers():
    """``workers(*nodes)``: one ``Worker`` in each node, ended at teardown."""
    made: list[Worker] = []

    def make(*nodes) -> list[Worker]:
        ws = [Worker(n) for n in nodes]
        made.extend(ws)
        return ws
    yield make
    for w in made:
        w.close()
