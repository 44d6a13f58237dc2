"""The peer plane (``--peers-listen``) on the N-node fixture: nodes in mount namespaces over
one backing, talking over loopback (docs/design.md, "Nodes serve each other from RAM").

The readers reach the backing through faultfs views that count what they serve, as the
server of a network filesystem would see it: a file read from a peer's RAM costs the
backing no READ. Requests without the backing's secret, with another one, replayed, and
answers from a peer that lies are refused, and the readers fall back to the backing with
the right bytes."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from acpfs.cluster.auth import SECRET_NAME, Secret
from acpfs.cluster.plane import target_of, version_text
from acpfs.cluster.records import RecordName
from conftest import Node, wait_for, wait_gone

PEERS = ("--peers-listen", "127.0.0.1:0")
MIB = 1 << 20


class Cluster:
    """Nodes over one shared backing: ``direct`` nodes mount it as it is, ``viewed`` ones
    through a faultfs view each (``views[i]``), which counts what the backing serves them."""

    def __init__(self, faults, tmp_path: Path) -> None:
        self.faults, self.tmp = faults, tmp_path
        self.shared = tmp_path / "shared"
        self.shared.mkdir(exist_ok=True)
        self.mnt = tmp_path / "ckpt"
        self.mnt.mkdir(exist_ok=True)
        self.views: dict[str, object] = {}

    def node(self, name: str, view: bool, extra: tuple[str, ...] = PEERS) -> Node:
        backing = self.shared
        if view:
            (self.tmp / f"view-{name}").mkdir()
            shim = self.faults.shim(self.shared, self.tmp / f"view-{name}")
            self.views[name] = shim
            backing = shim.mnt
        node = Node(name, self.tmp, backing, self.mnt, extra=extra)
        self.faults.mounts.append(node)   # unmounted before the views, also when a test fails
        return node.mount()

    def backing_reads(self, name: str) -> int:
        time.sleep(0.35)   # faultfs writes its counts every 0.1 s
        return self.views[name].counts().get("read_bytes", 0)


def checkpoint(node: Node, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = node.path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    node.sync()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def plane(node: Node) -> dict:
    return node.status()["peer_plane"]


def known_peers(node: Node, n: int) -> None:
    wait_for(lambda: sum(1 for p in node.status()["peers"]["peers"]
                         if p["state"] != "left" and p["address"]) >= n,
             30, f"{node.name} sees {n} peer planes")


@pytest.fixture
def cluster(faults, tmp_path):
    return Cluster(faults, tmp_path)


def test_a_checkpoint_is_read_from_the_ram_of_the_node_that_wrote_it(cluster):
    """A writes and syncs a checkpoint; B and C, cold, read it: their bytes come from A's
    RAM (or B's), exact, and their backing views serve almost no READ. With A killed, B
    reads what only A held from the backing, exact."""
    rnd = random.Random(32)
    files = {f"step_100/shard{i}.bin": rnd.randbytes(12 * MIB + i * 4097) for i in range(3)}
    files["step_100/latest"] = b"step_100"
    a = cluster.node("a", view=False)
    checkpoint(a, files)
    assert plane(a)["on"] and plane(a)["address"].startswith("127.0.0.1:")
    b = cluster.node("b", view=True)
    c = cluster.node("c", view=True)
    known_peers(b, 2)
    big = sum(len(d) for d in files.values() if len(d) >= MIB)
    before = cluster.backing_reads("b")
    for rel, data in files.items():
        assert sha(b.path(rel)) == hashlib.sha256(data).hexdigest(), rel
    read_b = cluster.backing_reads("b") - before
    pb = plane(b)
    assert pb["fetched_files"] == 3 and pb["fetched_bytes"] == big, pb
    assert read_b <= 64 * 1024, f"B's backing served {read_b} bytes of a {big}-byte checkpoint"
    assert plane(a)["served_bytes"] >= big // 2, plane(a)
    # C: from A or B (whoever holds it), again without the backing
    before = cluster.backing_reads("c")
    for rel, data in files.items():
        assert sha(c.path(rel)) == hashlib.sha256(data).hexdigest(), rel
    assert cluster.backing_reads("c") - before <= 64 * 1024
    assert plane(c)["fetched_bytes"] == big
    assert plane(a)["served_bytes"] + plane(b)["served_bytes"] >= 2 * big
    # read again: from the cache
    assert sha(b.path("step_100/shard0.bin")) == hashlib.sha256(files["step_100/shard0.bin"]).hexdigest()
    assert plane(b)["fetched_files"] == 3
    # A gone before its record expires: what only A holds comes from the backing
    only_a = rnd.randbytes(6 * MIB)
    checkpoint(a, {"step_200/model.bin": only_a})
    addr_a = plane(a)["address"]
    os.kill(a.pid, signal.SIGKILL)
    assert wait_gone(a.pid, 30)
    before = cluster.backing_reads("b")
    assert sha(b.path("step_200/model.bin")) == hashlib.sha256(only_a).hexdigest()
    assert cluster.backing_reads("b") - before >= len(only_a)
    pb = plane(b)
    assert pb["fetched_files"] == 3 and pb["fallbacks"] >= 1, pb
    assert addr_a in pb["failed_peers"], pb
