"""Model test: random operation sequences on a real mount against a plain directory.

A hypothesis ``RuleBasedStateMachine`` applies the same operations to a subdirectory of an
acpfs mount and to a subdirectory of a plain reference directory, and requires the same
outcome of each (same value, or the same errno). After every step the mount's tree must
equal the reference tree (names, kinds, modes, bytes, symlink targets; each file's stat size
its bytes). At the end of each
example, after ``acpfs sync``, the backing subdirectory must equal both.

The mount is made once per test function; each example works in a fresh subdirectory
``ex<N>`` of the mount, of the reference and (for the final check) of the backing, so that
examples do not see each other.

Names come from a small alphabet so that collisions (EEXIST, ENOTEMPTY, rename over an
existing entry) are frequent. Paths are picked among the entries that exist in the
reference tree (never through a symlink), so most steps do something. Modes keep owner
rwx on directories and owner rw on files, so that root's permission bypass does not matter.
"""

from __future__ import annotations

import collections
import errno
import functools
import itertools
import json
import os
import time
from pathlib import Path

from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import trees
from conftest import Mount, acpfs

NAMES = ["a", "b", "c", "d"]
FILE_MODES = [0o600, 0o644, 0o640, 0o664, 0o700, 0o755, 0o666]
DIR_MODES = [0o700, 0o755, 0o750, 0o711, 0o775]
TARGETS = ["a", "b/c", "../a", "..", "/nonexistent/x", "t" * 200]
TEMP_PREFIX = ".acpfs-tmp-"
MAX_HELD = 3

# Offsets and sizes: small, around the 4K and 64K block boundaries, and anywhere up to ~80K.
BOUNDARIES = [4095, 4096, 4097, 8191, 8192, 12288, 65535, 65536, 65537, 70000]
offsets = st.one_of(st.integers(0, 300), st.sampled_from(BOUNDARIES), st.integers(0, 80_000))
contents = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda b, n: bytes([b]) * n, st.integers(1, 255), st.integers(0, 20_000)),
    st.builds(lambda n, salt: bytes((i * 7 + salt) & 0xFF for i in range(n)),
              st.integers(0, 70_000), st.integers(0, 255)),
    # more than a 64K cache holds: spills to the backing in the tiny-cache test
    st.builds(lambda b, n: bytes([b]) * n, st.integers(1, 255), st.integers(60_000, 140_000)),
)
picks = st.integers(0, 1 << 16)
names = st.sampled_from(NAMES)


NODES = ".acpfs-nodes"   # global order's node records: acpfs's own, hidden from the mount


def tree(root: Path, contents=trees.read_bytes) -> dict[str, tuple]:
    """Names, kinds, modes, bytes and link targets under root (acpfs temp names and node
    records excluded); a file with several names also has its link count and its first name
    (hard links)."""
    return trees.tree(root, skip=lambda n: n.startswith(TEMP_PREFIX) or n == NODES, links=True,
                      contents=contents)


def diff(a: dict, b: dict) -> str:
    lines = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if va != vb:
            def short(v):
                if v is None:
                    return "absent"
                if v[0] == "file":
                    return f"file {v[1]} {len(v[2])} bytes {v[2][:24]!r}"
                return " ".join(map(str, v))
            lines.append(f"  {k}: {short(va)}  !=  {short(vb)}")
    return "\n".join(lines)


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except OSError as e:
        return ("err", errno.errorcode.get(e.errno, e.errno))


def show(o: tuple) -> str:
    """An outcome for humans: long byte strings as their length and first bytes."""
    if o[0] == "ok" and isinstance(o[1], bytes) and len(o[1]) > 32:
        return f"ok: {len(o[1])} bytes {o[1][:16]!r}..."
    return f"{o[0]}: {o[1]!r}"


def guarded(fn):
    """Mark the machine broken when a step fails, so that teardown only cleans up."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kw):
        try:
            return fn(self, *args, **kw)
        except BaseException:
            self.broken = True
            raise
    return wrapper


_counter = itertools.count()
STATS: collections.Counter = collections.Counter()   # what the runs did (shown with -s)


def make_machine(m: Mount, ref_root: Path):
    class AcpfsModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.broken = False
            name = f"ex{next(_counter)}"
            self.roots = (m.mnt / name, ref_root / name)
            self.back = m.back / name
            for r in self.roots:
                os.mkdir(r, 0o755)
            self.held: list[list] = []   # [mount fd, ref fd, description]
            self.strict = True            # compare the trees after every step
            note(f"example directory {name}")

        # -- helpers ----------------------------------------------------------------------
        def both(self, what: str, fn):
            """fn(root, side) on the mount and on the reference; the outcomes must agree."""
            om = outcome(fn, self.roots[0], 0)
            orf = outcome(fn, self.roots[1], 1)
            note(f"{what} -> {show(orf)}")
            STATS[f"{what.split()[0]} {orf[0] if orf[0] == 'ok' else orf[1]}"] += 1
            assert om == orf, f"{what}: mount gave {show(om)}, reference gave {show(orf)}"
            return orf

        def entries(self) -> dict[str, str]:
            """rel path -> kind ('dir', 'file', 'link') of the reference tree; '' is the root."""
            kinds = trees.tree(self.roots[1], skip=trees.NOTHING, contents=None)
            return {"": "dir", **{rel: e[0] for rel, e in kinds.items()}}

        def pick(self, i: int, kinds: tuple[str, ...], root_ok: bool = False) -> str | None:
            cands = sorted(k for k, v in self.entries().items() if v in kinds and (k or root_ok))
            return cands[i % len(cands)] if cands else None

        def child(self, parent_i: int, name: str) -> str:
            parent = self.pick(parent_i, ("dir",), root_ok=True)
            return f"{parent}/{name}" if parent else name

        def held_paths(self) -> list[str]:
            """Where the files held open are now (in the reference tree), sorted."""
            inos = {os.fstat(h[1]).st_ino for h in self.held}
            root = self.roots[1]
            return sorted(k for k, v in self.entries().items()
                          if v == "file" and os.lstat(root / k).st_ino in inos)

        def sync_in_process(self) -> None:
            seq = json.loads(os.getxattr(self.roots[0], "user.acpfs.seq"))["seq"]
            deadline = time.monotonic() + 60
            while json.loads(os.getxattr(m.mnt, "user.acpfs.status"))["queue"]["applied_seq"] < seq:
                assert time.monotonic() < deadline, "flusher did not reach the example's last op"
                time.sleep(0.005)

        def close_all(self) -> None:
            for h in self.held:
                for fd in h[:2]:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self.held = []

        @initialize(strict=st.booleans())
        def choose_pace(self, strict):
            """strict: compare the trees after every step (the flusher then mostly keeps up).
            Otherwise only at sync points and at the end: steps follow each other within
            microseconds and the flusher lags behind, so operations meet files and
            directories that are not yet persisted, or whose uploads are in flight."""
            self.strict = strict
            note(f"compare after every step: {strict}")

        # -- namespace ----------------------------------------------------------------------
        @rule(parent=picks, name=names, data=contents, mode=st.sampled_from(FILE_MODES))
        @guarded
        def create_file(self, parent, name, data, mode):
            rel = self.child(parent, name)

            def f(root, side):
                fd = os.open(root / rel, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
                try:
                    return os.write(fd, data)
                finally:
                    os.close(fd)
            self.both(f"create {rel} mode {mode:o} with {len(data)} bytes", f)

        @rule(parent=picks, name=names, mode=st.sampled_from(DIR_MODES))
        @guarded
        def mkdir(self, parent, name, mode):
            rel = self.child(parent, name)
            self.both(f"mkdir {rel} {mode:o}", lambda root, side: os.mkdir(root / rel, mode))

        @rule(parent=picks, name=names, link_to=st.sampled_from(TARGETS))
        @guarded
        def symlink(self, parent, name, link_to):
            rel = self.child(parent, name)
            self.both(f"symlink {rel} -> {link_to}", lambda root, side: os.symlink(link_to, root / rel))

        @rule(i=picks)
        @guarded
        def unlink(self, i):
            rel = self.pick(i, ("file", "link", "dir"))
            if rel is None:
                return
            self.both(f"unlink {rel}", lambda root, side: os.unlink(root / rel))

        @rule(i=picks)
        @guarded
        def rmdir(self, i):
            # mostly directories (empty or not), sometimes a file
            rel = self.pick(i, ("dir",) if i % 4 else ("dir", "file", "link"))
            if rel is None:
                return
            self.both(f"rmdir {rel}", lambda root, side: os.rmdir(root / rel))

        @rule(src=picks, parent=picks, name=names)
        @guarded
        def link(self, src, parent, name):
            s = self.pick(src, ("file", "link", "dir"))
            if s is None:
                return
            d = self.child(parent, name)
            self.both(f"link {s} -> {d}",
                      lambda root, side: os.link(root / s, root / d, follow_symlinks=False))

        @rule(src=picks, parent=picks, name=names)
        @guarded
        def rename(self, src, parent, name):
            s = self.pick(src, ("file", "link", "dir"))
            if s is None:
                return
            d = self.child(parent, name)
            self.both(f"rename {s} -> {d}", lambda root, side: os.rename(root / s, root / d))

        @rule(src=picks, parent=picks, name=names)
        @guarded
        def rename_dir(self, src, parent, name):
            s = self.pick(src, ("dir",))
            if s is None:
                return
            d = self.child(parent, name)
            self.both(f"rename dir {s} -> {d}", lambda root, side: os.rename(root / s, root / d))

        @rule(i=picks, fmode=st.sampled_from(FILE_MODES), dmode=st.sampled_from(DIR_MODES))
        @guarded
        def chmod(self, i, fmode, dmode):
            rel = self.pick(i, ("file", "dir"))
            if rel is None:
                return
            mode = dmode if self.entries()[rel] == "dir" else fmode
            self.both(f"chmod {rel} {mode:o}", lambda root, side: os.chmod(root / rel, mode))

        # -- content through short-lived opens ------------------------------------------
        @rule(i=picks, off=offsets, data=contents)
        @guarded
        def write_at(self, i, off, data):
            rel = self.pick(i, ("file",))
            if rel is None:
                return

            def f(root, side):
                fd = os.open(root / rel, os.O_WRONLY)
                try:
                    return os.pwrite(fd, data, off)
                finally:
                    os.close(fd)
            self.both(f"pwrite {rel} at {off}: {len(data)} bytes", f)

        @rule(i=picks, data=contents)
        @guarded
        def trunc_write(self, i, data):
            rel = self.pick(i, ("file",))
            if rel is None:
                return

            def f(root, side):
                fd = os.open(root / rel, os.O_WRONLY | os.O_TRUNC)
                try:
                    return os.write(fd, data)
                finally:
                    os.close(fd)
            self.both(f"open O_TRUNC {rel}, write {len(data)} bytes", f)

        @rule(i=picks, size=offsets)
        @guarded
        def truncate(self, i, size):
            rel = self.pick(i, ("file",))
            if rel is None:
                return
            self.both(f"truncate {rel} to {size}", lambda root, side: os.truncate(root / rel, size))

        @rule(i=picks, data=contents)
        @guarded
        def append(self, i, data):
            rel = self.pick(i, ("file",))
            if rel is None:
                return

            def f(root, side):
                fd = os.open(root / rel, os.O_WRONLY | os.O_APPEND)
                try:
                    return os.write(fd, data)
                finally:
                    os.close(fd)
            self.both(f"append {rel}: {len(data)} bytes", f)

        @rule(i=picks, name=names, data=contents, parent=picks, new=names)
        @guarded
        def write_then_rename_dir(self, i, name, data, parent, new):
            """Write a file in a directory and rename the directory (or an ancestor of it)
            at once, before the flusher has persisted the file."""
            d = self.pick(i, ("dir",))
            if d is None:
                return
            rel = f"{d}/{name}"
            up = d.split("/")
            moved = "/".join(up[:1 + i % len(up)])   # the directory itself or an ancestor
            dst = self.child(parent, new)

            def f(root, side):
                fd = os.open(root / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
                os.rename(root / moved, root / dst)
            self.both(f"write {rel} ({len(data)} bytes), then rename {moved} -> {dst}", f)

        @rule(i=picks, name=names, replace=st.booleans())
        @guarded
        def move_out_and_remove_dir(self, i, name, replace):
            """Move an entry out of its directory, then remove the directory (or replace it
            by a new empty one with a rename), before the flusher has caught up."""
            ents = self.entries()
            nested = sorted(k for k in ents if "/" in k)
            if not nested:
                return
            # prefer the only entry of its directory, so that the removal succeeds
            parents = collections.Counter(k.rsplit("/", 1)[0] for k in ents if k)
            only = [k for k in nested if parents[k.rsplit("/", 1)[0]] == 1]
            held = [k for k in self.held_paths() if "/" in k]
            nested = held if held and i % 3 == 0 else only if only and i % 4 else nested
            rel = nested[i % len(nested)]
            d, _ = rel.rsplit("/", 1)
            up = d.rsplit("/", 1)[0] if "/" in d else ""
            dst = f"{up}/{name}" if up else name
            spare = f"{up}/spare" if up else "spare"

            def f(root, side):
                os.rename(root / rel, root / dst)
                if replace:
                    os.mkdir(root / spare)
                    os.rename(root / spare, root / d)
                else:
                    os.rmdir(root / d)
            how = "rename a new empty dir over it" if replace else "rmdir it"
            self.both(f"move {rel} -> {dst}, then {how}: {d}", f)

        # -- files kept open across other steps -------------------------------------------
        @precondition(lambda self: len(self.held) < MAX_HELD)
        @rule(i=picks, name=names, how=st.sampled_from(["rdwr", "trunc", "create", "creat_trunc"]),
              mode=st.sampled_from(FILE_MODES))
        @guarded
        def open_held(self, i, name, how, mode):
            if how == "create":
                rel = self.child(i, name)
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
            elif how == "creat_trunc":   # existing or not; never through a symlink
                rel = self.child(i, name)
                flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
            else:
                rel = self.pick(i, ("file",))
                if rel is None:
                    return
                flags = os.O_RDWR | (os.O_TRUNC if how == "trunc" else 0)
            fds = [None, None]

            def f(root, side):
                fds[side] = os.open(root / rel, flags, mode)
            res = self.both(f"open {rel} ({how}) as handle {len(self.held)}", f)
            if res[0] == "ok":
                self.held.append([fds[0], fds[1], rel])

        @precondition(lambda self: self.held)
        @rule(h=picks, off=offsets, data=contents)
        @guarded
        def held_write(self, h, off, data):
            k = h % len(self.held)
            hd = self.held[k]
            self.both(f"handle {k} ({hd[2]}): pwrite at {off}: {len(data)} bytes",
                      lambda root, side: os.pwrite(hd[side], data, off))

        @precondition(lambda self: self.held)
        @rule(h=picks, off=offsets, n=st.integers(0, 100_000))
        @guarded
        def held_read(self, h, off, n):
            k = h % len(self.held)
            hd = self.held[k]
            self.both(f"handle {k} ({hd[2]}): pread {n} at {off}",
                      lambda root, side: os.pread(hd[side], n, off))

        @precondition(lambda self: self.held)
        @rule(h=picks, size=offsets)
        @guarded
        def held_truncate(self, h, size):
            k = h % len(self.held)
            hd = self.held[k]
            self.both(f"handle {k} ({hd[2]}): ftruncate {size}",
                      lambda root, side: os.ftruncate(hd[side], size))

        @precondition(lambda self: self.held)
        @rule(h=picks, mode=st.sampled_from(FILE_MODES))
        @guarded
        def held_fchmod(self, h, mode):
            k = h % len(self.held)
            hd = self.held[k]
            self.both(f"handle {k} ({hd[2]}): fchmod {mode:o}",
                      lambda root, side: os.fchmod(hd[side], mode))

        @precondition(lambda self: self.held)
        @rule(h=picks)
        @guarded
        def close_held(self, h):
            k = h % len(self.held)
            hd = self.held.pop(k)
            self.both(f"close handle {k} ({hd[2]})", lambda root, side: os.close(hd[side]))

        # -- durability in the middle of an example ---------------------------------------
        @rule()
        @guarded
        def sync_point(self):
            """Wait for the flusher; with nothing open, the backing must equal the reference."""
            note(f"sync ({len(self.held)} handles open)")
            tm, tr = tree(self.roots[0], contents=sized), tree(self.roots[1])
            assert tm == tr, f"mount != reference:\n{diff(tm, tr)}"
            self.sync_in_process()
            if not self.held:
                tr, tb = tree(self.roots[1]), tree(self.back)
                assert tb == tr, f"backing != reference after sync:\n{diff(tb, tr)}"

        @invariant()
        @guarded
        def same_tree(self):
            if not self.strict:
                return
            tm, tr = tree(self.roots[0], contents=sized), tree(self.roots[1])
            assert tm == tr, f"mount != reference:\n{diff(tm, tr)}"

        def teardown(self):
            self.close_all()
            if self.broken:
                return
            note("close all; acpfs sync")
            acpfs("sync", str(m.mnt), "--timeout", "60", timeout=120)
            tm, tr, tb = tree(self.roots[0], contents=sized), tree(self.roots[1]), tree(self.back)
            assert tm == tr, f"after sync, mount != reference:\n{diff(tm, tr)}"
            assert tb == tr, f"after sync, backing != reference:\n{diff(tb, tr)}"
            # nothing open, everything durable: no temporary file may be left behind
            # (a short grace for cleanups that run beside the ordered queue)
            deadline = time.monotonic() + 3
            while True:
                left = [os.path.join(d, n) for d, ds, fs in os.walk(self.back)
                        for n in ds + fs if n.startswith(TEMP_PREFIX)]
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert not left, f"temporary files left in the backing after sync: {left}"

    return AcpfsModel


def sized(path: Path, st: os.stat_result) -> bytes:
    """A file's bytes, which must be as many as its stat said (the kernel's GETATTRs after
    each change are answered below Python: acpfs/fuse/attrtable.py)."""
    data = path.read_bytes()
    assert len(data) == st.st_size, f"{path}: stat says {st.st_size} bytes, read {len(data)}"
    return data


def run_model(make_mount, tmp_path, max_examples: int, steps: int, **mount_kw) -> None:
    m = make_mount(**mount_kw)
    ref_root = tmp_path / "ref"
    ref_root.mkdir()
    old = os.umask(0o022)
    try:
        machine = make_machine(m, ref_root)
        run_state_machine_as_test(machine, settings=settings(
            max_examples=max_examples, stateful_step_count=steps, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                   HealthCheck.function_scoped_fixture,
                                   HealthCheck.data_too_large],
            print_blob=True))
        print(f"\n{next(_counter)} example directories; outcomes: {dict(sorted(STATS.items()))}")
        STATS.clear()
        # the daemon must still be healthy after all of it
        st_ = m.status()
        assert st_["errors"] == [], st_["errors"]
    finally:
        os.umask(old)


# MODEL_SCALE=4 runs four times as many examples (the defaults keep the module near 1.5 min on
# 2 cores, so that the whole suite stays under 45 minutes there).
SCALE = float(os.environ.get("MODEL_SCALE", "1"))


def test_model_default_blocks(make_mount, tmp_path):
    """64K blocks and a roomy cache: nothing is evicted."""
    run_model(make_mount, tmp_path, max_examples=int(100 * SCALE), steps=50)


def test_model_small_cache(make_mount, tmp_path):
    """4K blocks and a 512K cache: files are evicted and read back from the backing."""
    run_model(make_mount, tmp_path, max_examples=int(80 * SCALE), steps=50,
              cache_size="512K", extra=("--block-size", "4K"))


def test_model_tiny_cache(make_mount, tmp_path):
    """4K blocks and a 64K cache (16 blocks): most writes overflow the cache, so open files
    are written through to the backing (spilled) and large files are copied up into spill
    files. A stall shows up as ENOSPC after 5 s, which the reference never returns."""
    run_model(make_mount, tmp_path, max_examples=int(60 * SCALE), steps=40, cache_size="64K",
              extra=("--block-size", "4K", "--cache-full-timeout", "5"))
