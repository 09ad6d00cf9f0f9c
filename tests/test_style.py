"""The code follows one style: ``ruff format`` and ``ruff check`` (configured in pyproject.toml)
are clean, so CI (README's test command) fails on a file that is not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff_is_clean(command):
    ruff = Path(sys.executable).with_name("ruff")
    done = subprocess.run([str(ruff), *command, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


# the rooms of docs/engine.md and README "Layout": what each product folder may not import
FORBIDDEN = {
    "shared": ("client", "coordinator", "simulations", "benchmarks", "cli"),
    "client": ("coordinator", "simulations", "benchmarks", "cli"),
    "coordinator": ("client", "simulations", "benchmarks", "cli"),
}


def omnidraft_imports(path: Path) -> set[str]:
    """The ``omnidraft.<room>`` names a module imports anywhere (function-level imports too)."""
    import ast

    rooms = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        rooms |= {n.split(".")[1] for n in names if n.startswith("omnidraft.") and n.count(".") >= 1}
    return rooms


@pytest.mark.parametrize("room", list(FORBIDDEN))
def test_product_code_imports_only_the_rooms_it_may(room):
    """The engine imports neither the device nor the coordinator; those two never import each
    other; none of them imports the simulations, the benchmarks or the CLI."""
    found = {
        f"{path.relative_to(ROOT)} imports omnidraft.{other}"
        for path in sorted((ROOT / room).rglob("*.py"))
        for other in omnidraft_imports(path) & set(FORBIDDEN[room])
    }
    assert not found, "\n".join(sorted(found))


MAX_LINES = 500
GENERATED = ("_pb2.py", "_pb2_grpc.py")  # protoc's output (proto/generate.py), as pyproject's ruff excludes


def python_modules() -> list[Path]:
    """The repository's tracked Python files; without git (a copied tree), every one outside
    hidden folders, virtual environments and build output."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        return [ROOT / name for name in listed.split("\0") if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {"build", "dist", "node_modules", "__pycache__"}
        return [
            p
            for p in ROOT.rglob("*.py")
            if not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts[:-1])
        ]


def test_no_module_is_over_500_lines():
    """The project's rule: no Python module over 500 lines (generated code excepted); split one
    that grows past it into modules named for what they hold."""
    modules = python_modules()
    assert modules, "no Python modules found"
    found = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in sorted(modules)
        if not path.name.endswith(GENERATED)
        and (n := len(path.read_text(encoding="utf-8", errors="replace").splitlines())) > MAX_LINES
    ]
    assert not found, "over 500 lines:\n" + "\n".join(found)
