"""Builds acpfs.fuse._fastwrite (acpfs/fuse/_fastwrite.c and its parts); everything else is declared in setup.cfg.

The extension is optional: where it cannot be built (no compiler, no libfuse3 headers)
acpfs installs without it and WRITE requests take pyfuse3's path (acpfs/fuse/fastwrite.py).
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
    "acpfs.fuse._fastwrite",
    ["acpfs/fuse/_fastwrite.c", "acpfs/fuse/_attrs.c", "acpfs/fuse/_atonce.c",
     "acpfs/fuse/_burst.c"],
    depends=["acpfs/fuse/_attrs.h", "acpfs/fuse/_atonce.h", "acpfs/fuse/_burst.h"],
    extra_compile_args=[*cflags, "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=[*libs, "-ldl"],
    optional=True,
)])
