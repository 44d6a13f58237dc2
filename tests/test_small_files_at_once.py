"""LOOKUP, CREATE and UNLINK answered without a coroutine, in bursts (acpfs/fuse/atonce.py,
acpfs/fuse/_atonce.c, acpfs/fuse/_burst.c), keep what a lookup and a create promise
(docs/semantics.md, sections 1 and 10): a created file is there at once with its bytes,
``O_EXCL`` fails on a name that exists, a removed name is gone, a missing name is missing, a name another program
made in the backing is seen at the next lookup, and one it removed is gone once the kernel's
entry ran out (the coherence timeout).

Checked against a reference model with random operations and random pauses (which let the
flusher persist and the kernel's entries run out), on both data paths. ``status`` shows that
the lookups, creates and unlinks were answered at once and that requests were read in bursts.
"""

from __future__ import annotations

import errno
import os
import random
import time

import pytest

STEPS = 400
NAMES = 12


@pytest.mark.parametrize("seed", [1, 2])
def test_small_file_requests_answered_at_once_keep_the_model(make_mount, seed):
    rng = random.Random(seed)
    began = time.monotonic()   # (the handlers' time in Python is less than this test's)
    m = make_mount()
    (m.mnt / "d").mkdir()
    names = [f"f{i}" for i in range(NAMES)]
    model: dict[str, bytes] = {}
    others = 0
    for step in range(STEPS):
        op = rng.choices(["create", "excl", "stat", "read", "unlink", "probe", "other_new",
                          "other_gone", "pause"], [30, 6, 20, 14, 12, 8, 4, 2, 4])[0]
        name = rng.choice(names)
        path = m.mnt / "d" / name
        where = f"seed {seed}, step {step}: {op} {name}"
        if op in ("create", "excl"):
            data = f"{name} {step} ".encode() * rng.choice([1, 50, 1000])
            flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if op == "excl" else os.O_TRUNC)
            try:
                fd = os.open(path, flags, 0o640)
            except FileExistsError:
                assert op == "excl" and name in model, where
                continue
            assert op == "create" or name not in model, f"{where}: O_EXCL opened a name that exists"
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            model[name] = data
        elif op == "stat":
            try:
                st = os.stat(path)
            except FileNotFoundError:
                assert name not in model, where
                continue
            assert name in model and st.st_size == len(model[name]), where
            assert st.st_mode & 0o777 == 0o640 or name.startswith("o"), where
        elif op == "read":
            try:
                got = path.read_bytes()
            except FileNotFoundError:
                assert name not in model, where
                continue
            assert got == model.get(name), where
        elif op == "unlink":
            try:
                os.unlink(path)
            except FileNotFoundError:
                assert name not in model, where
                continue
            assert model.pop(name, None) is not None, where
        elif op == "probe":   # as SQLite probes its journal: never made, always missing
            assert not os.path.exists(m.mnt / "d" / f"{name}-journal"), where
        elif op == "other_new":   # another program makes a name this mount never looked up
            others += 1
            other = f"o{others}"
            m.sync()   # the directory is in the backing
            (m.back / "d" / other).write_bytes(b"from elsewhere")
            names.append(other)
            assert (m.mnt / "d" / other).read_bytes() == b"from elsewhere", where
            model[other] = b"from elsewhere"
        elif op == "other_gone" and model:   # another program removes a persisted name
            gone = rng.choice(sorted(model))
            m.sync()
            os.unlink(m.back / "d" / gone)
            del model[gone]
            time.sleep(1.2)   # the kernel's entry runs out (--coherence-timeout, 1 s)
            with pytest.raises(FileNotFoundError):
                os.stat(m.mnt / "d" / gone)
        elif op == "pause":
            time.sleep(rng.choice([0.01, 0.3]))
    assert sorted(os.listdir(m.mnt / "d")) == sorted(model), f"seed {seed}: the listing"
    for name, data in model.items():
        assert (m.mnt / "d" / name).read_bytes() == data, name
    m.sync()
    assert sorted(os.listdir(m.back / "d")) == sorted(model), f"seed {seed}: persisted"
    for name, data in model.items():
        assert (m.back / "d" / name).read_bytes() == data, f"{name}: persisted"
    st = m.status()
    at_once = st["at_once"]
    elapsed = time.monotonic() - began
    for kind in ("lookup", "create", "unlink"):
        assert at_once[kind]["answered"] > 0, (kind, at_once)
        assert at_once[kind]["answered"] <= st["requests"][kind], (kind, at_once)
        assert at_once[kind]["failed"] == 0, (kind, at_once)
    # the time each kind's handler took in Python (docs/status.md): some, and together less
    # than the test took
    assert all(at_once[k]["python_s"] > 0 for k in ("lookup", "create", "unlink", "flush",
                                                      "release")), at_once
    in_python = sum(at_once[k]["python_s"] for k in ("lookup", "create", "unlink", "open",
                                                      "flush", "release"))
    assert 0 < st["fast_write"]["python_s"] and in_python + st["fast_write"]["python_s"] < elapsed, \
        (at_once, st["fast_write"], elapsed)
    burst = at_once["burst"]
    assert burst["on"] and burst["extra"] > 0, burst


def test_errors_of_requests_answered_at_once(make_mount):
    """The errors a LOOKUP and a CREATE answered at once give are those of the kernel's
    usual path: a name too long, a name that exists, a file where a directory is needed."""
    m = make_mount()
    (m.mnt / "f").write_bytes(b"x")
    with pytest.raises(OSError) as e:
        os.stat(m.mnt / ("n" * 256))
    assert e.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as e:
        os.open(m.mnt / ("n" * 256), os.O_WRONLY | os.O_CREAT, 0o644)
    assert e.value.errno == errno.ENAMETOOLONG
    with pytest.raises(FileExistsError):
        os.open(m.mnt / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with pytest.raises(NotADirectoryError):
        os.open(m.mnt / "f" / "g", os.O_WRONLY | os.O_CREAT, 0o644)
    assert (m.mnt / "f").read_bytes() == b"x"
    assert m.status()["at_once"]["create"]["answered"] > 0


def test_directories_another_program_made_are_looked_up_at_once(make_mount):
    """A resume opens files in directories another node wrote: the directory's LOOKUP and the
    first LOOKUP in it (which lists it, Loader.loaded_now) are answered at once, and so is
    the lookup of a known directory once the kernel's entry ran out (compared with the
    backing, Loader.entry_unchanged_now). A directory replaced by a file in the backing is
    not: its lookup takes the coroutine, which finds the file."""
    m = make_mount(mount=False)
    for i in range(3):
        (m.back / f"step{i}").mkdir()
        (m.back / f"step{i}" / "model.bin").write_bytes(b"%d" % i * 1000)
    m.mount()
    before = m.status()["at_once"]["lookup"]
    for i in range(3):
        assert (m.mnt / f"step{i}" / "model.bin").read_bytes() == b"%d" % i * 1000
    (m.back / "step3").mkdir()                     # made after the mount's first listing
    (m.back / "step3" / "model.bin").write_bytes(b"new")
    assert (m.mnt / "step3" / "model.bin").read_bytes() == b"new"
    after = m.status()["at_once"]["lookup"]
    assert after["passed"] == before["passed"], (before, after)
    assert after["answered"] - before["answered"] >= 8, (before, after)
    time.sleep(m.status()["options"]["coherence_timeout_s"] + 0.2)   # the entries ran out
    os.stat(m.mnt / "step0")
    again = m.status()["at_once"]["lookup"]
    assert again["passed"] == after["passed"] and again["answered"] > after["answered"], again
    # another program replaces a directory with a file
    (m.back / "step1" / "model.bin").unlink()
    (m.back / "step1").rmdir()
    (m.back / "step1").write_bytes(b"a file now")
    time.sleep(m.status()["options"]["coherence_timeout_s"] + 0.2)
    assert (m.mnt / "step1").read_bytes() == b"a file now"
    assert m.status()["at_once"]["lookup"]["passed"] > again["passed"]
