"""Every node reads every node's files (contract 10), as a property against a reference model.

Random operations (write, overwrite, rename, unlink, mkdir, rmtree) run one after another,
each on a random node, on a small set of names in a few directories, so that the nodes keep
meeting on the same names: a node overwrites, renames or removes what another node wrote,
writes into a directory another node made or removed, lists a directory another node
changed. Each operation is followed by its node's `acpfs sync`, and the next operation waits
the coherence timeout: the close-to-open discipline of docs/semantics.md, section 10. At
random check points every node's whole view, and the backing, must equal the model (a
dict of path to content that the operations are applied to), and no conflict may be counted:
with that discipline the nodes behave as one filesystem.

``MODEL_SEED`` replays a run; ``MODEL_OPS`` sets its length. Each operation follows the
previous one's sync at once, with no wait past the coherence timeout: what opens and listings
see (the ``tree`` of every node) must equal the model right away; only the check of which
names are one inode, made by ``stat`` of names the kernel knows, waits the timeout first.

``test_every_node_reads_every_nodes_files_and_links`` adds hard links (names in the top
directory), and checks which names are one inode on every node and in the backing (the
seeds in LINK_SEEDS; ``MODEL_SEED`` runs one of your choice, ``MODEL_LINKS=1`` adds links
to the first test). A new version of a linked file lands under the names the publishing
node does not know too (found by inode in the backing, Publisher.unknown_names); a name of
it that another node removed or replaced alone leaves the file at the next open or lookup.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time

import pytest

from conftest import digest
from trees import NOTHING, tree

OPS = int(os.environ.get("MODEL_OPS", "60"))
COHERENCE = 0.1
DIRS = ["d1", "d2", "d1/sub"]
FILES = ["latest", "a.bin", "d1/x", "d1/y", "d2/x", "d1/sub/z", "d2"]   # d2: a file or a directory


def backing_tree(root) -> dict[str, str]:
    """Directories as "dir", files as their digest, acpfs's own directories aside; no file of
    acpfs's may be left."""
    out = tree(root, skip_files=NOTHING, modes=False, contents=lambda p, st: digest(p.read_bytes()))
    left = [p for p in out if os.path.basename(p).startswith(".acpfs-")]
    assert not left, f"a temporary file is left: {left}"
    return out


class Model:
    """The one filesystem the nodes together must behave as: path -> "dir" or a digest, and
    the names that are one file (hard links: an overwrite in place changes all of them)."""

    def __init__(self, links: bool = False) -> None:
        self.tree: dict[str, str] = {}
        self.links = links
        self.group: dict[str, set[str]] = {}   # a file's name -> all its names (one set each)

    def names(self, path: str) -> set[str]:
        return self.group.get(path, {path})

    def forget(self, path: str) -> None:
        names = self.group.pop(path, None)
        if names is not None:
            names.discard(path)
            if len(names) == 1:
                self.group.pop(next(iter(names)))

    def parent_ok(self, path: str) -> bool:
        parent = os.path.dirname(path)
        return parent == "" or self.tree.get(parent) == "dir"

    def below(self, path: str) -> list[str]:
        return [p for p in self.tree if p == path or p.startswith(path + "/")]

    def choose(self, rng: random.Random) -> list[str] | None:
        """A random operation that is valid in the model (the worker's words), or None."""
        kind = rng.choice(["write", "write", "write", "rename", "unlink", "mkdir", "rmtree"]
                          + ["link", "link"] * self.links)
        files = [p for p in FILES if self.tree.get(p, "file") != "dir"]
        if kind == "link":   # names in one directory (docs/semantics.md, hard links)
            src = [p for p in files if p in self.tree and "/" not in p]
            dst = [p for p in files if p not in self.tree and "/" not in p]
            return ["link", rng.choice(src), rng.choice(dst)] if src and dst else None
        if kind == "write":
            path = rng.choice(files)
            if not self.parent_ok(path):
                return None
            return ["write", path, f"v{rng.randrange(10**9)}", str(rng.choice([1, 100, 40000]))]
        if kind == "rename":
            src = [p for p in files if p in self.tree]
            if not src:
                return None
            s, d = rng.choice(src), rng.choice(files)
            return ["rename", s, d] if s != d and self.parent_ok(d) else None
        if kind == "unlink":
            there = [p for p in files if p in self.tree]
            return ["unlink", rng.choice(there)] if there else None
        d = rng.choice(DIRS)
        if kind == "mkdir":
            return ["mkdir", d] if d not in self.tree and self.parent_ok(d) else None
        return ["rmtree", d] if self.tree.get(d) == "dir" else None

    def apply(self, words: list[str]) -> None:
        cmd, path, *args = words
        if cmd == "write":        # open(path, "wb"): in place, under every name of the file
            for p in self.names(path):
                self.tree[p] = digest(hashlib.sha256(args[0].encode()).digest() * int(args[1]))
        elif cmd == "rename":
            dst = args[0]
            if dst in self.names(path):
                return            # two names of one file: rename(2) does nothing
            self.forget(dst)
            self.tree[dst] = self.tree.pop(path)
            names = self.group.pop(path, None)
            if names is not None:
                names.discard(path)
                names.add(dst)
                self.group[dst] = names
        elif cmd == "unlink":
            del self.tree[path]
            self.forget(path)
        elif cmd == "link":
            dst = args[0]
            self.tree[dst] = self.tree[path]
            names = self.group.setdefault(path, {path})
            names.add(dst)
            self.group[dst] = names
        elif cmd == "mkdir":
            self.tree[path] = "dir"
        elif cmd == "rmtree":
            for p in self.below(path):
                del self.tree[p]
                self.forget(p)

    def groups(self) -> list[list[str]]:
        return sorted({tuple(sorted(n)) for n in self.group.values()})  # type: ignore[arg-type]


def inode_groups(root) -> list[tuple[str, ...]]:
    """The names under root that are one file (more than one name), as the model lists them."""
    by_first: dict[str, list[str]] = {}
    for rel, e in tree(root, skip_files=NOTHING, contents=None, links=True).items():
        if len(e) == 5:      # ("file", mode, None, link count, first name)
            by_first.setdefault(e[4], []).append(rel)
    return sorted(tuple(sorted(n)) for n in by_first.values() if len(n) > 1)


def test_every_node_reads_every_nodes_files(make_nodes, workers):
    seed = int(os.environ.get("MODEL_SEED", random.randrange(1 << 30)))
    run_model(make_nodes, workers, seed, links=os.environ.get("MODEL_LINKS", "") not in ("", "0"))


# Seeds of the model with hard links: each of them failed once on the way (a name another
# node removed or replaced, unknown to the node publishing the file's new version).
LINK_SEEDS = [1, 2, 3, 9, 19, 23]


@pytest.mark.parametrize("seed", [int(os.environ["MODEL_SEED"])] if "MODEL_SEED" in os.environ
                         else LINK_SEEDS)
def test_every_node_reads_every_nodes_files_and_links(make_nodes, workers, seed):
    run_model(make_nodes, workers, seed, links=True)


def run_model(make_nodes, workers, seed: int, links: bool) -> None:
    print(f"MODEL_SEED={seed}")
    rng = random.Random(seed)
    nodes = make_nodes(3, extra=("--coherence-timeout", str(COHERENCE)))
    ws = workers(*nodes)
    model = Model(links=links)
    done: list[str] = []
    checks = 0
    while len(done) < OPS:
        words = model.choose(rng)
        if words is None:
            continue
        i = rng.randrange(len(nodes))
        ws[i].do(*words)
        nodes[i].sync()
        model.apply(words)
        done.append(f"{nodes[i].name}: {' '.join(words)}")
        if rng.random() < 0.3 or len(done) == OPS:
            checks += 1
            history = "\n".join(done[-12:])
            assert backing_tree(nodes[0].backing) == model.tree, \
                f"seed {seed}: the backing differs from the model after:\n{history}"
            assert inode_groups(nodes[0].backing) == model.groups(), \
                f"seed {seed}: the backing's hard links differ from the model after:\n{history}"
            # at once after the writer's sync: what opens and listings see (close-to-open)
            for node, w in zip(nodes, ws):
                view = json.loads(w.do("tree", "."))
                assert view == model.tree, f"seed {seed}: node {node.name} sees {view}, " \
                                           f"the model holds {model.tree}, after:\n{history}"
            # a stat of a name the kernel knows may lag by the coherence timeout
            time.sleep(COHERENCE + 0.05)
            for node in nodes:
                assert inode_groups(node.path()) == model.groups(), \
                    f"seed {seed}: node {node.name}'s hard links differ from the model after:\n{history}"
    for node in nodes:
        st = node.status()
        assert st["errors"] == [] and st["conflicts"]["total"] == 0, (node.name, st["conflicts"])
    print(f"{OPS} operations on 3 nodes, {checks} checks of every view: all equal to the model")


# Seeds of the converge test (MODEL_SEED runs one of your choice). Seeds 2 and 635963647 failed
# before a file renamed after another node removed it left the view (Coherence.merge_listing);
# seeds 1 and 3 (never failed) left the default set to keep the suite under 45 minutes.
CONVERGE_SEEDS = [2, 411547727, 635963647]


@pytest.mark.parametrize("seed", [int(os.environ["MODEL_SEED"])] if "MODEL_SEED" in os.environ
                         else CONVERGE_SEEDS)
def test_nodes_converge_after_random_holds(faults, make_nodes, workers, tmp_path, seed):
    """The same operations, now without the discipline: no sync, no wait, and each node's
    way to the backing held back at random (each rename answered 0.3 s late: uploads go on,
publishes and mkdirs lag; a hang would also stall the node's first listings, which wait
for the backing by design, docs/faults.md), so
    that the nodes' changes meet in the backing in every order. Whatever the conflict rules
    decided, once the holds end and every node synced: no queue is stuck, every file in the
    backing (and in `.acpfs-conflicts/`) is whole content some node wrote, and every node's
    view equals the backing."""
    print(f"MODEL_SEED={seed}")
    rng = random.Random(seed)
    shared = tmp_path / "shared"
    views = [tmp_path / f"view{i}" for i in range(2)]
    shims = []
    for v in views:            # before the nodes: their namespaces hold every view
        v.mkdir()
        shims.append(faults.shim(shared, v))
    nodes = make_nodes(2, mount=False, extra=("--coherence-timeout", str(COHERENCE)))
    for node, v in zip(nodes, views):
        node.backing = v
        faults.mount(node)     # unmounted before the shims go
    ws = workers(*nodes)
    written: set[str] = set()
    held = [False, False]
    failed = 0
    for _ in range(OPS):
        if rng.random() < 0.15:
            i = rng.randrange(2)
            held[i] = not held[i]
            shims[i].set("slow 0.3 rename" if held[i] else "ok")
        kind = rng.choice(["write", "write", "write", "rename", "unlink", "mkdir", "rmtree"])
        if kind == "write":
            tag, units = f"v{rng.randrange(10**9)}", rng.choice([1, 100, 40000])
            words = ["write", rng.choice(FILES), tag, str(units)]
        elif kind == "rename":
            words = ["rename", rng.choice(FILES), rng.choice(FILES)]
        elif kind == "unlink":
            words = ["unlink", rng.choice(FILES)]
        else:
            words = [kind, rng.choice(DIRS)]
        ok, _ = ws[rng.randrange(2)].attempt(*words)
        failed += not ok
        if ok and kind == "write":
            written.add(digest(hashlib.sha256(tag.encode()).digest() * units))
        time.sleep(rng.choice([0, 0, 0.02, 0.15]))
    for shim in shims:
        shim.set("ok")
    for node in nodes:
        node.sync()
    time.sleep(COHERENCE + 0.1)
    backing = backing_tree(shared)
    torn = [p for p, d in backing.items() if d != "dir" and d not in written]
    assert torn == [], f"seed {seed}: files holding content nobody wrote: {torn}"
    aside = shared / ".acpfs-conflicts"
    kept = [p for p in aside.rglob("*") if p.is_file()] if aside.exists() else []
    assert all(digest(p.read_bytes()) in written for p in kept), f"seed {seed}"
    conflicts: dict[str, int] = {}
    for node, w in zip(nodes, ws):
        st = node.status()
        assert st["errors"] == [] and st["queue"]["applied_seq"] == st["queue"]["last_seq"], st
        for k, n in st["conflicts"]["by_kind"].items():
            conflicts[k] = conflicts.get(k, 0) + n
        view = json.loads(w.do("tree", "."))
        view = {p: d for p, d in view.items() if not p.startswith(".acpfs-")}
        assert view == backing, f"seed {seed}: node {node.name} sees {view}, the backing holds {backing}"
    print(f"{OPS} operations on 2 nodes with holds ({failed} refused by a node's view): "
          f"conflicts {conflicts}, {len(kept)} files kept aside; every view equals the backing")
