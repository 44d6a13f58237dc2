"""A checkpointing program for the crash tests: it saves steps into a mount and logs, after
each call returns, what that call acknowledged.

Usage: crash_writer.py DIR ACK_LOG SEED    (DIR: a directory on the mount; paths are logged
relative to it)

Each step: mkdir step_N; write step_N/model.bin (sizes vary; some larger than the test's
cache, so they are written through); write step_N/meta.json; overwrite rolling.bin in place;
write latest.tmp and rename it over latest; remove the step three back. Before each change
the log gets {"begin": ...}, after it returns {"ack": ...}; the log is on another filesystem
and flushed line by line, so it survives the daemon being killed. The program stops at the
first error (the daemon is gone).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys


def content(seed: int, size: int) -> bytes:
    rnd = random.Random(seed)
    return rnd.randbytes(size)


def main() -> int:
    mount, log_path, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rnd = random.Random(seed)
    log = open(log_path, "a", buffering=1)

    def begin(op: str, path: str, data: bytes | None = None) -> None:
        log.write(json.dumps({"begin": op, "path": path,
                              "sha": hashlib.sha256(data).hexdigest() if data is not None else None}) + "\n")

    def ack(op: str, path: str, data: bytes | None = None, src: str | None = None) -> None:
        log.write(json.dumps({"ack": op, "path": path, "src": src,
                              "sha": hashlib.sha256(data).hexdigest() if data is not None else None}) + "\n")

    def write(rel: str, data: bytes) -> None:
        begin("write", rel, data)
        with open(os.path.join(mount, rel), "wb") as f:
            for off in range(0, len(data), 1 << 20):
                f.write(data[off:off + (1 << 20)])
        ack("write", rel, data)

    try:
        for step in range(1, 10_000):
            d = f"step_{step}"
            begin("mkdir", d)
            os.mkdir(os.path.join(mount, d))
            ack("mkdir", d)
            big = rnd.random() < 0.08
            size = rnd.randint(40, 56) << 20 if big else rnd.randint(1, 3 << 20)
            write(f"{d}/model.bin", content(seed * 100_000 + step, size))
            write(f"{d}/meta.json", json.dumps({"step": step}).encode())
            write("rolling.bin", content(seed * 100_000 + 50_000 + step, rnd.randint(1, 1 << 20)))
            pointer = d.encode()
            write("latest.tmp", pointer)
            begin("rename", "latest")
            os.rename(os.path.join(mount, "latest.tmp"), os.path.join(mount, "latest"))
            ack("rename", "latest", src="latest.tmp")
            old = f"step_{step - 3}"
            if step > 3:
                for name in ("model.bin", "meta.json"):
                    begin("unlink", f"{old}/{name}")
                    os.unlink(os.path.join(mount, old, name))
                    ack("unlink", f"{old}/{name}")
                begin("rmdir", old)
                os.rmdir(os.path.join(mount, old))
                ack("rmdir", old)
    except OSError as e:
        log.write(json.dumps({"error": str(e)}) + "\n")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
