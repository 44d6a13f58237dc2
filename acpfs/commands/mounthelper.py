"""The mount helper ``mount.fuse.acpfs``: ``mount -t fuse.acpfs`` and fstab lines.

For a filesystem of type ``fuse.acpfs``, mount(8) (libmount) runs the first of
``/sbin/mount.fuse.acpfs``, ``/sbin/fs.d/...``, ``/sbin/fs/...`` that exists, as

    mount.fuse.acpfs BACKING MOUNTPOINT [-s] [-f] [-n] [-v] [-o OPTIONS] [-N NAMESPACE]

with the fstab line's options, less those it keeps for itself (``noauto``, ``auto``,
``defaults``, ``x-*``, ``X-*``, ``comment=``), and ``rw`` or ``ro`` first. This module turns
that into ``acpfs mount MOUNTPOINT --backing BACKING ...`` and runs it in this process:

- each option of ``acpfs mount`` in underscore form: ``cache_size=32G`` is
  ``--cache-size 32G``, ``allow_other`` is ``--allow-other``; the list is read from the
  command's own parser (``cli.add_mount_arguments``), so the two never disagree;
- options that are mount(8)'s, systemd's or already true of every acpfs mount are ignored
  (``IGNORED``, ``IGNORED_PREFIXES``);
- options acpfs cannot honour are refused with the reason (``REFUSED``), and so is any
  other option (with ``-s``, mount's "sloppy", unknown options are ignored with a warning).

Every refusal is one line on stderr and nothing is mounted. The exit status is mount(8)'s:
0 mounted (also when it already was, over the same backing), 1 bad invocation (an unknown
option, a bad value, a refused option, or what ``acpfs mount`` calls bad usage: a missing
directory, a mount point in use), 32 the mount failed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from . import cli
from ..errors import UsageError
from ..fuse.fastwrite import REEXEC_MARK

PROG = "mount.fuse.acpfs"
FSTYPE = "fuse.acpfs"
EXIT_USAGE = 1      # mount(8): incorrect invocation or permissions
EXIT_INTERRUPTED = 8   # mount(8): user interrupt
EXIT_FAILED = 32    # mount(8): mount failure

# mount(8)'s and systemd's business, or already true of every acpfs mount: accepted and
# ignored. ``user`` and its kin let a user mount an fstab line (this helper then runs as
# that user); FUSE mounts are always nosuid and nodev; rw, exec, async are the defaults.
IGNORED = frozenset({
    "defaults", "auto", "noauto", "_netdev", "nofail", "user", "nouser", "users", "nousers",
    "owner", "noowner", "group", "nogroup", "rw", "exec", "async", "nosuid", "nodev",
    # access times: reads never update atime on acpfs (docs/semantics.md), whatever is asked
    "atime", "noatime", "relatime", "norelatime", "strictatime", "nostrictatime",
    "lazytime", "nolazytime", "diratime", "nodiratime",
})
IGNORED_PREFIXES = ("x-", "X-", "comment=", "user=")

REFUSED = {
    "ro": "acpfs mounts are read-write; a read-only view of the backing needs no cache",
    # mount(8) passes the flags set, not their absence: these come only from a direct call
    "suid": "acpfs mounts are always nosuid",
    "dev": "acpfs mounts are always nodev",
    "sync": "acpfs is a write-back cache; for fsync() that waits for the backing use "
            "fsync=backing",
    "dirsync": "acpfs is a write-back cache; for fsync() that waits for the backing use "
               "fsync=backing",
    "remount": "an acpfs mount cannot be remounted; unmount it ('acpfs umount') and mount it "
               "again",
    "backing": "the backing directory is the source, the first field of the line",
    "foreground": "mount(8) waits for the helper; to run the daemon in the foreground use "
                  "the acpfs@.service unit or 'acpfs mount --foreground'",
    "mountpoint": "the mount point is the second field of the line",
}


def mount_actions() -> dict[str, argparse.Action]:
    """The ``-o`` names this helper maps: each option of ``acpfs mount`` by its
    destination (``cache_size``, ``allow_other``), as ``acpfs mount``'s parser declares
    it."""
    parser = cli.Parser(prog="acpfs mount", add_help=False)   # no -h, no help entry
    cli.add_mount_arguments(parser)
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in REFUSED}


def parse_argv(argv: list[str]) -> argparse.Namespace:
    """mount(8)'s call: source, target, the flags it passes, ``-o`` (maybe several)."""
    p = cli.Parser(prog=PROG, description="Mount an acpfs cache as mount(8) asks: "
                   f"mount -t {FSTYPE} BACKING MOUNTPOINT -o OPTIONS (docs/operations.md).")
    p.add_argument("source")
    p.add_argument("target")
    p.add_argument("-o", dest="options", action="append", default=[])
    p.add_argument("-t", dest="type", default=FSTYPE)
    p.add_argument("-s", dest="sloppy", action="store_true")
    p.add_argument("-f", dest="fake", action="store_true")
    p.add_argument("-n", dest="nomtab", action="store_true")
    p.add_argument("-v", dest="verbose", action="store_true")
    p.add_argument("-N", dest="namespace")
    a = p.parse_args(argv)
    if a.type != FSTYPE:
        raise UsageError(f"filesystem type {a.type!r} is not {FSTYPE}")
    if a.namespace:
        raise UsageError("mounting into another mount namespace (-N) is not supported")
    return a


def translate(options: list[str], sloppy: bool) -> tuple[list[str], list[str]]:
    """The ``acpfs mount`` arguments for mount(8)'s ``-o`` lists, and the unknown options
    left out (only with ``sloppy``; without, an unknown option is a UsageError)."""
    actions = mount_actions()
    args: list[str] = []
    unknown: list[str] = []
    for item in ",".join(options).split(","):
        name, eq, value = item.partition("=")
        if not item or item in IGNORED or item.startswith(IGNORED_PREFIXES):
            continue
        if name in REFUSED:
            raise UsageError(f"mount option {name!r} is not supported: {REFUSED[name]}")
        action = actions.get(name)
        if action is None:
            if sloppy:
                unknown.append(item)
                continue
            raise UsageError(f"unknown mount option {item!r} (use the options of "
                             "'acpfs mount --help' in underscore form, e.g. cache_size=32G)")
        args += option_args(action, name, eq, value)
    return args, unknown


def option_args(action: argparse.Action, name: str, eq: str, value: str) -> list[str]:
    """``acpfs mount``'s arguments for one ``-o`` option, its value checked as the
    command's parser would."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        if eq:
            raise UsageError(f"mount option {name!r} takes no value (not {name}={value})")
        return [flag]
    if not eq or not value:
        raise UsageError(f"mount option {name!r} needs a value ({name}=...)")
    try:
        typed = action.type(value) if callable(action.type) else value
    except ValueError:   # int(), float(): their message is for programmers
        kind = getattr(action.type, "__name__", "value")
        raise UsageError(f"bad value in mount option {name}={value}: not an {kind}" if kind == "int"
                         else f"bad value in mount option {name}={value}") from None
    except (argparse.ArgumentTypeError, UsageError) as e:
        raise UsageError(f"bad value in mount option {name}={value}: {e}") from None
    if action.choices is not None and typed not in action.choices:
        raise UsageError(f"bad value in mount option {name}={value}: use "
                         f"{cli.spoken(action.choices)}")
    return [flag, value]


def run(argv: list[str]) -> int:
    """Mount as mount(8) asked; the exit status is mount(8)'s."""
    try:
        a = parse_argv(argv)
        args, unknown = translate(a.options, a.sloppy)
    except UsageError as e:
        print(f"acpfs: {cli.safe(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    command = ["mount", a.target, "--backing", a.source, *args]
    if not os.environ.get(REEXEC_MARK):   # said once, not again when cli runs this again
        if unknown:
            print(f"acpfs: ignoring unknown mount options (-s): {cli.safe(','.join(unknown))}",
                  file=sys.stderr)
        if a.verbose or a.fake:
            print(f"{PROG}: acpfs {cli.safe(shlex.join(command))}", file=sys.stderr)
    if a.fake:
        return 0
    status = cli.main(command, from_command_line=True)   # may run this helper again first
    return {0: 0, 2: EXIT_USAGE, 130: EXIT_INTERRUPTED}.get(status, EXIT_FAILED)


def main() -> int:
    return run(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
