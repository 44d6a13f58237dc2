"""The error types acpfs raises across layers.

``Failure`` is the one error a user sees: an operation on a mount or a command failed;
``str()`` is one line for the user (the ``acpfs`` command prints it and exits with status 1).
``UsageError`` is bad input from the user (exit status 2). ``Aborted`` ends a wait of the
flusher when the daemon is told to stop without draining. A request's error, an errno for
the kernel, is ``node.FsError``.
"""

from __future__ import annotations


class Failure(Exception):
    """An operation on an acpfs mount failed. ``str()`` is one line for the user (the
    ``acpfs`` command prints it and exits with status 1); ``errno`` and ``strerror`` are the
    failed system call's (None when no system call failed)."""

    def __init__(self, message: str, cause: OSError | None = None) -> None:
        super().__init__(message)
        self.errno = cause.errno if cause is not None else None
        self.strerror = cause.strerror if cause is not None else None


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class Aborted(Exception):
    """The daemon was told to stop without draining."""
