#!/usr/bin/env python3
"""Regenerate the Python modules for every ``proto/*.proto``.

    python proto/generate.py          # write proto/<name>_pb2.py (+ _pb2_grpc.py for services)
    python proto/generate.py --check  # exit 1 if the committed modules differ from fresh output

Each file is compiled with ``grpc_tools.protoc -I proto``, so .proto files import each other by
bare file name (``import "common.proto";``). protoc turns such an import into ``import
common_pb2``, which only resolves with proto/ on ``sys.path``; those lines are rewritten to
``from . import common_pb2`` so the modules work as the ``omnidraft.proto`` package.
``--grpc_python_out`` is passed only for files that declare a ``service``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_SERVICE = re.compile(r"^\s*service\s+\w+", re.MULTILINE)
_FLAT_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def declares_service(proto: Path) -> bool:
    """True if the .proto file (comments ignored) declares a gRPC ``service``."""
    return bool(_SERVICE.search(_COMMENT.sub("", proto.read_text(encoding="utf-8"))))


def _protoc(args: list[str]) -> None:
    """Run grpc_tools' bundled protoc; exit with a one-line message if it fails."""
    wkt = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    if protoc.main(["grpc_tools.protoc", f"-I{wkt}", *args]) != 0:
        raise SystemExit("generate.py: protoc failed (see its message above)")


def generate(proto_dir: Path) -> dict[str, bytes]:
    """Compile every ``*.proto`` in proto_dir; return {generated file name: contents}."""
    protos = sorted(proto_dir.glob("*.proto"))
    if not protos:
        return {}
    services = [str(p) for p in protos if declares_service(p)]
    local = {p.stem + "_pb2" for p in protos}
    with tempfile.TemporaryDirectory() as tmp:
        _protoc([f"-I{proto_dir}", f"--python_out={tmp}", *map(str, protos)])
        if services:
            _protoc([f"-I{proto_dir}", f"--grpc_python_out={tmp}", *services])
        return {
            path.name: _FLAT_IMPORT.sub(
                lambda m: f"from . import {m[1]} as {m[2]}" if m[1] in local else m[0],
                path.read_text(encoding="utf-8"),
            ).encode()
            for path in sorted(Path(tmp).iterdir())
        }


def committed(proto_dir: Path) -> dict[str, bytes]:
    """The generated modules currently in proto_dir: {file name: contents}."""
    return {p.name: p.read_bytes() for p in proto_dir.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the committed modules")
    parser.add_argument("--proto-dir", type=Path, default=PROTO_DIR, help="default: this script's folder")
    args = parser.parse_args(argv)
    proto_dir = args.proto_dir.resolve()
    fresh, old = generate(proto_dir), committed(proto_dir)
    stale = sorted(name for name in fresh.keys() | old.keys() if fresh.get(name) != old.get(name))
    if args.check:
        if stale:
            print(
                f"generate.py: generated modules out of date: {', '.join(stale)} (run: python proto/generate.py)",
                file=sys.stderr,
            )
            return 1
        return 0
    for name in stale:
        if name in fresh:
            (proto_dir / name).write_bytes(fresh[name])
        else:
            (proto_dir / name).unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
