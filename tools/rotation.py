"""How many bytes an HF-style checkpoint rotation uploads, through acpfs over a slow backing.

    ./tools/rotation [--saves 10] [--keep 2] [--model-mb 24] [--slow 0.02]

Mounts acpfs over a faultfs shim (tests/faultfs.py) that answers each WRITE ``--slow``
seconds late, a stand-in for a shared store slower than the program; runs ``--saves``
saves (``step_N/model.pt``, ``step_N/trainer_state.json``, ``latest`` written under a
temporary name and renamed) removing the step ``--keep`` saves back after each
(``save_total_limit``), as fast as the program can; syncs; prints the bytes written through
the mount and the bytes the flusher published (``persisted_since_mount``), and their ratio.

Under the strict prefix (docs/semantics.md, section 4) every checkpoint that ``latest`` ever
named is uploaded once, even when it is rotated away before it landed: skipping it would
show a ``latest`` whose checkpoint never landed. Run it with PYTHONPATH pointing at another
checkout, from a neutral directory, to compare versions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from faultfs import Shim  # noqa: E402

ACPFS = [sys.executable, "-m", "acpfs"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--keep", type=int, default=2, help="save_total_limit")
    ap.add_argument("--model-mb", type=int, default=24)
    ap.add_argument("--slow", type=float, default=0.02, help="seconds each backing WRITE waits")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="acpfs-rotation-"))
    src, back, mnt = work / "src", work / "back", work / "mnt"
    for d in (src, back, mnt):
        d.mkdir()
    shim = Shim(src, back, work / "ctl")
    mounted = False
    try:
        shim.set(f"slow {a.slow} write")
        subprocess.run(ACPFS + ["mount", str(mnt), "--backing", str(back), "--cache-size",
                                f"{a.model_mb * (a.saves + 2)}M", "--cache-dir", str(work / "cache"),
                                "--log-file", str(work / "log")], check=True, capture_output=True)
        mounted = True
        model = os.urandom(1 << 20) * a.model_mb
        written = 0
        start = time.monotonic()
        for i in range(1, a.saves + 1):
            step = mnt / f"step_{i}"
            step.mkdir()
            (step / "model.pt").write_bytes(model)
            state = json.dumps({"global_step": i}).encode()
            (step / "trainer_state.json").write_bytes(state)
            (mnt / "latest.tmp").write_text(step.name)
            os.replace(mnt / "latest.tmp", mnt / "latest")
            written += len(model) + len(state) + len(step.name)
            if i > a.keep:
                shutil.rmtree(mnt / f"step_{i - a.keep}")
        program = time.monotonic() - start
        subprocess.run(ACPFS + ["sync", str(mnt), "--timeout", "1200"], check=True, capture_output=True)
        st = json.loads(os.getxattr(mnt, "user.acpfs.status"))
        published = st["persisted_since_mount"]["bytes"]
        print(f"saves {a.saves}, save_total_limit {a.keep}, model {a.model_mb} MiB, backing "
              f"WRITE +{a.slow}s; program {program:.1f}s")
        print(f"written through the mount: {written / 2**20:8.1f} MiB")
        print(f"published to the backing:  {published / 2**20:8.1f} MiB "
              f"({published / written:.2f} of it, {st['persisted_since_mount']['files']} files)")
    finally:
        if mounted:
            subprocess.run(ACPFS + ["umount", str(mnt), "--timeout", "600"], capture_output=True)
        shim.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
