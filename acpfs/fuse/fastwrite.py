"""How the daemon copies WRITE requests into the pool: the fast path (loading
acpfs.fuse._fastwrite before pyfuse3, and its state) and non-temporal copies.

pyfuse3 hands each WRITE to Python as a fresh ``bytes`` copy of libfuse's buffer; the C
extension (acpfs/fuse/_fastwrite.c) lets ``operations.Operations.write_now`` copy straight from that
buffer into the pool instead. It works by defining ``fuse_session_new`` in a library loaded
RTLD_GLOBAL, so it must be loaded before pyfuse3 is: ``acpfs.fuse.operations`` imports this module first.

Everything degrades to pyfuse3's own path (and says so in the log and in ``status``) when
the extension is not built, pyfuse3 was imported before it, or the hook was not reached.

The extension also asks the kernel for shared mmap of direct_io files (its INIT exchange):
only where granted (``direct_io_mmap``) do writers, and readers of cached files, skip the page
cache: elsewhere shared writable mappings of their files would fail with ENODEV.

Copies into the pool are large (up to 1 MiB per WRITE) and not read again soon, so the
daemon copies with non-temporal stores: glibc's memcpy uses them from NT_THRESHOLD up (its
default, ~3/8 of the L3 cache, is far above a request). glibc reads GLIBC_TUNABLES only when
a process starts, and the daemon is forked from the ``mount`` command, so that command runs
itself again with the tunable set (``reexec_for_copies``).
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType
from typing import Callable, Optional

log = logging.getLogger(__name__)

# requests answered at once read per trip through pyfuse3's loop, and how long to poll the
# device for the next one (acpfs/fuse/_burst.c; ACPFS_BURST=1 turns bursts off)
BURST_REQUESTS = 64
BURST_POLL_US = 50

# --idle-poll: the CPU latency request held while requests arrive (acpfs/fuse/_idlepoll.c),
# and how long after the last request it is let go
IDLE_POLL_DEVICE = "/dev/cpu_dma_latency"
IDLE_POLL_TAIL_MS = 50

NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
NT_THRESHOLD = 256 << 10
REEXEC_MARK = "ACPFS_REEXECUTED"   # set in the rerun: never run again twice


def _load() -> tuple[Optional[ModuleType], str]:
    if os.environ.get("ACPFS_NO_FAST_WRITE"):
        return None, "disabled by ACPFS_NO_FAST_WRITE"
    if "pyfuse3" in sys.modules:
        return None, "pyfuse3 was imported before acpfs.fuse.fastwrite"
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_GLOBAL)
    try:
        from acpfs.fuse import _fastwrite
    except ImportError as e:
        return None, f"acpfs.fuse._fastwrite is not built ({e})"
    finally:
        sys.setdlopenflags(flags)
    return _fastwrite, ""


_ext, _why_not = _load()


def install(handler: Callable[[int, int, memoryview], Optional[int]],
            fallocate: Callable[[int, int, int, int], int] | None = None,
            at_once: dict[str, Callable[..., object]] | None = None) -> bool:
    """After pyfuse3.init: route WRITEs through ``handler``, FALLOCATEs through
    ``fallocate`` (pyfuse3 has no handler for them), and read-only OPENs, FLUSH and RELEASE
    through ``at_once["open"]``, ``["flush"]`` and ``["release"]`` first
    (acpfs/fuse/_atonce.c; not with ACPFS_NO_AT_ONCE=1); False (and why, logged) if
    unavailable: then fallocate fails with EOPNOTSUPP and those requests take pyfuse3's
    path."""
    global _why_not
    if _ext is None:
        log.info("fast write path off: %s; writes take pyfuse3's path", _why_not)
        return False
    if not _ext.stats()["sessions_hooked"]:
        _why_not = "pyfuse3's FUSE session was not created through the hook"
        log.warning("fast write path off: %s; writes take pyfuse3's path", _why_not)
        return False
    _ext.set_handler(handler)
    if fallocate is not None:
        _ext.set_fallocate_handler(fallocate)
    if not os.environ.get("ACPFS_NO_AT_ONCE"):
        for kind, fn in (at_once or {}).items():
            _ext.set_at_once(kind, fn)
    _ext.burst_config(_setting("ACPFS_BURST", BURST_REQUESTS),
                      _setting("ACPFS_BURST_POLL_US", BURST_POLL_US) * 1000)
    return True


_idle_why_not = "not asked for"


def start_idle_poll(mode: str) -> bool:
    """``--idle-poll auto``: while requests arrive, idle CPUs poll instead of halting
    (acpfs/fuse/_idlepoll.c; docs/design.md, "Idle CPUs poll while requests arrive");
    whether it is on. Off (and why, logged at INFO) with ``off``, without the extension, or
    where the daemon may not open /dev/cpu_dma_latency (only root may)."""
    global _idle_why_not
    if mode == "off":
        _idle_why_not = "off (--idle-poll off)"
    elif _ext is None:
        _idle_why_not = f"needs the C extension ({_why_not})"
    else:
        try:
            _ext.idle_poll_start(IDLE_POLL_DEVICE, IDLE_POLL_TAIL_MS * 1_000_000)
            _idle_why_not = ""
        except OSError as e:
            _idle_why_not = f"cannot open {IDLE_POLL_DEVICE} ({e.strerror}; only root may)"
    if _idle_why_not:
        log.info("idle CPUs halt between requests: %s", _idle_why_not)
        return False
    log.info("idle CPUs poll while requests arrive, until %d ms after the last (%s held at 0 us)",
             IDLE_POLL_TAIL_MS, IDLE_POLL_DEVICE)
    return True


def stop_idle_poll() -> None:
    """The daemon is done serving: let go of the latency request."""
    if _ext is not None and not _idle_why_not:
        _ext.idle_poll_stop()


def idle_poll_state() -> dict:
    """For ``acpfs status`` (``idle_poll``, docs/status.md)."""
    if _idle_why_not:
        return {"on": False, "why_not": _idle_why_not}
    s = _ext.idle_poll_stats()
    return {"on": s["on"], "held": s["held"], "holds": s["holds"],
            "held_s": round(s["held_s"], 3), "tail_ms": s["tail_ns"] // 1_000_000,
            "errors": s["errors"]}


def _setting(name: str, default: int) -> int:
    """A whole number from the environment, or ``default`` (logged where it is not one)."""
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        log.warning("%s=%r is not a whole number; using %d", name, raw, default)
        return default


def at_once_state() -> dict:
    """For ``acpfs status`` (``at_once``): per kind (lookup, create, unlink, open, flush, release, read), whether
    the extension offers it to Python without a coroutine, and how many were answered so,
    passed on to pyfuse3 (``passed``) or answered with an error (``failed``); and the bursts
    (acpfs/fuse/_burst.c): how many requests were read past pyfuse3's (``extra``), how many
    of those the poll caught, and the time spent polling."""
    if _ext is None:
        return {"on": False}
    kinds = _ext.at_once_stats()
    b = _ext.burst_stats()
    burst = {"on": b["max_requests"] > 1, "max_requests": b["max_requests"],
             "poll_us": b["poll_ns"] // 1000, "bursts": b["bursts"], "extra": b["extra"],
             "caught": b["caught"], "polled_s": round(b["polled_ns"] / 1e9, 3)}
    return {"on": any(k["on"] for k in kinds.values()), **kinds, "burst": burst}


def last_request() -> float:
    """time.monotonic() when the last request other than READ, WRITE and FORGET was
    dispatched, those answered in C too (0.0 without the extension; _burst.c)."""
    return _ext.burst_last_request() if _ext is not None else 0.0


def extension() -> Optional[ModuleType]:
    """The C extension, if it is loaded and can hook the session (passthrough.py uses it)."""
    return _ext


def ask_passthrough(depth: int) -> None:
    """Before the mount: the INIT reply asks for FUSE_PASSTHROUGH with this stack depth."""
    if _ext is not None:
        _ext.set_passthrough(depth)


def reply_noflush() -> None:
    """The OPEN reply sent next says FOPEN_NOFLUSH: close() of that open sends no FLUSH (a
    round trip to the daemon) where the daemon has nothing to do at close. Called as the last
    step of an OPEN handler, as ``passthrough.Kernel.reply``; without the extension, a no-op."""
    if _ext is not None:
        _ext.reply_noflush()


def direct_io_mmap() -> bool:
    """Whether files may get direct_io without losing shared mmap: the INIT reply granted
    FUSE_DIRECT_IO_ALLOW_MMAP (see acpfs/fuse/_fastwrite.c; off with ACPFS_NO_READ_DIRECT_IO=1)."""
    return _ext is not None and _ext.direct_io_mmap()


def reexec_for_copies() -> None:
    """Run this command again, as it was started, with NT_TUNABLE added to GLIBC_TUNABLES;
    not if the tunable is named there already (a value the user set is kept), on other
    machines than x86-64 (the tunable is x86's), or if this process is such a rerun."""
    import platform
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    named = any(item.partition("=")[0] == NT_TUNABLE for item in tunables.split(":"))
    if named or os.environ.get(REEXEC_MARK) or platform.machine() != "x86_64":
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(filter(None, [tunables, f"{NT_TUNABLE}={NT_THRESHOLD}"]))
    env[REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError as e:
        log.warning("cannot run %s again with %s (%s); copies stay temporal", sys.executable,
                    NT_TUNABLE, e)


def nt_threshold() -> int | None:
    """The non-temporal copy threshold in this process's GLIBC_TUNABLES (read as glibc
    does: 0x hex, 0 octal, else decimal), if one was set."""
    for item in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name == NT_TUNABLE:
            try:
                if value[:2].lower() == "0x":
                    return int(value[2:], 16)
                return int(value, 8) if value.startswith("0") and len(value) > 1 else int(value)
            except ValueError:
                return None
    return None


def state() -> dict:
    """For ``acpfs status``: whether the fast path is on, how many WRITEs took each path, and
    the non-temporal copy threshold."""
    nt = {"non_temporal_threshold": nt_threshold(), "readers_direct_io": direct_io_mmap(),
          "writers_direct_io": direct_io_mmap()}
    if _ext is None or not _ext.stats()["sessions_hooked"]:
        return {"on": False, "why_not": _why_not, **nt}
    hidden = ("sessions_hooked", "custom_io", "kernel_flags")
    return {"on": True, **{k: v for k, v in _ext.stats().items() if k not in hidden}, **nt}
