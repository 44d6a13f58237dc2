"""Real checkpoint writers on a real mount: what they read back through the mount, and the
exact bytes they find in the backing directory once ``acpfs sync`` returns.

Every test compares tensors exactly (dtype, shape and every element) both through the mount
and from the backing path, so a torn, stale, reordered or lost write fails it.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from conftest import listing

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


# -- helpers ---------------------------------------------------------------------------------

def make_state(seed: int, scale: int = 1) -> dict[str, "torch.Tensor"]:
    """A state dict of a few tensors, about 66 MiB at scale 1 (dtypes vary on purpose)."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, scale)
    return {
        "embed.weight": torch.randn(2048 * n, 2048, generator=g),                        # 16 MiB
        "layer0.weight": torch.randn(4096 * n, 2048, generator=g),                       # 32 MiB
        "layer0.bias": torch.randn(4096, generator=g),
        "layer1.weight_half": torch.randn(1024 * n, 4096, generator=g).to(torch.float16),  # 8 MiB
        "layer1.weight_bf16": torch.randn(512 * n, 4096, generator=g).to(torch.bfloat16),  # 4 MiB
        "counts": torch.randint(-2**62, 2**62, (768 * n, 1024), generator=g, dtype=torch.int64),  # 6 MiB
        "mask": torch.rand(1000, 333, generator=g) > 0.5,
        "scalar": torch.tensor(float(seed)),
    }


def small_state(seed: int) -> dict[str, "torch.Tensor"]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(512, 1024, generator=g),            # 2 MiB
        "b": torch.randn(1024, generator=g).to(torch.bfloat16),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


def assert_same(got: dict, ref: dict, where: str) -> None:
    assert set(got) == set(ref), f"{where}: keys {sorted(got)} != {sorted(ref)}"
    for k, r in ref.items():
        t = got[k]
        assert isinstance(t, torch.Tensor), f"{where}: {k} is {type(t)}"
        assert t.dtype == r.dtype, f"{where}: {k} dtype {t.dtype} != {r.dtype}"
        assert t.shape == r.shape, f"{where}: {k} shape {tuple(t.shape)} != {tuple(r.shape)}"
        assert torch.equal(t, r), f"{where}: {k} differs"


def no_temp_files(root: Path) -> list[str]:
    return [str(Path(d, n).relative_to(root)) for d, _, files in os.walk(root)
            for n in files if n.startswith(".acpfs-tmp-")]


def files_under(root: Path) -> set[str]:
    return {str(Path(d, n).relative_to(root)) for d, _, files in os.walk(root) for n in files}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- torch.save / torch.load -------------------------------------------------------------------

@pytest.mark.parametrize("cache_size", ["512M", "48M"], ids=["ram", "spill"])
def test_torch_save_load_and_mmap(make_mount, cache_size):
    """In the ``spill`` case the checkpoint is larger than the cache: it is written through to
    the backing while torch.save runs, and read back from there."""
    m = make_mount(cache_size=cache_size)
    ref = make_state(1)
    nested = {"model": ref, "epoch": 3, "note": "acpfs"}
    path = m.mnt / "model.pt"
    torch.save(nested, path)

    # back through the mount at once (from RAM)
    got = torch.load(path, weights_only=True)
    assert got["epoch"] == 3 and got["note"] == "acpfs"
    assert_same(got["model"], ref, "mount, before sync")
    got = torch.load(path, mmap=True, weights_only=True)
    assert_same(got["model"], ref, "mount mmap, before sync")
    del got

    m.sync()
    assert m.state("model.pt") == "persisted"
    assert no_temp_files(m.back) == []
    # the backing holds exactly the bytes the mount shows
    assert (m.back / "model.pt").read_bytes() == path.read_bytes()
    got = torch.load(m.back / "model.pt", weights_only=True)
    assert_same(got["model"], ref, "backing")
    got = torch.load(m.back / "model.pt", mmap=True, weights_only=True)
    assert_same(got["model"], ref, "backing mmap")
    del got

    # mmap from the mount after sync, fresh open
    got = torch.load(path, mmap=True, weights_only=True)
    assert_same(got["model"], ref, "mount mmap, after sync")
    del got

    # and after a remount, where the content can only come from the backing
    m.umount()
    m.mount()
    got = torch.load(m.mnt / "model.pt", mmap=True, weights_only=True)
    assert_same(got["model"], ref, "mount mmap, after remount")
    assert got["epoch"] == 3
    del got
    with open(m.mnt / "model.pt", "rb") as f:
        got = torch.load(f, weights_only=True)
    assert_same(got["model"], ref, "mount file object, after remount")


def test_torch_save_overwrite_same_name(mnt):
    """A second torch.save over the same name: the backing ends with the second state only."""
    a, b = small_state(10), make_state(11)
    p = mnt.mnt / "ckpt.pt"
    torch.save(a, p)
    mnt.sync()
    assert_same(torch.load(mnt.back / "ckpt.pt", weights_only=True), a, "backing v1")
    torch.save(b, p)
    assert_same(torch.load(p, mmap=True, weights_only=True), b, "mount v2")
    mnt.sync()
    assert_same(torch.load(mnt.back / "ckpt.pt", weights_only=True), b, "backing v2")
    assert (mnt.back / "ckpt.pt").read_bytes() == p.read_bytes()


# -- safetensors ------------------------------------------------------------------------------

def test_safetensors_save_load(mnt):
    ref = make_state(2)
    ref = {k: v.contiguous() for k, v in ref.items()}
    (mnt.mnt / "hf").mkdir()
    path = mnt.mnt / "hf" / "model.safetensors"
    safetensors_torch.save_file(ref, str(path), metadata={"format": "pt", "step": "7"})

    assert_same(safetensors_torch.load_file(str(path)), ref, "mount, before sync")
    mnt.sync()
    assert mnt.state("hf/model.safetensors") == "persisted"
    bpath = mnt.back / "hf" / "model.safetensors"
    assert bpath.read_bytes() == path.read_bytes()
    assert_same(safetensors_torch.load_file(str(bpath)), ref, "backing")
    from safetensors import safe_open
    with safe_open(str(bpath), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "step": "7"}
    assert_same(safetensors_torch.load_file(str(path)), ref, "mount, after sync")
    assert no_temp_files(mnt.back) == []


# -- torch.distributed.checkpoint ---------------------------------------------------------------

def test_distributed_checkpoint_gloo(make_mount, tmp_path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    m = make_mount(cache_size="512M")
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        ref = make_state(3)
        extra = {"step": torch.tensor(1234), "lr": torch.tensor(3e-4, dtype=torch.float64)}
        sd = {"model": {k: v.clone() for k, v in ref.items()}, "extra": {k: v.clone() for k, v in extra.items()}}
        ck = m.mnt / "dcp" / "step_100"
        dcp.save(sd, checkpoint_id=str(ck))
        dist.barrier()
        assert (ck / ".metadata").exists()

        def blank() -> dict:
            return {"model": {k: torch.zeros_like(v) for k, v in ref.items()},
                    "extra": {k: torch.zeros_like(v) for k, v in extra.items()}}

        # load through the mount (from the cache)
        out = blank()
        dcp.load(out, checkpoint_id=str(ck))
        assert_same(out["model"], ref, "dcp mount")
        assert_same(out["extra"], extra, "dcp mount extra")

        m.sync()
        back = m.back / "dcp" / "step_100"
        assert files_under(back) == files_under(ck), "backing and mount hold different files"
        assert ".metadata" in files_under(back)
        assert not any(n.endswith(".tmp") for n in files_under(back))
        for rel in files_under(ck):
            assert (back / rel).read_bytes() == (ck / rel).read_bytes(), rel
        out = blank()
        dcp.load(out, checkpoint_id=str(back))
        assert_same(out["model"], ref, "dcp backing")
        assert_same(out["extra"], extra, "dcp backing extra")
        assert no_temp_files(m.back) == []
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


# -- HF Trainer / DeepSpeed style ------------------------------------------------------------------

def test_trainer_style_rotation_and_latest(mnt):
    """checkpoint-N dirs with several files, ``latest`` rewritten in place, old ones rmtree'd."""
    keep = 2
    steps = [100, 200, 300, 400, 500]
    states = {}
    mode_cycle = ["w", "r+", "w", "r+", "w"]
    for i, step in enumerate(steps):
        d = mnt.mnt / f"checkpoint-{step}"
        d.mkdir()
        st = small_state(step)
        states[step] = st
        safetensors_torch.save_file(st, str(d / "model.safetensors"))
        torch.save({"exp_avg": st["w"] * 2, "step": step}, d / "optimizer.pt")
        torch.save({"python": step, "torch": torch.get_rng_state()}, d / "rng_state.pth")
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": [step] * 50}))
        ds = d / f"global_step{step}"
        ds.mkdir()
        torch.save({"module": st}, ds / "mp_rank_00_model_states.pt")
        # DeepSpeed-style ``latest`` in place, alternating the two ways writers do it
        tag = f"checkpoint-{step}"
        latest = mnt.mnt / "latest"
        if mode_cycle[i] == "r+" and latest.exists():
            with open(latest, "r+") as f:
                f.seek(0)
                f.write(tag)
                f.truncate()
        else:
            with open(latest, "w") as f:
                f.write(tag)
        assert latest.read_text() == tag
        # rotation (save_total_limit)
        kept = sorted((p for p in mnt.mnt.iterdir() if p.name.startswith("checkpoint-")),
                      key=lambda p: int(p.name.split("-")[1]))
        for old in kept[:-keep]:
            shutil.rmtree(old)

    want_kept = [f"checkpoint-{s}" for s in steps[-keep:]]
    assert sorted(os.listdir(mnt.mnt)) == sorted(want_kept + ["latest"])
    mnt.sync()
    assert listing(mnt.back) == sorted(want_kept + ["latest"])
    assert (mnt.back / "latest").read_text() == f"checkpoint-{steps[-1]}"
    assert no_temp_files(mnt.back) == []
    for name in want_kept:
        step = int(name.split("-")[1])
        d = mnt.back / name
        assert files_under(d) == {"model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json",
                                  f"global_step{step}/mp_rank_00_model_states.pt"}
        assert_same(safetensors_torch.load_file(str(d / "model.safetensors")), states[step], f"{name} st")
        opt = torch.load(d / "optimizer.pt", weights_only=True)
        assert opt["step"] == step and torch.equal(opt["exp_avg"], states[step]["w"] * 2)
        assert torch.load(d / "rng_state.pth", weights_only=True)["python"] == step
        assert json.loads((d / "trainer_state.json").read_text())["global_step"] == step
        assert_same(torch.load(d / f"global_step{step}" / "mp_rank_00_model_states.pt",
                               weights_only=True)["module"], states[step], f"{name} ds")
        # the mount and the backing agree byte for byte
        for rel in files_under(d):
            assert (d / rel).read_bytes() == (mnt.mnt / name / rel).read_bytes(), rel


# -- Megatron style --------------------------------------------------------------------------------

def test_megatron_style_tracker_replace(make_mount):
    m = make_mount(mount=False, cache_size="512M")
    # a run being resumed: iteration 0 and its tracker exist in the backing already
    d0 = m.back / "iter_0000000" / "mp_rank_00"
    d0.mkdir(parents=True)
    torch.save({"model": small_state(0), "iteration": 0}, d0 / "model_optim_rng.pt")
    (m.back / "latest_checkpointed_iteration.txt").write_text("0")
    m.mount()
    tracker = m.mnt / "latest_checkpointed_iteration.txt"
    assert tracker.read_text() == "0"

    states = {0: small_state(0)}
    for it in (10, 20, 30):
        st = make_state(it) if it == 20 else small_state(it)
        states[it] = st
        for rank in ("mp_rank_00", "mp_rank_01"):
            d = m.mnt / f"iter_{it:07d}" / rank
            d.mkdir(parents=True)
            torch.save({"model": st, "iteration": it, "rank": rank}, d / "model_optim_rng.pt")
        tmp = m.mnt / "latest_checkpointed_iteration.txt.tmp"
        with open(tmp, "w") as f:
            f.write(str(it))
        os.replace(tmp, tracker)
        assert tracker.read_text() == str(it)
        assert not tmp.exists()
        got = torch.load(m.mnt / f"iter_{it:07d}" / "mp_rank_01" / "model_optim_rng.pt", weights_only=True)
        assert_same(got["model"], st, f"mount iter {it}")

    m.sync()
    assert (m.back / "latest_checkpointed_iteration.txt").read_text() == "30"
    assert not (m.back / "latest_checkpointed_iteration.txt.tmp").exists()
    assert no_temp_files(m.back) == []
    assert listing(m.back) == ["iter_0000000", "iter_0000010", "iter_0000020", "iter_0000030",
                                         "latest_checkpointed_iteration.txt"]
    for it, st in states.items():
        ranks = ("mp_rank_00",) if it == 0 else ("mp_rank_00", "mp_rank_01")
        assert sorted(os.listdir(m.back / f"iter_{it:07d}")) == list(ranks)
        for rank in ranks:
            got = torch.load(m.back / f"iter_{it:07d}" / rank / "model_optim_rng.pt", weights_only=True)
            assert got["iteration"] == it
            assert_same(got["model"], st, f"backing iter {it} {rank}")
