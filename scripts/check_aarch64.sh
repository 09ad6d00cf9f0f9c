#!/usr/bin/env bash
# Does the device install (the base package, no extras) resolve for a glibc aarch64 board
# (manylinux_2_28, CPython 3.11) from binary wheels only? A dry run: nothing is installed.
# Resolves twice: as PyPI gives it (torch's aarch64 wheel declares CUDA 13 packages), and with
# those CUDA packages excluded (a board takes torch's CPU wheel from PyTorch's own index).
# Needs the package index; uses uv (installed with flwr).
set -euo pipefail
cd "$(dirname "$0")/.."
UV="${UV:-$(command -v uv || echo .venv/bin/uv)}"
OUT="${1:-/tmp/omnidraft-aarch64}"
mkdir -p "$OUT"
echo "torch==2.13.0" > "$OUT/constraints.txt"
args=(pyproject.toml --python-version 3.11 --python-platform aarch64-manylinux_2_28 --only-binary :all:
      --constraint "$OUT/constraints.txt" --no-header --quiet)
"$UV" pip compile "${args[@]}" -o "$OUT/with-cuda.txt"
grep -E '^(cuda|nvidia|triton)' "$OUT/with-cuda.txt" | cut -d= -f1 > "$OUT/cuda-packages.txt" || true
"$UV" pip compile "${args[@]}" --excludes "$OUT/cuda-packages.txt" -o "$OUT/cpu-only.txt"
for f in with-cuda cpu-only; do
  n=$(grep -c '==' "$OUT/$f.txt")
  echo "$f: $n packages, all as manylinux aarch64 / py3 wheels ($OUT/$f.txt)"
done
if grep -qE '^(ray|matplotlib)==' "$OUT/cpu-only.txt"; then
  echo "error: the device install pulls Ray or matplotlib" >&2; exit 1
fi
grep -E '^(torch|flwr|grpcio|cryptography|transformers|tokenizers|numpy)==' "$OUT/cpu-only.txt" | tr '\n' ' '; echo
