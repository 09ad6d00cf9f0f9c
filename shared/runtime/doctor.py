"""What this machine gives the runtime, and what it lacks (``omnidraft doctor``).

``diagnose()`` gathers, without loading a model: the CPU and the instruction-set features the
kernels use, which native int8 kernel builds exist for this machine and why the others do not,
the backend int8 models will run on, the catalog models on disk (bytes) and the cached cost
profiles. ``missing`` lists, one line each, what is absent and what that costs (speed, bit-exact
int8 verification). ``format_report`` prints it for people.
"""

from __future__ import annotations

import os
import shutil

import torch

from omnidraft.shared.engine import catalog
from omnidraft.shared.engine.profiling import cpu_name
from omnidraft.shared.runtime.heap import memory_limit_bytes, small_machine
from omnidraft.shared.runtime.native_kernels import (
    FALLBACK_COST,
    NATIVE_MACHINES,
    cpu_flags,
    cpu_has_native_bf16,
    cpu_machine,
    default_native_isa,
    installed_library,
    library_origin,
    native_error,
)

# the CPU features the kernels and torch's paths use, by machine
FEATURES = {
    "x86_64": ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"),
    "aarch64": ("asimd", "asimddp"),
}


def diagnose() -> dict:
    """The machine, its kernels, models and profiles as JSON-able values (see the module docstring)."""
    machine = cpu_machine()
    flags = cpu_flags()
    # each build for this machine: "ok" or why not (the CPU's missing features, the compiler, the OS)
    isas = {isa: native_error(isa) or "ok" for isa, arch in NATIVE_MACHINES.items() if arch == machine}
    default = default_native_isa()
    usable = default is not None and native_error(default) is None
    bf16 = cpu_has_native_bf16()
    home = catalog.omnidraft_home()
    models = {name: catalog.info(name)["bytes_on_disk"] for name in catalog.CATALOG if catalog.is_pulled(name)}
    profiles = home / "profiles"
    missing = []
    if os.environ.get("OMNIDRAFT_NATIVE") == "0":
        missing.append(f"native kernels switched off (OMNIDRAFT_NATIVE=0): {FALLBACK_COST}")
    elif not usable:
        why = native_error(default) if default else "no instruction set of this CPU has native kernels"
        missing.append(f"no native int8 kernels ({why}): {FALLBACK_COST}")
    not_installed = [isa for isa in isas if installed_library(isa) is None]
    if not_installed and not shutil.which(os.environ.get("CC", "gcc")):
        missing.append(
            f"no C compiler ({os.environ.get('CC', 'gcc')}) and no installed build of {', '.join(not_installed)}: "
            "those kernels cannot be built"
        )
    if machine == "x86_64" and not bf16:
        missing.append("no native bf16 (AVX512-BF16/AMX): training runs in float32, about 2x slower")
    if not models:
        missing.append(
            "no catalog model on disk yet: the first run downloads and converts them (omnidraft models pull NAME)"
        )
    return {
        "machine": {
            "cpu": cpu_name(),
            "arch": machine,
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "memory_limit_bytes": memory_limit_bytes(),
            "board_settings": small_machine(),
        },
        "cpu_features": {f: f in flags for f in FEATURES.get(machine, ())},
        "native_kernels": isas,
        "int8_backend": f"native-{default} ({library_origin(default)})" if usable else "fbgemm (no native kernels)",
        "native_bf16": bf16,
        "home": str(home),
        "models_bytes": models,
        "models_format": {name: catalog.pulled_format(name) for name in models},
        "profiles": len(list(profiles.glob("*.json"))) if profiles.is_dir() else 0,
        "missing": missing,
    }


def format_report(report: dict) -> str:
    """``diagnose()`` as lines for a terminal."""
    m = report["machine"]
    lines = [
        f"machine   {m['cpu']} ({m['arch']}, {m['cpus']} CPUs), torch {m['torch']} "
        f"({m['torch_cpu_capability']}, {m['threads']} threads)",
        f"memory    {m['memory_limit_bytes'] / 2**30:.1f} GiB for this process; board settings (recompute "
        f"activations, hand re-packs back): {'yes' if m['board_settings'] else 'no'}",
        "features  " + " ".join(f if on else f"-{f}" for f, on in report["cpu_features"].items()),
        "kernels   " + "; ".join(f"{isa}: {state}" for isa, state in report["native_kernels"].items()),
        f"int8      {report['int8_backend']}; native bf16: {'yes' if report['native_bf16'] else 'no'}",
        f"home      {report['home']}",
    ]
    models = report["models_bytes"]
    formats = report.get("models_format", {})
    lines.append(
        "models    "
        + (", ".join(f"{n} {b / 1e9:.2f} GB ({formats.get(n, '?')})" for n, b in models.items()) if models else "none")
        + (f" ({sum(models.values()) / 1e9:.2f} GB in all)" if models else "")
    )
    lines.append(f"profiles  {report['profiles']} cached")
    lines += [f"missing   {line}" for line in report["missing"]] or ["missing   nothing"]
    return "\n".join(lines)
