"""Mount options: parsing, defaults, environment variables, and where things live on disk.

Every option of ``acpfs mount`` has an ``ACPFS_*`` environment variable (the option's name
upper-cased, dashes as underscores); the command line wins over the environment, and the
default below applies when neither names it. Each default is written here only, and the
options are read here only: ``settings`` reads those that need nothing on disk, the mount
command checks the places and builds one ``Options``, which the daemon hands whole to the
parts that read a setting. The command line's help texts take the defaults from here.
Also here: the kind of filesystem a directory is on, as far as acpfs cares
(``ram_filesystem``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import re
from typing import Any

from .errors import UsageError

# -- defaults of the options of ``acpfs mount`` (as typed: seconds, words, bytes) -------
DEFAULT_CACHE_FRACTION = 0.25   # of RAM, and at most half of the cache directory's free space
MIN_CACHE = 4 << 20
DEFAULT_FSYNC = "memory"              # --fsync: what fsync() waits for ("memory", "backing")
DEFAULT_FLUSH_WORKERS = 4             # --flush-workers: parallel uploads to the backing
DEFAULT_CACHE_FULL_TIMEOUT = 300.0    # --cache-full-timeout: seconds before ENOSPC
DEFAULT_PERSIST_OPEN_AFTER = 120.0    # --persist-open-after: seconds (0: never)
DEFAULT_COHERENCE_TIMEOUT = 1.0       # --coherence-timeout: seconds (Loader.refreshed)
DEFAULT_GLOBAL_ORDER = "on"           # --global-order ("on", "off"; peers.py)
DEFAULT_MAX_CLOCK_SKEW = 0.01         # --max-clock-skew: seconds
DEFAULT_PEER_HEARTBEAT = 1.0          # --peer-heartbeat: seconds
DEFAULT_PEER_LEASE = 30.0             # --peer-lease: seconds
DEFAULT_WATCH_INTERVAL = 1.0          # acpfs status --watch --interval: seconds
DEFAULT_PASSTHROUGH = "auto"          # --passthrough (PASSTHROUGH_MODES)
DEFAULT_BLOCK_SIZE = 64 << 10         # --block-size: bytes
DEFAULT_LOG_LEVEL = "info"            # --log-level
DEFAULT_METRICS = ""                  # --metrics HOST:PORT ("": no endpoint; parse_address)
METRICS_HOST = "127.0.0.1"            # the host of a --metrics given as ":PORT" or "PORT"
METRICS_CLIENT_TIMEOUT = 10.0         # s a scrape may take to send its request
METRICS_MAX_SCRAPES = 8               # scrapes served at once; more are closed at once
# the buckets of acpfs_close_to_durable_seconds (s): from 10 ms to 1 h
CLOSE_TO_DURABLE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                            120.0, 300.0, 600.0, 1800.0, 3600.0)
# where the cache directories and the logs are when not named (default_cache_dir,
# default_log_file)
CACHE_AREA = "/dev/shm"
ROOT_LOG_DIR = "/var/log/acpfs"
USER_STATE_DIR = "~/.local/state"     # when XDG_STATE_HOME is not set
# ``acpfs temps --older-than``
DEFAULT_TEMPS_OLDER_THAN = "1d"

LOG_LEVELS = ("debug", "info", "warning", "error")
FSYNC_CHOICES = {   # --fsync: what fsync() waits for
    "memory": "returns at once, data is in RAM",
    "backing": "waits until the file is durable in the backing directory",
}
PASSTHROUGH_MODES = ("auto", "on", "off")   # --passthrough (ACPFS_PASSTHROUGH)
DEFAULT_BACKING_CALLS = "auto"        # --backing-calls (BACKING_CALLS)
BACKING_CALLS = {   # --backing-calls: where a lookup's or an open's call to the backing runs
    "auto": "on the daemon's event loop where the backing is a local filesystem "
            "(mounttable.local_fstype), else in worker threads",
    "threads": "always in worker threads (a local disk that can stall for long)",
}
DEFAULT_IDLE_POLL = "auto"   # --idle-poll (IDLE_POLL)
IDLE_POLL = {   # --idle-poll: whether idle CPUs poll while requests arrive
    "auto": "while programs send requests, and 50 ms after, idle CPUs poll instead of "
            "halting, so the daemon's replies wake them at once (a CPU latency request of "
            "0 us; needs root)",
    "off": "idle CPUs halt as the system decides",
}
PASSTHROUGH_CHOICES = {   # --passthrough, one per mode
    "auto": "where possible",
    "on": "fail the mount where not",
    "off": "every request goes through the daemon",
}
HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


def parse_size(text: str, what: str = "size") -> int:
    """Bytes from '123', '64K', '512M', '8G', '1T' (powers of 1024) or '25%' of RAM."""
    s = str(text).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGTkmgt%]?)(?:i?[Bb])?", s)
    if not m:
        raise UsageError(f"invalid {what} {text!r}: use bytes with a K/M/G/T suffix or a percentage of RAM")
    value, unit = float(m.group(1)), m.group(2).upper()
    if unit == "%":
        if not 0 < value <= 90:
            raise UsageError(f"invalid {what} {text!r}: a percentage must be above 0 and at most 90")
        return int(total_ram() * value / 100)
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(value * mult)


def short_size(n: int) -> str:
    """``n`` bytes as ``parse_size`` reads them, in the largest unit that divides it: 65536
    is '64K'."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def safe(text: str) -> str:
    """``text`` with control characters escaped, for a line a human reads (a name holding a
    newline must not print a line of its own)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def age(s: float) -> str:
    s = int(s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def spoken(words) -> str:
    """'a, b, c or d'."""
    words = list(words)
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else "".join(words)


def total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_cache_size(cache_dir: str) -> int:
    size = int(total_ram() * DEFAULT_CACHE_FRACTION)
    try:
        st = os.statvfs(cache_dir)
        size = min(size, st.f_bavail * st.f_frsize // 2)
    except OSError:
        pass
    return max(size, MIN_CACHE)


def key_of(path: str) -> str:
    return hashlib.sha256(os.fsencode(path)).hexdigest()[:16]


def default_cache_dir(backing: str) -> str:
    """One directory per backing directory, so that a new mount finds what a dead one left."""
    return os.path.join(CACHE_AREA, f"acpfs-{os.getuid()}", key_of(backing))


RAM_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}   # statfs(2) f_type


def ram_filesystem(path: str) -> str | None:
    """"tmpfs" or "ramfs" when ``path`` is on a filesystem held in RAM (nothing there
    survives a reboot), else None (also when it cannot be told). os.statvfs has no f_type:
    statfs(2) is called through ctypes; f_type is the first field of struct statfs, a C
    long on Linux."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(512)       # more than any architecture's struct statfs
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return RAM_FILESYSTEMS.get(ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF)


def default_log_file(mountpoint: str) -> str:
    if os.geteuid() == 0:
        base = ROOT_LOG_DIR
    else:
        base = os.path.join(os.environ.get("XDG_STATE_HOME") or os.path.expanduser(USER_STATE_DIR),
                            "acpfs")
    name = mountpoint.strip("/").replace("/", "-") or "root"
    return os.path.join(base, f"{name}.log")


def env(name: str, default=None):
    return os.environ.get("ACPFS_" + name.upper().replace("-", "_"), default)


def env_flag(name: str) -> bool:
    v = env(name)
    if v is None:
        return False
    if v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if v.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise UsageError(f"invalid ACPFS_{name.upper().replace('-', '_')}={v!r}: use 1 or 0")


# -- the options of a mount, built once ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Options:
    """Everything ``acpfs mount`` was asked for, from the command line, the environment and
    the defaults above: built once by the command (``settings`` and the places it checked on
    disk) and handed whole to the daemon and the parts that read a setting."""
    mountpoint: str
    backing: str
    cache_dir: str
    cache_size: int
    log_file: str
    fsync_backing: bool = DEFAULT_FSYNC == "backing"
    flush_workers: int = DEFAULT_FLUSH_WORKERS
    log_level: str = DEFAULT_LOG_LEVEL
    allow_other: bool = False
    noexec: bool = False
    mlock: bool = False
    foreground: bool = False
    cache_full_timeout: float = DEFAULT_CACHE_FULL_TIMEOUT
    persist_open_after: float = DEFAULT_PERSIST_OPEN_AFTER
    coherence_timeout: float = DEFAULT_COHERENCE_TIMEOUT
    block_size: int = DEFAULT_BLOCK_SIZE
    global_order: bool = DEFAULT_GLOBAL_ORDER == "on"
    max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW
    peer_heartbeat: float = DEFAULT_PEER_HEARTBEAT
    peer_lease: float = DEFAULT_PEER_LEASE
    passthrough: str = DEFAULT_PASSTHROUGH   # PASSTHROUGH_MODES
    backing_calls: str = DEFAULT_BACKING_CALLS   # BACKING_CALLS
    idle_poll: str = DEFAULT_IDLE_POLL       # IDLE_POLL
    metrics: str = DEFAULT_METRICS           # --metrics HOST:PORT, "" for none
    peers_listen: str = ""                   # --peers-listen HOST:PORT, "" for no peer plane
    replicas: int = 0                        # --replicas: other nodes holding unsaved changes
    replica_budget: int = 0                  # --replica-budget: bytes held for others (0: a
                                             # quarter of the cache size)
    replica_wait: bool = False               # --replica-wait: close() waits for the copy

    def as_status(self) -> dict[str, Any]:
        """The options the status document shows (docs/status.md, ``options``)."""
        return {"fsync": "backing" if self.fsync_backing else "memory",
                "flush_workers": self.flush_workers,
                "cache_full_timeout_s": self.cache_full_timeout,
                "persist_open_after_s": self.persist_open_after,
                "coherence_timeout_s": self.coherence_timeout,
                "backing_calls": self.backing_calls, "idle_poll": self.idle_poll}


# -- reading the options -------------------------------------------------------------------
def int_env(name: str, default: int) -> int:
    v = env(name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise UsageError(f"invalid ACPFS_{name.upper()}={v!r}: not an integer") from None


def float_env(name: str, default: float) -> float:
    v = env(name)
    if v is None:
        return default
    try:
        return seconds(v)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"invalid ACPFS_{name.upper()}={v!r}: {e}") from None


def seconds(text: str) -> float:
    """A number of seconds (argparse type): finite, or the option is refused."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"not a finite number of seconds: {text!r}")
    return v


def text_setting(a: Any, name: str, default: str) -> str:
    """An option as typed: on the command line, else in its ACPFS_* variable, else
    ``default`` (an empty value counts as none)."""
    return getattr(a, name) or env(name) or default


def seconds_setting(a: Any, name: str, default: float) -> float:
    """A number of seconds: on the command line, else in its ACPFS_* variable, else
    ``default``."""
    value = getattr(a, name)
    return value if value is not None else float_env(name, default)


def settings(a: Any) -> dict[str, Any]:
    """The fields of ``Options`` that need nothing on disk, from the command line (``a``,
    an ``Any`` of ``acpfs mount``), the environment and the defaults above;
    checked in the order of the options' help. A bad value is a ``UsageError``."""
    fsync = text_setting(a, "fsync", DEFAULT_FSYNC)
    if fsync not in FSYNC_CHOICES:
        raise UsageError(f"invalid --fsync {fsync!r}: use 'memory' or 'backing'")
    workers = a.flush_workers if a.flush_workers is not None \
        else int_env("flush_workers", DEFAULT_FLUSH_WORKERS)
    if not 1 <= workers <= 64:
        raise UsageError("--flush-workers must be between 1 and 64")
    level = text_setting(a, "log_level", DEFAULT_LOG_LEVEL).lower()
    if level not in LOG_LEVELS:
        raise UsageError(f"invalid --log-level {level!r}: use {spoken(LOG_LEVELS)}")
    settings = dict(fsync_backing=fsync == "backing", flush_workers=workers, log_level=level,
                    **timeout_settings(a))
    order = text_setting(a, "global_order", DEFAULT_GLOBAL_ORDER)
    if order not in ("on", "off"):
        raise UsageError(f"invalid --global-order {order!r}: use 'on' or 'off'")
    settings.update(global_order=order == "on", **peer_settings(a))
    block_size_text = a.block_size or env("block_size")
    block_size = parse_size(block_size_text, "block size") if block_size_text else DEFAULT_BLOCK_SIZE
    if block_size < 4096 or block_size & (block_size - 1) or block_size > (16 << 20):
        raise UsageError("--block-size must be a power of two between 4K and 16M")
    foreground = a.foreground or env_flag("foreground")
    pt_mode = text_setting(a, "passthrough", DEFAULT_PASSTHROUGH).lower()
    if pt_mode not in PASSTHROUGH_MODES:
        raise UsageError(f"invalid --passthrough {pt_mode!r}: use auto, on or off")
    calls = text_setting(a, "backing_calls", DEFAULT_BACKING_CALLS).lower()
    if calls not in BACKING_CALLS:
        raise UsageError(f"invalid --backing-calls {calls!r}: use auto or threads")
    idle = text_setting(a, "idle_poll", DEFAULT_IDLE_POLL).lower()
    if idle not in IDLE_POLL:
        raise UsageError(f"invalid --idle-poll {idle!r}: use auto or off")
    settings.update(block_size=block_size, foreground=foreground, passthrough=pt_mode,
                    backing_calls=calls, idle_poll=idle)
    metrics = text_setting(a, "metrics", DEFAULT_METRICS).strip()
    if metrics:
        parse_address(metrics)
    settings.update(metrics=metrics)
    peers = text_setting(a, "peers_listen", "").strip()
    if peers:
        host, sep, port = peers.rpartition(":")
        if not sep or not host.strip("[]") or not port.isdigit() or int(port) > 65535:
            raise UsageError(f"invalid --peers-listen {peers!r}: use HOST:PORT or [IPV6]:PORT "
                             "(port 0: any free port)")
        if not settings["global_order"]:
            raise UsageError("--peers-listen needs global order: the nodes find each other's "
                             "peer plane in the node records (drop --global-order off)")
    settings.update(peers_listen=peers, **replica_settings(a, peers))
    return settings


def replica_settings(a: Any, peers: str) -> dict[str, int]:
    """--replicas and --replica-budget (cluster/replicate.py, cluster/replicas.py)."""
    text = text_setting(a, "replicas", "0").strip()
    if text not in ("0", "1"):
        raise UsageError(f"invalid --replicas {text!r}: use 0 or 1 (one other node holds a "
                         "copy of what this node has not persisted)")
    if text == "1" and not peers:
        raise UsageError("--replicas 1 needs --peers-listen: replicas travel over the peer plane")
    budget_text = (text_setting(a, "replica_budget", "") or "").strip()
    budget = parse_size(budget_text, "replica budget") if budget_text else 0
    wait = getattr(a, "replica_wait", None)
    wait = env_flag("replica_wait") if wait is None else wait
    if wait and text != "1":
        raise UsageError("--replica-wait needs --replicas 1")
    return {"replicas": int(text), "replica_budget": budget, "replica_wait": wait}


def timeout_settings(a: Any) -> dict[str, float]:
    """--cache-full-timeout, --persist-open-after and --coherence-timeout."""
    full_timeout = seconds_setting(a, "cache_full_timeout", DEFAULT_CACHE_FULL_TIMEOUT)
    persist_open = seconds_setting(a, "persist_open_after", DEFAULT_PERSIST_OPEN_AFTER)
    coherence = seconds_setting(a, "coherence_timeout", DEFAULT_COHERENCE_TIMEOUT)
    if persist_open < 0 or full_timeout < 0 or coherence < 0:
        raise UsageError("--cache-full-timeout, --persist-open-after and --coherence-timeout must "
                         "not be negative")
    return dict(cache_full_timeout=full_timeout, persist_open_after=persist_open,
                coherence_timeout=coherence)


def peer_settings(a: Any) -> dict[str, float]:
    """--max-clock-skew, --peer-heartbeat and --peer-lease (global order: peers.py)."""
    skew = seconds_setting(a, "max_clock_skew", DEFAULT_MAX_CLOCK_SKEW)
    beat = seconds_setting(a, "peer_heartbeat", DEFAULT_PEER_HEARTBEAT)
    lease = seconds_setting(a, "peer_lease", DEFAULT_PEER_LEASE)
    if not 0 <= skew <= 1:
        raise UsageError("--max-clock-skew must be between 0 and 1 second")
    if not 0.05 <= beat <= 60:
        raise UsageError("--peer-heartbeat must be between 0.05 and 60 seconds")
    if not lease >= 3 * beat:
        raise UsageError("--peer-lease must be at least 3 heartbeats (--peer-heartbeat)")
    return dict(max_clock_skew=skew, peer_heartbeat=beat, peer_lease=lease)


def parse_address(text: str) -> tuple[str, int]:
    """(host, port) of a ``--metrics`` value: ``PORT``, ``:PORT`` (both on loopback),
    ``HOST:PORT`` or ``[IPV6]:PORT``; port 0 takes any free port (``status`` shows which)."""
    usage = (f"invalid --metrics {text!r}: use PORT or :PORT (on {METRICS_HOST}), HOST:PORT or "
             "[IPV6]:PORT")
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host = ""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise UsageError(usage)
    elif ":" in host:
        raise UsageError(f"invalid --metrics {text!r}: write an IPv6 address in brackets, "
                         "[::1]:PORT")
    elif host and not HOST_NAME.fullmatch(host):
        raise UsageError(usage)
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"invalid --metrics {text!r}: the port must be a number from 0 to 65535"
                         if port else usage)
    return host or METRICS_HOST, int(port)
