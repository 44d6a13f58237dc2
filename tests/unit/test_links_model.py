"""Model test of hard links against the ordering promise (docs/semantics.md, "Hard links").

A hypothesis ``RuleBasedStateMachine`` drives a ``Cache`` and its ``Flusher`` (harness.py, no
mount) with random operations on six names in two directories: files created, rewritten
(truncated or appended to) and closed, linked under other names, unlinked, renamed (over
other files, over another name of the same file). Meanwhile the flusher is held at random
points, as in test_prefix_model.py: a hang on one backing method after a random number of
its calls, moved and released later.

The model: each file is one object with its content at its last close; a name maps to a
file. The visible state after each step is path -> ("file", mode, bytes); the history is the
sequence of visible states. The checks:
- after every step, the backing (read while the flusher cannot change it) is a state of the
  history at or after the one it showed last, with the one documented exception: while a
  new version of a file with several names lands name by name, a name still to come holds
  the file's version before (its content at the close before the last);
- once drained, the backing is the latest state, and the names of one file are one inode
  there, with that many links; names of different files are different inodes;
- after every step, the mount's view is the model: each name is the model file's node,
  with the model's content and link count.
"""

from __future__ import annotations

import collections
import os
import shutil
import time
from pathlib import Path

from hypothesis import HealthCheck, note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from heldmodel import WAIT, HeldMachine, hold, run
from test_prefix_model import diff, show

PATHS = ["a", "b", "c", "d/a", "d/b", "d/c"]
MODE = 0o644
PAUSE_METHODS = ["publish", "link", "link", "rename", "unlink", "write_temp", "open_dir"]
STATS: collections.Counter = collections.Counter()

paths = st.sampled_from(PATHS)
picks = st.integers(0, 1 << 16)   # one of the names in use
contents = st.binary(min_size=1, max_size=64)


class MFile:
    def __init__(self, node, data: bytes) -> None:
        self.node = node
        self.data = data          # at its last close
        self.prev = b""           # at the close before (what names still to come may hold)


class LinksModel(HeldMachine):
    base: Path

    def __init__(self) -> None:
        super().__init__()
        self.setup(self.base / f"ex{STATS['examples']}")
        STATS["examples"] += 1
        self.names: dict[str, MFile] = {}
        self.d = self.cache.names.mkdir(self.cache.inodes.root, b"d", 0o755, 0, 0)
        self.history: list[tuple[dict, dict, str]] = [({}, {}, "start"),
                                                      ({"d": ("dir", oct(0o755))}, {}, "mkdir d")]

    # -- the model ---------------------------------------------------------------------------
    def where(self, path: str):
        d, _, name = path.rpartition("/")
        return (self.d if d else self.cache.inodes.root), name.encode()

    def names_of(self, f: MFile) -> list[str]:
        return sorted(p for p, g in self.names.items() if g is f)

    def record(self, label: str) -> None:
        state: dict = {"d": ("dir", oct(0o755))}
        alt: dict = {}
        for p, f in self.names.items():
            state[p] = ("file", oct(MODE), f.data)
            if len(self.names_of(f)) > 1:
                alt[p] = ("file", oct(MODE), f.prev)
        if state != self.history[-1][0]:
            self.history.append((state, alt, label))
            note(f"  state {len(self.history) - 1} after {label}: {show(state)}")

    def check(self, where: str) -> None:
        if self.violation is not None:
            return
        b = self.read_backing()
        def matches(h) -> bool:
            state, alt, _ = h
            return b.keys() == state.keys() and all(b[p] == v or alt.get(p) == b[p]
                                                    for p, v in state.items())
        if self.advance(matches):
            STATS["matched with a name still to come"] += b != self.history[self.lo][0]
            return
        self.violation = "\n".join(
            [f"{where}: the backing shows a state the mount never had", f"  backing: {show(b)}",
             f"  pause: {self.pause_desc or 'none'}", "  history:"]
            + [f"    {i}{'*' if i == self.lo else ' '} {label}: {show(s)}"
               for i, (s, _, label) in enumerate(self.history)])
        note(self.violation)

    # -- rules: the mount --------------------------------------------------------------------
    def _write(self, node, data: bytes, trunc: bool) -> bytes:
        cache = self.cache
        cache.files.open(node, True, trunc)
        off = 0 if trunc else node.size
        cache.files.write(node, off, data)
        cache.files.release(node, True)
        return data

    @rule(path=paths, data=contents)
    def create(self, path, data):
        if path in self.names:
            return
        parent, name = self.where(path)
        node = self.cache.names.create(parent, name, MODE, 0, 0)
        self.cache.files.open(node, True, False)
        self.cache.files.write(node, 0, data)
        self.cache.files.release(node, True)
        self.names[path] = MFile(node, data)
        self.record(f"create {path}")

    def pick(self, i: int) -> str:
        names = sorted(self.names)
        return names[i % len(names)]

    @precondition(lambda self: self.names)
    @rule(pick=picks, data=contents, trunc=st.booleans())
    def rewrite(self, pick, data, trunc):
        path = self.pick(pick)
        f = self.names[path]
        self._write(f.node, data, trunc)
        f.prev, f.data = f.data, (data if trunc else f.data + data)
        self.record(f"{'rewrite' if trunc else 'append to'} {path}")

    @precondition(lambda self: self.names)
    @rule(pick=picks, dst=paths)
    def link(self, pick, dst):
        src = self.pick(pick)
        f = self.names[src]
        if dst in self.names:
            return
        parent, name = self.where(dst)
        self.cache.names.link(f.node, parent, name)
        self.names[dst] = f
        STATS["links"] += 1
        self.record(f"link {src} {dst}")

    @precondition(lambda self: self.names)
    @rule(pick=picks)
    def unlink(self, pick):
        path = self.pick(pick)
        self.cache.names.unlink(*self.where(path))
        del self.names[path]
        self.record(f"unlink {path}")

    @precondition(lambda self: self.names)
    @rule(pick=picks, dst=paths)
    def rename(self, pick, dst):
        src = self.pick(pick)
        f = self.names[src]
        if src == dst:
            return
        self.cache.names.rename(*self.where(src), *self.where(dst))
        if self.names.get(dst) is not f:      # two names of one file: nothing happens
            del self.names[src]
            self.names[dst] = f
        self.record(f"rename {src} {dst}")

    # -- rules: the flusher ------------------------------------------------------------------
    def _pause(self, method: str, skip: int):
        self.pause_desc = f"{method} after {skip} calls"
        return hold(self.core.backing, method, skip)

    @initialize(method=st.none() | st.sampled_from(PAUSE_METHODS), skip=st.sampled_from([0, 1, 2, 4]))
    def start(self, method, skip):
        if method is not None:
            self.fault = self._pause(method, skip)

    @precondition(lambda self: self.fault is not None)
    @rule(method=st.sampled_from(PAUSE_METHODS), skip=st.sampled_from([0, 1, 2, 4]))
    def move_pause(self, method, skip):
        old, self.fault = self.fault, self._pause(method, skip)
        old.release()
        time.sleep(0.02)
        self.check("at the moved pause")

    @precondition(lambda self: self.fault is None)
    @rule(method=st.sampled_from(PAUSE_METHODS), skip=st.sampled_from([0, 1, 2, 4]))
    def pause(self, method, skip):
        self.fault = self._pause(method, skip)

    @rule(now=st.integers(0, 2))
    def drain(self, now):
        if now == 0:
            self.drained("drain")

    def drained(self, where: str) -> None:
        if self.fault is not None:
            self.fault.release()
            self.fault = None
            self.pause_desc = ""
        self.core.drain(timeout=WAIT)
        b = self.read_backing()
        state = self.history[-1][0]
        if self.violation is None and b != state:
            self.violation = f"{where}: drained, the backing is not the latest state: {diff(b, state)}"
        self.lo = len(self.history) - 1
        back = self.core.back
        files = {id(f): f for f in self.names.values()}
        inos = {}
        for f in files.values():
            names = self.names_of(f)
            got = {os.lstat(back / p).st_ino for p in names}
            assert len(got) == 1, f"{where}: names {names} of one file are {len(got)} inodes"
            assert os.lstat(back / names[0]).st_nlink == len(names), f"{where}: link count of {names}"
            inos[got.pop()] = names
        assert len(inos) == len(files), f"{where}: two files share an inode: {inos}"
        STATS["drained with links"] += any(len(n) > 1 for n in inos.values())

    # -- checks ------------------------------------------------------------------------------
    @invariant()
    def backing_is_a_past_state(self):
        self.check("after the step")

    @invariant()
    def model_is_the_mount(self):
        for path, f in self.names.items():
            parent, name = self.where(path)
            node = self.cache.names.lookup(parent, name)
            assert node is f.node, f"{path}: another node"
            assert node.nlink == len(self.names_of(f)), f"{path}: link count"
            assert bytes(self.cache.files.read(node, 0, len(f.data) + 1)) == f.data, f"{path}: bytes"
        for d in (self.cache.inodes.root, self.d):
            for name in d.children:
                path = (b"d/" if d is self.d else b"") + name
                assert path.decode() in self.names or path == b"d", f"{path!r}: not in the model"

    def teardown(self):
        try:
            self.drained("at the end")
            if self.violation is not None:
                raise AssertionError(self.violation)
        finally:
            if self.fault is not None:
                self.fault.release()
            self.core.close()
            shutil.rmtree(self.dir, ignore_errors=True)


def test_hard_links_keep_the_backing_a_state_of_the_mount(tmp_path):
    LinksModel.base = tmp_path
    try:
        run(LinksModel, 150, 40, list(HealthCheck))
    finally:
        print(f"\nsteps and checks: {dict(sorted(STATS.items()))}")
        STATS.clear()
