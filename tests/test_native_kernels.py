"""The native kernels on their own, without Python in the loop (``tests/native/fd_check.c``):
on this machine for every x86 instruction set its CPU has, and for AArch64 cross-built with
Debian's ``gcc-aarch64-linux-gnu`` and run under ``qemu-aarch64`` (with and without the
dot-product extension) when those are installed (``deploy/aarch64/check.sh`` installs them).
Each build must give a block's logits bit-identical to single steps, and logits close to the
other builds' on the same random model (the integer sums are exact everywhere; only float
summation order differs)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from omnidraft.shared.runtime.native_kernels import NATIVE_DIR, NATIVE_ISAS, UNIT, compile_flags, cpu_flags

CHECK = Path(__file__).with_name("native") / "fd_check.c"
X86 = [isa for isa in ("amx", "avx512", "avx2") if NATIVE_ISAS[isa][1] <= cpu_flags()]
CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
# qemu's CPU models: `max` has the dot-product extension, Cortex-A53 (Armv8.0) does not
AARCH64 = {"neon-dotprod": "max", "neon": "cortex-a53"}


def build(tmp_path: Path, isa: str, cc: str, extra: list[str]) -> Path:
    source = tmp_path / f"fd_check_{isa}.c"
    source.write_text(f'#include "{UNIT}"\n' + CHECK.read_text())  # the unit every build compiles
    exe = tmp_path / f"fd_check_{isa}"
    for openmp in (["-fopenmp"], []):
        proc = subprocess.run(
            [cc, *compile_flags(isa), f"-I{NATIVE_DIR}", *openmp, *extra, str(source), "-o", str(exe), "-lm"],
            capture_output=True,
            text=True,
        )
        if proc.returncode == 0:
            return exe
    pytest.fail(f"{cc} could not build the {isa} kernels: {proc.stderr[-800:]}")


def run(cmd: list[str], logits: Path) -> np.ndarray:
    proc = subprocess.run([*cmd, str(logits)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("==") == 2, proc.stdout  # both activation modes: block == single steps
    return np.fromfile(logits, dtype="<f4")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> np.ndarray:
    """Logits of the random model from the best x86 build on this machine."""
    if not X86 or shutil.which("gcc") is None:
        pytest.skip("no x86 instruction set or gcc here")
    tmp = tmp_path_factory.mktemp("ref")
    return run([str(build(tmp, X86[-1], "gcc", []))], tmp / "logits.bin")


@pytest.mark.parametrize("isa", X86)
def test_x86_kernels_block_equals_single_steps(isa, tmp_path, reference):
    logits = run([str(build(tmp_path, isa, "gcc", []))], tmp_path / "logits.bin")
    assert logits.shape == reference.shape and np.isfinite(logits).all()
    assert np.abs(logits - reference).max() <= 2e-3 * np.abs(reference).max()


@pytest.mark.parametrize("isa", list(AARCH64))
def test_aarch64_kernels_under_qemu(isa, tmp_path, reference):
    """Cross-built AArch64 kernels run under user-mode qemu: block == single steps, and the
    logits agree with the x86 build's."""
    missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    exe = build(tmp_path, isa, CROSS_CC, ["-static"])
    logits = run([QEMU, "-cpu", AARCH64[isa], str(exe)], tmp_path / "logits.bin")
    assert logits.shape == reference.shape and np.isfinite(logits).all()
    assert np.abs(logits - reference).max() <= 2e-3 * np.abs(reference).max()
