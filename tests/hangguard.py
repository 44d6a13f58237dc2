"""A test that hangs fails instead, with the stacks that say where it hung.

A mounted test can block for ever in a system call on a FUSE mount (a daemon that never
answers); CI then stops at its time limit with nothing to show. ``guard(test, tmp_path)``
arms a timer: after ``ACPFS_TEST_HANG_AFTER`` seconds (default 300; no test takes a tenth of
it) it prints the test's own threads (faulthandler), then the Python stacks of every
process whose command line names the test's directory (its acpfs daemons and faultfs
shims, in any mount namespace: py-spy), and then aborts their FUSE connections
(``/sys/fs/fuse/connections/N/abort``), the kernel's way to end a connection whose daemon
does not answer: every request waiting on it fails with ENOTCONN, so the test fails and
its fixtures unmount as after any failure.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

HANG_AFTER = float(os.environ.get("ACPFS_TEST_HANG_AFTER", "300"))


def _processes_of(root: Path) -> list[int]:
    """Processes whose command line names a path under ``root``."""
    key = os.fsencode(str(root).rstrip("/") + "/")   # pytest-1/ is not pytest-10/
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if key in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return found


def _fuse_connections(pid: int, root: Path) -> set[str]:
    """The FUSE connection numbers (the mount's minor device) of ``pid``'s mount namespace
    mounted under ``root``."""
    conns = set()
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                if fields[sep + 1].startswith("fuse") and \
                        fields[4].startswith(str(root).rstrip("/") + "/"):
                    conns.add(fields[2].split(":")[1])
    except (OSError, ValueError, IndexError):
        pass
    return conns


def _kernel_waits(pid: int) -> str:
    """Each thread of ``pid`` with what it waits for in the kernel (state, wchan)."""
    out = []
    try:
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                out.append(f"  thread {tid}: {state} {f.read()}")
    except OSError:
        pass
    return "\n".join(out)


def _report_and_abort(test: str, root: Path) -> None:
    err = sys.stderr
    print(f"\n=== hang guard: {test} still runs after {HANG_AFTER:g}s; its threads:", file=err)
    faulthandler.dump_traceback(file=err, all_threads=True)
    pids = _processes_of(root)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    conns: set[str] = set()
    print(f"=== hang guard: the test process in the kernel:\n{_kernel_waits(os.getpid())}",
          file=err)
    for pid in pids:
        conns |= _fuse_connections(pid, root)
        print(f"=== hang guard: process {pid} in the kernel:\n{_kernel_waits(pid)}", file=err)
        if os.path.exists(py_spy):
            try:   # --nonblocking: a process stuck in a FUSE request cannot be stopped to look
                r = subprocess.run([py_spy, "dump", "--nonblocking", "-p", str(pid)],
                                   capture_output=True, text=True, timeout=30)
                print(f"=== hang guard: process {pid}:\n{r.stdout}{r.stderr}", file=err)
            except subprocess.TimeoutExpired:
                print(f"=== hang guard: py-spy could not read process {pid}", file=err)
    conns |= _fuse_connections(os.getpid(), root)
    if conns and not os.path.exists("/sys/fs/fuse/connections/" + next(iter(conns))):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", "/sys/fs/fuse/connections"],
                       capture_output=True)
    for conn in sorted(conns):
        try:
            with open(f"/sys/fs/fuse/connections/{conn}/abort", "w") as f:
                f.write("1")
            print(f"=== hang guard: aborted FUSE connection {conn}", file=err)
        except OSError as e:
            print(f"=== hang guard: cannot abort FUSE connection {conn}: {e}", file=err)
    err.flush()


@contextmanager
def guard(test: str, root: Path) -> Iterator[None]:
    """Run the body (a test with its fixtures) under the hang guard."""
    timer = threading.Timer(HANG_AFTER, _report_and_abort, (test, root))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
