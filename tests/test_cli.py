"""The omnidraft CLI: exact flags, JSON contracts, and one-line errors with exit status 2."""

from __future__ import annotations

import json

import pytest

from omnidraft.benchmarks.tiny_models import build_pair
from omnidraft.cli import main


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    build_pair(save_dir=root)
    return root / "drafter", root / "target"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err):
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"omnidraft {version('omnidraft-fleet')}"


def test_models_list(capsys):
    code, out, _ = run(capsys, "models", "list", "--json")
    assert code == 0
    names = [row["name"] for row in json.loads(out)]
    assert names == ["smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma3-270m"]


def test_doctor_names_the_kernels_and_what_is_missing(capsys, monkeypatch, tmp_path):
    """``omnidraft doctor``: the machine and its kernel builds; with the kernels unavailable (an
    instruction set this CPU cannot run) it says what is lost, and so does a runner that falls
    back, in one line, once."""
    from omnidraft.shared.runtime import native_kernels
    from omnidraft.shared.runtime.fast_drafter import FastLlamaRunner

    monkeypatch.setenv("OMNIDRAFT_HOME", str(tmp_path))
    code, out, _ = run(capsys, "doctor", "--json")
    report = json.loads(out)
    assert code == 0 and report["machine"]["cpus"] >= 1 and report["models_bytes"] == {}
    assert any("no catalog model" in line for line in report["missing"])
    if native_kernels.native_library() is not None:
        assert report["int8_backend"].startswith(f"native-{native_kernels.default_native_isa()} (")
        assert report["native_kernels"][native_kernels.default_native_isa()] == "ok"
    monkeypatch.setenv("OMNIDRAFT_MEMORY_MB", "4096")  # acting as a 4 GiB board
    code, out, _ = run(capsys, "doctor", "--json")
    assert code == 0 and json.loads(out)["machine"]["memory_limit_bytes"] == 4 * 2**30
    assert json.loads(out)["machine"]["board_settings"] is True
    monkeypatch.setenv("OMNIDRAFT_MEMORY_MB", "4G")
    code, _, err = run(capsys, "doctor")
    assert code != 0 and err.strip() == "error: OMNIDRAFT_MEMORY_MB must be a positive whole number of MB, got '4G'"
    monkeypatch.delenv("OMNIDRAFT_MEMORY_MB")
    monkeypatch.setenv("OMNIDRAFT_NATIVE_ISA", "sse2")
    code, out, _ = run(capsys, "doctor")
    assert code == 0 and "int8      fbgemm (no native kernels)" in out
    assert "missing   no native int8 kernels (RuntimeError: unknown instruction set 'sse2'" in out
    monkeypatch.setattr(native_kernels, "_warned", set())
    model = build_pair().target
    for _ in range(2):
        runner = FastLlamaRunner(model, weights="int8", max_positions=32)
        assert runner.backend == "fbgemm-int8"
    err = capsys.readouterr().err.splitlines()
    warned = [line for line in err if line.startswith("warning: no native int8 kernels")]
    assert len(warned) == 1 and "sse2" in warned[0] and "not bit-identical" in warned[0]


@pytest.mark.parametrize(
    "argv",
    [
        ("models", "pull", "no-such-model"),
        ("models", "pull", "smollm2-135m", "no-such-model"),  # checked before any download
        ("models", "pull", "smollm2-135m", "--format", "onnx"),
        ("models", "info", "no-such-model"),
        ("models", "frobnicate"),
        ("generate", "--drafter", "x"),
        ("generate", "--drafter", "no-such-model", "--target", "qwen2.5-coder-1.5b", "--prompt", "hi"),
        ("generate", "--drafter", "/nonexistent/dir", "--target", "qwen2.5-coder-1.5b", "--prompt", "hi"),
        ("generate", "--drafter", "a", "--target", "b", "--prompt", "hi", "--temperature", "-1"),
        ("generate", "--drafter", "a", "--target", "b", "--prompt", "hi", "--max-new-tokens", "0"),
        ("generate", "--drafter", "a", "--target", "b", "--prompt", "hi", "--dtype", "fp64"),
        ("generate", "--drafter", "a", "--target", "b", "--prompt", ""),
        ("bench", "--drafter", "a", "--target", "b", "--dataset", "humaneval", "--methods", "ar,magic"),
        ("bench", "--drafter", "a", "--target", "b", "--dataset", "/no/such/file.jsonl"),
        ("bench", "--drafter", "a", "--target", "b", "--dataset", "humaneval", "--limit", "0"),
        ("bench", "--drafter", "a", "--target", "b", "--dataset", "humaneval", "--methods", "ar,omnidraft-cold"),
        ("bench", "--drafter", "a", "--target", "/no/such/dir", "--dataset", "humaneval", "--methods", "ar,llamacpp"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert_one_line_error(code, err)


def test_bench_rejects_malformed_jsonl(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    code, _, err = run(capsys, "bench", "--drafter", "a", "--target", "b", "--dataset", str(bad))
    assert_one_line_error(code, err)
    assert "bad.jsonl:2" in err
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"text": "ok"}\n')
    code, _, err = run(capsys, "bench", "--drafter", "a", "--target", "b", "--dataset", str(nofield))
    assert_one_line_error(code, err)


def test_generate_json_contract_and_identity(capsys, tiny_dirs):
    drafter, target = tiny_dirs
    common = [
        "generate",
        "--drafter",
        str(drafter),
        "--target",
        str(target),
        "--dtype",
        "fp64",
        "--prompt",
        "def alpha_3(beta, gamma):\n",
        "--max-new-tokens",
        "24",
        "--json",
    ]
    code, out, _ = run(capsys, *common)
    assert code == 0
    spd = json.loads(out)
    assert set(spd) >= {"text", "token_ids", "stats"}
    for key in (
        "target_calls",
        "drafter_steps",
        "proposed_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "tokens_per_target_call",
        "ngram_hits",
        "wall_s",
    ):
        assert key in spd["stats"]
    assert len(spd["token_ids"]) == 24
    code, out, _ = run(capsys, *common, "--method", "ar")
    assert code == 0
    ar = json.loads(out)
    assert ar["token_ids"] == spd["token_ids"] and ar["text"] == spd["text"]


def test_bench_writes_report(capsys, tiny_dirs, tmp_path):
    drafter, target = tiny_dirs
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"prompt": p}) for p in ["def beta_1(alpha, total):\n", "def count_2(items, value):\n    "]
        )
        + "\n"
    )
    out_file = tmp_path / "report.json"

    def bench(methods: str, *extra: str) -> tuple[int, str]:
        common = ("--drafter", str(drafter), "--target", str(target), "--dtype", "fp64", "--dataset", str(data))
        code, out, _ = run(
            capsys, "bench", *common, "--max-new-tokens", "16", "--methods", methods, *extra, "--out", str(out_file)
        )
        return code, out

    code, out = bench("ar,pld,omnidraft")
    assert code == 0
    assert "omnidraft" in out and "vs ar" in out and "worst" in out
    report = json.loads(out_file.read_text())
    assert set(report) == {"config", "methods", "prompts"}
    assert set(report["methods"]) == {"ar", "pld", "omnidraft"}
    for m in report["methods"].values():
        assert {
            "tokens_per_s",
            "speedup_vs_ar",
            "acceptance_rate",
            "tokens_per_target_call",
            "identical_to_ar",
            "worst_prompt_vs_ar",
        } <= set(m)
    assert report["methods"]["omnidraft"]["identical_to_ar"] is True
    assert report["methods"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert len(report["prompts"]) == 2

    # a device's state against the cold decoder, interleaved in one bench
    code, out = bench("ar,omnidraft,omnidraft-cold", "--state-dir", str(tmp_path / "state"))
    assert code == 0 and "omnidraft-cold" in out
    report = json.loads(out_file.read_text())
    assert report["config"]["state_dir"] is not None
    for m in ("ar", "omnidraft", "omnidraft-cold"):
        e = report["methods"][m]
        assert e["identical_to_ar"] is True
        assert e["decode_tokens_per_s"] > e["tokens_per_s"]  # the prompt's prefill left out
        assert e["decode_speedup_vs_ar"] > 0
        assert m == "ar" or e["drafter_steps"] > 0
