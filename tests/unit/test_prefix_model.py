"""Model test of the ordering promise: the backing always shows one of the states the mount went
through, in order (a prefix of its history), and, once the flusher is idle, the latest one.

A hypothesis ``RuleBasedStateMachine`` drives a ``Cache`` and its ``Flusher`` (tests/unit/harness.py,
no mount) with random operations: files created, written and closed (small contents), reopened and
rewritten (with or without O_TRUNC), held open across other operations, truncated, renamed over each
other (also "write name.tmp, close it, rename it over name", the pointer-file pattern), deleted
(also "rm -rf" of a whole directory, one entry at a time), directories made, renamed and removed,
chmod of files and directories, symlinks. Meanwhile it pauses the flusher at random points: a hang
on one backing method (``publish``, ``rename``, ``unlink``, ``mkdir``, ``write_temp``, ...),
armed after a random number of calls of that method, held across later operations and released
later (or at the end).

The history. The test keeps a model of the mount, and after every call into the cache it records
the mount's *visible* state, where the visible state is what the flusher's op stream can carry:
    path -> ("dir", mode) | ("link", target) | ("file", mode, bytes)
in which a regular file counts with the content and mode it had at its last close (its last
snapshot: a close with changes, or a truncate of a file nobody has open), and is absent if it
was never closed. Unsaved changes of an open file (its bytes, and a chmod made while it has
unsaved bytes, which the cache sends with the next snapshot instead of as an op of its own) are not
part of the visible state until the close. Every other operation (mkdir, symlink, rename, unlink,
rmdir, chmod of a directory or of a file without unsaved changes) changes the visible state at
once. The history is the sequence of visible states after each call (consecutive duplicates
dropped); the first is the empty tree.

The checks.
- After every step, immediately: the backing tree (acpfs temporary names skipped) equals a state
  of the history, at or after the one it matched at the previous check (the backing never goes
  back in time). The tree is read while the flusher cannot change it: under the cache's
  position lock, or while the thread that holds that lock is the one held by the pause.
- ``settle``: the same, after the flusher has done everything it can before the pause (the held
  call was entered, or the queue is empty) and stopped moving.
- ``move_pause``: the same, after releasing the held call and holding the flusher again at a
  later call (so the flusher stops between two chosen operations, not only before the first).
- ``drain`` (a step, one time in three) and the end of every example (open files closed first):
  with the pause released and the queue drained, the backing equals the latest visible state
  ("complete").
- After every step the model is also compared with the mount's own view (names, kinds, modes,
  contents read through the cache), so that the history really is the mount's.

The first test has every operation; the second deletes or replaces a file only when every
close of it since the last drain has been persisted (only files not closed since the last
``drain`` step), a gentler load that reaches deeper histories. Both must pass: there is no
exception to the promise (docs/semantics.md, section 4). The last tests are the smallest
deterministic cases of holes that the first test found: a file deleted or replaced after its
close but before its snapshot was persisted used to be skipped, so the backing showed the
states between its close and its deletion without it; a mkdir took the directory's mode at
the time it was applied.

A failure message has the whole history, the state the backing showed, where the flusher was
paused, and which files were removed while a snapshot of theirs was still queued. Shrinking is
off (see SHRINK). PREFIX_MODEL_SCALE=10 runs ten times as many examples; ``-s`` prints what the
runs did.
"""

from __future__ import annotations

import collections
import functools
import itertools
import shutil
import stat as statmod
import time
from pathlib import Path

from hypothesis import HealthCheck, note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from acpfs.node import node_path
from harness import Parts, write_file
from heldmodel import WAIT, HeldMachine, backing_tree, hold, run

NAMES = ["a", "b", "c"]
FILE_MODES = [0o644, 0o600, 0o640, 0o755]
DIR_MODES = [0o755, 0o700, 0o750]
TARGETS = ["a", "../b", "/nowhere"]
# backing methods the pause can hold (each is entered by the sequencer or an upload worker
# before the backing changes, so a held call leaves the backing between two operations)
PAUSE_METHODS = ["publish", "rename", "unlink", "mkdir", "symlink", "setattr", "write_temp",
                 "finish_temp", "open_dir"]

picks = st.integers(0, 1 << 16)
skips = st.sampled_from([0, 0, 1, 2, 4])   # calls of the method to let by before holding one
methods = st.sampled_from(PAUSE_METHODS)
names = st.sampled_from(NAMES)
contents = st.one_of(
    st.binary(min_size=1, max_size=24),
    st.builds(lambda b, n: bytes([b]) * n, st.integers(1, 255), st.integers(1, 9000)),
)


# -- the model of the mount -------------------------------------------------------------------
class MFile:
    def __init__(self, node, mode: int) -> None:
        self.node = node
        self.mode = mode                    # the mount's mode now
        self.data = bytearray()             # the mount's bytes now
        self.vis: tuple[int, bytes] | None = None   # (mode, bytes) at the last snapshot
        self.dirty = True                   # unsaved changes (a new file has some)
        self.open = False                   # held open for writing by the test
        self.linked = True
        self.fresh = False                  # closed (snapshot) since the last drain


class MDir:
    def __init__(self, node, mode: int) -> None:
        self.node = node
        self.mode = mode
        self.fresh = True                   # made since the last drain
        self.kids: dict[str, MFile | MDir | MLink] = {}


class MLink:
    def __init__(self, node, target: str) -> None:
        self.node = node
        self.target = target
        self.fresh = False


def walk(d: MDir, prefix: str = ""):
    """(path, entry, parent, name) of everything under d, parents first, sorted."""
    for name in sorted(d.kids):
        e = d.kids[name]
        path = f"{prefix}{name}"
        yield path, e, d, name
        if isinstance(e, MDir):
            yield from walk(e, path + "/")


def files_under(e) -> list[MFile]:
    if isinstance(e, MFile):
        return [e]
    if isinstance(e, MDir):
        return [f for _, f, _, _ in walk(e) if isinstance(f, MFile)]
    return []


def short(v) -> str:
    if v is None:
        return "absent"
    if v[0] == "file":
        b = v[2]
        return f"file {v[1]} {b!r}" if len(b) <= 24 else f"file {v[1]} {len(b)} bytes {b[:12]!r}..."
    return " ".join(map(str, v))


def show(state: dict) -> str:
    return "{" + ", ".join(f"{k}: {short(v)}" for k, v in sorted(state.items())) + "}"


def diff(a: dict, b: dict) -> str:
    return "; ".join(f"{k}: {short(a.get(k))} vs {short(b.get(k))}"
                     for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


# -- test instrumentation ---------------------------------------------------------------------
LIVE: list[Parts] = []   # cores of running examples: closed by the test even if teardown did not run
_counter = itertools.count()


STATS: collections.Counter = collections.Counter()   # what the runs did (shown with -s)


def guarded(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kw):
        STATS[fn.__name__] += 1
        try:
            return fn(self, *args, **kw)
        except BaseException:
            self.broken = True
            raise
    return wrapper


def make_machine(base: Path, unpersisted_deletes: bool):
    class PrefixModel(HeldMachine):
        def __init__(self) -> None:
            super().__init__()
            self.broken = False
            self.setup(base / f"ex{next(_counter)}")
            LIVE.append(self.core)
            self.root = MDir(self.cache.inodes.root, 0)
            self.cancelled: list[str] = []      # files removed with a snapshot still queued
            self.queued: list = []
            self.history: list[tuple[dict, str]] = [({}, "start")]
            STATS["examples"] += 1
            self.t0 = time.monotonic()
            self.handles: set[MFile] = set()   # files held open for writing (linked or not)

        # -- the history ---------------------------------------------------------------------
        def visible(self) -> dict[str, tuple]:
            out: dict[str, tuple] = {}
            for path, e, _, _ in walk(self.root):
                if isinstance(e, MDir):
                    out[path] = ("dir", oct(e.mode))
                elif isinstance(e, MLink):
                    out[path] = ("link", e.target)
                elif e.vis is not None:
                    out[path] = ("file", oct(e.vis[0]), e.vis[1])
            return out

        def record(self, label: str) -> None:
            s = self.visible()
            if s != self.history[-1][0]:
                self.history.append((s, label))
                note(f"  state {len(self.history) - 1} after {label}: {show(s)}")

        def check(self, where: str) -> None:
            """The backing is a state of the history, not before the one it showed last.

            A failed check is kept and raised at the end of the example, so that whether it
            happens (which depends on the flusher's timing) does not change which steps run."""
            if self.violation is not None:
                return
            b = self.read_backing()
            STATS["checks while the flusher is behind"] += not self.idle()
            STATS["checks while a call is held"] += self.held_thread() is not None
            if self.advance(lambda h: h[0] == b):
                return
            near = min(range(len(self.history)),
                       key=lambda i: (len(diff(b, self.history[i][0]).split("; ")), -i))
            lines = [f"{where}: the backing shows a state the mount never had "
                     f"(or one before state {self.lo}, which it showed already)",
                     f"  backing: {show(b)}",
                     f"  pause: {self.pause_desc or 'none'}; applied seq {self.core.flusher.oplog.applied_seq}"
                     f" of {self.cache.oplog.seq}",
                     "  history:"]
            lines += [f"    {i}{'*' if i == self.lo else ' '} {label}: {show(s)}"
                      for i, (s, label) in enumerate(self.history)]
            lines.append(f"  closest: state {near}: backing vs state: {diff(b, self.history[near][0])}")
            lines.append("  files removed while a snapshot of theirs was not applied yet: "
                         + ("; ".join(self.cancelled) or "none"))
            self.violation = "\n".join(lines)
            STATS["violations"] += 1
            note(self.violation)

        def idle(self) -> bool:
            return self.core.flusher.oplog.applied_seq >= self.cache.oplog.seq

        def wait_quiet(self) -> None:
            """Until the pause was entered or the flusher is idle, then until it stops moving."""
            deadline = time.monotonic() + WAIT
            while not self.idle() and not (self.fault is not None and self.fault.entered.is_set()):
                assert time.monotonic() < deadline, "flusher neither idle nor paused"
                time.sleep(0.001)
            last, since = self.core.flusher.oplog.applied_seq, time.monotonic()
            while not self.idle() and time.monotonic() - since < 0.02:
                time.sleep(0.002)
                if self.core.flusher.oplog.applied_seq != last:
                    last, since = self.core.flusher.oplog.applied_seq, time.monotonic()

        # -- picking entries -------------------------------------------------------------------
        def entries(self, want=lambda e: True):
            return [t for t in walk(self.root) if want(t[1])]

        def pick_dir(self, i: int) -> tuple[str, MDir]:
            dirs = [("", self.root)] + [(p, e) for p, e, _, _ in self.entries(lambda e: isinstance(e, MDir))]
            return dirs[i % len(dirs)]

        def deletable(self, e) -> bool:
            """May the test remove e (or replace it)? Always in the first test; in the second,
            not if a file in it was closed since the last drain (its snapshot may be queued)."""
            return unpersisted_deletes or not any(f.fresh for f in files_under(e))

        def open_files(self) -> list[MFile]:
            return sorted((f for f in self.handles), key=lambda f: f.node.ino)

        # -- calls into the cache, mirrored in the model ---------------------------------------
        def _create(self, d: MDir, name: str, mode: int) -> MFile:
            """create and open for writing (FUSE's create)"""
            node = self.cache.names.create(d.node, name.encode(), mode, 0, 0)
            self.cache.files.open(node, True, False)
            f = d.kids[name] = MFile(node, mode)
            f.open = True
            self.handles.add(f)
            return f

        def _open(self, f: MFile, trunc: bool) -> None:
            assert f.node.content is not None, "the pool is large enough never to evict"
            self.cache.files.open(f.node, True, trunc)
            f.open = True
            self.handles.add(f)
            if trunc and f.data:
                f.data = bytearray()
                f.dirty = True

        def _write(self, f: MFile, off: int, data: bytes) -> None:
            self.cache.files.write(f.node, off, data)
            if len(f.data) < off:
                f.data.extend(bytes(off - len(f.data)))
            f.data[off:off + len(data)] = data
            f.dirty = True

        def _close(self, f: MFile, label: str) -> None:
            self.cache.files.release(f.node, True)
            f.open = False
            self.handles.discard(f)
            if f.dirty and f.linked:
                f.vis, f.dirty, f.fresh = (f.mode, bytes(f.data)), False, True
            self.record(label)

        def _unlink(self, d: MDir, name: str, label: str) -> None:
            e = d.kids[name]
            self._before_removal(e)
            if isinstance(e, MDir):
                self.cache.names.rmdir(d.node, name.encode())
            else:
                self.cache.names.unlink(d.node, name.encode())
            self._forget(d, name)
            self.record(label)

        def _forget(self, d: MDir, name: str) -> None:
            """e left the mount (unlinked, rmdir-ed, replaced by a rename; after the cache call)"""
            e = d.kids.pop(name)
            if isinstance(e, MFile):
                e.linked = False
                if self.queued:
                    self.cancelled.append(f"{node_path(d.node)}/{name}: "
                                          + ", ".join(f"seq {op.seq} {op.state}" for op in self.queued))

        def _before_removal(self, e) -> None:
            """Note the snapshots of e that the flusher has not applied yet (those still queued
            or uploading are cancelled when e leaves the mount, so the model must know them)."""
            with self.cache.oplog.lock:
                self.queued = list(e.node.publish_ops) if isinstance(e, MFile) else []

        # -- rules: files ------------------------------------------------------------------------
        @rule(parent=picks, name=names, data=contents, mode=st.sampled_from(FILE_MODES),
              keep_open=st.booleans())
        @guarded
        def new_file(self, parent, name, data, mode, keep_open):
            """create, write, close (or keep it open: it stays absent from the visible state)"""
            path, d = self.pick_dir(parent)
            if name in d.kids:
                return
            f = self._create(d, name, mode)
            self._write(f, 0, data)
            if not keep_open:
                self._close(f, f"new file {path}/{name}")

        @rule(pick=picks, data=contents, off=st.sampled_from([0, 0, 3, 4096, "end"]),
              trunc=st.booleans(), keep_open=st.booleans())
        @guarded
        def rewrite(self, pick, data, off, trunc, keep_open):
            """reopen a closed file for writing (O_TRUNC or not), write, close or keep it open"""
            fs = self.entries(lambda e: isinstance(e, MFile) and not e.open)
            if not fs:
                return
            path, f, _, _ = fs[pick % len(fs)]
            self._open(f, trunc)
            self._write(f, len(f.data) if off == "end" else off, data)
            if not keep_open:
                self._close(f, f"rewrite {path}")

        @precondition(lambda self: self.handles)
        @rule(pick=picks, data=contents, off=st.sampled_from([0, 5, "end"]))
        @guarded
        def write_open(self, pick, data, off):
            fs = self.open_files()
            f = fs[pick % len(fs)]
            self._write(f, len(f.data) if off == "end" else off, data)

        @precondition(lambda self: self.handles)
        @rule(pick=picks)
        @guarded
        def close_open(self, pick):
            fs = self.open_files()
            f = fs[pick % len(fs)]
            self._close(f, f"close {node_path(f.node)}")

        @rule(pick=picks, size=st.sampled_from([0, 1, 10, 5000]))
        @guarded
        def truncate(self, pick, size):
            """truncate a file: a closed one is snapshotted at once, an open one at its close"""
            fs = self.entries(lambda e: isinstance(e, MFile))
            if not fs:
                return
            path, f, _, _ = fs[pick % len(fs)]
            assert f.node.content is not None, "the pool is large enough never to evict"
            self.cache.files.truncate(f.node, size)
            f.data = f.data[:size] + bytearray(max(0, size - len(f.data)))
            f.dirty = True
            if not f.open:
                f.vis, f.dirty, f.fresh = (f.mode, bytes(f.data)), False, True
            self.record(f"truncate {path} {size}")

        @rule(pick=picks, mode=st.sampled_from(FILE_MODES + DIR_MODES))
        @guarded
        def chmod(self, pick, mode):
            es = self.entries(lambda e: not isinstance(e, MLink))
            if not es:
                return
            path, e, _, _ = es[pick % len(es)]
            if isinstance(e, MDir):
                mode |= 0o700
            self.cache.names.setattr(e.node, mode=mode)
            e.mode = mode
            if isinstance(e, MFile) and not e.dirty:
                e.vis = (mode, e.vis[1])
            self.record(f"chmod {path} {oct(mode)}")

        # -- rules: namespace ------------------------------------------------------------------
        @rule(parent=picks, name=names, mode=st.sampled_from(DIR_MODES))
        @guarded
        def mkdir(self, parent, name, mode):
            path, d = self.pick_dir(parent)
            if name in d.kids:
                return
            node = self.cache.names.mkdir(d.node, name.encode(), mode, 0, 0)
            d.kids[name] = MDir(node, mode)
            self.record(f"mkdir {path}/{name}")

        @rule(parent=picks, name=names, to=st.sampled_from(TARGETS))
        @guarded
        def symlink(self, parent, name, to):
            path, d = self.pick_dir(parent)
            if name in d.kids:
                return
            node = self.cache.names.symlink(d.node, name.encode(), to.encode(), 0, 0)
            d.kids[name] = MLink(node, to)
            self.record(f"symlink {path}/{name} -> {to}")

        @rule(pick=picks)
        @guarded
        def unlink(self, pick):
            """unlink a file or symlink, or rmdir an empty directory"""
            es = self.entries(lambda e: not isinstance(e, MDir) or not e.kids)
            if not es:
                return
            path, e, d, name = es[pick % len(es)]
            if not self.deletable(e):
                return
            self._unlink(d, name, f"{'rmdir' if isinstance(e, MDir) else 'unlink'} {path}")

        @rule(pick=picks)
        @guarded
        def rm_rf(self, pick):
            """remove a directory and everything under it, deepest entries first"""
            ds = self.entries(lambda e: isinstance(e, MDir))
            if not ds:
                return
            path, top, parent, name = ds[pick % len(ds)]
            if not self.deletable(top):
                return

            def rm(d: MDir, name: str, path: str) -> None:
                e = d.kids[name]
                if isinstance(e, MDir):
                    for kid in sorted(e.kids):
                        rm(e, kid, f"{path}/{kid}")
                self._unlink(d, name, f"rm -rf: {'rmdir' if isinstance(e, MDir) else 'unlink'} {path}")
            rm(parent, name, path)

        @rule(src=picks, parent=picks, name=names)
        @guarded
        def rename(self, src, parent, name):
            es = self.entries()
            if not es:
                return
            spath, e, sd, sname = es[src % len(es)]
            dpath, d = self.pick_dir(parent)
            dst = f"{dpath}/{name}" if dpath else name
            if isinstance(e, MDir) and (dpath == spath or dpath.startswith(spath + "/")):
                return   # into itself: the kernel refuses it before acpfs sees it
            self._rename(sd, sname, d, name, f"rename {spath} -> {dst}")

        def _rename(self, sd: MDir, sname: str, d: MDir, name: str, label: str) -> bool:
            e = sd.kids[sname]
            t = d.kids.get(name)
            if t is e:
                return False
            if t is not None:
                if isinstance(e, MDir) != isinstance(t, MDir):
                    return False
                if isinstance(t, MDir) and t.kids:
                    return False
                if not self.deletable(t):
                    return False
            self._before_removal(t)
            self.cache.names.rename(sd.node, sname.encode(), d.node, name.encode())
            if t is not None:
                self._forget(d, name)
            del sd.kids[sname]
            d.kids[name] = e
            self.record(label)
            return True

        @rule(parent=picks, name=names, data=contents)
        @guarded
        def pointer(self, parent, name, data):
            """write name.tmp, close it, rename it over name (a 'latest' pointer file)"""
            path, d = self.pick_dir(parent)
            tmp = name + ".tmp"
            t = d.kids.get(name)
            if tmp in d.kids or isinstance(t, MDir) or (t is not None and not self.deletable(t)):
                return
            where = f"{path}/" if path else ""
            f = self._create(d, tmp, 0o644)
            self._write(f, 0, data)
            self._close(f, f"pointer: new file {where}{tmp}")
            assert self._rename(d, tmp, d, name, f"pointer: rename {where}{tmp} -> {where}{name}")

        # -- rules: the flusher ------------------------------------------------------------------
        def _pause(self, method: str, skip: int):
            return hold(self.core.backing, method, skip)

        @initialize(method=st.none() | methods, skip=skips)
        @guarded
        def start(self, method, skip):
            """(half of the examples start with the flusher paused)"""
            if method is not None:
                self.fault = self._pause(method, skip)
                self.pause_desc = f"{method} after {skip} calls, from the start"

        @precondition(lambda self: self.fault is None)
        @rule(method=methods, skip=skips)
        @guarded
        def pause(self, method, skip):
            """hold the next call of a backing method after `skip` of them went by"""
            self.fault = self._pause(method, skip)
            self.pause_desc = f"{method} after {skip} calls"

        @precondition(lambda self: self.fault is not None)
        @rule(method=methods, skip=skips)
        @guarded
        def move_pause(self, method, skip):
            """let the held call go on, and hold the flusher again further on; then settle"""
            old, self.fault = self.fault, self._pause(method, skip)
            old.release()
            self.pause_desc = f"{method} after {skip} calls, moved"
            self.wait_quiet()
            self.check("settled at the moved pause")

        @precondition(lambda self: self.fault is not None)
        @rule()
        @guarded
        def settle(self):
            """let the flusher do everything it can before the pause, then check"""
            self.wait_quiet()
            self.check("settled")

        @precondition(lambda self: self.fault is not None)
        @rule()
        @guarded
        def resume(self):
            self.fault.release()
            self.fault = None
            self.pause_desc = ""

        @rule(now=st.integers(0, 2))
        @guarded
        def drain(self, now):
            """(one time in three: the others are no-ops, so that the flusher is seldom idle)"""
            if now == 0:
                self.drained("drain")

        def drained(self, where: str) -> None:
            if self.fault is not None:
                self.fault.release()
                self.fault = None
                self.pause_desc = ""
            self.core.drain(timeout=WAIT)
            for _, e, _, _ in walk(self.root):
                e.fresh = False
            if self.violation is not None:
                return
            b = self.read_backing()
            s, label = self.history[-1]
            if b != s:
                self.violation = (f"{where}: the flusher is idle but the backing is not the latest "
                                  f"state (after {label}): backing vs state: {diff(b, s)}")
                note(self.violation)
            self.lo = len(self.history) - 1

        # -- checks ------------------------------------------------------------------------------
        @invariant()
        @guarded
        def backing_is_a_past_state(self):
            self.check("after the step")

        @invariant()
        @guarded
        def model_is_the_mount(self):
            def compare(d: MDir, path: str) -> None:
                kids = d.node.children
                assert sorted(k.decode() for k in kids) == sorted(d.kids), f"names in {path or '.'}"
                for name, e in d.kids.items():
                    node = kids[name.encode()]
                    assert node is e.node, f"{path}{name}: another node"
                    if isinstance(e, MDir):
                        assert node.is_dir and statmod.S_IMODE(node.mode) == e.mode
                        compare(e, f"{path}{name}/")
                    elif isinstance(e, MLink):
                        assert node.is_link and node.target == e.target.encode()
                    else:
                        assert node.is_reg and statmod.S_IMODE(node.mode) == e.mode, f"{path}{name}"
                        got = self.cache.files.read(e.node, 0, len(e.data) + 1)
                        got = None if got is None else bytes(got)   # no view of the pool kept
                        assert got == bytes(e.data), f"{path}{name}: bytes"
                        assert node.dirty == e.dirty, f"{path}{name}: dirty"
            compare(self.root, "")

        def teardown(self):
            STATS["states"] += len(self.history)
            STATS["ms"] += int(1000 * (time.monotonic() - self.t0))
            if self.fault is not None and self.fault.entered.is_set():
                STATS["pauses held at the end"] += 1
            try:
                if not self.broken:
                    for f in self.open_files():
                        self._close(f, f"at the end: close {node_path(f.node)}")
                    self.drained("at the end, closed and drained")
                    if self.violation is not None:
                        raise AssertionError(self.violation)
            finally:
                if self.fault is not None:
                    self.fault.release()
                LIVE.remove(self.core)
                self.core.close()
                shutil.rmtree(self.dir, ignore_errors=True)

    return PrefixModel


def run_model(tmp_path: Path, unpersisted_deletes: bool, max_examples: int, steps: int) -> None:
    machine = make_machine(tmp_path, unpersisted_deletes)
    try:
        run(machine, max_examples, steps, [HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])
    finally:
        print(f"\nsteps and checks: {dict(sorted(STATS.items()))}")
        STATS.clear()
        while LIVE:   # a failure before teardown: never leave a held flusher behind
            LIVE.pop().close()


def test_backing_is_always_a_state_of_the_mount(tmp_path):
    """Every operation, deletes and replacements of files not yet persisted included."""
    run_model(tmp_path, unpersisted_deletes=True, max_examples=500, steps=30)


def test_backing_is_always_a_state_of_the_mount_when_deletes_follow_persistence(tmp_path):
    """Files are deleted or replaced only when their last close was persisted (after a drain)."""
    run_model(tmp_path, unpersisted_deletes=False, max_examples=200, steps=30)


def test_mkdir_lands_with_the_mode_it_was_made_with(core):
    """mkdir d 0755; mkdir e; chmod d 0700: while `mkdir e` is held, the backing must show d
    with 0755 (the mount never had d 0700 without e)."""
    cache = core.cache
    held = core.backing.inject("mkdir", path="e", hang=True)
    try:
        with cache.inodes.position_lock:            # every op is queued before the first is applied
            d = cache.names.mkdir(cache.inodes.root, b"d", 0o755, 0, 0)
            cache.names.mkdir(cache.inodes.root, b"e", 0o755, 0, 0)
            cache.names.setattr(d, mode=0o700)
        assert held.entered.wait(WAIT)
        assert oct(statmod.S_IMODE((core.back / "d").stat().st_mode)) == oct(0o755)
    finally:
        held.release()
    core.drain()
    assert oct(statmod.S_IMODE((core.back / "d").stat().st_mode)) == oct(0o700)


def test_pointer_replaced_before_it_was_persisted(core):
    """The smallest case of the first model test: write a.tmp, rename it over a, twice. The
    first a is replaced before it was persisted, so its upload is skipped; while the second
    rename is held, the backing has a.tmp (the new content) and no a at all."""
    cache, root = core.cache, core.cache.inodes.root
    held = core.backing.inject("rename", hang=True)
    try:
        with cache.inodes.position_lock:            # every op is queued before the first is applied
            for data in (b"v1", b"v2"):
                cache.files.release(write_file(cache, b"a.tmp", data), True)
                cache.names.rename(root, b"a.tmp", root, b"a")
        assert held.entered.wait(WAIT)
        f = ("file", "0o644")
        history = [{}, {"a.tmp": (*f, b"v1")}, {"a": (*f, b"v1")},
                   {"a": (*f, b"v1"), "a.tmp": (*f, b"v2")}, {"a": (*f, b"v2")}]
        seen = backing_tree(core.back)
        assert seen in history, f"the backing shows {show(seen)}"
    finally:
        held.release()
