#!/usr/bin/env bash
# tools/device-bench.sh [tools/bench.py args...]: build acpfs and its FUSE stack on a lent
# machine without network, smoke-test a mount, then run tools/bench.py there.
#
# Where: the device machine, from the repository root, as root, with the kit that
# ./tools/device-kit built here carried along:
#     run(command="bash tools/device-bench.sh --size 2G ...", carry=[".devkit"], timeout_s=600)
# Needs there: x86_64, FUSE in the kernel, python3 >= 3.10 with its headers (Python.h), pip,
# gcc, and trio's dependencies (attrs, sortedcontainers, idna). Brings (.devkit/): libfuse3
# 3.14 and its headers, fusermount3 and a fuse3-only pkg-config, pyfuse3 3.5.0's sdist, trio,
# outcome and sniffio wheels, setuptools + setuptools_scm to build pyfuse3 with.
# Steps: check the machine and /dev/fuse; install the build tools and wheels into scratch;
# build pyfuse3 from its sdist (from its shipped C file, Cython hidden) and acpfs.fuse._fastwrite
# in place (acpfs/fuse/_fastwrite*.so in this tree), both against the kit's libfuse3; mount, write,
# sync and unmount once; run tools/bench.py; stop it cleanly before the caller's limit.
#
# Environment:
#   OUT              results directory (the device tool's $OUT); without it only stdout
#   KIT_DIR          the kit (default .devkit at the repository root)
#   KIT_WORK         scratch (default /tmp/acpfs-kit)
#   KIT_PASSTHROUGH  ACPFS_PASSTHROUGH (auto|on|off) for the smoke test and the bench's "acpfs"
#                    target; default unset (auto). "acpfs-daemon" sets off itself.
#   KIT_USE_CYTHON=1 let the machine's Cython regenerate pyfuse3's C file
#   KIT_SKIP_BENCH=1 stop after the smoke test
#   KIT_DEADLINE_S   when to be done, in seconds from the start (default 570, for a 600 s call):
#                    the bench gets SIGTERM 30 s before (it unmounts and keeps results.json),
#                    SIGKILL 25 s after that; what it left mounted is unmounted here
#
# Comes back under $OUT:
#   remote.log            everything this script printed
#   bench/                tools/bench.py's results: results.json, table.md (chart.png with
#                         matplotlib); summary.md instead of table.md when the bench stopped
#                         early (tools/bench_partial.py: medians of what was measured)
#   acpfs-logs.tar.gz     the daemons' logs, when the bench failed or was stopped
#   *.log                 the build log (or the smoke test's daemon log) of a step that failed
set -Eeuo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIT="${KIT_DIR:-$REPO/.devkit}"
W="${KIT_WORK:-/tmp/acpfs-kit}"
cd "$REPO"

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/remote.log") 2>&1
fi

T0=$SECONDS
STEP="start"
STEP_T=$SECONDS
step() {
    [ "$STEP" = "start" ] || echo "--- done: $STEP ($((SECONDS - STEP_T))s)"
    STEP="$1"
    STEP_T=$SECONDS
    echo
    echo "=== [$(date +%T), +$((SECONDS - T0))s] $STEP"
}
die() {
    echo "!!! FATAL in step '$STEP': $*" >&2
    exit 1
}
on_err='rc=$?; echo "!!! FAILED (exit $rc) in step '"'"'$STEP'"'"', line $LINENO: $BASH_COMMAND" >&2'
trap "$on_err" ERR
show_log() {   # the end of a build log, after a failure; the whole log goes to $OUT
    echo "----- last 60 lines of $1 -----" >&2
    tail -n 60 "$1" >&2 || true
    echo "----- end of $1 -----" >&2
    [ -z "${OUT:-}" ] || cp "$1" "$OUT/" || true
}

# ---------------------------------------------------------------------------------------
step "machine"
echo "kernel:  $(uname -r) ($(uname -m))"
echo "nproc:   $(nproc)"
PY="$(command -v python3)" || die "no python3 on PATH"
echo "python3: $PY, $("$PY" -V 2>&1)"
echo "repo:    $REPO (kit $KIT, scratch $W)"
echo "user:    $(id -un) (uid $(id -u))"
free -g | sed -n 1,2p || true
df -h /tmp /var/tmp /dev/shm 2>/dev/null || true
[ "$(uname -m)" = x86_64 ] || die "the kit is for x86_64, not $(uname -m)"
[ -d "$KIT/root" ] || die "no kit at $KIT: run ./tools/device-kit here and carry [\".devkit\"]"
"$PY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' \
    || die "acpfs needs Python 3.10 or later; python3 is $("$PY" -V 2>&1)"
# the bench keeps a copy and both acpfs pools (2.5 x --size each) in /dev/shm
shm_kib=$(df -k --output=size /dev/shm 2>/dev/null | tail -1 | tr -d ' ' || echo 0)
if [ "${shm_kib:-0}" -lt $((40 * 1024 * 1024)) ] && grep -q " /dev/shm tmpfs " /proc/mounts; then
    echo "WARNING: /dev/shm is only $((shm_kib / 1024)) MiB: remounting it with size=75%"
    mount -o remount,size=75% /dev/shm || echo "WARNING: remount of /dev/shm failed: a large --size will not fit"
    df -h /dev/shm
fi

# ---------------------------------------------------------------------------------------
step "/dev/fuse"
if ! grep -qw fuse /proc/filesystems; then
    echo "fuse is not in /proc/filesystems; trying modprobe fuse"
    modprobe fuse 2>&1 || true
fi
grep -w fuse /proc/filesystems || die "the kernel has no FUSE (not in /proc/filesystems, modprobe fuse failed): acpfs cannot mount here"
if [ ! -c /dev/fuse ]; then
    echo "/dev/fuse is missing: mknod /dev/fuse c 10 229"
    mknod -m 0666 /dev/fuse c 10 229 || die "mknod /dev/fuse failed"
fi
ls -l /dev/fuse
"$PY" -c 'import os; os.close(os.open("/dev/fuse", os.O_RDWR))' || die "cannot open /dev/fuse read-write"
echo "/dev/fuse opens read-write"
[ "$(id -u)" = 0 ] || echo "WARNING: not root: mounts go through fusermount3, which is not setuid in this kit"

# ---------------------------------------------------------------------------------------
step "compiler and Python headers"
command -v gcc >/dev/null || die "no gcc on PATH: neither pyfuse3 nor acpfs/fuse/_fastwrite.c can be built"
gcc --version | sed -n 1p
PYINC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
EXT_SUFFIX="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
echo "python include dir: $PYINC; extension suffix: $EXT_SUFFIX"
[ -f "$PYINC/Python.h" ] || die "$PYINC/Python.h is missing (the kit brings no Python headers): pyfuse3 cannot be built"
echo "Python.h is there"

# ---------------------------------------------------------------------------------------
step "environment"
FUSE_LIB="$KIT/root/usr/lib/x86_64-linux-gnu"
FUSE_INC="$KIT/root/usr/include/fuse3"
[ -f "$FUSE_LIB/libfuse3.so.3" ] && [ -f "$FUSE_INC/fuse_lowlevel.h" ] || die "the kit's libfuse3 is incomplete ($FUSE_LIB, $FUSE_INC): rebuild it with ./tools/device-kit"
chmod +x "$KIT/bin/pkg-config" "$KIT/bin/fusermount3" "$KIT/root/bin/fusermount3"
rm -rf "$W/site" "$W/buildtools" "$W/bin" "$W/build-temp" "$W/build-lib" "$W/nocython"
mkdir -p "$W/site" "$W/buildtools" "$W/bin" "$W/nocython/Cython"
export PATH="$KIT/bin:$W/bin:$PATH"
export CPATH="$FUSE_INC${CPATH:+:$CPATH}"
export LIBRARY_PATH="$FUSE_LIB${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$FUSE_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PKG_CONFIG_PATH="$FUSE_LIB/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1
ORIG_PYTHONPATH="${PYTHONPATH:-}"
unset PYTHONPATH
echo "pkg-config: $(command -v pkg-config) -> fuse3 $(pkg-config --modversion fuse3): $(pkg-config --cflags --libs fuse3)"
echo "fusermount3: $(command -v fusermount3) ($(fusermount3 -V 2>&1))"
"$PY" -m pip --version || die "python3 -m pip does not work"
"$PY" -c 'import setuptools; print("machine setuptools", setuptools.__version__)' || true
"$PY" -c 'import Cython; print("machine Cython", Cython.__version__)' 2>/dev/null || echo "machine Cython: none"

# ---------------------------------------------------------------------------------------
step "install build tools (setuptools, setuptools_scm) into $W/buildtools"
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$W/buildtools" "$KIT"/buildtools/*.whl \
    || die "pip could not install the kit's build tools"
PYTHONPATH="$W/buildtools" "$PY" -c 'import setuptools, setuptools_scm; print("build with setuptools", setuptools.__version__, "from", setuptools.__file__)' \
    || die "setuptools_scm does not import (its dependency packaging must be on the machine)"

# ---------------------------------------------------------------------------------------
step "install trio, outcome, sniffio into $W/site"
"$PY" -m pip install -q --no-index --no-deps --target "$W/site" "$KIT"/wheels/*.whl \
    || die "pip could not install the kit's wheels"
PYTHONPATH="$W/site" "$PY" -c 'import trio, outcome, sniffio, attrs, sortedcontainers, idna; print("trio", trio.__version__)' \
    || die "trio does not import (its dependencies attrs, sortedcontainers, idna must be on the machine)"

# ---------------------------------------------------------------------------------------
step "build pyfuse3 3.5.0 from the sdist into $W/site"
BP="$W/buildtools"
if [ "${KIT_USE_CYTHON:-0}" = 1 ]; then
    echo "KIT_USE_CYTHON=1: the machine's Cython regenerates pyfuse3's C file"
else
    # setuptools compiles the C file shipped in the sdist when Cython does not import
    echo 'raise ImportError("Cython hidden by tools/device-bench.sh (KIT_USE_CYTHON=1 lets it through)")' \
        >"$W/nocython/Cython/__init__.py"
    BP="$BP:$W/nocython"
    echo "using the C file shipped in the sdist (Cython hidden)"
fi
if ! PYTHONPATH="$BP" "$PY" -m pip install -v --no-index --no-deps --no-build-isolation \
        --target "$W/site" "$KIT"/sdist/pyfuse3-3.5.0.tar.gz >"$W/pyfuse3-build.log" 2>&1; then
    show_log "$W/pyfuse3-build.log"
    die "pyfuse3 did not build (full log $W/pyfuse3-build.log)"
fi
grep -E "^(gcc|x86_64-linux-gnu-gcc|cc) " "$W/pyfuse3-build.log" | cut -c1-400 || true
PF_SO="$(ls "$W"/site/pyfuse3/__init__*.so 2>/dev/null | sed -n 1p || true)"
[ -n "$PF_SO" ] || die "no pyfuse3/__init__*.so in $W/site"
echo "built $PF_SO"

# ---------------------------------------------------------------------------------------
step "build acpfs.fuse._fastwrite in place"
rm -f acpfs/fuse/_fastwrite"$EXT_SUFFIX"
if ! PYTHONPATH="$W/buildtools" "$PY" setup.py -q build_ext --inplace --build-temp "$W/build-temp" --build-lib "$W/build-lib" \
        >"$W/fastwrite-build.log" 2>&1; then
    show_log "$W/fastwrite-build.log"
    die "setup.py build_ext failed (full log $W/fastwrite-build.log)"
fi
grep -iE "warning|error" "$W/fastwrite-build.log" | head -20 || true
# the extension is optional=True in setup.py: a failed compile is only a warning there
[ -f "acpfs/fuse/_fastwrite$EXT_SUFFIX" ] || { show_log "$W/fastwrite-build.log"; die "acpfs/fuse/_fastwrite$EXT_SUFFIX was not built"; }
echo "built $REPO/acpfs/fuse/_fastwrite$EXT_SUFFIX"

# ---------------------------------------------------------------------------------------
step "check the built modules"
for so in "$PF_SO" "acpfs/fuse/_fastwrite$EXT_SUFFIX"; do
    echo "$so:"
    deps="$(ldd "$so")" || die "ldd $so failed"
    grep -E "fuse|not found" <<<"$deps" || true
    ! grep -q "not found" <<<"$deps" || die "$so has unresolved libraries"
    grep -q "libfuse3.so.3 => $FUSE_LIB/" <<<"$deps" || die "$so does not load libfuse3 from the kit"
done
export PYTHONPATH="$W/site:$REPO${ORIG_PYTHONPATH:+:$ORIG_PYTHONPATH}"
# setup.cfg's console entry point is acpfs.commands.cli:main, which acpfs/__main__.py runs
cat >"$W/bin/acpfs" <<EOF
#!/bin/sh
exec "$PY" -m acpfs "\$@"
EOF
chmod +x "$W/bin/acpfs"
echo "acpfs on PATH: $(command -v acpfs); $(acpfs --version)"
# KIT_PASSTHROUGH, if set, is what ACPFS_PASSTHROUGH becomes for the smoke test and the bench
PT="${KIT_PASSTHROUGH:-}"
if [ -n "$PT" ]; then export ACPFS_PASSTHROUGH="$PT"; else unset ACPFS_PASSTHROUGH; fi
"$PY" - <<'EOF'
import acpfs, acpfs.fuse.fastwrite as f   # first: it loads acpfs.fuse._fastwrite before pyfuse3, as acpfs.fuse.operations does
import pyfuse3, trio
print("pyfuse3", pyfuse3.__version__, "from", pyfuse3.__file__)
print("acpfs", acpfs.__version__, "from", acpfs.__file__)
assert f._ext is not None, f"acpfs.fuse.fastwrite did not load the C extension: {f._why_not}"
print("acpfs.fuse.fastwrite loaded", f._ext.__file__)
EOF

# ---------------------------------------------------------------------------------------
step "smoke test: mount, write, status, sync, umount (ACPFS_PASSTHROUGH=${PT:-unset (auto)})"
SM="$(mktemp -d /tmp/acpfs-smoke.XXXXXX)"
mkdir -p "$SM/mnt" "$SM/backing"
smoke_cleanup() {
    if grep -q " $SM/mnt " /proc/mounts; then
        echo "smoke: lazy unmount of $SM/mnt"
        fusermount3 -u -z "$SM/mnt" 2>/dev/null || umount -l "$SM/mnt" || true
    fi
    rm -rf "/dev/shm/acpfs-smoke-cache.$$"
}
trap 'smoke_cleanup' EXIT
timeout 120 acpfs mount "$SM/mnt" --backing "$SM/backing" --cache-size 1G \
    --cache-dir "/dev/shm/acpfs-smoke-cache.$$" --log-file "$SM/acpfs.log" \
    || { show_log "$SM/acpfs.log"; die "acpfs mount failed"; }
grep " $SM/mnt " /proc/mounts || die "acpfs mount returned but $SM/mnt is not mounted"
head -c 64M /dev/urandom >"$SM/src.bin"
t=$(date +%s%N)
cp "$SM/src.bin" "$SM/mnt/file.bin"
echo "wrote 64 MiB through the mount in $(( ($(date +%s%N) - t) / 1000000 )) ms"
cmp "$SM/src.bin" "$SM/mnt/file.bin" || die "read back through the mount differs"
timeout 60 acpfs status "$SM/mnt" || { show_log "$SM/acpfs.log"; die "acpfs status failed"; }
timeout 120 acpfs sync "$SM/mnt" || { show_log "$SM/acpfs.log"; die "acpfs sync failed"; }
cmp "$SM/src.bin" "$SM/backing/file.bin" || die "the backing's copy differs after acpfs sync"
echo "backing holds the file after sync"
timeout 120 acpfs umount "$SM/mnt" || { show_log "$SM/acpfs.log"; die "acpfs umount failed"; }
! grep -q " $SM/mnt " /proc/mounts || die "still mounted after acpfs umount"
grep -iE "passthrough|error|warning" "$SM/acpfs.log" | head -10 || true
rm -rf "$SM"
smoke_cleanup
trap - EXIT

# ---------------------------------------------------------------------------------------
if [ "${KIT_SKIP_BENCH:-0}" = 1 ]; then
    step "bench skipped (KIT_SKIP_BENCH=1)"
    echo "=== all done in $((SECONDS - T0))s"
    exit 0
fi
step "bench: tools/bench.py $*"
args=("$@")
BOUT=""
prev=""
for a in "${args[@]}"; do
    case "$a" in --out=*) BOUT="${a#--out=}" ;; esac
    [ "$prev" = "--out" ] && BOUT="$a"
    prev="$a"
done
if [ -z "$BOUT" ]; then
    if [ -n "${OUT:-}" ]; then BOUT="$OUT/bench"; else BOUT="/tmp/bench-results/device-$(date +%Y%m%d-%H%M%S)"; fi
    args+=(--out "$BOUT")
fi
echo "target 'acpfs' mounts with ACPFS_PASSTHROUGH=${PT:-unset (auto)}; 'acpfs-daemon' sets off itself"
DEADLINE="${KIT_DEADLINE_S:-570}"
BUDGET=$((DEADLINE - (SECONDS - T0) - 30))
[ "$BUDGET" -gt 30 ] || die "no time left for the bench (KIT_DEADLINE_S=$DEADLINE, $((SECONDS - T0))s used)"
echo "bench results: $BOUT; bench time limit ${BUDGET}s (SIGTERM, then SIGKILL 25s later)"
BT=$SECONDS
before="$(ls -d /tmp/bench-2* /dev/shm/bench-2* /var/tmp/bench-2* 2>/dev/null || true)"
trap - ERR
set +e
PYTHONUNBUFFERED=1 timeout --signal=TERM --kill-after=25 "$BUDGET" "$PY" tools/bench.py "${args[@]}"
brc=$?
set -e
trap "$on_err" ERR
echo "bench ran $((SECONDS - BT))s, exit status $brc"
if [ $brc != 0 ]; then
    case $brc in
        124) echo "!!! the bench hit its time limit (${BUDGET}s) and stopped: results are partial" ;;
        137) echo "!!! the bench was killed (SIGKILL: 25 s past its time limit, or memory): results are partial" ;;
    esac
    # the scratch directories of this run that the bench left behind
    new=()
    for d in $(ls -d /tmp/bench-2* /dev/shm/bench-2* /var/tmp/bench-2* 2>/dev/null || true); do
        grep -qxF "$d" <<<"$before" || new+=("$d")
    done
    # its mounts, if it was stopped while they were up (SIGKILL, or SIGTERM during its own
    # unmounts): unmount them, so that the daemons persist and exit
    for d in "${new[@]}"; do
        for m in $(awk -v d="$d/" '$3 ~ /^fuse/ && index($2, d) == 1 {print $2}' /proc/mounts); do
            echo "unmounting what the bench left mounted: $m"
            timeout 120 acpfs umount "$m" || fusermount3 -u -z "$m" || umount -l "$m" || true
        done
    done
    logs=()
    for d in "${new[@]}"; do
        for f in "$d"/*.log; do [ -f "$f" ] && logs+=("$f"); done
    done
    if [ ${#logs[@]} -gt 0 ] && [ -n "${OUT:-}" ]; then
        tar czf "$OUT/acpfs-logs.tar.gz" "${logs[@]}" 2>/dev/null && echo "daemon logs: $OUT/acpfs-logs.tar.gz"
    fi
    for d in "${new[@]}"; do
        grep -qF " $d/" /proc/mounts && { echo "left in place (still mounted): $d"; continue; }
        rm -rf "$d"
    done
fi
if [ -f "$BOUT/results.json" ] && [ ! -f "$BOUT/table.md" ]; then
    step "summary of the partial results ($BOUT/summary.md)"
    "$PY" tools/bench_partial.py "$BOUT" || true
fi
[ $brc = 0 ] || die "tools/bench.py exited with $brc"
step "finished"
echo "=== all done in $((SECONDS - T0))s"
