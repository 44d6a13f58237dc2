"""Builds the C extensions; everything else is declared in setup.cfg.

- acpfs.fuse._fastwrite (acpfs/fuse/_fastwrite.c and its parts): where it cannot be built (no
  compiler, no libfuse3 headers) acpfs installs without it and WRITE requests take pyfuse3's
  path (acpfs/fuse/fastwrite.py).
- acpfs.backing._beneath (acpfs/backing/_beneath.c): directories of the backing opened in one
  system call; without it they are walked one name at a time (acpfs/backing/root.py).

Both are optional.
"""

import subprocess

from setuptools import Extension, setup


def pkg_config(*args: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", *args, "fuse3"], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return out.split()


cflags = pkg_config("--cflags") or ["-I/usr/include/fuse3"]
libs = pkg_config("--libs") or ["-lfuse3"]

setup(ext_modules=[Extension(
    "acpfs.backing._beneath", ["acpfs/backing/_beneath.c"],
    extra_compile_args=["-Wall", "-Wextra"], optional=True,
), Extension(
    "acpfs.fuse._fastwrite",
    ["acpfs/fuse/_fastwrite.c", "acpfs/fuse/_attrs.c", "acpfs/fuse/_atonce.c",
     "acpfs/fuse/_burst.c", "acpfs/fuse/_idlepoll.c"],
    depends=["acpfs/fuse/_attrs.h", "acpfs/fuse/_atonce.h", "acpfs/fuse/_burst.h",
             "acpfs/fuse/_clock.h", "acpfs/fuse/_idlepoll.h"],
    extra_compile_args=[*cflags, "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=[*libs, "-ldl"],
    optional=True,
)])
