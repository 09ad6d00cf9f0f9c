"""Tests for proto/generate.py (the protobuf code generator driver)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "proto" / "generate.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_committed_modules_are_up_to_date() -> None:
    result = run("--check")
    assert result.returncode == 0, result.stderr
    assert (REPO / "proto" / "ngram_cache_pb2.py").is_file()


def test_generate_services_imports_and_check(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "fakeproto"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "common.proto").write_text(
        'syntax = "proto3";\npackage t.v1;\n// service NotReally {}\nmessage Ping { string note = 1; }\n'
    )
    (pkg / "api.proto").write_text(
        'syntax = "proto3";\npackage t.v1;\nimport "common.proto";\n'
        "service Api {\n  rpc Echo (Ping) returns (Ping);\n}\n"
    )
    (pkg / "gone_pb2.py").write_text("# orphan of a deleted .proto\n")

    assert run("--check", "--proto-dir", str(pkg)).returncode == 1
    assert run("--proto-dir", str(pkg)).returncode == 0
    generated = sorted(p.name for p in pkg.glob("*_pb2*.py"))
    assert generated == ["api_pb2.py", "api_pb2_grpc.py", "common_pb2.py"]  # grpc only for services
    assert "from . import common_pb2 as common__pb2" in (pkg / "api_pb2.py").read_text()
    assert "from . import common_pb2 as common__pb2" in (pkg / "api_pb2_grpc.py").read_text()
    assert run("--check", "--proto-dir", str(pkg)).returncode == 0

    monkeypatch.syspath_prepend(str(tmp_path))
    api_grpc = importlib.import_module("fakeproto.api_pb2_grpc")
    assert hasattr(api_grpc, "ApiStub")
    assert importlib.import_module("fakeproto.api_pb2").DESCRIPTOR.dependencies[0].name == "common.proto"

    with (pkg / "common_pb2.py").open("a") as f:
        f.write("# hand edit\n")
    result = run("--check", "--proto-dir", str(pkg))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "common_pb2.py" in result.stderr
