"""The adaptation commands on the tiny pair (conftest's ``pair_dir``): ``omnidraft adapt`` end to
end (before/after figures, the fixed-k protocol, the plot, the learned state then used by
``bench`` and ``generate``), its ablation, ``drift``, and their one-line errors on bad input."""

from __future__ import annotations

import json

import pytest
from tiny_pair import PROMPTS

from omnidraft.benchmarks.tiny_models import corpus


def _jsonl(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def test_adapt_command_end_to_end(pair_dir, tmp_path, capsys):
    from omnidraft.cli import main

    data = _jsonl(tmp_path / "p.jsonl", PROMPTS[:6])
    out, plot, state = tmp_path / "a.json", tmp_path / "a.png", tmp_path / "state"
    pair = [
        "--drafter",
        str(pair_dir / "drafter"),
        "--target",
        str(pair_dir / "target"),
        "--dtype",
        "fp64",
        "--drafter-weights",
        "fp32",
        "--max-new-tokens",
        "8",
    ]
    rc = main(
        [
            "adapt",
            *pair,
            "--dataset",
            data,
            "--train-fraction",
            "0.67",
            "--interval",
            "2",
            "--lr",
            "1e-2",
            "--state-dir",
            str(state),
            "--out",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    for phase in ("before", "after"):
        assert set(report[phase]) >= {"acceptance_rate", "tokens_per_target_call", "tokens_per_s", "speedup_vs_ar"}
        fixed = report[phase]["fixed_k"]  # the paper's protocol: exactly 4 drafter tokens per round
        assert fixed["k"] == 4 and 0 <= fixed["acceptance_rate"] <= 1
        assert 1 <= fixed["tokens_per_target_call"] <= 4 + 1
    assert len(report["curve"]) == 2 and report["train_prompts"] == 4 and report["heldout_prompts"] == 2
    assert report["identical_to_ar_after"] == 2  # fp32: greedy output is the target's own
    # the target alone ran in both passes; each speedup is over its own pass's ar
    assert report["ar_deterministic"] and report["ar_after"]["new_tokens"] == report["ar"]["new_tokens"]
    for phase, ar in (("before", "ar"), ("after", "ar_after")):
        assert report[phase]["speedup_vs_ar"] == pytest.approx(
            report[phase]["tokens_per_s"] / report[ar]["tokens_per_s"]
        )
    # after / before: the learned state over the starting state's snapshot, decoded in one pass
    assert report["speed_after_over_before"] == pytest.approx(
        report["after"]["tokens_per_s"] / report["before_again"]["tokens_per_s"]
    )
    assert report["before_again"]["new_tokens"] == report["before"]["new_tokens"]
    assert report["before_repeated"]  # the snapshot decided as the untrained session did
    assert report["across_passes"]["speed_after_over_before"] == pytest.approx(
        report["after"]["speedup_vs_ar"] / report["before"]["speedup_vs_ar"]
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "after" in capsys.readouterr().out
    # the learned state is used by bench and generate
    rc = main(
        [
            "bench",
            *pair,
            "--dataset",
            data,
            "--limit",
            "2",
            "--methods",
            "ar,omnidraft",
            "--state-dir",
            str(state),
            "--out",
            str(tmp_path / "b.json"),
        ]
    )
    assert rc == 0
    bench = json.loads((tmp_path / "b.json").read_text())
    assert bench["config"]["state_dir"] and bench["methods"]["omnidraft"]["identical_prompts"] == 2
    assert main(["generate", *pair, "--prompt", PROMPTS[0], "--state-dir", str(state)]) == 0


def test_adapt_ablation_and_drift_commands(pair_dir, tmp_path):
    from omnidraft.cli import main

    data = _jsonl(tmp_path / "p.jsonl", PROMPTS[:6])
    pair = [
        "--drafter",
        str(pair_dir / "drafter"),
        "--target",
        str(pair_dir / "target"),
        "--dtype",
        "fp64",
        "--drafter-weights",
        "fp32",
        "--max-new-tokens",
        "8",
    ]
    out = tmp_path / "ab.json"
    assert (
        main(
            [
                "adapt",
                *pair,
                "--dataset",
                data,
                "--train-fraction",
                "0.67",
                "--interval",
                "2",
                "--ablation",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert list(report["variants"]) == [
        "cold",
        "cache only",
        "L_DM",
        "L_DM + lambda L_ngram",
        "L_seq",
        "L_seq + adaptive head",
    ]
    assert report["updates"]["cache only"] == 0 and report["updates"]["L_DM"] == 2
    assert all(v == 2 for v in report["identical_to_ar"].values())

    other = _jsonl(tmp_path / "q.jsonl", [t[:20] for t in corpus(6, seed=99)])
    target = str(pair_dir / "target")
    out = tmp_path / "drift.json"
    assert (
        main(
            [
                "drift",
                "--drafter",
                str(pair_dir / "drafter"),
                "--stream",
                f"{target}:{data}:3,{target}:{other}:3",
                "--dtype",
                "fp64",
                "--drafter-weights",
                "fp32",
                "--max-new-tokens",
                "8",
                "--out",
                str(out),
                "--plot",
                str(tmp_path / "drift.png"),
            ]
        )
        == 0
    )
    drift = json.loads(out.read_text())
    assert set(drift["runs"]) == {"with cache", "without cache"}
    assert all(len(rows) == 6 for rows in drift["runs"].values())
    assert drift["runs"]["without cache"][-1]["cache_entries"] == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["adapt", "--dataset", "humaneval", "--train-fraction", "1.5"], "--train-fraction must be in (0, 1)"),
        (["adapt", "--dataset", "humaneval", "--limit", "1"], "--limit must be >= 2"),
        (["adapt", "--dataset", "humaneval", "--acceptance-k", "-1"], "--acceptance-k must be >= 0"),
        (["adapt", "--dataset", "humaneval", "--lora-modules", "nope"], "unknown LoRA module set"),
        (["adapt", "--dataset", "humaneval", "--interval", "0"], "interval must be >= 1"),
        (["adapt", "--dataset", "/no/such.jsonl"], "an existing JSONL file"),
        (["adapt", "--dataset", "humaneval", "--state-dir", __file__], "is not a directory"),
        (["bench", "--dataset", "humaneval", "--state-dir", __file__], "is not a directory"),
    ],
)
def test_adapt_bad_input_is_one_line_error(argv, message, capsys):
    from omnidraft.cli import main

    rc = main([argv[0], "--drafter", "smollm2-135m", "--target", "qwen2.5-coder-0.5b", *argv[1:]])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def test_drift_stream_spec_errors():
    from omnidraft.benchmarks.drift import parse_stream

    assert parse_stream("a:humaneval:3,b:pydoc:4") == [("a", "humaneval", 3), ("b", "pydoc", 4)]
    for bad in ("a:humaneval:3", "a:humaneval:x,b:pydoc:1", "a:humaneval:0,b:pydoc:1", "humaneval:3,b:pydoc:1"):
        with pytest.raises(ValueError):
            parse_stream(bad)
