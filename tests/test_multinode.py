"""Several nodes over one shared backing (contract 10), each a mount namespace of its own with
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

from conftest import ACPFS, content, digest, listing, wait_for

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
    assert listing(back) == sorted(f"step_{r}" for r in range(ROUNDS))
    for r in range(ROUNDS):
        assert sorted(os.listdir(back / f"step_{r}")) == [f"shard_{i}.bin" for i in range(n)]
    for node in nodes:
        st = node.status()
        assert st["errors"] == [] and st["queue"]["applied_seq"] == st["queue"]["last_seq"]


def test_nodes_see_each_others_files_and_removals(make_nodes):
    """Close-to-open coherence of names (contract 10): a name missing from a node's view,
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
    """Close-to-open coherence of contents (contract 10): a file a node holds clean
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


def settled(*nodes) -> list[dict]:
    """Each node synced: its queue empty and no op failing. Returns their statuses."""
    out = []
    for node in nodes:
        node.sync()
        st = node.status()
        assert st["errors"] == [] and st["queue"]["applied_seq"] == st["queue"]["last_seq"], st
        out.append(st)
    return out


STEPS = int(os.environ.get("MULTINODE_STEPS", "12"))
KEEP = 2


def test_rotation_across_nodes_then_resume_in_job_and_after_remount(make_nodes, workers):
    """The main node rotates checkpoints that hold other nodes' shards, and removes them whole.
    Each step, a rank on each node saves its shard into step_<k>/; the main node then points
    `latest` at it and removes step_<k-2> with shutil.rmtree. Its coherent listing shows the
    other node's shard (its directory listing is older than --coherence-timeout), so the
    whole step leaves the backing, and `latest` keeps landing: the old code left the main
    node's flusher retrying `rmdir: ENOTEMPTY` for ever, and everything after it in RAM.
    Then every node resumes from `latest`, in the job and after both nodes remounted."""
    a, b = nodes = make_nodes(2, extra=("--coherence-timeout", "0.2"))
    wa, wb = workers(a, b)
    shards = {}
    for k in range(STEPS):
        for rank, w in enumerate((wa, wb)):
            shards[k, rank] = content(f"step{k}-rank{rank}", (1 << 15) + 101 * rank + k)
            w.send("write", f"step_{k}/rank_{rank}.bin", f"step{k}-rank{rank}",
                   (1 << 15) + 101 * rank + k)
        wa.answer(), wb.answer()                 # the job's barrier after a save
        wa.do("point", "latest", f"step_{k}")
        if k >= KEEP:
            # saves are minutes apart in a job: the other node's shard of the step rotated
            # away has long landed (here: waited for), and the main node's listing is stale
            old = b.backing / f"step_{k - KEEP}" / "rank_1.bin"
            wait_for(old.exists, what=f"{old} to land")
            time.sleep(0.25)
            wa.do("rmtree", f"step_{k - KEEP}")
    sa, sb = settled(a, b)
    back = a.backing
    assert (back / "latest").read_text() == f"step_{STEPS - 1}"
    expect = [f"step_{k}" for k in range(STEPS - KEEP, STEPS)]
    assert sorted(p for p in os.listdir(back) if p.startswith("step_")) == expect
    for k in range(STEPS - KEEP, STEPS):
        for rank in range(2):
            assert (back / f"step_{k}" / f"rank_{rank}.bin").read_bytes() == shards[k, rank]
    assert sa["conflicts"]["total"] == 0 and sb["conflicts"]["total"] == 0, \
        (sa["conflicts"], sb["conflicts"])
    time.sleep(0.3)

    def resume(wa, wb) -> None:
        for w in (wa, wb):
            step = w.do("cat", "latest")
            assert step == f"step_{STEPS - 1}"
            assert w.do("ls", step) == "rank_0.bin,rank_1.bin"
            for rank in range(2):
                assert w.do("sha", f"{step}/rank_{rank}.bin") == digest(shards[STEPS - 1, rank])
        assert wb.do("ls", ".") == ",".join(["latest"] + expect)   # B's view: rotated too

    resume(wa, wb)                               # in the job, on the same mounts
    wa.close(), wb.close()
    for node in nodes:
        node.run(*ACPFS, "umount", str(node.mnt))
    for node in nodes:
        node.mount()
    resume(*workers(a, b))                       # after both nodes mounted again


@pytest.mark.parametrize("held", ["hang", "hang rename"])
def test_a_shard_landing_in_a_step_being_removed_is_a_conflict_not_a_wedge(make_nodes, workers, faults,
                                                                            tmp_path, held):
    """A shard landing in a removed step is a conflict, never a wedge: node B's shard of step_1
    is still on its way (its backing held: before its upload started, or uploaded and waiting to
    be renamed into place) while the main node A removes step_1. A removes what it sees; B's
    shard then lands by the conflict rules (docs/semantics.md, section 10): a directory removed
    under a pending file is made again (`dir_recreated` on B), a directory holding B's temporary
    file stays (`not_empty` on A). Both queues move on, later changes land, and no acknowledged
    byte is lost."""
    shared = tmp_path / "shared"
    (tmp_path / "b-view").mkdir()
    shim = faults.shim(shared, tmp_path / "b-view")       # B's way to the shared directory
    # B's held backing holds its node record too: each node waits for the other until its
    # lease ran out (global order), 5 s here rather than the default 30
    a, b = make_nodes(2, mount=False, extra=("--peer-lease", "5"))
    b.backing = tmp_path / "b-view"
    a.mount()
    faults.mount(b)                                       # torn down before the shim
    wa, wb = workers(a, b)
    wa.do("write", "step_1/rank_0.bin", "a1", 1000)
    settled(a)
    time.sleep(1.1)                                       # B's coherence timeout
    assert wb.do("ls", "step_1") == "rank_0.bin"
    shim.set(held)
    wb.do("write", "step_1/rank_1.bin", "b1", 3000)      # acknowledged; B's backing is held
    if held == "hang rename":
        wait_for(lambda: any(n.startswith(".acpfs-tmp-") for n in os.listdir(shared / "step_1")),
                 what="B's upload")
    time.sleep(1.1)
    wa.do("rmtree", "step_1")                             # A does not see B's shard yet
    wa.do("point", "latest", "step_2")
    sa, = settled(a)
    shim.set("ok")
    wb.do("write", "step_2/rank_1.bin", "b2", 10)
    sb, = settled(b)
    assert (shared / "latest").read_text() == "step_2"
    assert os.listdir(shared / "step_1") == ["rank_1.bin"]
    assert (shared / "step_1" / "rank_1.bin").read_bytes() == content("b1", 3000)
    assert (shared / "step_2" / "rank_1.bin").read_bytes() == content("b2", 10)
    got = {k: n for st in (sa, sb) for k, n in st["conflicts"]["by_kind"].items() if n}
    assert got == ({"dir_recreated": 1} if held == "hang" else {"not_empty": 1}), got
    loser = b if held == "hang" else a
    assert "conflict at 'step_1'" in loser.log.read_text()
    shown = loser.run(*ACPFS, "status", str(loser.mnt)).stdout
    assert "conflicts  1 with other writers of the backing" in shown, shown
    assert "step_1: " in shown, shown
    time.sleep(1.1)
    for w in (wa, wb):                                    # both see what the backing holds
        assert w.do("ls", "step_1") == "rank_1.bin"
        assert w.do("sha", "step_1/rank_1.bin") == digest(content("b1", 3000))


RACES = int(os.environ.get("MULTINODE_RACES", "20"))


def test_two_nodes_publishing_one_name_one_whole_version_wins(make_nodes, workers):
    """Two nodes write the same name at the same moment. The last publisher wins,
    whole files only: the backing holds one node's version, never a mix, and once their
    coherence timeout passed both nodes read that version. Each time one node's version
    replaced one it never saw, that node counts a `replaced` conflict."""
    a, b = nodes = make_nodes(2, extra=("--coherence-timeout", "0.1"))
    wa, wb = workers(a, b)
    for r in range(RACES):
        versions = {}
        for node, w, units in ((a, wa, 20000 + r), (b, wb, 30000 + r)):
            versions[node.name] = content(f"{node.name}-{r}", units)
            w.send("write", "shared.bin", f"{node.name}-{r}", units)
        wa.answer(), wb.answer()
        settled(a, b)
        won = (a.backing / "shared.bin").read_bytes()
        assert won in versions.values(), f"round {r}: the backing holds a mix"
        time.sleep(0.15)
        for w in (wa, wb):
            assert w.do("sha", "shared.bin") == digest(won), f"round {r}: node {w.node.name}"
    replaced = sum(n.status()["conflicts"]["by_kind"]["replaced"] for n in nodes)
    assert 0 < replaced <= RACES
    print(f"{RACES} rounds: {replaced} replaced conflicts, no mix, both nodes read the winner")
