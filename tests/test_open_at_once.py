"""OPENs of readers, FLUSH and RELEASE answered without a coroutine (core/opennow.py,
acpfs/fuse/_atonce.c) keep every promise an open and a close make (docs/semantics.md, section 10): each open reads the version
the backing or this mount holds at that moment, whole; an open held while the file is
replaced (another program's rename in the backing, a rename on this mount) keeps the
version it opened.

Checked against a reference model with random operations and random hold points: another
program replaces files in the backing, this mount rewrites them, readers open, hold, read
and close, and pauses let the daemon keep what was read (so opens meet files in the cache,
files passed through to their backing file, and files being kept). The coherence timeout is
an hour: only the check at each open can make a fresh open right.

On the passthrough path with a local backing most of those opens are answered at once
(``status``: ``at_once``), and on both paths the closes (FLUSH, RELEASE); on the daemon's
path (./tools/test-daemon-path) no OPEN is, and the same model holds.
"""

from __future__ import annotations

import os
import random
import time

import pytest

FILES = 4
STEPS = 160


def put(m, rel: str, data: bytes) -> None:
    """Another program replaces ``rel`` in the backing, atomically."""
    tmp = m.back / (rel + ".other")
    tmp.write_bytes(data)
    os.replace(tmp, m.back / rel)


def read_fd(fd: int) -> bytes:
    out, off = [], 0
    while True:
        piece = os.pread(fd, 1 << 20, off)
        if not piece:
            return b"".join(out)
        out.append(piece)
        off += len(piece)


@pytest.mark.parametrize("seed", [1, 2])
def test_opens_read_the_version_of_their_moment_against_a_model(make_mount, seed):
    rng = random.Random(seed)
    m = make_mount(extra=("--coherence-timeout", "3600"))
    names = [f"f{i}.bin" for i in range(FILES)]
    model: dict[str, bytes] = {}
    mine: set[str] = set()   # rewritten through the mount since the last sync

    def fresh(name: str) -> bytes:
        return f"{name} {rng.random()} ".encode() * rng.choice([1, 300, 20000])

    for name in names:
        model[name] = fresh(name)
        put(m, name, model[name])
    held: list[tuple[int, str, bytes]] = []   # (fd, name, the version it opened)
    try:
        for step in range(STEPS):
            op = rng.choices(["other", "write", "read", "hold", "check", "close", "pause"],
                             [14, 8, 30, 12, 14, 10, 4])[0]
            name = rng.choice(names)
            where = f"seed {seed}, step {step}: {op} {name}"
            if op == "other":
                if name in mine:   # another writer after this mount's own change landed
                    m.sync(name)
                    mine.discard(name)
                model[name] = fresh(name)
                put(m, name, model[name])
            elif op == "write":
                model[name] = fresh(name)
                if any(h[1] == name for h in held) or rng.random() < 0.5:
                    # replaced by a rename (as checkpoints are saved): held opens keep theirs
                    (m.mnt / (name + ".tmp")).write_bytes(model[name])
                    os.replace(m.mnt / (name + ".tmp"), m.mnt / name)
                else:   # rewritten in place, nothing open on it (an open would see it)
                    (m.mnt / name).write_bytes(model[name])
                mine.add(name)
            elif op == "read":
                assert (m.mnt / name).read_bytes() == model[name], where
            elif op == "hold" and len(held) < 4:
                fd = os.open(m.mnt / name, os.O_RDONLY)
                held.append((fd, name, model[name]))
                assert os.pread(fd, 64, 0) == model[name][:64], where
            elif op == "check" and held:
                fd, held_name, version = rng.choice(held)
                assert read_fd(fd) == version, f"{where}: a held open of {held_name} changed"
            elif op == "close" and held:
                fd, held_name, version = held.pop(rng.randrange(len(held)))
                assert read_fd(fd) == version, f"{where}: a held open of {held_name} changed"
                os.close(fd)
            elif op == "pause":   # the daemon keeps what readers left (after 1 s quiet)
                time.sleep(rng.choice([0.05, 1.3]))
        for fd, held_name, version in held:
            assert read_fd(fd) == version, f"seed {seed}, end: a held open of {held_name} changed"
    finally:
        for fd, _, _ in held:
            os.close(fd)
    for name in names:
        assert (m.mnt / name).read_bytes() == model[name]
    m.sync()
    for name in names:
        assert (m.back / name).read_bytes() == model[name], "persisted: the last version"
    st = m.status()
    at_once = st["at_once"]
    assert at_once["on"], at_once
    for kind in ("open", "flush", "release"):
        assert at_once[kind]["answered"] <= st["requests"][kind], (kind, at_once)
        assert at_once[kind]["failed"] == 0, (kind, at_once)
    assert at_once["flush"]["answered"] > 0 and at_once["release"]["answered"] > 0, at_once
    opens = at_once["open"]
    if st["passthrough"]["on"] and st["backing_calls"]["where"] == "inline":
        assert opens["answered"] > 0 and opens["passed"] > 0, opens
    else:
        assert opens["answered"] == 0, opens
