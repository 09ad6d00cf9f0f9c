"""Prompts cut from one real project's source: what one device's user writes.

A *personal codebase* stream: every function of an installed Python package, in file order,
becomes a prompt made of its module's imports followed by the function's head (decorators,
signature and docstring, or the signature alone); the model writes the body. Prompts of one
project share its names, idioms and imports, so a device that keeps writing in it has much of
its own to learn, unlike a mix of unrelated sources.

``codebase_prompts("peft")`` reads the package's files where it is installed (it is never
imported); the order is deterministic (sorted paths, then line), so splitting the stream in
order puts later files in the held-out part. Dataset names ``codebase:<package>`` select it in
``omnidraft bench`` and ``omnidraft adapt``.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

PREFIX = "codebase:"
MAX_IMPORT_CHARS = 1200  # the module's import block is cut (whole lines) at this size
MAX_HEAD_CHARS = 1500  # functions whose head is longer are skipped
MIN_BODY_LINES = 3  # functions whose body (after the docstring) is shorter are skipped


def package_root(package: str) -> Path:
    """The directory (or single file) an installed package's source lives in; ValueError with a
    one-line message when it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        raise ValueError(f"package {package!r} is not installed (codebase prompts read its source)")
    origin = Path(spec.origin)
    return origin.parent if origin.name == "__init__.py" else origin


def _import_block(tree: ast.Module, lines: list[str]) -> str:
    """The module's top-level import statements, as written, cut at ``MAX_IMPORT_CHARS``."""
    out, size = [], 0
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            if size + len(text) + 1 > MAX_IMPORT_CHARS:
                break
            out.append(text)
            size += len(text) + 1
    return "\n".join(out)


def _head(node, lines: list[str]) -> str | None:
    """A function's decorators, signature and docstring as written (newline-terminated), or
    None when its body is too short or its head too long."""
    first = node.body[0]
    has_doc = (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    )
    body = node.body[1:] if has_doc else node.body
    if not body or node.end_lineno - body[0].lineno + 1 < MIN_BODY_LINES:
        return None
    start = _first_line(node)
    end = first.end_lineno if has_doc else body[0].lineno - 1
    head = "\n".join(lines[start - 1 : end]) + "\n"
    return head if len(head) <= MAX_HEAD_CHARS else None


def _first_line(node: ast.stmt) -> int:
    """The first source line of a statement, its decorators included (``lineno`` is the
    ``def``/``class`` line)."""
    return min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])


def _function_heads(tree: ast.Module, lines: list[str]):
    """``(line, head)`` of every module-level function and every method of a module-level
    class with a body of at least ``MIN_BODY_LINES`` lines; a method's head follows its class
    statement (``class C(Base):``)."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions):
            head = _head(node, lines)
            if head is not None:
                yield node.lineno, head
        elif isinstance(node, ast.ClassDef) and node.body:
            start = _first_line(node)
            end = _first_line(node.body[0])  # a decorated first method: its decorators are its own
            header = "\n".join(lines[start - 1 : end - 1]).rstrip() + "\n"
            for item in node.body:
                if isinstance(item, functions):
                    head = _head(item, lines)
                    if head is not None:
                        yield item.lineno, header + head


def parsed_modules(paths) -> Iterator[tuple[Path, list[str], ast.Module]]:
    """``(path, source lines, syntax tree)`` of each readable, parseable Python file of
    ``paths`` (the others are skipped)."""
    for path in paths:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        yield path, source.splitlines(), tree


def codebase_prompts(package: str, limit: int | None = None) -> list[str]:
    """The personal-codebase stream of ``package`` (see the module docstring), at most
    ``limit`` prompts."""
    root = package_root(package)
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    prompts: list[str] = []
    for _, lines, tree in parsed_modules(files):
        imports = _import_block(tree, lines)
        for _, head in sorted(_function_heads(tree, lines)):
            prompts.append(f"{imports}\n\n\n{head}" if imports else head)
            if limit and len(prompts) >= limit:
                return prompts
    if not prompts:
        raise ValueError(f"package {package!r} has no function to cut prompts from")
    return prompts
