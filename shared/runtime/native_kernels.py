"""The native int8 kernels: what this CPU runs, and the compiled library for an instruction set.

The C sources are in ``shared/runtime/native/``. ``fd_unit.c`` is compiled once per instruction set
(``NATIVE_ISAS``) with that set's compiler flags (``compile_flags``). ``pip install`` builds them
(``setup.py``: one optional extension module per instruction set of the build machine's
architecture, ``omnidraft.shared.runtime._fd_<set>``, loaded with ctypes; a set the compiler cannot build
is skipped with a warning), and the loader dispatches at run time to the best set this CPU has
(``default_native_isa``). Each library carries the key of the sources and flags it was built
from (``fd_source_key``); where no installed build exists for a set, or it was built from other
sources (an editable checkout edited since its install), the set is built at first use with
``$CC`` (default gcc) into ``$OMNIDRAFT_HOME/fast_drafter/``. Without either, int8 falls back to
fbgemm and one line on stderr says what that loses (``FALLBACK_COST``).

At import this module needs only the standard library: ``setup.py`` loads it by path for the
build flags before anything else is installed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import os
import platform
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

NATIVE_DIR = Path(__file__).with_name("native")
UNIT = "fd_unit.c"  # the translation unit every build compiles (it includes the headers)
OPENMP = ["-fopenmp"]  # OpenMP for 2+ threads; a compiler without it builds single-threaded kernels


# AArch64 hardware capabilities (Linux AT_HWCAP bits) -> the /proc/cpuinfo feature names
_AARCH64_HWCAPS = {1: "asimd", 20: "asimddp"}


class FdModel(ctypes.Structure):
    """The C kernels' ``fd_model`` (``native/fd_common.h``): dimensions, pointers to the packed
    weights, KV caches and RoPE tables, and the activation mode."""

    _fields_ = [(name, ctypes.c_int32) for name in ("D", "H", "KV", "HD", "I", "L", "maxpos", "n_qkv", "n_head")] + [
        ("eps", ctypes.c_float),
        ("layer_ptrs", ctypes.c_void_p),
        ("head_ptrs", ctypes.c_void_p),
        ("kcache", ctypes.c_void_p),
        ("vcache", ctypes.c_void_p),
        ("cos_t", ctypes.c_void_p),
        ("sin_t", ctypes.c_void_p),
        ("act8", ctypes.c_int32),
    ]


def _aarch64_hwcaps() -> set[str]:
    """The CPU features the kernel reports to this process (``getauxval(AT_HWCAP)``): what the
    CPU runs, also where /proc/cpuinfo is unreadable (Android) or not the emulated CPU's (qemu-user)."""
    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return set()
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    hwcap = getauxval(16)  # AT_HWCAP
    return {name for bit, name in _AARCH64_HWCAPS.items() if hwcap >> bit & 1}


def cpu_machine() -> str:
    """This machine's architecture as the native builds name it (``x86_64``, ``aarch64``, ...)."""
    return {"AMD64": "x86_64", "arm64": "aarch64"}.get(platform.machine(), platform.machine())


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (``/proc/cpuinfo`` on x86-64, ``AT_HWCAP`` on
    AArch64); empty where neither can be read."""
    if cpu_machine() == "aarch64":
        return _aarch64_hwcaps()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# oneDNN ISA caps (``ONEDNN_MAX_CPU_ISA``) under which its bf16 kernels still run natively
_ONEDNN_BF16_ISAS = {
    "ALL",
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX10_1_512",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512_AMX_FP16",
}


def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists AMX-BF16 or AVX512-BF16 (Linux only; False elsewhere) and
    ``ONEDNN_MAX_CPU_ISA``, if set, still lets oneDNN use them."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap and cap not in _ONEDNN_BF16_ISAS:
        return False
    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


@functools.cache
def onednn_bf16_linear() -> bool:
    """True when oneDNN can prepack bf16 Linear weights on this CPU (it needs AVX512 BW/VL/DQ or
    AVX-NE-CONVERT; AVX2-only CPUs cannot)."""
    import torch

    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# instruction set -> (gcc flags, /proc/cpuinfo flags it needs), best first
_AVX512 = (
    ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"],
    {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"},
)
NATIVE_ISAS: dict[str, tuple[list[str], set[str]]] = {
    # AVX-512 VNNI for one-token steps, AMX-INT8 tiles for calls of 2+ tokens (Intel Sapphire Rapids and later)
    "amx": (_AVX512[0] + ["-mamx-tile", "-mamx-int8"], _AVX512[1] | {"amx_tile", "amx_int8"}),
    "avx512": _AVX512,
    "avx2": (["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
    # AArch64 (edge boards, phones): SDOT with the dot-product extension (Armv8.2+), plain NEON otherwise
    "neon-dotprod": (["-march=armv8.2-a+dotprod"], {"asimd", "asimddp"}),
    "neon": (["-march=armv8-a"], {"asimd"}),
}
_NATIVE_HEADERS = {  # what fd_unit.c includes for each set, beside fd_common.h and fd_driver.c
    "amx": ["fd_avx512.h", "fd_amx.h"],
    "avx512": ["fd_avx512.h"],
    "avx2": ["fd_avx2.h"],
    "neon-dotprod": ["fd_neon.h"],
    "neon": ["fd_neon.h"],
}
NATIVE_MACHINES = {
    "amx": "x86_64",
    "avx512": "x86_64",
    "avx2": "x86_64",
    "neon-dotprod": "aarch64",
    "neon": "aarch64",
}  # the machine each instruction set's build runs on
_native_lock = threading.Lock()
_native_state: dict[str, tuple] = {}  # instruction set -> (library or None, why not or None)


def default_native_isa() -> str | None:
    """The instruction set the native kernels use on this machine: ``$OMNIDRAFT_NATIVE_ISA``
    when set (a key of ``NATIVE_ISAS``), else the best one the CPU has that builds and runs;
    None when none fits."""
    forced = os.environ.get("OMNIDRAFT_NATIVE_ISA")
    if forced:
        return forced
    flags = cpu_flags()
    fits = [isa for isa, (_, needs) in NATIVE_ISAS.items() if needs <= flags]
    # the best one that also builds and runs here (AMX needs a gcc that knows it and the
    # kernel's permission for the tile state); else the best one, whose error says why not
    return next((isa for isa in fits if native_library(isa) is not None), fits[0] if fits else None)


def _native(isa: str | None) -> tuple:
    """(library or None, why not or None) for ``isa`` (default: ``default_native_isa()``),
    built on first use."""
    isa = isa or default_native_isa() or "avx512"
    with _native_lock:
        if isa not in _native_state:
            try:
                _native_state[isa] = (_build_native(isa), None)
            except Exception as exc:  # no compiler, unsupported CPU, ...: fall back to torch kernels
                _native_state[isa] = (None, f"{type(exc).__name__}: {exc}")
        return _native_state[isa]


def native_library(isa: str | None = None):
    """The native int8 kernel library (ctypes) for ``isa`` (default: ``default_native_isa()``),
    or None where it cannot be used (the reason is ``native_error(isa)``).

    Needs Linux on x86-64 (AMX-INT8, AVX-512 VNNI or AVX2 + FMA + F16C) or AArch64 (NEON, with or
    without the dot-product extension), and the build ``pip install`` made or a C compiler (see
    the module docstring). ``OMNIDRAFT_NATIVE=0`` disables it.
    """
    return _native(isa)[0]


def native_error(isa: str | None = None) -> str | None:
    """Why ``native_library(isa)`` is None (None when it is available)."""
    return _native(isa)[1]


# what running int8 weights without the native kernels costs (warnings, omnidraft doctor)
FALLBACK_COST = (
    "int8 runs on fbgemm: slower, and verification blocks are not bit-identical to single "
    "steps (greedy output may differ from the target alone's)"
)
_warned: set[str] = set()


def warn_no_kernels(reason: str | None) -> None:
    """One line on stderr, once per process and reason, when int8 weights fall back to fbgemm
    (not when ``OMNIDRAFT_NATIVE=0`` asked for it)."""
    if reason is None or "OMNIDRAFT_NATIVE=0" in reason or reason in _warned:
        return
    _warned.add(reason)
    print(f"warning: no native int8 kernels ({reason}); {FALLBACK_COST}; see omnidraft doctor", file=sys.stderr)


def compile_flags(isa: str) -> list[str]:
    """The compiler flags of ``isa``'s build of ``fd_unit.c`` (include path aside): optimization,
    the instruction set, which kernels to include and the key of the sources and flags."""
    return [
        "-O3",
        *NATIVE_ISAS[isa][0],
        f"-DFD_ISA_{isa.upper().replace('-', '_')}",
        f'-DFD_SOURCE_KEY="{source_key(isa)}"',
    ]


def source_key(isa: str) -> str:
    """16 hex digits of the sha256 of ``isa``'s sources (the unit and what it includes) and its
    instruction-set flags: equal keys, equal kernels."""
    digest = hashlib.sha256(" ".join(NATIVE_ISAS[isa][0]).encode())
    for name in native_sources(isa):
        digest.update((NATIVE_DIR / name).read_bytes())
    return digest.hexdigest()[:16]


def native_sources(isa: str) -> list[str]:
    """The files of ``isa``'s build in ``NATIVE_DIR``: the unit and what it includes."""
    return [UNIT, "fd_common.h", *_NATIVE_HEADERS[isa], "fd_driver.c"]


def extension_name(isa: str) -> str:
    """The installed build's module name inside ``omnidraft.shared.runtime`` (``_fd_avx512``, ...)."""
    return "_fd_" + isa.replace("-", "_")


def installed_library(isa: str) -> Path | None:
    """The library ``pip install`` built for ``isa``, if it exists and was built from these sources."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).with_name(extension_name(isa) + suffix)
        if path.is_file():
            return path if _library_key(path) == source_key(isa) else None
    return None


def _library_key(path: Path) -> str | None:
    try:
        key = ctypes.CDLL(str(path)).fd_source_key
    except (OSError, AttributeError):
        return None
    key.restype = ctypes.c_char_p
    return key().decode()


def library_origin(isa: str) -> str:
    """Where ``isa``'s kernels come from here: ``installed``, ``built at first use`` or ``none``
    (``omnidraft doctor``)."""
    lib = native_library(isa)
    if lib is None:
        return "none"
    return "installed" if Path(lib._name).parent == Path(__file__).parent else "built at first use"


def _build_native(isa: str):
    """The ctypes library of ``isa``: the installed build, else one built now (see the module
    docstring); raises with the reason where neither is possible."""
    if os.environ.get("OMNIDRAFT_NATIVE", "1") == "0":
        raise RuntimeError("disabled by OMNIDRAFT_NATIVE=0")
    if isa not in NATIVE_ISAS:
        raise RuntimeError(f"unknown instruction set {isa!r} (choose {', '.join(NATIVE_ISAS)})")
    if platform.system() != "Linux" or cpu_machine() != NATIVE_MACHINES[isa]:
        raise RuntimeError(f"the {isa} kernels need {NATIVE_MACHINES[isa]} Linux")
    missing = NATIVE_ISAS[isa][1] - cpu_flags()
    if missing:
        raise RuntimeError(f"CPU lacks {sorted(missing)}")
    so = installed_library(isa) or _compile_at_first_use(isa)
    lib = ctypes.CDLL(str(so))
    lib.fd_forward.restype = ctypes.c_int
    lib.fd_forward.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.fd_forward_rows.restype = ctypes.c_int
    lib.fd_forward_rows.argtypes = [
        ctypes.c_void_p,  # const fd_model* const* rmd
        ctypes.c_void_p,  # const int32_t* rpos
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,  # const int32_t* keep
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.fd_pack_rows.restype = None
    lib.fd_pack_rows.argtypes = [
        ctypes.c_void_p,  # const float* w
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,  # uint8_t* packed
        ctypes.c_void_p,  # float* scales
        ctypes.c_int,
    ]
    if isa == "amx" and lib.fd_amx_init() != 0:
        raise RuntimeError("Linux refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
    return lib


def _compile_at_first_use(isa: str) -> Path:
    """Build ``isa``'s library with ``$CC`` into ``$OMNIDRAFT_HOME/fast_drafter/`` (once per
    sources, flags and compiler; ~1-3 s) and return its path."""
    from omnidraft.shared.engine import catalog

    cc = os.environ.get("CC", "gcc")
    flags = [*compile_flags(isa), "-shared", "-fPIC", f"-I{NATIVE_DIR}"]
    key = hashlib.sha256((" ".join(flags) + cc).encode()).hexdigest()[:16]
    out_dir = catalog.omnidraft_home() / "fast_drafter"
    so = out_dir / f"fd_{isa}_{key}.so"
    if so.exists():
        return so
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_so = Path(tmp) / "fd.so"
        for extra in (OPENMP, []):
            try:
                proc = subprocess.run(
                    [cc, *flags, *extra, str(NATIVE_DIR / UNIT), "-o", str(tmp_so), "-lm"],
                    capture_output=True,
                    text=True,
                )
            except OSError as exc:  # no compiler
                raise RuntimeError(f"not installed with the package, and {cc} cannot run: {exc}") from None
            if proc.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp_so, so)  # atomic: concurrent builders agree on the result
    return so
