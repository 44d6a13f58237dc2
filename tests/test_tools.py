"""The measuring tools the closing notes quote: tools/fuse_floor.py's floors, per placement."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOOR = [sys.executable, str(ROOT / "tools" / "fuse_floor.py")]


def test_fuse_floor_measures_both_floors_pinned_and_unpinned():
    """One round of 200 files: every placement the machine allows, each with /dev/shm and
    both floors, a rate for every phase, and each floor's ratio within its round; both
    mounts gone afterwards."""
    r = subprocess.run(FLOOR + ["200", "--rounds", "1"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    want = ["unpinned", "same"] + (["apart"] if len(os.sched_getaffinity(0)) > 1 else [])
    got = re.findall(r"^placement (\w+):$", r.stdout, re.M)
    assert got == want, r.stdout
    for block in r.stdout.split("placement ")[1:]:
        rows = {line.split()[0] + (" floor" if line.split()[1] == "floor" else ""): line
                for line in block.splitlines()[2:]}
        assert set(rows) == {"shm", "floor", "c floor"}, block
        assert all(float(v) > 0 for v in rows["shm"].split()[1:]), block
        for label in ("floor", "c floor"):
            ratios = re.findall(r"([0-9.]+)x \(", rows[label])
            assert len(ratios) == 3 and all(float(x) > 0 for x in ratios), block
    mounts = Path("/proc/self/mounts").read_text()
    assert "floor" not in " ".join(line.split()[0] for line in mounts.splitlines())


@pytest.mark.parametrize("args", [["--placements", "pinned"], ["--rounds", "0"], ["0"]])
def test_fuse_floor_refuses_bad_input_in_one_line(args):
    r = subprocess.run(FLOOR + args, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fuse_floor: "), r.stderr
    assert "Traceback" not in r.stderr
