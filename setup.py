"""Build the native int8 kernels at install time; everything else is in pyproject.toml.

One extension module per instruction set of the build machine's architecture
(``omnidraft.shared.runtime._fd_avx512``, ...): plain shared objects that the runtime loads with ctypes
and dispatches among by the CPU it runs on (``omnidraft/shared/runtime/native_kernels.py``, loaded here
by path because nothing is installed yet). A set the compiler cannot build (an old gcc without
AMX, no compiler at all) is skipped with a warning; the runtime then builds it at first use if
it can, or falls back to slower kernels and says so.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("_native_kernels", HERE / "shared" / "runtime" / "native_kernels.py")
native = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native)


class BuildKernels(build_ext):
    """Each kernel build with OpenMP, else without it, else skipped with one warning line."""

    def build_extension(self, ext: Extension) -> None:
        base = list(ext.extra_compile_args)
        for openmp in (native.OPENMP, []):
            ext.extra_compile_args = base + openmp
            ext.extra_link_args = [*openmp, "-lm"]
            try:
                super().build_extension(ext)
                return
            except Exception as exc:  # CompileError, LinkError, a missing compiler
                error = exc
        print(f"warning: native kernels {ext.name} not built ({error}); see omnidraft doctor", file=sys.stderr)


def kernel_extensions() -> list[Extension]:
    if platform.system() != "Linux":
        return []
    unit = (Path("shared") / "runtime" / "native" / native.UNIT).as_posix()
    return [
        Extension(
            f"omnidraft.shared.runtime.{native.extension_name(isa)}",
            sources=[unit],
            include_dirs=[(Path("shared") / "runtime" / "native").as_posix()],
            extra_compile_args=native.compile_flags(isa),
            depends=[(Path("shared") / "runtime" / "native" / name).as_posix() for name in native.native_sources(isa)],
            optional=True,
        )
        for isa, arch in native.NATIVE_MACHINES.items()
        if arch == native.cpu_machine()
    ]


setup(ext_modules=kernel_extensions(), cmdclass={"build_ext": BuildKernels})
