#!/usr/bin/env bash
# The device package on AArch64, checked on an x86-64 Linux machine under emulation.
#
#   bash deploy/aarch64/check.sh                 # kernels, then the full arm64 userland
#   bash deploy/aarch64/check.sh --kernels-only  # the part CI runs
#
# 1. Kernels: the native int8 kernels cross-built with Debian's gcc-aarch64-linux-gnu and run
#    under qemu-aarch64, with the dot-product extension (qemu CPU `max`) and without it
#    (Cortex-A53): a block's logits equal single steps' bit for bit, and agree with the x86
#    build's (tests/test_native_kernels.py).
# 2. Userland: a Debian arm64 root (debootstrap + qemu-user-static through binfmt_misc) installs
#    the device package as docs/deployment.md says (torch==2.13.0 first, then the project; pytest
#    beside it), runs the greedy-identity tests on tiny models there, `omnidraft generate` with a
#    catalog pair speculatively and with the target alone (the same tokens, checked), and
#    `omnidraft device serve` answering `omnidraft device ask`.
# The last line says what passed, e.g. `aarch64: kernels ok, greedy identical 13/13 (...), device
# answered`, or what failed; the exit status is non-zero on any failure. Needs root for apt-get, mount
# and chroot. The arm64 root is kept in $OMNIDRAFT_ARM64_ROOT (default ~/.cache/omnidraft/arm64-root).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO="$PWD"
PY="${PYTHON:-$REPO/.venv/bin/python}"
ROOT="${OMNIDRAFT_ARM64_ROOT:-$HOME/.cache/omnidraft/arm64-root}"
SUITE="${OMNIDRAFT_ARM64_SUITE:-bookworm}"
MIRROR="${OMNIDRAFT_ARM64_MIRROR:-http://deb.debian.org/debian}"
KERNELS_ONLY=0
case "${1:-}" in
  "") ;;
  --kernels-only) KERNELS_ONLY=1 ;;
  *) echo "usage: bash deploy/aarch64/check.sh [--kernels-only] (unknown argument: $1)" >&2; exit 2 ;;
esac

say() { echo "[aarch64] $*" >&2; }
finish() { echo "aarch64: $*"; exit "${STATUS:-0}"; }

need_packages() {  # install Debian packages whose commands are missing (root only)
  local missing=()
  while [ $# -gt 1 ]; do command -v "$1" >/dev/null 2>&1 || missing+=("$2"); shift 2; done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    say "missing ${missing[*]}: install them (Debian/Ubuntu: apt-get install ${missing[*]})"; return 1
  fi
  say "installing ${missing[*]}"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

# --- 1. kernels -------------------------------------------------------------------------------
need_packages aarch64-linux-gnu-gcc gcc-aarch64-linux-gnu qemu-aarch64 qemu-user \
  || { STATUS=1 finish "kernels not checked (no cross compiler or qemu)"; }
[ -x "$PY" ] || { STATUS=1 finish "kernels not checked: no $PY (run scripts/setup.sh first)"; }
say "kernels: cross-built, run under qemu-aarch64"
if "$PY" -m pytest -q -rs tests/test_native_kernels.py -k aarch64 -p no:cacheprovider >&2; then
  KERNELS="kernels ok"
else
  STATUS=1 finish "kernels FAILED (tests/test_native_kernels.py -k aarch64)"
fi
[ $KERNELS_ONLY = 1 ] && finish "$KERNELS (userland not run: --kernels-only)"

# --- 2. userland --------------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || { STATUS=1 finish "$KERNELS; userland needs root (debootstrap, chroot)"; }
need_packages debootstrap debootstrap qemu-aarch64-static qemu-user-static update-binfmts binfmt-support \
  || { STATUS=1 finish "$KERNELS; userland not run (no debootstrap/qemu-user-static)"; }
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
  mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
    || { STATUS=1 finish "$KERNELS; userland not run: binfmt_misc cannot be mounted here"; }
fi
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 \
  || { STATUS=1 finish "$KERNELS; userland not run: cannot register qemu-aarch64 with binfmt_misc"; }

T0=$SECONDS
if [ ! -x "$ROOT/usr/bin/python3" ]; then
  say "debootstrap $SUITE arm64 into $ROOT (several minutes)"
  mkdir -p "$ROOT"
  # two stages, with the emulator inside the root: works whether or not binfmt_misc holds it open (F flag)
  { debootstrap --foreign --arch=arm64 --include=python3,python3-venv,python3-pip,gcc,libc6-dev,ca-certificates \
        "$SUITE" "$ROOT" "$MIRROR" \
    && cp "$(command -v qemu-aarch64-static)" "$ROOT/usr/bin/" \
    && chroot "$ROOT" /debootstrap/debootstrap --second-stage; } >"$ROOT.debootstrap.log" 2>&1 \
    || { STATUS=1 finish "$KERNELS; userland FAILED: debootstrap (see $ROOT.debootstrap.log)"; }
fi
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# trust what this machine trusts (networks whose egress proxy re-signs TLS add their own CA)
[ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
for fs in proc dev; do mountpoint -q "$ROOT/$fs" || mount --bind "/$fs" "$ROOT/$fs"; done
trap 'for fs in dev proc; do umount -l "$ROOT/$fs" 2>/dev/null; done' EXIT
# The emulated CPU: a 2-core Neoverse-N1 (Armv8.2 with the dot-product extension, no SVE).
# Not the host's /sys: torch's oneDNN reads each core's MIDR_EL1 there and crashes without it,
# so the root gets a minimal sysfs describing the emulated cores.
export QEMU_CPU=neoverse-n1
mountpoint -q "$ROOT/sys" && umount -l "$ROOT/sys"
for c in 0 1; do
  mkdir -p "$ROOT/sys/devices/system/cpu/cpu$c/regs/identification"
  echo 0x00000000413fd0c1 > "$ROOT/sys/devices/system/cpu/cpu$c/regs/identification/midr_el1"
done
for f in possible present online; do echo 0-1 > "$ROOT/sys/devices/system/cpu/$f"; done

# the working tree as committed, plus uncommitted changes (what `pip install .` of a checkout sees)
say "copying the project into the arm64 root"
rm -rf "$ROOT/opt/omnidraft" && mkdir -p "$ROOT/opt/omnidraft"
git ls-files -z --cached --others --exclude-standard | (cd "$REPO" && xargs -0 cp --parents -t "$ROOT/opt/omnidraft" 2>/dev/null)
run_arm() { chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin OMNIDRAFT_HOME=/root/.cache/omnidraft \
              QEMU_CPU="$QEMU_CPU" bash -c "cd /opt/omnidraft && $1"; }
say "installing the device package in the arm64 root (torch first, then the project; slow under emulation)"
run_arm "python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 \
         && /opt/venv/bin/pip install -q --disable-pip-version-check -e . pytest" >&2 \
  || { STATUS=1 finish "$KERNELS; userland FAILED: pip install"; }
run_arm "/opt/venv/bin/python -c 'import platform; from omnidraft.shared.runtime.native_kernels import default_native_isa, native_error; \
         isa = default_native_isa(); print(\"arm64 root:\", platform.machine(), \"native kernels:\", isa, native_error(isa) or \"built\")'" >&2

say "greedy identity on tiny models (arm64)"
OUT=$(run_arm "/opt/venv/bin/python -m pytest -q -p no:cacheprovider tests/test_precision.py -k 'bit_identical or greedy_identity'" 2>&1)
echo "$OUT" | tail -3 >&2
PASSED=$(echo "$OUT" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+' || echo 0)
FAILED=$(echo "$OUT" | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+' || echo 0)
IDENT="greedy identical $PASSED/$((PASSED + FAILED))"
[ "$FAILED" = 0 ] && [ "$PASSED" -gt 0 ] || { STATUS=1 finish "$KERNELS; $IDENT (tests/test_precision.py in the arm64 root)"; }

say "greedy identity with a catalog pair (arm64): omnidraft generate, speculative and the target alone"
# --draft-stop confidence: the throughput rule would first measure this machine's cost profile
# (about an hour under emulation)
GEN="/opt/venv/bin/omnidraft generate --drafter smollm2-135m --target qwen2.5-coder-0.5b --dtype int8 \
     --draft-stop confidence --max-new-tokens 24 --prompt 'def fibonacci(n):' --json"
run_arm "$GEN --method omnidraft > /root/gen-omnidraft.json && $GEN --method ar > /root/gen-ar.json \
         && /opt/venv/bin/python -c 'import json; a, b = (json.load(open(f\"/root/gen-{m}.json\")) for m in (\"ar\", \"omnidraft\")); \
            print(\"omnidraft:\", repr(b[\"text\"]), b[\"stats\"][\"target_calls\"], \"target calls; ar:\", a[\"stats\"][\"target_calls\"]); \
            raise SystemExit(a[\"token_ids\"] != b[\"token_ids\"])'" >&2
case $? in
  0) PAIR=1 ;;
  1) PAIR=0 ;;
  *) STATUS=1 finish "$KERNELS; $IDENT; generate FAILED" ;;
esac
IDENT="greedy identical $((PASSED + PAIR))/$((PASSED + FAILED + 1)) (tiny models $PASSED/$((PASSED + FAILED)), smollm2-135m -> qwen2.5-coder-0.5b $PAIR/1)"
[ $PAIR = 1 ] || { STATUS=1 finish "$KERNELS; $IDENT: the catalog pair's speculative output differs from the target alone"; }

say "omnidraft device serve + ask (arm64)"
# --dtype int8: `auto` would time every candidate precision first (over 35 min under emulation);
# --draft-stop confidence: the throughput rule would measure the pair's cost profile on the first
# request (about an hour under emulation)
run_arm "(/opt/venv/bin/omnidraft device serve --drafter smollm2-135m --target qwen2.5-coder-0.5b --dtype int8 \
            --draft-stop confidence --state-dir /root/state > /root/serve.log 2>&1 &) ; \
         for i in \$(seq 600); do /opt/venv/bin/omnidraft device ask 'def add(a, b):' --max-new-tokens 8 2>/dev/null && exit 0; sleep 2; done; \
         tail -5 /root/serve.log; exit 1" >&2
ASK=$?
run_arm "pkill -f 'omnidraft device serve'" >/dev/null 2>&1
[ $ASK = 0 ] || { STATUS=1 finish "$KERNELS; $IDENT; device did NOT answer"; }
say "userland part took $((SECONDS - T0)) s"
finish "$KERNELS, $IDENT, device answered"
