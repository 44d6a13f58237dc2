"""Files held open for writing for a long time (training logs, event files) do not live only
in RAM: after --persist-open-after seconds, appended-only files are published as they are,
and any other file is staged in the backing without replacing its complete version."""

from __future__ import annotations

import os
import signal
import time

from conftest import acpfs, staged_files, wait_for

AGE = "1"


def test_an_appended_log_is_published_while_open(make_mount):
    m = make_mount(extra=("--persist-open-after", AGE))
    log = open(m.mnt / "train.log", "a")
    log.write("step 1 loss 2.0\n")
    log.flush()
    wait_for(lambda: (m.back / "train.log").exists())
    assert (m.back / "train.log").read_text() == "step 1 loss 2.0\n"
    log.write("step 2 loss 1.5\n")
    log.flush()
    wait_for(lambda: (m.back / "train.log").read_text().count("\n") == 2)
    assert (m.back / "train.log").read_text() == "step 1 loss 2.0\nstep 2 loss 1.5\n"
    assert m.state("train.log") in ("persisted", "flushing")
    log.write("step 3 loss 1.2\n")
    log.close()
    m.sync()
    assert (m.back / "train.log").read_text().splitlines()[-1] == "step 3 loss 1.2"


def test_a_file_rewritten_in_place_is_staged_never_published_while_open(make_mount):
    m = make_mount(extra=("--persist-open-after", AGE))
    (m.mnt / "model.bin").write_bytes(b"complete" * 1000)
    m.sync()
    f = open(m.mnt / "model.bin", "r+b")    # no O_APPEND: a partial version must not land
    f.write(b"PARTIAL!")
    f.flush()
    wait_for(lambda: any(p.stat().st_size == 8000 for p in staged_files(m.back)))
    time.sleep(1.5)
    assert (m.back / "model.bin").read_bytes() == b"complete" * 1000
    # the daemon dies with the file open: the staged content is kept aside, the old version stays
    os.kill(m.pid, signal.SIGKILL)
    try:
        f.close()
    except OSError:
        pass
    acpfs(*m.args())
    m.pid = m.status()["pid"]
    m.sync()     # kept aside in the mount at once, in the backing like any change
    rec = m.status()["recovery"]
    assert len(rec["kept_aside"]) == 1
    assert (m.back / rec["kept_aside"][0]).read_bytes() == b"PARTIAL!" + b"complete" * 999
    assert (m.back / "model.bin").read_bytes() == b"complete" * 1000


def test_a_log_truncated_then_appended_is_not_published_as_a_prefix(make_mount):
    m = make_mount(extra=("--persist-open-after", AGE))
    (m.mnt / "events").write_bytes(b"old complete run\n")
    m.sync()
    f = open(m.mnt / "events", "a")
    f.truncate(0)                           # the old content goes: a prefix rule no longer holds
    f.write("new run\n")
    f.flush()
    wait_for(lambda: staged_files(m.back))
    assert (m.back / "events").read_bytes() == b"old complete run\n"
    f.close()
    m.sync()
    assert (m.back / "events").read_bytes() == b"new run\n"
    assert not list(m.back.glob(".acpfs-tmp-*"))


def test_a_log_written_through_stays_writable_and_staged_until_closed(make_mount):
    """An appended-only log that the cache could not hold is written through to a staging
    file. Publishing it while open would hand that file to the flusher under the writer:
    it stays staged (fsynced every period), every later append succeeds, and its last close
    publishes all of it."""
    m = make_mount(cache_size="1M", extra=("--block-size", "4K", "--persist-open-after", AGE))
    (m.mnt / "run.log").write_bytes(b"first run\n")
    m.sync()
    fd = os.open(m.mnt / "run.log", os.O_WRONLY | os.O_APPEND)
    try:
        expect = bytearray(b"first run\n")
        for i in range(4):
            chunk = bytes([65 + i]) * 1_500_000    # more than the cache: written through
            assert os.write(fd, chunk) == len(chunk)
            expect += chunk
            time.sleep(1.6)                        # past --persist-open-after, more than once
        assert [p.stat().st_size for p in staged_files(m.back)] == [len(expect)]
        assert (m.back / "run.log").read_bytes() == b"first run\n"   # never a partial version
    finally:
        os.close(fd)
    m.sync()
    assert (m.back / "run.log").read_bytes() == expect
    assert m.status()["errors"] == []
