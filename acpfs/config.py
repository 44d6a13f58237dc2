"""Mount options: parsing, defaults, environment variables, and where things live on disk.

Every option of ``acpfs mount`` has an ``ACPFS_*`` environment variable (the option's name
upper-cased, dashes as underscores); the command line wins over the environment, and the
default below applies when neither names it. Each default is written here only: the command
line (its help texts too), ``daemon.Options`` and ``control.MountInfo`` take it from here.
Also here: the kind of filesystem a directory is on, as far as acpfs cares
(``ram_filesystem``).
"""

from __future__ import annotations

import hashlib
import os
import re

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
DEFAULT_PASSTHROUGH = "auto"          # --passthrough (passthrough.MODES)
DEFAULT_BLOCK_SIZE = 64 << 10         # --block-size: bytes
DEFAULT_LOG_LEVEL = "info"            # --log-level
DEFAULT_METRICS = ""                  # --metrics HOST:PORT ("": no endpoint; metrics_http.py)
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
