"""Measurement side of tools/bench: runs inside a separate Python process.

`bench_worker.py serve SIZE` holds one state dict of SIZE bytes and answers JSON commands
(one per line on stdin, one JSON answer per line on stdout), so torch is imported and the
tensors are built once per run, not once per measurement.

`bench_worker.py rank SIZE PATH FSYNC` is one of the concurrent writers of the `writers` and
`admission` workloads: it builds its shard, prints "ready", and at each "go" (or "go OTHER")
on stdin torch.saves the shard to PATH (OTHER) and prints the seconds it took.

Every timed region is measured with time.perf_counter() around the calls a user would make;
verification (comparing loaded tensors) happens outside the timed region.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

TENSOR_BYTES = 64 << 20  # 64 MiB float32 tensors


def log(*a: object) -> None:
    print("[worker]", *a, file=sys.stderr, flush=True)


def make_state_dict(size: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    sd = {}
    left = size
    i = 0
    while left > 0:
        nbytes = min(TENSOR_BYTES, left)
        n = max(1, nbytes // 4)
        sd[f"layer{i:04d}.weight"] = torch.rand(n, generator=g)
        left -= n * 4
        i += 1
    return sd


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(root, f))
        fsync_path(root)


def touch(sd) -> None:
    """Read one byte of every 4 KiB page of every tensor.

    torch.load(mmap=True) and safetensors' load_file map the file lazily; without this the
    figure would measure mmap() alone, not the reads from the target.
    """
    for v in sd.values():
        v.reshape(-1).view(torch_uint8())[::4096].sum()


def torch_uint8():
    import torch

    return torch.uint8


def same(a, b) -> bool:
    import torch

    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) for k in a)


def small_files(path: str, n: int, data: bytes, fsync: bool = False, unlink: bool = True,
                per_dir: int = 0) -> dict:
    """Create, write ``data`` into and close ``n`` files under ``path`` (``per_dir`` a
    directory, 0: all in ``path``), then stat and unlink them: seconds of each phase."""
    names = []
    dirs = set()
    for i in range(n):
        d = os.path.join(path, f"d{i // per_dir:04d}") if per_dir else path
        names.append(os.path.join(d, f"f{i:06d}"))
        dirs.add(d)
    for d in sorted(dirs):
        os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    for p in names:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
        os.close(fd)
    t1 = time.perf_counter()
    out = {"create_s": t1 - t0}
    if unlink:
        for p in names:
            os.stat(p)
        t2 = time.perf_counter()
        for p in names:
            os.unlink(p)
        t3 = time.perf_counter()
        out.update(stat_s=t2 - t1, unlink_s=t3 - t2)
    return out


def sqlite_work(path: str, mode: str = "delete", rows: int = 20000, queries: int = 2000,
                inserts: int = 300) -> dict:
    """SQLite in journal mode ``mode`` on ``path``: a table of ``rows`` rows made in one
    transaction, then ``queries`` point queries, then ``inserts`` single-row transactions:
    seconds of each phase. DELETE (the default mode): each query probes the missing
    -journal name (a hot-journal check) and reads the header; each insert makes, syncs and
    removes the journal. WAL: queries read the mapped -shm index; inserts append to and
    sync the -wal file."""
    import random
    import sqlite3

    db = os.path.join(path, f"bench-{mode}.db")
    con = sqlite3.connect(db, isolation_level=None)
    got = con.execute(f"PRAGMA journal_mode={mode}").fetchone()[0]
    if got.lower() != mode:
        raise RuntimeError(f"SQLite refused journal_mode={mode} on {path} (got {got})")
    con.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v BLOB)")
    con.execute("BEGIN")
    con.executemany("INSERT INTO t VALUES (?, ?)", ((i, b"v" * 100) for i in range(rows)))
    con.execute("COMMIT")
    rnd = random.Random(0)
    t0 = time.perf_counter()
    for _ in range(queries):
        con.execute("SELECT v FROM t WHERE k = ?", (rnd.randrange(rows),)).fetchone()
    t1 = time.perf_counter()
    for i in range(inserts):
        con.execute("INSERT INTO t VALUES (?, ?)", (rows + i, b"w" * 100))
    t2 = time.perf_counter()
    con.close()
    return {"query_s": t1 - t0, "insert_s": t2 - t1, "queries": queries, "inserts": inserts}


class Worker:
    def __init__(self, size: int) -> None:
        import torch  # noqa: F401  (import cost paid once, before any measurement)

        t = time.perf_counter()
        self.sd = make_state_dict(size)
        self.size = sum(v.numel() * v.element_size() for v in self.sd.values())
        log(f"state dict of {self.size / 2**30:.2f} GiB built in {time.perf_counter() - t:.1f}s")
        self.buf = os.urandom(1 << 20)

    # -- torch.save / torch.load ----------------------------------------------------------
    def torch_save(self, path: str, fsync: bool) -> dict:
        import torch

        t = time.perf_counter()
        torch.save(self.sd, path)
        if fsync:
            fsync_path(path)
        return {"s": time.perf_counter() - t, "bytes": os.path.getsize(path)}

    def torch_load(self, path: str, mmap: bool = False) -> dict:
        import torch

        t = time.perf_counter()
        try:
            sd = torch.load(path, mmap=mmap, weights_only=True)
            if mmap:
                touch(sd)
        except Exception as e:  # reported, not fatal: "mmap=True works" is a result
            return {"s": None, "ok": False, "error": f"{type(e).__name__}: {e}"}
        s = time.perf_counter() - t
        ok = same(sd, self.sd)
        del sd
        return {"s": s, "ok": ok}

    # -- safetensors ----------------------------------------------------------------------
    def st_save(self, path: str, fsync: bool) -> dict:
        from safetensors.torch import save_file

        t = time.perf_counter()
        save_file(self.sd, path)
        if fsync:
            fsync_path(path)
        return {"s": time.perf_counter() - t, "bytes": os.path.getsize(path)}

    def st_load(self, path: str) -> dict:
        from safetensors.torch import load_file

        t = time.perf_counter()
        sd = load_file(path)
        touch(sd)
        s = time.perf_counter() - t
        ok = same(sd, self.sd)
        del sd
        return {"s": s, "ok": ok}

    def read_file(self, path: str, piece: int = 8 << 20) -> dict:
        """read() of a whole file in ``piece``-sized pieces into one buffer (a loader that
        reads rather than maps)."""
        buf = bytearray(piece)
        n = 0
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while got := f.readinto(buf):
                n += got
        return {"s": time.perf_counter() - t, "bytes": n}

    def read_small(self, path: str) -> dict:
        """Every file of directory ``path`` (sorted): stat, open, read whole, close (a loader
        of a checkpoint made of many small files: shards, configs, tokenizer files)."""
        names = sorted(os.listdir(path))
        n = 0
        t = time.perf_counter()
        for name in names:
            p = os.path.join(path, name)
            os.stat(p)
            with open(p, "rb", buffering=0) as f:
                n += len(f.read())
        return {"s": time.perf_counter() - t, "files": len(names), "bytes": n}

    def np_memmap(self, path: str) -> dict:
        """A file mapped by np.memmap (as weight loaders of raw arrays do), every 4 KiB page
        read once: the mmap load path, without a framework's parsing."""
        import numpy as np

        t = time.perf_counter()
        arr = np.memmap(path, dtype=np.uint8, mode="r")
        int(arr[::4096].sum())
        n = arr.size
        del arr
        return {"s": time.perf_counter() - t, "bytes": n}

    # -- torch.distributed.checkpoint -----------------------------------------------------
    def dcp_save(self, path: str, fsync: bool) -> dict:
        import torch.distributed.checkpoint as dcp

        t = time.perf_counter()
        # sync_files=True is DCP's default: it fsyncs every file it writes, on every target.
        dcp.save(self.sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True)
        return {"s": time.perf_counter() - t}

    def dcp_load(self, path: str) -> dict:
        import torch
        import torch.distributed.checkpoint as dcp

        target = {k: torch.empty_like(v) for k, v in self.sd.items()}
        t = time.perf_counter()
        dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        s = time.perf_counter() - t
        ok = same(target, self.sd)
        del target
        return {"s": s, "ok": ok}

    # -- write 1 MiB at a time, close, wait until durable ---------------------------------
    def write_close(self, path: str, size: int, fsync: bool, poll: str | None,
                    backing_path: str | None, sync_cmd: list | None, timeout: float = 900) -> dict:
        """Write SIZE bytes with 1 MiB write()s, time close() alone, then time until durable.

        poll="acpfs": poll user.acpfs.state of the file every ms until "persisted", while
        `sync_cmd` (`acpfs sync MOUNT`, started right after close) drains the mount.
        poll="rclone": poll the file in the backing until it has full size and its last MiB.
        """
        buf = self.buf
        n = size // len(buf)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, buf)
        if fsync:
            os.fsync(fd)
        t1 = time.perf_counter()
        os.close(fd)
        t2 = time.perf_counter()
        out = {"write_s": t1 - t0, "close_s": t2 - t1, "bytes": n * len(buf)}
        deadline = t2 + timeout
        if poll == "acpfs":
            proc = subprocess.Popen(sync_cmd) if sync_cmd else None
            while os.getxattr(path, "user.acpfs.state") != b"persisted":
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{path} not persisted after {timeout}s")
                time.sleep(0.001)
            out["durable_s"] = time.perf_counter() - t2
            if proc is not None:
                rc = proc.wait()
                out["drain_s"] = time.perf_counter() - t2
                out["drain_rc"] = rc
        elif poll == "rclone":
            want = n * len(buf)
            while True:
                try:
                    if os.stat(backing_path).st_size == want:
                        with open(backing_path, "rb") as f:
                            f.seek(want - len(buf))
                            if f.read() == buf:
                                break
                except FileNotFoundError:
                    pass
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{backing_path} incomplete after {timeout}s")
                time.sleep(0.001)
            out["durable_s"] = time.perf_counter() - t2
        return out

    def copy_fsync(self, src: str, dst: str) -> dict:
        """The baseline for flush throughput: a plain copy of the same bytes, fsynced."""
        t = time.perf_counter()
        sfd = os.open(src, os.O_RDONLY)
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = os.fstat(sfd).st_size
            while left > 0:
                k = os.sendfile(dfd, sfd, None, min(left, 1 << 30))
                if k <= 0:
                    break
                left -= k
            os.fsync(dfd)
        finally:
            os.close(dfd)
            os.close(sfd)
        return {"s": time.perf_counter() - t}

    # -- many small files -----------------------------------------------------------------
    def small(self, path: str, n: int, size: int, fsync: bool, unlink: bool = True,
              per_dir: int = 0) -> dict:
        return small_files(path, n, self.buf[:size], fsync, unlink, per_dir)

    def sqlite(self, path: str, mode: str = "delete") -> dict:
        return sqlite_work(path, mode)

    def ping(self) -> dict:
        return {"pid": os.getpid(), "size": self.size}


def serve(size: int) -> None:
    w = Worker(size)
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the protocol stream
    out.write(json.dumps({"ready": True, "size": w.size}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            res = {"ok": True, "result": getattr(w, req["cmd"])(**req.get("args", {}))}
        except Exception as e:
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(res) + "\n")
        out.flush()


def rank(size: int, path: str, fsync: bool) -> None:
    """One rank: builds its state dict, says "ready", then saves it at each "go" (to PATH)
    or "go OTHER" (to OTHER), answering each with the seconds it took, until stdin ends."""
    import torch

    sd = make_state_dict(size, seed=os.getpid())
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split(maxsplit=1)
        if not cmd or cmd[0] != "go":
            return
        target = cmd[1].strip() if len(cmd) > 1 else path
        t = time.perf_counter()
        torch.save(sd, target)
        if fsync:
            fsync_path(target)
        print(json.dumps({"s": time.perf_counter() - t}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    elif sys.argv[1] == "rank":
        rank(int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1")
    else:
        sys.exit(f"usage: {sys.argv[0]} serve SIZE | rank SIZE PATH FSYNC")
