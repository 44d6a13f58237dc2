"""Real torch.distributed.checkpoint across two nodes over one backing (contract 10): 2 nodes x 2
ranks (world size 4, gloo), each node a mount namespace of its own (``conftest.make_nodes``)
mounting acpfs at the same path, the ranks of a node running inside it.

Every rank saves a tensor all ranks hold (replicated: DCP writes it once, from one rank) and
tensors only it holds; at load every rank asks also for the tensors of a rank on the other
node, and all read the ``.metadata`` that rank 0 (node A) wrote, so each node reads files the
other node wrote. After each save the ranks follow the documented protocol for reading on
one node what another just wrote (docs/semantics.md, section 10): ``acpfs sync`` on every
node, a barrier, rank 0 rewrites the ``latest`` pointer, ``acpfs sync`` and a barrier again,
then one coherence timeout before anyone reads. Then the backing is checked from outside the
job, and the job resumes after both nodes remounted. (The order of ``latest`` after the
shards needs no sync: test_global_order_dcp.py.)
"""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ACPFS

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE
STEPS = 3
# --coherence-timeout of the mounts (the default, 1 s) and a margin: see WORKER
COHERENCE_WAIT = 1.2

# What a rank saves at a step; run by the test and, as source, by the ranks. Contents depend
# on the step and the rank, so a stale step, another rank's data or misplaced bytes all differ.
def make_state(step: int, rank: int) -> dict[str, "torch.Tensor"]:
    g = torch.Generator().manual_seed(7919 * step + 1)
    sd = {"replicated.weight": torch.randn(512, 1024, generator=g)}                   # 2 MiB, every rank
    g = torch.Generator().manual_seed(7919 * step + 101 + rank)
    sd[f"rank{rank}.weight"] = torch.randn(640 + 64 * rank, 1024, generator=g)       # 2.5-3.25 MiB
    sd[f"rank{rank}.bf16"] = torch.randn(512, 1024, generator=g).to(torch.bfloat16)  # 1 MiB
    sd[f"rank{rank}.counts"] = torch.randint(-2**62, 2**62, (96, 1024), generator=g,
                                             dtype=torch.int64)                    # 0.75 MiB
    sd[f"rank{rank}.step"] = torch.tensor(100 * step + rank)
    return sd


# A rank. "train": STEPS saves, each followed by sync, barrier, rank 0 rewriting `latest`, sync,
# barrier, and every rank reading `latest` and loading that step. "resume": every rank reads
# `latest` and loads that step (which must be the last one). A rank loads its own tensors, the
# replicated one and those of `peer`, a rank on the other node.
WORKER = "import torch\n" + inspect.getsource(make_state) + textwrap.dedent("""
    import datetime, os, subprocess, sys, time
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    mnt, mode, steps, wait = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    peer = (rank + world // 2) % world          # the same local rank on the other node
    latest = os.path.join(mnt, "latest")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))

    def sync():
        r = subprocess.run([sys.executable, "-m", "acpfs", "sync", mnt, "--timeout", "120"],
                           capture_output=True, text=True, timeout=180)
        if r.returncode:
            raise SystemExit(f"rank {rank}: acpfs sync failed ({r.returncode}): {r.stderr}")

    def load(step):
        want = {**make_state(step, peer), **make_state(step, rank)}
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(got, checkpoint_id=os.path.join(mnt, f"step_{step}"))
        bad = [k for k, v in want.items()
               if got[k].dtype != v.dtype or got[k].shape != v.shape or not torch.equal(got[k], v)]
        assert not bad, f"rank {rank}: step_{step} loaded, these differ from what was saved: {bad}"
        print(f"rank {rank}: step_{step} ok ({len(want)} tensors)", flush=True)

    def read_latest(want):
        with open(latest) as f:
            name = f.read()
        assert name == want, f"rank {rank}: latest holds {name!r}, not {want!r}"
        return name

    if mode == "train":
        for step in range(steps):
            dcp.save(make_state(step, rank), checkpoint_id=os.path.join(mnt, f"step_{step}"))
            sync()                   # this node's shards are in the backing
            dist.barrier()           # ... and every node's
            if rank == 0:
                with open(latest, "w") as f:        # the pointer, rewritten in place
                    f.write(f"step_{step}")
            sync()
            dist.barrier()
            # Close-to-open coherence holds within --coherence-timeout (1 s), not at once: a
            # node trusts what it knows of a directory (step_<k>, which it made and wrote into
            # itself moments ago; the root, where it saw `latest` at the previous step) for that
            # long before it looks at the backing again, so without the wait node B may not
            # find node A's shards or read the previous `latest` (docs/semantics.md, 10). Without
            # it, ranks 2 and 3 got ENOENT for `latest` at step 0 in 3 runs of 3.
            time.sleep(wait)
            load(int(read_latest(f"step_{step}").split("_")[1]))
    else:
        load(int(read_latest(f"step_{steps - 1}").split("_")[1]))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
""")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(nodes, logs: Path, mode: str, wait: float = COHERENCE_WAIT, timeout: float = 240) -> None:
    """Run WORKER as WORLD ranks, RANKS_PER_NODE inside each node; fail with every rank's
    output if one fails. The ranks are killed whatever happens: one failing rank leaves the
    others waiting in a collective."""
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(WORLD), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs, outs = [], []
    try:
        for rank in range(WORLD):
            node = nodes[rank // RANKS_PER_NODE]
            out = open(logs / f"{mode}-rank{rank}.log", "w+")
            outs.append(out)
            procs.append(node.popen(sys.executable, "-c", WORKER, str(node.mnt), mode, str(STEPS),
                                    str(wait), env={**env, "RANK": str(rank)},
                                    stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + 5:
                break        # the others had time to report; they would wait for the failed one
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        texts = []
        for out in outs:
            out.seek(0)
            texts.append(out.read())
            out.close()
    codes = [p.returncode for p in procs]
    if codes != [0] * WORLD:
        report = [f"--- rank {rank} (node {nodes[rank // RANKS_PER_NODE].name}), exit {code}:\n"
                  f"{text[-4000:]}" for rank, (code, text) in enumerate(zip(codes, texts))]
        pytest.fail(f"{mode}: ranks exited {codes} (negative: killed after {timeout:.0f} s or "
                    f"after another rank failed)\n" + "\n".join(report), pytrace=False)


def expected(step: int) -> dict[str, "torch.Tensor"]:
    sd = {}
    for rank in range(WORLD):
        sd.update(make_state(step, rank))
    return sd


def check_backing(nodes) -> None:
    back = nodes[0].backing
    assert sorted(n for n in os.listdir(back) if not n.startswith(".acpfs-")) == \
        sorted([f"step_{s}" for s in range(STEPS)] + ["latest"])
    assert (back / "latest").read_text() == f"step_{STEPS - 1}"
    for step in range(STEPS):
        d = back / f"step_{step}"
        files = sorted(os.listdir(d))
        # .metadata from rank 0 (its .metadata.tmp renamed), one data file per rank
        assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(WORLD)], f"step_{step}: {files}"
        # what every node reads through its mount is what the backing holds
        for name in files:
            data = (d / name).read_bytes()
            for node in nodes:
                assert node.path(f"step_{step}/{name}").read_bytes() == data, \
                    f"node {node.name} reads step_{step}/{name} other than the backing holds"
        # and the backing alone, loaded single-process, holds every rank's tensors exactly
        want = expected(step)
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(got, checkpoint_id=str(d), no_dist=True)
        bad = [k for k, v in want.items()
               if got[k].dtype != v.dtype or got[k].shape != v.shape or not torch.equal(got[k], v)]
        assert not bad, f"backing step_{step}: these tensors differ from what was saved: {bad}"


def check_status(nodes) -> None:
    for node in nodes:
        st = node.status()
        assert st["errors"] == [], f"node {node.name}: {st['errors']}"
        assert st["queue"]["pending_ops"] == 0 and st["queue"]["applied_seq"] == st["queue"]["last_seq"], \
            f"node {node.name}: queue {st['queue']}"
        assert st["conflicts"]["total"] == 0, f"node {node.name}: conflicts {st['conflicts']}"
        assert st["flusher_alive"] and st["journal_error"] is None, f"node {node.name}: {st}"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")   # no_dist load
def test_dcp_two_nodes_save_load_latest_and_resume_after_remount(make_nodes, tmp_path):
    nodes = make_nodes(NODES)
    run_job(nodes, tmp_path / "ranks", "train")
    for node in nodes:
        node.sync()
    time.sleep(COHERENCE_WAIT)     # both nodes read every file below: see WORKER
    check_backing(nodes)
    check_status(nodes)

    # resume: both nodes remount (their caches start empty), every rank loads `latest` again
    for node in nodes:
        node.run(*ACPFS, "umount", str(node.mnt), "--timeout", "120", timeout=200)
        assert not node.mounted()
    for node in nodes:
        node.mount()
    run_job(nodes, tmp_path / "ranks", "resume", wait=0)
    check_status(nodes)
