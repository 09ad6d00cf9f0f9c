#!/usr/bin/env bash
# Build the device image (deploy/Dockerfile.device) with podman, run it, and check that
# `omnidraft device ask` on the host gets an answer from the service inside it.
# The last line printed says how it went, e.g.
#   image: omnidraft-device 1.53 GB, device answered
# and the exit status is non-zero when any step failed (the container is removed either way).
#
# Prerequisites: root (debootstrap, chown of the volume); podman (4.x) with runc;
# the repository's virtualenv (.venv, `omnidraft` on the host: pulls the models, asks the device);
# debootstrap only when the official base image cannot be pulled (installed with apt-get if missing).
#
# Base image. The Dockerfile starts FROM python:${PYTHON}-slim-bookworm; that one is used when
# `podman pull docker.io/library/python:3.11-slim-bookworm` works. Where Docker Hub cannot be reached
# (the machine this was written on: "lookup registry-1.docker.io ... no such host") the script makes
# a stand-in, localhost/omnidraft-python-base:3.11-bookworm: a debootstrapped Debian bookworm
# (minbase + python3, python3-venv, ca-certificates: Debian's Python 3.11) with a venv at
# /usr/local/venv first on PATH, so `python` and `pip` are the venv's as in the official image, and
# builds both of the Dockerfile's stages from it (`--build-arg BASE=`). Only PYTHON=3.11 (bookworm's Python) has a stand-in.
#
# Packages. Where local pip mirrors exist ($PIP_MIRRORS: a find-links folder and PEP 503 "simple"
# trees, by default /opt/wheels /opt/pypi /opt/pypi-more) they are mounted read-only into the build
# with a generated pip configuration (mirrors, constraints, the host's CA bundle for pypi.org behind
# a TLS-inspecting proxy) at /etc/xdg/pip, and torch==2.13.0 (the CPU wheel) comes through it
# (--build-arg TORCH_INDEX=, since download.pytorch.org may not be reachable). Without mirrors the
# Dockerfile's defaults apply (PyTorch's CPU index, PyPI). The mount points stay in the image as
# empty folders (/etc/xdg/pip, /run/omnidraft-mirrors/*): podman 4.3 leaves them.
#
# Running. The models are pulled on the host, in GGUF, into $DEVICE_HOME, which is mounted as the
# image's volume /var/lib/omnidraft (owned by the image's `omnidraft` user), so nothing is
# downloaded in the container; the dtype profiles the service measures on first start are kept
# there too, so later starts are quicker. The container runs the image's own CMD with host
# networking (`podman run --network=host`): the service listens on the host's loopback,
# 127.0.0.1:50051, and the host asks it there with the owner token (<volume>/state/owner.token).
#
# podman here: `--runtime runc` and lowered nofile/nproc ulimits for builds and runs (crun: "cgroups
# in hybrid mode not supported"; runc with the default limits: "error setting rlimits").
#
# Another platform. PLATFORM (default: the host's, e.g. linux/amd64) picks the image's platform;
# PLATFORM=linux/arm64 on an x86-64 host builds and runs the arm64 image under qemu-user:
#   PLATFORM=linux/arm64 bash deploy/build_image.sh
# The emulator must be registered with binfmt_misc with the F flag (the kernel opens it at
# registration, so it runs inside containers); the script mounts binfmt_misc, installs Debian's
# qemu-user-static and binfmt-support and enables qemu-<arch> where it is missing (root).
# A foreign image is tagged with its architecture (IMAGE default localhost/omnidraft-device:latest-arm64,
# so it does not replace the host's), and so is its stand-in base (…:3.11-bookworm-arm64: debootstrap
# --foreign --arch=arm64, the second stage run under the emulator). pip takes torch==2.13.0 for the
# platform from the configured indexes: the mirrors' CPU wheel is x86-64 only, so on arm64 it is PyPI's
# aarch64 wheel, which is built with CUDA and pulls NVIDIA's CUDA libraries (several GB) that it
# links against (import torch fails without them). setup.py builds the NEON kernels (with and
# without dotprod) into the wheel; doctor reports `int8 native-neon-dotprod (installed)` there.
# Containers of a foreign image run with QEMU_CPU (default neoverse-n1: Armv8.2 with dotprod, no SVE)
# and a small read-only sysfs describing those cores at /sys/devices/system/cpu (torch's oneDNN
# reads each core's MIDR_EL1 there and crashes on the host's x86 sysfs); the service is started
# with --dtype $SERVE_DTYPE (default int8 for a foreign platform: the CMD's `auto` times every
# precision first, over 35 minutes under emulation; empty: the image's CMD). The first request on
# a volume without a cost profile for the pair measures it (profiles/ in the volume, kept for later
# starts): about an hour under emulation on 2 busy cores (59 min), so a foreign platform's READY_TIMEOUT
# and ASK_TIMEOUT (the ask's deadline, 300 s otherwise) default to 3600 s and 5400 s. Emulated speed
# says nothing about a board's: the script reports times only.
# Settings (environment): PYTHON, PLATFORM, IMAGE, DEVICE_HOME, READY_TIMEOUT, ASK_TIMEOUT, SERVE_DTYPE,
# QEMU_CPU, PIP_MIRRORS, PIP_CONSTRAINTS, PIP_CA, TORCH_INDEX, PODMAN_RUNTIME, PODMAN_ULIMITS,
# REBUILD_BASE=1, DEBIAN_MIRROR.
set -euo pipefail

case "${1-}" in
    "") ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: deploy/build_image.sh takes no arguments (got '$1'); its settings are environment variables (--help)" >&2; exit 2 ;;
esac

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-3.11}
HOST_PLATFORM=linux/$(podman info --format '{{.Host.Arch}}' 2>/dev/null || echo unknown)
PLATFORM=${PLATFORM:-$HOST_PLATFORM}
ARCH=${PLATFORM#*/}; ARCH=${ARCH%%/*}
[[ $PLATFORM == linux/* && -n $ARCH ]] || { echo "error: PLATFORM must be linux/<arch> (got '$PLATFORM')" >&2; exit 2; }
FOREIGN=0; SUFFIX=
[ "$PLATFORM" = "$HOST_PLATFORM" ] || { FOREIGN=1; SUFFIX=-$ARCH; }
IMAGE=${IMAGE:-localhost/omnidraft-device:latest$SUFFIX}
OFFICIAL_BASE=docker.io/library/python:${PYTHON}-slim-bookworm
LOCAL_BASE=localhost/omnidraft-python-base:${PYTHON}-bookworm$SUFFIX
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PULL_TIMEOUT=${PULL_TIMEOUT:-60}
DEVICE_HOME=${DEVICE_HOME:-/var/tmp/omnidraft-device-home}
if [ "$FOREIGN" = 1 ]; then
    READY_TIMEOUT=${READY_TIMEOUT:-3600}; ASK_TIMEOUT=${ASK_TIMEOUT:-5400}; SERVE_DTYPE=${SERVE_DTYPE-int8}
else
    READY_TIMEOUT=${READY_TIMEOUT:-1200}  # seconds; the first start measures dtype profiles (minutes on 2 CPUs)
    ASK_TIMEOUT=${ASK_TIMEOUT:-300}; SERVE_DTYPE=${SERVE_DTYPE-}
fi
QEMU_CPU=${QEMU_CPU:-neoverse-n1}
OMNIDRAFT=${OMNIDRAFT:-$ROOT/.venv/bin/omnidraft}
MODELS=(smollm2-135m qwen2.5-coder-0.5b)
PIP_MIRRORS=${PIP_MIRRORS:-/opt/wheels /opt/pypi /opt/pypi-more}
PIP_CONSTRAINTS=${PIP_CONSTRAINTS:-/etc/xdg/pip/constraints.txt}
PIP_CA=${PIP_CA:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
PODMAN=(podman --runtime "${PODMAN_RUNTIME:-runc}")
read -r -a ULIMITS <<< "${PODMAN_ULIMITS:---ulimit nofile=1024:1024 --ulimit nproc=1024:1024}"
CONTAINER=omnidraft-device-check-$$
NAME=${IMAGE##*/}; NAME=${NAME%%:*}
[ "$FOREIGN" = 0 ] || NAME="$NAME $PLATFORM"

WORK=$(mktemp -d /var/tmp/omnidraft-build.XXXXXX)
STEP=start
SIZE="not built"
ROOTFS=

say() { printf '== %s\n' "$*" >&2; }
human() { awk -v b="$1" 'BEGIN { if (b >= 1e9) printf "%.2f GB", b / 1e9; else printf "%.0f MB", b / 1e6 }'; }
image_size() { human "$(podman image inspect --format '{{.Size}}' "$1")"; }

finish() {
    local rc=$?
    trap - EXIT
    if podman container exists "$CONTAINER" 2>/dev/null; then
        if [ "$rc" -ne 0 ]; then
            say "container log (last 20 lines):"; podman logs "$CONTAINER" 2>&1 | tail -20 >&2 || true
        fi
        podman rm -f -t 10 "$CONTAINER" > /dev/null 2>&1 || true
    fi
    [ -n "$ROOTFS" ] && rm -rf --one-file-system "$ROOTFS"
    if [ "$rc" -eq 0 ]; then
        rm -rf "$WORK"
        echo "image: $NAME $SIZE, device answered"
    else
        echo "logs: $WORK" >&2
        echo "image: $NAME $SIZE, FAILED at $STEP (exit $rc)"
    fi
    exit "$rc"
}
trap finish EXIT

fail() { echo "error: $*" >&2; exit 1; }

# --- emulation (a foreign PLATFORM) ------------------------------------------------------------
RUN_EMU=()       # what containers of the image run with (foreign: the emulated CPU and its sysfs)
BUILD_PLATFORM=()
PULL_PLATFORM=()
if [ "$FOREIGN" = 1 ]; then
    STEP="emulation ($PLATFORM)"
    case $ARCH in arm64) QEMU_ARCH=aarch64 ;; amd64) QEMU_ARCH=x86_64 ;; *) QEMU_ARCH=$ARCH ;; esac
    BINFMT=/proc/sys/fs/binfmt_misc
    [ -e "$BINFMT/register" ] || mount -t binfmt_misc binfmt_misc "$BINFMT" 2> /dev/null \
        || fail "binfmt_misc is not mounted at $BINFMT and cannot be (needs root)"
    if ! grep -q '^flags:.*F' "$BINFMT/qemu-$QEMU_ARCH" 2> /dev/null; then
        [ "$(id -u)" -eq 0 ] || fail "qemu-$QEMU_ARCH is not registered with binfmt_misc with the F flag (as root: apt-get install qemu-user-static binfmt-support)"
        say "registering qemu-$QEMU_ARCH-static with binfmt_misc"
        if ! command -v "qemu-$QEMU_ARCH-static" > /dev/null || ! command -v update-binfmts > /dev/null; then
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static binfmt-support; } \
                > "$WORK/apt.log" 2>&1 || fail "cannot install qemu-user-static and binfmt-support (log: $WORK/apt.log)"
        fi
        # an entry without F (qemu-user-binfmt's) is dropped for qemu-user-static's
        [ -e "$BINFMT/qemu-$QEMU_ARCH" ] && echo -1 > "$BINFMT/qemu-$QEMU_ARCH"
        update-binfmts --enable "qemu-$QEMU_ARCH" >> "$WORK/apt.log" 2>&1 || true
        grep -q '^flags:.*F' "$BINFMT/qemu-$QEMU_ARCH" 2> /dev/null \
            || fail "cannot register qemu-$QEMU_ARCH with binfmt_misc with the F flag (log: $WORK/apt.log)"
    fi
    [ "$(head -1 "$BINFMT/qemu-$QEMU_ARCH")" = enabled ] || echo 1 > "$BINFMT/qemu-$QEMU_ARCH"
    say "platform $PLATFORM under qemu-$QEMU_ARCH ($(sed -n 's/^interpreter //p' "$BINFMT/qemu-$QEMU_ARCH"), QEMU_CPU=$QEMU_CPU)"
    RUN_EMU=(--platform "$PLATFORM" -e "QEMU_CPU=$QEMU_CPU")  # --platform: no "does not match" warning
    if [ "$ARCH" = arm64 ]; then
        # the emulated cores' sysfs: MIDR_EL1 of a Neoverse-N1 for each CPU the host gives
        SYSCPU=$WORK/sys-cpu
        CPUS=$(nproc)
        for ((c = 0; c < CPUS; c++)); do
            mkdir -p "$SYSCPU/cpu$c/regs/identification"
            echo 0x00000000413fd0c1 > "$SYSCPU/cpu$c/regs/identification/midr_el1"
        done
        for f in possible present online; do echo "0-$((CPUS - 1))" > "$SYSCPU/$f"; done
        RUN_EMU+=(-v "$SYSCPU:/sys/devices/system/cpu:ro")
        BUILD_PLATFORM=(-v "$SYSCPU:/sys/devices/system/cpu:ro")
    fi
    BUILD_PLATFORM+=(--platform "$PLATFORM")
    PULL_PLATFORM=(--platform "$PLATFORM")
fi

# --- base image -------------------------------------------------------------------------------
STEP="base image"
BUILD_FROM=()  # the Dockerfile's default base (the official image)
official_here() {  # the official base is here for PLATFORM (a foreign one: of its architecture)
    if [ "$FOREIGN" = 0 ]; then podman image exists "$OFFICIAL_BASE"
    else [ "$(podman image inspect --format '{{.Os}}/{{.Architecture}}' "$OFFICIAL_BASE" 2> /dev/null)" = "$PLATFORM" ]; fi
}
if official_here || timeout "$PULL_TIMEOUT" podman pull -q "${PULL_PLATFORM[@]}" "$OFFICIAL_BASE" > "$WORK/pull.log" 2>&1; then
    BASE=$OFFICIAL_BASE
    say "base: $BASE (official)"
else
    say "cannot pull $OFFICIAL_BASE: $(tail -1 "$WORK/pull.log")"
    [ "$PYTHON" = 3.11 ] || fail "no stand-in base for Python $PYTHON (Debian bookworm has 3.11)"
    BASE=$LOCAL_BASE
    BUILD_FROM=(--build-arg "BASE=$BASE")
    if [ "${REBUILD_BASE:-0}" != 1 ] && podman image exists "$BASE"; then
        say "base: $BASE (stand-in, already built)"
    else
        say "base: building the stand-in $BASE from Debian bookworm ($DEBIAN_MIRROR, $ARCH)"
        [ "$(id -u)" -eq 0 ] || fail "debootstrap needs root"
        command -v debootstrap > /dev/null || apt-get install -y debootstrap > "$WORK/apt.log" 2>&1
        ROOTFS=$WORK/rootfs
        STEP="debootstrap (log: $WORK/debootstrap.log)"
        if [ "$FOREIGN" = 0 ]; then
            debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
                bookworm "$ROOTFS" "$DEBIAN_MIRROR" > "$WORK/debootstrap.log" 2>&1
        else
            # two stages, the second under the emulator (copied in, then removed before the import)
            { debootstrap --foreign --arch="$ARCH" --variant=minbase --include=python3,python3-venv,ca-certificates \
                  bookworm "$ROOTFS" "$DEBIAN_MIRROR" \
              && cp "$(command -v "qemu-$QEMU_ARCH-static")" "$ROOTFS/usr/bin/" \
              && chroot "$ROOTFS" /debootstrap/debootstrap --second-stage; } > "$WORK/debootstrap.log" 2>&1
        fi
        STEP="stand-in base venv"
        chroot "$ROOTFS" python3 -m venv /usr/local/venv
        chroot "$ROOTFS" apt-get clean
        rm -rf "$ROOTFS"/var/lib/apt/lists/*
        [ "$FOREIGN" = 0 ] || rm -f "$ROOTFS/usr/bin/qemu-$QEMU_ARCH-static"
        : > "$ROOTFS/etc/resolv.conf"; : > "$ROOTFS/etc/hostname"
        STEP="podman import"
        IMPORT_ARCH=()
        [ "$FOREIGN" = 0 ] || IMPORT_ARCH=(--arch "$ARCH")
        tar -C "$ROOTFS" -c . | podman import -q "${IMPORT_ARCH[@]}" \
            --change 'ENV PATH=/usr/local/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
            --message "stand-in for $OFFICIAL_BASE ($PLATFORM): Debian bookworm minbase, python3 venv at /usr/local/venv" \
            - "$BASE" > /dev/null
        rm -rf "$ROOTFS"; ROOTFS=
    fi
    STEP="stand-in base check"
    "${PODMAN[@]}" run --rm "${ULIMITS[@]}" "${RUN_EMU[@]}" "$BASE" sh -c \
        'test "$(command -v python)" = /usr/local/venv/bin/python && pip --version && command -v useradd' > /dev/null
    if [ "$FOREIGN" = 1 ]; then
        machine=$("${PODMAN[@]}" run --rm "${ULIMITS[@]}" "${RUN_EMU[@]}" "$BASE" python -c 'import platform; print(platform.machine())')
        [ "$machine" = "$QEMU_ARCH" ] || fail "the stand-in base $BASE runs as '$machine', not $QEMU_ARCH"
    fi
fi
BASE_SIZE=$(image_size "$BASE")
say "base size: $BASE_SIZE"

# --- pip mirrors --------------------------------------------------------------------------------
STEP="pip mirrors"
BUILD_ARGS=()
MOUNTS=()
FIND_LINKS=()
INDEXES=()
for dir in $PIP_MIRRORS; do
    [ -d "$dir" ] || continue
    at=/run/omnidraft-mirrors/$(basename "$dir")
    MOUNTS+=(-v "$dir:$at:ro")
    if [ -d "$dir/simple" ]; then INDEXES+=("file://$at/simple"); else FIND_LINKS+=("$at"); fi
done
if [ ${#MOUNTS[@]} -gt 0 ]; then
    conf=$WORK/pip
    mkdir -p "$conf"
    {
        echo "[global]"
        [ ${#FIND_LINKS[@]} -eq 0 ] || echo "find-links = ${FIND_LINKS[*]}"
        [ ${#INDEXES[@]} -eq 0 ] || echo "extra-index-url = ${INDEXES[*]}"
        if [ -f "$PIP_CONSTRAINTS" ]; then cp "$PIP_CONSTRAINTS" "$conf/constraints.txt"; echo "constraint = /etc/xdg/pip/constraints.txt"; fi
        if [ -f "$PIP_CA" ]; then cp "$PIP_CA" "$conf/ca.crt"; echo "cert = /etc/xdg/pip/ca.crt"; fi
        echo "default-timeout = 180"
        echo "disable-pip-version-check = 1"
    } > "$conf/pip.conf"
    MOUNTS+=(-v "$conf:/etc/xdg/pip:ro")
    BUILD_ARGS+=(--build-arg "TORCH_INDEX=${TORCH_INDEX-}")
    say "pip mirrors: ${FIND_LINKS[*]} ${INDEXES[*]}; torch from ${TORCH_INDEX:-the pip configuration}"
elif [ -n "${TORCH_INDEX+set}" ]; then
    BUILD_ARGS+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
fi

# --- build --------------------------------------------------------------------------------------
STEP="podman build (log: $WORK/build.log)"
say "building $IMAGE"
t0=$SECONDS
if ! "${PODMAN[@]}" build "${ULIMITS[@]}" --network=host "${BUILD_PLATFORM[@]}" "${BUILD_FROM[@]}" "${BUILD_ARGS[@]}" "${MOUNTS[@]}" \
        -f "$ROOT/deploy/Dockerfile.device" -t "$IMAGE" "$ROOT" > "$WORK/build.log" 2>&1; then
    tail -30 "$WORK/build.log" >&2
    exit 1
fi
BUILD_S=$((SECONDS - t0))
SIZE=$(image_size "$IMAGE")
say "built $IMAGE ($(podman image inspect --format '{{.Os}}/{{.Architecture}}' "$IMAGE")) in ${BUILD_S} s: $SIZE (base $BASE: $BASE_SIZE)"

# --- the kernels came from the wheel: no compiler in the image, `doctor` loads them as installed --
STEP="kernel check"
"${PODMAN[@]}" run --rm "${ULIMITS[@]}" "${RUN_EMU[@]}" --entrypoint sh "$IMAGE" -c \
    '! command -v gcc > /dev/null && ! command -v cc > /dev/null && omnidraft doctor' > "$WORK/doctor.out" 2>&1 \
    || { cat "$WORK/doctor.out" >&2; fail "the image holds a compiler, or doctor failed"; }
KERNELS=$(sed -n 's/^int8 *//p' "$WORK/doctor.out")
say "image kernels: $KERNELS"
[[ $KERNELS == native-*"(installed)"* ]] || fail "the image's int8 kernels are not the wheel's: $KERNELS"

# --- models and the volume ----------------------------------------------------------------------
STEP="models pull (log: $WORK/pull-models.log)"
mkdir -p "$DEVICE_HOME"
say "models into $DEVICE_HOME: ${MODELS[*]} (GGUF)"
OMNIDRAFT_HOME=$DEVICE_HOME "$OMNIDRAFT" models pull "${MODELS[@]}" --format gguf > "$WORK/pull-models.log" 2>&1 \
    || { tail -20 "$WORK/pull-models.log" >&2; exit 1; }

STEP="volume owner"
ids=$("${PODMAN[@]}" run --rm "${ULIMITS[@]}" "${RUN_EMU[@]}" --entrypoint sh "$IMAGE" -c 'echo "$(id -u):$(id -g)"')
[[ $ids =~ ^[0-9]+:[0-9]+$ ]] || fail "cannot tell the image user's uid:gid ($ids)"
chown -R "$ids" "$DEVICE_HOME"

# --- run and ask --------------------------------------------------------------------------------
STEP="podman run"
SERVE=()  # empty: the image's CMD
if [ -n "$SERVE_DTYPE" ]; then
    SERVE=(device serve --drafter "${MODELS[0]}" --target "${MODELS[1]}" --dtype "$SERVE_DTYPE"
           --state-dir /var/lib/omnidraft/state --listen 127.0.0.1:50051)
    say "running device serve --dtype $SERVE_DTYPE (the CMD with another dtype) on the host's loopback, 127.0.0.1:50051"
else
    say "running the image's CMD (device serve on the host's loopback, 127.0.0.1:50051)"
fi
t0=$SECONDS
"${PODMAN[@]}" run -d --name "$CONTAINER" "${ULIMITS[@]}" "${RUN_EMU[@]}" --network=host \
    -v "$DEVICE_HOME:/var/lib/omnidraft" "$IMAGE" "${SERVE[@]}" > /dev/null

STEP="waiting for the service"
CLIENT=(--server 127.0.0.1:50051 --owner-token "$DEVICE_HOME/state/owner.token")
until [ -f "$DEVICE_HOME/state/owner.token" ] && "$OMNIDRAFT" device health "${CLIENT[@]}" --timeout 10 > /dev/null 2>&1; do
    [ "$(podman inspect --format '{{.State.Running}}' "$CONTAINER")" = true ] || fail "the container exited"
    [ $((SECONDS - t0)) -lt "$READY_TIMEOUT" ] || fail "no answer from the service within $READY_TIMEOUT s"
    sleep 5
done
READY_S=$((SECONDS - t0))
say "service up after ${READY_S} s"

STEP="omnidraft device ask"
"$OMNIDRAFT" device ask 'def add(a, b):' --max-new-tokens 8 "${CLIENT[@]}" --timeout "$ASK_TIMEOUT" > "$WORK/ask.out" 2>&1 \
    || { cat "$WORK/ask.out" >&2; exit 1; }
RUN_S=$((SECONDS - t0))
say "device answered (${RUN_S} s after start):"
cat "$WORK/ask.out" >&2
grep -q '[^[:space:]]' "$WORK/ask.out" || fail "empty answer"

STEP="podman stop"
podman stop -t 20 "$CONTAINER" > /dev/null
podman rm "$CONTAINER" > /dev/null
say "build ${BUILD_S} s, service ready ${READY_S} s, answered ${RUN_S} s after start; base $BASE $BASE_SIZE"
