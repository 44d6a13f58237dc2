"""The `peers` workload of tools/bench: N nodes of one job load the same cold checkpoint over
the latency backing (docs/benchmarks.md, "Nodes serve each other from RAM").

Each node mounts acpfs (`--peers-listen 127.0.0.1:0`) over a view of its own of one shared
directory: tests/faultfs.py, answering each READ 2 ms late as a network filesystem does, and
counting the bytes it serves. The reference is the same N readers on those views directly
(each node reading the backing itself: N views, N page caches, as N clients of one server).
The N readers are `dd bs=8M` processes started at once; the time is until the last ends.

Rows: `peers_load` (GB/s: N x size / time to the last reader), `peers_backing_x` (bytes the
views served / the file's size: the reference's is N).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

NODES = 4


def served(shims) -> int:
    time.sleep(0.5)   # faultfs writes its counts every 0.1 s
    return sum(s.counts().get("read_bytes", 0) for s in shims)


def cpu_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of every CPU since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) the process ``pid`` used so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def readers_at_once(paths: list[str], cpu: list[float] | None = None,
                    who: dict[str, list[int]] | None = None) -> tuple[float, dict[str, float]]:
    """Seconds until the last of one `dd` per path, started at once, ends (``cpu`` gets
    the share of the machine's CPU time that was busy meanwhile), and the CPU seconds each
    group of ``who`` (a name -> its processes) and the `dd`s used meanwhile: where the two
    CPUs went."""
    who = who or {}
    before = {k: sum(cpu_seconds(p) for p in pids) for k, pids in who.items()}
    busy0, all0 = cpu_ticks()
    start = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={p}", "of=/dev/null", "bs=8M"], stderr=subprocess.DEVNULL)
             for p in paths]
    used = {"dd": 0.0}
    for p in procs:
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        used["dd"] += ru.ru_utime + ru.ru_stime
        if p.returncode != 0:
            raise RuntimeError(f"dd of {p.args[1]} failed ({p.returncode})")
    took = time.perf_counter() - start
    busy1, all1 = cpu_ticks()
    for k, pids in who.items():
        used[k] = sum(cpu_seconds(p) for p in pids) - before[k]
    if cpu is not None:
        cpu.append(round((busy1 - busy0) / max(1, all1 - all0), 2))
    used["machine"] = (busy1 - busy0) / os.sysconf("SC_CLK_TCK")
    return took, {k: round(v, 2) for k, v in used.items()}


def run(bench, t, rep: int, make_mount: Callable[..., object], record: Callable[..., None],
        fill: Callable[[str, int, bytes], None]) -> dict:
    """One repetition for target ``t`` (acpfs or acpfs-daemon): returns what the views served
    to each, for the report's extras."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from faultfs import Shim
    size = bench.args.size
    base = os.path.join(bench.tmp, f"peers-{t.name}-r{rep}")
    src = os.path.join(bench.bdir, f"peers-src-{t.name}-r{rep}")
    os.makedirs(src)
    block = os.urandom(1 << 20)
    for name in ("ckpt.bin", "ckpt-direct.bin"):
        fill(os.path.join(src, name), size, block)
    shims, mounts = [], []
    try:
        for i in range(NODES):
            view = f"{base}-view{i}"
            os.makedirs(view)
            shim = Shim(Path(src), Path(view), Path(f"{base}-view{i}.ctl"))
            shims.append(shim)
            shim.set("slow 0.002 read")
        gb = NODES * size / 1e9
        # each node reading the backing itself
        cpu: list[float] = []
        before = served(shims)
        s, used_direct = readers_at_once([os.path.join(sh.mnt, "ckpt-direct.bin") for sh in shims],
                                         cpu, {"faultfs": [sh.proc.pid for sh in shims]})
        record("peers_load", "backing", rep, gb / s)
        record("peers_backing_x", "backing", rep, (served(shims) - before) / size)
        for i, shim in enumerate(shims):
            m = make_mount(f"{base}-mnt{i}", str(shim.mnt), i)
            m.start()
            mounts.append(m)
        deadline = time.monotonic() + 30   # every node sees every other's plane
        while any(sum(1 for p in m.status()["peers"]["peers"] if p.get("address")) < NODES - 1
                  for m in mounts):
            if time.monotonic() > deadline:
                raise RuntimeError("the nodes did not see each other's planes within 30 s")
            time.sleep(0.2)
        before = served(shims)
        who = {"faultfs": [sh.proc.pid for sh in shims]}
        who.update({f"acpfs{i}": [m.pid] for i, m in enumerate(mounts)})
        s, used = readers_at_once([os.path.join(m.root, "ckpt.bin") for m in mounts], cpu, who)
        record("peers_load", t.name, rep, gb / s)
        record("peers_backing_x", t.name, rep, (served(shims) - before) / size)
        planes = [m.status()["peer_plane"] for m in mounts]
        print(f"bench: peers rep {rep} {t.name}: {s:.1f} s, CPU s {used}, leader "
                  f"{[i for i, p in enumerate(planes) if p.get('pulled_files')]}; "
                  f"direct {used_direct}", file=sys.stderr, flush=True)
        return {"planes": planes, "cpu_busy": {"backing": cpu[0], t.name: cpu[1]},
                "cpu_seconds": {"backing": used_direct, t.name: used}}
    finally:
        for m in mounts:
            with contextlib.suppress(Exception):
                m.stop()
        for shim in shims:
            with contextlib.suppress(Exception):
                shim.set("ok")
            shim.close()
        subprocess.run(["rm", "-rf", src])
