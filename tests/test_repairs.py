"""Changes made to the backing behind acpfs's back never lose acknowledged data and never wedge
the flusher, on real mounts: the reproductions of what went wrong before.

- A pending file's directory is moved away (or swapped for a symlink) and the daemon is
  killed before the file landed: the next mount keeps the content aside in
  ``.acpfs-recovered/`` (ERROR in the log, listed in ``status``), where it used to be
  skipped as "already done".
- The first queued op fails (the backing refuses a mkdir) while later uploads run
  ahead; the temporary file of one of them is removed; the directory is repaired: the
  flusher writes the removed file again and ``acpfs sync`` returns, where it used to time out
  for ever on ``publish ... ENOENT``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import acpfs, gone, listing, wait_for


@pytest.mark.parametrize("how", ["moved away", "swapped for a symlink"])
def test_recovery_keeps_aside_content_whose_directory_is_gone(make_mount, faults, tmp_path, how):
    m = make_mount("m", mount=False)
    src = tmp_path / "src"
    shim = faults.shim(src, m.back)
    faults.mount(m)
    (m.mnt / "d").mkdir()
    os.listdir(m.mnt / "d")
    m.sync()
    shim.set("hang")                                   # nothing lands from here on
    (m.mnt / "d" / "f").write_bytes(b"acknowledged")   # close() returned
    os.kill(m.pid, signal.SIGKILL)
    wait_for(lambda: gone(m.pid), what="the daemon to die")
    os.rename(src / "d", src / "d.away")               # behind acpfs's back
    if how == "swapped for a symlink":
        os.symlink("d.away", src / "d")
    shim.set("ok")
    acpfs(*m.args())                                   # recovers over the stale mount
    m.pid = m.status()["pid"]
    m.sync()
    rec = m.status()["recovery"]
    assert rec is not None and len(rec["kept_aside"]) == 1, rec
    aside = rec["kept_aside"][0]
    assert aside.startswith(".acpfs-recovered/") and aside.endswith("/d%2Ff")
    assert (src / aside).read_bytes() == b"acknowledged"
    assert f"kept aside as {aside}" in m.log.read_text()
    assert "ERROR" in [line.split()[2] for line in m.log.read_text().splitlines()
                       if f"kept aside as {aside}" in line]
    assert os.listdir(src / "d.away") == []            # nothing went through a symlink


def test_a_removed_temporary_file_is_written_again_and_sync_returns(make_mount, faults, tmp_path):
    m = make_mount("m", mount=False)
    src = tmp_path / "src"
    shim = faults.shim(src, m.back)
    faults.mount(m)
    shim.set("eio mkdir")                              # the first queued op will fail
    (m.mnt / "d0").mkdir()
    (m.mnt / "d0" / "x").write_bytes(b"x")
    (m.mnt / "d1").mkdir()
    model = os.urandom(3 << 20)
    (m.mnt / "d1" / "model.pt").write_bytes(model)
    (m.mnt / "latest").write_text("d1")
    # latest's upload runs ahead of the failing op; remove its temporary file once it is
    # complete (its times are set last): removed while being written, the upload itself
    # fails (ESTALE from faultfs) and writes a new one, which is not the case tested here
    mtime = (m.mnt / "latest").stat().st_mtime_ns

    def complete_temps() -> list[str]:
        names = [n for n in os.listdir(src) if n.startswith(".acpfs-tmp-") and not n.endswith("-staging")]
        try:
            return names if names and all((src / n).read_bytes() == b"d1" and
                                          (src / n).stat().st_mtime_ns == mtime for n in names) else []
        except FileNotFoundError:
            return []
    temps = wait_for(complete_temps, what="latest's upload")
    for n in temps:
        os.unlink(src / n)
    st = m.status()
    assert st["errors"] and st["errors"][0]["path"] == "d0", st["errors"]
    shim.set("ok")                                     # repaired
    m.sync(timeout=60)                                 # used to time out for ever (ENOENT)
    assert (src / "latest").read_text() == "d1"
    assert (src / "d1" / "model.pt").read_bytes() == model
    assert (src / "d0" / "x").read_bytes() == b"x"
    assert json.loads(os.getxattr(m.mnt, "user.acpfs.status"))["errors"] == []
    assert "its temporary file is gone from the backing; writing it again" in m.log.read_text()


def test_a_backing_that_goes_away_and_comes_back(make_mount, faults, tmp_path):
    """A backing whose filesystem dies and comes back is opened again: the backing is itself a
    mount (a FUSE store here; NFS and SFS behave the same) that dies and is mounted again at the
    same path. The daemon's descriptors answer ENOTCONN; it opens the root again by path once a
    filesystem is mounted there again (never the empty directory under it meanwhile), shows it
    in status, and carries on."""
    m = make_mount("m", mount=False)
    src = tmp_path / "src"
    shim = faults.shim(src, m.back)
    faults.mount(m)
    (m.mnt / "d").mkdir()
    (m.mnt / "d" / "before").write_bytes(b"1")
    m.sync()
    shim.proc.kill()                                   # the store dies
    shim.proc.wait()
    subprocess.run(["fusermount3", "-u", "-z", str(m.back)], check=True)
    (m.mnt / "d" / "while_gone").write_bytes(b"2")     # acknowledged, waits in RAM
    time.sleep(1.5)
    assert listing(m.back) == []                    # never written under the mount point
    assert m.status()["errors"], "the failing backing does not show in status"
    faults.shim(src, m.back)                           # mounted again at the same path
    (m.mnt / "after").write_bytes(b"3")
    m.sync(timeout=60)
    assert (src / "d" / "while_gone").read_bytes() == b"2"
    assert (src / "after").read_bytes() == b"3"
    st = m.status()
    assert st["backing_reopened"]["count"] >= 1 and st["errors"] == []
    assert "went away and is back" in m.log.read_text()
    assert not [n for n in os.listdir(src) if n.startswith(".acpfs-tmp-")]
