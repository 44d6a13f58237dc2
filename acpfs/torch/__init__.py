"""``acpfs.torch``: torch.save/torch.load that keep working when the acpfs daemon does not.

A checkpoint saved into an acpfs mount is in RAM when ``torch.save`` returns and reaches the
backing directory a little later. If the daemon dies, hangs or was unmounted, a training job
that only calls ``torch.save`` would crash or hang. This module is the automatic fallback::

    import acpfs.torch as at

    info = at.save(model.state_dict(), "/ckpt/step_1000/model.pt")   # memory speed
    at.save("step_1000", "/ckpt/latest")
    at.wait_persisted("/ckpt/step_1000")          # True once durable in the backing
    sd = at.load("/ckpt/step_1000/model.pt", map_location="cpu", mmap=True)
    at.preload(["/ckpt/step_1000"])               # warm the cache before a resume

API
---
``save(obj, path, *, timeout=None, **torch_save_kwargs) -> Saved``
    ``torch.save(obj, ...)`` through the mount: the bytes go to ``.NAME.acpfs-save-PID-RAND``
    next to ``path`` on the mount and are renamed over ``path`` once complete (so a save that
    is abandoned while still writing, see below, never replaces ``path`` later). Missing parent directories are
    created (on the mount, or in the backing when falling back). Falls back to writing directly
    to the backing directory when

    - the path's mount is **dead** (the daemon is gone: ``ENOTCONN``/``ECONNABORTED``),
    - the mount point is **not mounted** any more but a mount record (written by every
      acpfs daemon, kept after it exits) or ``configure()`` names its backing, or
    - the save does not complete within ``timeout`` seconds (argument, else
      ``configure(timeout=...)``, else ``ACPFS_SAVE_TIMEOUT``, else 600): the daemon **hangs**.
      The timeout covers the whole save: set it above what a save may take when the cache is
      full and writers run at the backing's speed, or a slow save is written twice.

    The fallback write is atomic: ``.NAME.acpfs-fallback-PID-RAND`` in the same backing
    directory (parents created), fsynced, renamed over the final name, directory fsynced.
    A warning is logged once per mount on the ``logging`` logger ``"acpfs.torch"``. After a
    mount fell back (dead or hung), later saves of this process to that mount go straight to
    the backing; a new mount at the same place (``acpfs mount`` again) is used again.
    A path on no acpfs mount (and under no recorded or configured mount point) is saved with
    ``torch.save`` and fsynced. Returns a :class:`Saved` telling where the bytes went.

``load(path, **torch_load_kwargs)``
    ``torch.load`` from the mount; from the backing copy when the mount is dead, hung (it does
    not answer ``statvfs`` within a few seconds), not mounted, or when this process saved
    ``path`` by fallback (the mount's view of it may be older). Keyword arguments (``mmap``,
    ``weights_only``, ``map_location``, ...) pass through.

``wait_persisted(path_or_dir, timeout=None) -> True``
    Blocks until the file, or everything under the directory, is durable in the backing, like
    ``acpfs sync PATH``. Raises ``TimeoutError`` after ``timeout`` seconds. A file saved by
    fallback is durable already. When the daemon is dead the answer comes from the backing: a
    file counts as persisted if its backing copy exists (for files this process saved through
    the mount: with the size and modification time it had on the mount); otherwise
    :class:`NotPersisted` is raised (the data was lost with the daemon).

``preload(paths, max_bytes=None) -> Preloaded``
    Reads files (directories recursively) into their mount's cache ahead of a resume, like
    ``acpfs preload`` (several files at once, each in parallel ranges); files that do not fit
    are listed in ``left_out``, files past the ``max_bytes`` budget in ``over_budget``. Paths on
    no live acpfs mount are skipped (no-op). ``load`` of a file not in the cache needs no
    preload: the kernel reads the backing file itself, and the file is kept once read.

``configure(mountpoint=None, backing=None, timeout=None)``
    Name the backing directory of a mount point explicitly (wins over the mount record), and/or
    set the default save timeout. ``ACPFS_MOUNTPOINT`` + ``ACPFS_BACKING`` do the same from the
    environment, but only when no mount record exists; ``ACPFS_BACKING`` alone applies to any
    acpfs mount without a record.

Where the backing of a path comes from: ``configure()``, then the mount record
(``acpfs.userdirs.read_mount_record``), then the live daemon's status, then the environment.
Paths are resolved without touching the FUSE mount (a hung daemon cannot block resolution):
symbolic links are followed up to the mount point, not inside it.

Limits (read before relying on the fallback):

- A write into a hung FUSE daemon cannot be cancelled. The abandoned worker thread (a daemon
  thread named ``acpfs-torch-save PATH``) stays blocked until the daemon answers or dies; if
  the daemon resumes, the thread finishes its temporary file and removes it instead of
  renaming it over ``path``.
- If the daemon only hung (it was not killed), files it had already acknowledged but not yet
  persisted are still persisted when it resumes, possibly over a newer fallback version of the
  same name (e.g. ``latest``). Per-step file names are not affected. A killed daemon is
  different: every fallback save is listed in the mount's cache directory, and the next
  ``acpfs mount``, which recovers the dead daemon's journal, never replays an older version
  over such a path
  (``tests/test_torch_api.py::test_remount_after_a_kill_does_not_roll_back_a_fallback_save``).
- A mount whose daemon is dead shows nothing; ``load`` reads what reached the backing.
  Files acknowledged through the mount but not yet persisted reach the backing only when
  the next ``acpfs mount`` recovers them (the fallback warning lists those this process
  saved). Until then a pointer saved by fallback (``latest``) may name a checkpoint that is
  not in the backing yet: write pointers after ``wait_persisted`` of their checkpoint, or
  check the checkpoint when resuming.

Nothing here imports ``torch_npu``; ``torch.save``/``torch.load`` handle NPU tensors
themselves where ``torch_npu`` is installed (``map_location`` as usual).
``import acpfs`` does not import torch; importing ``acpfs.torch`` does.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

import torch

from ..commands import client
from ..errors import Failure, UsageError
from ._backing import _check_backing, _tell_recovery, _warn_once, _write_atomic
from ._target import (PROBE_TIMEOUT, NotPersisted, _Target, _fallen, _in_thread, _lock,
                      _overrides, _probe, _resolve, _saved, _warned)

__all__ = ["save", "load", "wait_persisted", "preload", "configure", "Saved", "Preloaded",
           "NotPersisted"]

log = logging.getLogger("acpfs.torch")

DEFAULT_SAVE_TIMEOUT = 600.0


@dataclass(frozen=True)
class Saved:
    """Where ``save`` put the bytes.

    ``route`` is ``"mount"`` (through the acpfs mount: persisted in the background),
    ``"backing"`` (fallback: written directly, already durable) or ``"plain"`` (not on acpfs:
    written and fsynced); ``written`` is the file actually written; ``reason`` says why a
    fallback happened.
    """
    path: str
    route: Literal["mount", "backing", "plain"]
    written: str
    seconds: float
    reason: str | None = None


@dataclass(frozen=True)
class Preloaded:
    """What ``preload`` loaded: counts, the files left out with the reason, and the files not
    read because the byte budget was spent."""
    files: int = 0
    bytes: int = 0
    left_out: list[str] = field(default_factory=list)
    over_budget: list[str] = field(default_factory=list)


_timeout: float | None = None                   # configure(timeout=...)


def configure(mountpoint: str | os.PathLike | None = None, backing: str | os.PathLike | None = None,
              timeout: float | None = None) -> None:
    """Set the backing of ``mountpoint`` (both or neither) and/or the default save timeout."""
    global _timeout
    if (mountpoint is None) != (backing is None):
        raise ValueError("configure(): give mountpoint and backing together")
    with _lock:
        if mountpoint is not None:
            _overrides[os.path.realpath(os.fspath(mountpoint))] = os.path.realpath(os.fspath(backing))
        if timeout is not None:
            if timeout <= 0:
                raise ValueError("configure(): timeout must be positive")
            _timeout = float(timeout)


def _save_timeout(timeout: float | None) -> float:
    if timeout is not None:
        return float(timeout)
    if _timeout is not None:
        return _timeout
    v = os.environ.get("ACPFS_SAVE_TIMEOUT")
    if v:
        try:
            return float(v)
        except ValueError:
            raise ValueError(f"invalid ACPFS_SAVE_TIMEOUT={v!r}: not a number") from None
    return DEFAULT_SAVE_TIMEOUT


# -- save -------------------------------------------------------------------------------------
def _save_direct(obj: Any, t: _Target, kwargs: dict[str, Any], reason: str, start: float,
                 dead: bool = False) -> Saved:
    dest = t.backing_path()
    _warn_once(t, reason, dead)
    _write_atomic(obj, dest, kwargs, "fallback")
    _tell_recovery(t)
    with _lock:
        _saved[t.path] = ("backing", 0, 0)
    return Saved(t.path, "backing", dest, time.monotonic() - start, reason)


class _MountWrite:
    """torch.save to a temporary name on the mount, renamed over the final name unless abandoned."""

    def __init__(self, obj: Any, path: str, kwargs: dict[str, Any]) -> None:
        d, name = os.path.split(path)
        self.obj, self.path, self.kwargs = obj, path, kwargs
        self.tmp = os.path.join(d, f".{name}.acpfs-save-{os.getpid()}-{secrets.token_hex(4)}")
        self.cond = threading.Condition()
        self.state = "writing"   # -> committing -> done | failed; writing -> abandoned
        self.error: BaseException | None = None
        self.size = self.mtime_ns = 0

    def run(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.tmp), exist_ok=True)
            with open(self.tmp, "wb") as f:
                torch.save(self.obj, f, **self.kwargs)
            with self.cond:
                if self.state == "abandoned":
                    raise _Abandoned()
                self.state = "committing"
            st = os.stat(self.tmp)
            self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
            os.replace(self.tmp, self.path)
            with self.cond:
                self.state = "done"
                self.cond.notify_all()
        except BaseException as e:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass
            with self.cond:
                if not isinstance(e, _Abandoned):
                    self.error = e
                if self.state != "abandoned":
                    self.state = "failed"
                self.cond.notify_all()
        finally:
            self.obj = None

    def wait(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.state in ("writing", "committing"):
                left = deadline - time.monotonic()
                if left <= 0:
                    if self.state == "writing":
                        self.state = "abandoned"
                        return "abandoned"
                    # renaming: give the rename a last few seconds, then abandon it too
                    if not self.cond.wait(PROBE_TIMEOUT) and self.state == "committing":
                        return "abandoned"
                    continue
                self.cond.wait(left)
            return self.state


class _Abandoned(Exception):
    pass


def save(obj: Any, path: str | os.PathLike, *, timeout: float | None = None,
         **torch_save_kwargs: Any) -> Saved:
    """``torch.save(obj, path)`` through the acpfs mount, or directly to its backing when the
    mount is dead, unmounted or does not complete the save within ``timeout`` seconds."""
    start = time.monotonic()
    wait_s = _save_timeout(timeout)
    t = _resolve(path)
    if t.kind == "plain":
        with open(t.path, "wb") as f:
            torch.save(obj, f, **torch_save_kwargs)
            f.flush()
            os.fsync(f.fileno())
        return Saved(t.path, "plain", t.path, time.monotonic() - start)
    if t.kind == "unmounted":
        return _save_direct(obj, t, torch_save_kwargs, "not mounted (its daemon exited)", start)
    with _lock:
        fallen = _fallen.get(t.key)
    if fallen:
        return _save_direct(obj, t, torch_save_kwargs, fallen, start)
    w = _MountWrite(obj, t.path, torch_save_kwargs)
    th = threading.Thread(target=w.run, name=f"acpfs-torch-save {t.path}", daemon=True)
    th.start()
    state = w.wait(wait_s)
    if state == "done":
        th.join()
        with _lock:
            _saved[t.path] = ("mount", w.size, w.mtime_ns)
            _warned.discard(t.mountpoint)
        return Saved(t.path, "mount", t.path, time.monotonic() - start)
    if state == "abandoned":
        # th (a daemon thread named for the save) stays blocked until the daemon answers or dies
        with _lock:
            reason = f"the daemon did not complete a save within {wait_s:g}s (hung)"
            _fallen[t.key] = reason
        return _save_direct(obj, t, torch_save_kwargs, reason, start)
    th.join()
    err = w.error
    if isinstance(err, OSError) and (err.errno in client.DEAD_ERRNOS or _probe(t.mountpoint) == "dead"):
        reason = f"the daemon is gone ({os.strerror(err.errno) if err.errno else err})"
        with _lock:
            _fallen[t.key] = reason
        return _save_direct(obj, t, torch_save_kwargs, reason, start, dead=True)
    assert err is not None
    raise err


# -- load -------------------------------------------------------------------------------------
def _load_source(t: _Target) -> str:
    if t.kind == "plain":
        return t.path
    if t.kind == "unmounted":
        return t.backing_path()
    with _lock:
        route = _saved.get(t.path, ("",))[0]
    if route == "backing" or _probe(t.mountpoint) != "live":
        return t.backing_path()
    return t.path


def load(path: str | os.PathLike, **torch_load_kwargs: Any) -> Any:
    """``torch.load(path)`` from the mount, or from the backing copy when the mount is dead,
    hung, not mounted, or this process saved ``path`` by fallback."""
    t = _resolve(path)
    src = _load_source(t)
    if src == t.path and t.kind == "mounted":
        try:
            return torch.load(src, **torch_load_kwargs)
        except OSError as e:
            if e.errno not in client.DEAD_ERRNOS:
                raise
            src = t.backing_path()
    return torch.load(src, **torch_load_kwargs)


# -- wait_persisted ---------------------------------------------------------------------------------
class _Dead(Exception):
    pass


def _wait_live(t: _Target, timeout: float | None) -> bool:
    """Wait up to ``timeout`` seconds for the live mount of ``t`` to persist it: True once it
    has, False on the timeout; _Dead when the daemon is gone."""
    assert t.mountpoint is not None
    try:
        seq, open_dirty = client.read_seq(t.path)
        if open_dirty:
            log.info("acpfs.torch: %d files under %s are still open for writing; their data is "
                     "persisted after they are closed", open_dirty, t.path)
        client.wait_applied(t.mountpoint, seq, timeout)
    except client.StaleMount:
        raise _Dead() from None
    except client.WaitTimeout:
        return False
    except Failure as e:
        raise OSError(e.errno or errno.EIO, str(e)) from None
    return True


def wait_persisted(path_or_dir: str | os.PathLike, timeout: float | None = None) -> bool:
    """Block until ``path_or_dir`` (a file, or a directory recursively) is durable in the backing.

    Returns True; raises TimeoutError after ``timeout`` seconds, NotPersisted when the daemon
    is gone and the backing lacks the data, FileNotFoundError for a missing plain path.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    t = _resolve(path_or_dir)
    if t.kind == "plain":
        if not os.path.lexists(t.path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), t.path)
        return True              # save() fsynced it
    if t.kind == "unmounted":
        return _check_backing(t)
    with _lock:
        route = _saved.get(t.path, ("",))[0]
    if route == "backing":
        return True
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"wait_persisted({t.path}): not durable after {timeout:g}s")
        state = _probe(t.mountpoint, PROBE_TIMEOUT if left is None else min(PROBE_TIMEOUT, left))
        if state == "dead":
            return _check_backing(t)
        if state == "hung":
            try:
                return _check_backing(t)
            except NotPersisted:
                time.sleep(0.2)
                continue
        ok, val = _in_thread(lambda: _wait_live(t, left), left, "acpfs-torch-wait")
        if ok == "done" and val:
            return True
        if ok == "error":
            if isinstance(val, _Dead):
                return _check_backing(t)
            raise val
        # timed out (or hung in a FUSE call): loop to the deadline check


# -- preload -------------------------------------------------------------------------------------
def preload(paths: Iterable[str | os.PathLike], max_bytes: int | None = None) -> Preloaded:
    """Read files (directories recursively) into their mount's cache ahead of a resume,
    several at once, each fetched from the backing in parallel ranges.

    Paths on no live acpfs mount are skipped. Files that do not fit are listed in ``left_out``;
    with ``max_bytes``, the files from the first one past that budget on are not read and
    are listed in ``over_budget``.
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError("acpfs preload: max_bytes must not be negative")
    live = []
    for p in paths:
        t = _resolve(p)
        if t.kind == "mounted" and _probe(t.mountpoint) == "live":
            if not os.path.lexists(t.path):
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), t.path)
            live.append(t.path)
    if not live:
        return Preloaded()
    try:
        done = client.preload(live, quiet=True, max_bytes=max_bytes)
    except UsageError as e:
        raise ValueError(f"acpfs preload: {e}") from None
    except Failure as e:
        raise OSError(errno.EIO, f"acpfs preload failed: {e}") from None
    return Preloaded(done.files, done.nbytes, list(done.left_out), list(done.over_budget))
