"""A ``Backing`` whose calls can be made to fail or hang, chosen per call, per path, on an event.

Every public method of ``acpfs.backing.backing.Backing`` (the only place acpfs makes system calls
on the backing), whichever of its pieces defines it, is wrapped: before the real call, the
faults injected with ``inject`` are consulted in order, and the first that matches acts. A fault matches by method name (or
any), by a substring of the call's path in the backing (names from the root joined with
``/``; calls on a descriptor have the path the descriptor was opened with), only while its
``armed`` event is set (set by default), and only for ``times`` calls (default: every).

    back = FaultyBacking(str(tmp_path / "back"))
    f = back.inject("publish", path="latest", errno=errno.EIO, times=3)   # fail 3 times
    h = back.inject("write_temp", hang=True)    # hold every upload until h.release()
    h.entered.wait(5)                           # a call is being held now
    h.release()

Every call is logged in ``calls`` as (method, path), so a test can also assert what acpfs
did to the backing.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from typing import Any

from acpfs.backing.backing import NODES_DIR, Backing, staging_dir_of
from acpfs.backing.records import NodeRecords

# methods whose result is a descriptor (or a pair of them) opened at the call's path
OPENERS = {"open_dir", "open_file", "create_temp", "create_staged", "open_staged"}
# methods on the node records of global order: their path is in the records directory
RECORDS = {n for n in vars(NodeRecords) if not n.startswith("_")}
# methods left alone: no I/O (a name), or needed to tear a test down; ``dir`` only opens
# through ``open_dir`` (wrapped: its path is the directory's) and closes what that opened
UNWRAPPED = {"staged_name", "temp_name", "is_leftover", "owns", "close", "dir"}


class Fault:
    def __init__(self, method: str | None, path: str | None, errno: int | None, hang: bool,
                 times: int | None, armed: threading.Event | None) -> None:
        self.method = method
        self.path = path
        self.errno = errno
        self.hang = hang
        self.times = times
        self.armed = armed or _always_set()
        self.hits = 0
        self.entered = threading.Event()    # a call met this fault (for hangs: is held now)
        self._released = threading.Event()

    def matches(self, method: str, path: str) -> bool:
        if self.method is not None and self.method != method:
            return False
        if self.path is not None and self.path not in path:
            return False
        if not self.armed.is_set():
            return False
        return self.times is None or self.hits < self.times

    def act(self, method: str, path: str) -> None:
        self.hits += 1
        self.entered.set()
        if self.hang:
            self._released.wait()
        if self.errno is not None:
            raise OSError(self.errno, f"{os.strerror(self.errno)} (injected into {method} {path})")

    def release(self) -> None:
        """Let held calls go on (and every later one: a released hang does not hang again)."""
        self.hang = False
        self._released.set()


def _always_set() -> threading.Event:
    e = threading.Event()
    e.set()
    return e


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def _path_of(backing: FaultyBacking, method: str, bound: inspect.BoundArguments) -> str:
    args = bound.arguments
    if method in RECORDS:     # ".acpfs-nodes/<record>", "... -> .acpfs-nodes/<new>"
        where = os.fsdecode(NODES_DIR)
        path = _join(where, os.fsdecode(args.get("name", b"")))
        return path + " -> " + _join(where, os.fsdecode(args["new"])) if "new" in args else path
    if method == "publish":   # the final name: "publish of latest"
        return _join(backing.fd_paths.get(args["dst_dfd"], ""), os.fsdecode(args["name"]))
    for key in ("fd", "src_fd", "dst_fd", "dfd"):
        if key in args and isinstance(args[key], int):
            where = backing.fd_paths.get(args[key], f"fd {args[key]}")
            if isinstance(args.get("tmpname"), bytes):
                return _join(where, os.fsdecode(args["tmpname"]))
            return where
    comps = args.get("comps") or args.get("scomps")
    parts = [os.fsdecode(c) for c in comps or ()]
    for key in ("name", "sname", "tmpname"):
        if isinstance(args.get(key), bytes):
            parts.append(os.fsdecode(args[key]))
            break
    if method == "rename":
        dst = [os.fsdecode(c) for c in args["dcomps"]] + [os.fsdecode(args["dname"])]
        return _join(*parts) + " -> " + _join(*dst)
    if method in ("create_staged", "open_staged", "remove_staged"):
        # a restaged copy's fresh name (``where`` given) is no staged file's name
        where = args.get("where") or staging_dir_of(args["tmpname"])
        return _join(os.fsdecode(where), *parts)
    return _join(*parts)


class FaultyBacking(Backing):
    def __init__(self, root: str, instance: str | None = None, dead_instance: str | None = None) -> None:
        super().__init__(root, instance, dead_instance)
        self.faults: list[Fault] = []
        self.calls: list[tuple[str, str]] = []
        self.fd_paths: dict[int, str] = {}
        self._lock = threading.Lock()

    def inject(self, method: str | None = None, *, path: str | None = None, errno: int | None = None,
               hang: bool = False, times: int | None = None,
               armed: threading.Event | None = None) -> Fault:
        if method is not None and not callable(getattr(Backing, method, None)):
            raise ValueError(f"Backing has no method {method!r}")
        if errno is None and not hang:
            raise ValueError("a fault fails (errno=...) or hangs (hang=True), or both")
        f = Fault(method, path, errno, hang, times, armed)
        with self._lock:
            self.faults.append(f)
        return f

    def clear(self) -> None:
        """Remove every fault, releasing held calls."""
        with self._lock:
            faults, self.faults = self.faults, []
        for f in faults:
            f.release()

    def _before(self, method: str, path: str) -> None:
        with self._lock:
            self.calls.append((method, path))
            fault = next((f for f in self.faults if f.matches(method, path)), None)
        if fault is not None:
            fault.act(method, path)

    def _opened(self, path: str, result: Any) -> None:
        fds = result if isinstance(result, tuple) else (result,)
        for fd in fds:
            if isinstance(fd, int):
                self.fd_paths[fd] = path


def _wrap(name: str, fn: Any) -> Any:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(self: FaultyBacking, *args: Any, **kw: Any) -> Any:
        bound = sig.bind(self, *args, **kw)
        path = _path_of(self, name, bound)
        self._before(name, path)
        result = fn(self, *args, **kw)
        if name in OPENERS and result is not None:
            self._opened(path, result)
        return result
    return wrapper


# ``Backing`` is made of pieces (acpfs/backing.py): every public method of any of them
for _name in sorted({n for cls in Backing.__mro__ if cls is not object for n in vars(cls)}):
    _fn = inspect.getattr_static(Backing, _name)
    if not _name.startswith("_") and callable(_fn) and _name not in UNWRAPPED \
            and not isinstance(_fn, staticmethod):
        setattr(FaultyBacking, _name, _wrap(_name, _fn))
