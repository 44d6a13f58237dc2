"""Several nodes over one shared backing (issue 11), each a mount namespace of its own with
its own /run/acpfs and cache directory (``conftest.make_nodes``), the same mount point on
every node, as on a cluster.

What holds so far: every daemon writes only its own temporary files (names carry its
instance and 64 random bits, created exclusively), so ranks on different nodes saving their
shards into the same directory at the same moment never mix bytes. Earlier names were
``.acpfs-tmp-<ino>-<seq>``, equal on freshly mounted nodes and opened with ``O_TRUNC``: 5 of
8 first saves of two nodes broke (one rank's file holding the other's bytes, or a mix).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time

import pytest

ROUNDS = int(os.environ.get("MULTINODE_ROUNDS", "50"))

# A rank: for each line "<round>" on stdin, make step_<round>/ if missing and write its shard
# into it as one file, then answer "done <round>". All ranks get the line at the same moment.
RANK = textwrap.dedent("""
    import hashlib, os, sys
    mnt, rank = sys.argv[1], int(sys.argv[2])
    for line in sys.stdin:
        r = int(line)
        d = os.path.join(mnt, f"step_{r}")
        os.makedirs(d, exist_ok=True)
        seed = hashlib.sha256(f"{r}-{rank}".encode()).digest()
        data = seed * ((1 << 20) // 32 + 97 * rank + r)
        with open(os.path.join(d, f"shard_{rank}.bin"), "wb") as f:
            f.write(data)
        print("done", r, flush=True)
""")


def shard(r: int, rank: int) -> bytes:
    seed = hashlib.sha256(f"{r}-{rank}".encode()).digest()
    return seed * ((1 << 20) // 32 + 97 * rank + r)


@pytest.mark.parametrize("n", [2, 3])
def test_simultaneous_first_saves_never_mix_shards(make_nodes, n):
    nodes = make_nodes(n)
    ranks = [node.popen(sys.executable, "-c", RANK, str(node.mnt), str(i), stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
             for i, node in enumerate(nodes)]
    try:
        for r in range(ROUNDS):
            for p in ranks:                      # every rank starts the round at once
                p.stdin.write(f"{r}\n")
                p.stdin.flush()
            for p in ranks:
                assert p.stdout.readline() == f"done {r}\n"
    finally:
        for p in ranks:
            p.stdin.close()
            p.wait(timeout=60)
    for node in nodes:
        node.sync()
    back = nodes[0].backing
    wrong = [f"step_{r}/shard_{i}.bin" for r in range(ROUNDS) for i in range(n)
             if (back / f"step_{r}" / f"shard_{i}.bin").read_bytes() != shard(r, i)]
    assert wrong == [], f"{len(wrong)} of {ROUNDS * n} shards hold other bytes: {wrong[:5]}"
    assert sorted(os.listdir(back)) == sorted(f"step_{r}" for r in range(ROUNDS))
    for r in range(ROUNDS):
        assert sorted(os.listdir(back / f"step_{r}")) == [f"shard_{i}.bin" for i in range(n)]
    for node in nodes:
        st = node.status()
        assert st["errors"] == [] and st["queue"]["applied_seq"] == st["queue"]["last_seq"]


def test_nodes_see_each_others_files_and_removals(make_nodes):
    """Close-to-open coherence of names (issue 11, point 3): a name missing from a node's view,
    or a directory listed, is looked up in the backing again once its listing is older than
    --coherence-timeout (1 s): files another node wrote appear, files another node removed
    disappear; a node's own pending changes always win in its own view."""
    a, b = make_nodes(2)
    os.mkdir(a.path("step"))
    a.path("step/a").write_bytes(b"from a")
    a.sync()
    os.makedirs(b.path("step"), exist_ok=True)            # B sees A's directory (or makes it)
    b.path("step/b").write_bytes(b"from b")
    b.path("latest").write_text("step")
    b.sync()
    time.sleep(1.2)
    assert sorted(os.listdir(a.path("step"))) == ["a", "b"]
    assert a.path("step/b").read_bytes() == b"from b"
    assert a.path("latest").read_text() == "step"          # a name A never saw: looked up
    assert b.path("step/a").read_bytes() == b"from a"
    os.unlink(b.path("step/b"))
    b.sync()
    a.path("step/mine").write_bytes(b"pending on a")        # A's own change, not yet synced
    time.sleep(1.2)
    assert sorted(os.listdir(a.path("step"))) == ["a", "mine"]
    time.sleep(0.2)     # the kernel is told to forget the name asynchronously
    assert not a.path("step/b").exists()
    a.sync()
    time.sleep(1.2)
    assert sorted(os.listdir(b.path("step"))) == ["a", "mine"]
    assert b.path("step/mine").read_bytes() == b"pending on a"


def test_a_node_reads_the_version_another_node_published(make_nodes):
    """Close-to-open coherence of contents (issue 11, point 3): a file a node holds clean
    (cached, or read before) is compared with the backing at open and stat once its check is
    older than --coherence-timeout; another node's newer version (overwritten, or grown)
    replaces the stale copy."""
    a, b = make_nodes(2)
    a.path("model.pt").write_bytes(b"v1" * 1000)          # cached on A
    a.path("log.txt").write_bytes(b"line 1\n")
    a.sync()
    time.sleep(1.2)
    assert b.path("log.txt").read_bytes() == b"line 1\n"
    assert a.path("log.txt").read_bytes() == b"line 1\n"   # A has read it before
    b.path("model.pt").write_bytes(b"v2" * 3000)            # overwritten on B
    with open(b.path("log.txt"), "ab") as f:                 # grown on B
        f.write(b"line 2\n")
    b.sync()
    time.sleep(1.2)
    assert os.stat(a.path("log.txt")).st_size == len(b"line 1\nline 2\n")
    assert a.path("log.txt").read_bytes() == b"line 1\nline 2\n"
    assert a.path("model.pt").read_bytes() == b"v2" * 3000
    a.path("model.pt").write_bytes(b"v3")                   # and A's own change wins on A
    assert a.path("model.pt").read_bytes() == b"v3"
    a.sync()
    assert (a.backing / "model.pt").read_bytes() == b"v3"
