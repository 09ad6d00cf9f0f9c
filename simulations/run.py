#!/usr/bin/env python3
"""Simulate a fleet of devices federating the shared drafter on Flower's Simulation Engine.

    python simulations/run.py                                  # the default scenario (real models)
    python simulations/run.py --models tiny --devices 500      # tiny models built on the spot
    python simulations/run.py --scenario simulations/scenarios/rollout.toml

Writes under ``--out`` (default ``runs/<timestamp>/``): ``devices/`` (each device's own state
and text), ``coordinator/`` (global state per target), ``metrics.jsonl`` (one line per round and
target), ``summary.json`` (configuration, wall time, peak memory, per-target summary), PNG plots
and ``report.md``. Re-running with the same ``--out`` resumes after the last finished round.
Flags override the ``--scenario`` TOML file, which overrides the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``omnidraft`` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
# `python simulations/run.py` runs scenarios/default.toml; `--models tiny` starts from tiny.toml.
DEFAULT_SCENARIO = SCENARIOS / "default.toml"
TINY_SCENARIO = SCENARIOS / "tiny.toml"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="simulations/run.py", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--scenario", type=Path, default=None, help="TOML file with scenario keys (flags override it)")
    a("--models", choices=["real", "tiny"])
    a("--devices", type=int, help="devices that train (default 100; --models tiny: 50)")
    a("--rounds", type=int)
    a("--fraction", type=float, help="share of the joined devices sampled per round")
    a("--targets", help="target mix, e.g. qwen2.5-coder-0.5b:0.5,gemma3-270m:0.5")
    a(
        "--data",
        help="comma list of humaneval,stdlib,pydoc,codebase:<package>; codebases (one installed project "
        "per device, by popularity); or PATH.jsonl (a 'prompt' per line, optional 'label')",
    )
    a("--alpha", type=float, help="Dirichlet concentration of each device's mix of sources (default 0.5)")
    a("--prompts-per-device", type=int)
    a("--heldout-per-device", type=int)
    a("--prompts-per-round", type=int)
    a("--max-new-tokens", type=int)
    a("--probes", type=int, help="evaluation-only devices per target (a fixed panel)")
    a("--probe-heldout", type=int, help="held-out prompts per probe device (fixed-k acceptance)")
    a(
        "--probe-speed-prompts",
        type=int,
        help="of the probe's held-out prompts, how many are also decoded adaptively and timed (0: all)",
    )
    a("--newcomer-evals", type=int, help="new devices per target and round measured warm and cold")
    a("--late-joiners", type=int, help="devices that join late (at --join-round, default the last round)")
    a("--join-round", type=int)
    a(
        "--rollout",
        help="TARGET@ROUND:SHARE: before ROUND the operator rolls a new TARGET out to a "
        "SHARE of the devices (omnidraft fleet rollout)",
    )
    a(
        "--rollback",
        help="TARGET@ROUND: before ROUND the operator restores TARGET's previous state (omnidraft fleet rollback)",
    )
    a("--drift", help="SOURCE@ROUND: from ROUND every device's traffic comes from SOURCE")
    a("--lora-rank", type=int)
    a("--lr", type=float, help="the devices' learning rate (AdamW)")
    a("--local-epochs", type=int, help="passes over a round's samples on each device (default 1)")
    a(
        "--server-opt",
        choices=["avg", "momentum", "adam"],
        help="how the coordinator moves a target's global adapter towards the round's aggregate: avg "
        "(plain FedAvg, default), momentum (FedAvgM) or adam (FedAdam), with --server-lr",
    )
    a("--server-lr", type=float, help="the server optimizer's learning rate")
    a(
        "--acceptance-k",
        type=int,
        help="probes and new devices also decode drafting exactly K tokens per round, the paper's "
        "acceptance protocol (default 4; 0: not measured)",
    )
    a(
        "--ffa",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FFA-LoRA: freeze A, train and average only B (exact averaging; the default scenario's choice; --no-ffa: plain LoRA)",
    )
    a(
        "--secagg",
        action="store_true",
        default=None,
        help="sum each target's adapter updates with Flower's SecAgg+ (the coordinator sees only their mean)",
    )
    a(
        "--translate",
        choices=["ngram", "text"],
        help="drafted block -> target tokens: text (the target tokenizer; the default scenario) or ngram (the paper's cache merge)",
    )
    a(
        "--dtype",
        choices=["bf16", "fp32", "int8"],
        help="target precision (int8: the native int8 runtime where the CPU has AVX-512 VNNI or AVX2)",
    )
    a(
        "--draft-stop",
        choices=["auto", "cost", "confidence"],
        help="what each round drafts: auto/cost (default) the throughput rule, from the machine's cached cost "
        "profile and counted acceptance; confidence: always the drafter, stopping under a confidence threshold",
    )
    a(
        "--share-projects",
        action="store_true",
        default=None,
        help="with codebases too small for every device to hold its own prompts (e.g. --devices 1000): devices "
        "beyond a project's own stretches share its code, as teammates do",
    )
    a(
        "--replay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="training devices replay the target's greedy output of a prompt decoded before (this run or an "
        "earlier one on this machine; cached under $OMNIDRAFT_HOME/recordings): the same drafting, "
        "acceptance and learning at the drafter's cost, their speed modelled (default; --no-replay: "
        "the target runs for every decode)",
    )
    a("--no-ar", action="store_true", help="probes do not run the target alone (no speedup figures)")
    a("--aggregation", choices=["fedavg", "median", "trimmed"])
    a("--clip-norm", type=float, help="L2 bound on each device's adapter update")
    a(
        "--dp-noise",
        type=float,
        help="differential privacy on the adapter updates (DP-FedAvg: fixed clipping, equal weights, central noise): "
        "Gaussian noise of this multiplier times --clip-norm on the sum of the clipped updates, composed "
        "into the reported epsilon (default 0: off; needs --clip-norm and the fedavg aggregation)",
    )
    a(
        "--update-bits",
        type=int,
        choices=(4, 8, 32),
        help="bits per value of the update a device sends (the default scenario: 4, with FFA-LoRA)",
    )
    a("--k", type=int, help="devices that must hold an n-gram before it is released (default 5)")
    a("--noise", type=float, help="Gaussian noise multiplier on n-gram counts")
    a("--seed", type=int)
    a("--cpus-per-device", type=int, help="CPUs (and torch threads) per simulated device (the default: 2)")
    a("--ray-address", help="join an existing Ray cluster (ray start --head) instead of a local one")
    a(
        "--attack",
        action="append",
        metavar="KIND:FRACTION",
        help="fault injection (repeatable): this share of the training devices sends spoiled replies of KIND "
        "(nan, inf, huge-norm, wrong-shape, extra-metric, huge-weight, tokens-overflow, garbage-status, "
        "sign-flip, replay, crash; all: every kind)",
    )
    a("--out", type=Path, default=None, help="output directory (default runs/<timestamp>)")
    return p


def scenario_from_args(args: argparse.Namespace):
    """The scenario: ``scenarios/default.toml`` (``tiny.toml`` for tiny models), then the
    ``--scenario`` file, then the flags."""
    from omnidraft.simulations.scenario import Drift, Rollback, Rollout, Scenario, load_toml, parse_targets

    from_file = load_toml(args.scenario) if args.scenario is not None else {}
    tiny = (args.models or from_file.get("models")) == "tiny"
    raw: dict = load_toml(TINY_SCENARIO if tiny else DEFAULT_SCENARIO)
    raw.update(from_file)
    skip = {
        "scenario",
        "out",
        "targets",
        "attack",
        "rollout",
        "rollback",
        "drift",
        "no_ar",
        "aggregation",
        "clip_norm",
        "dp_noise",
        "update_bits",
        "k",
        "noise",
        "server_opt",
        "server_lr",
    }
    raw.update({k: v for k, v in vars(args).items() if v is not None and k not in skip})
    if args.targets:
        raw["targets"] = parse_targets(args.targets)
    if args.rollout:
        raw["rollout"] = Rollout.parse(args.rollout)
    if args.rollback:
        raw["rollback"] = Rollback.parse(args.rollback)
    if args.drift:
        raw["drift"] = Drift.parse(args.drift)
    if args.no_ar:
        raw["measure_ar"] = False
    if args.attack:
        from omnidraft.simulations.attacks import parse_attacks

        raw["attacks"] = {**(raw.get("attacks") or {}), **parse_attacks(args.attack)}
    aggregation = dict(raw.get("aggregation") or {})
    aggregation.update(
        {
            k: v
            for k, v in (
                ("method", args.aggregation),
                ("clip_norm", args.clip_norm),
                ("dp_noise", args.dp_noise),
                ("update_bits", args.update_bits),
            )
            if v is not None
        }
    )
    raw["aggregation"] = aggregation
    server_opt = dict(raw.get("server_opt") or {})
    server_opt.update({k: v for k, v in (("kind", args.server_opt), ("lr", args.server_lr)) if v is not None})
    raw["server_opt"] = server_opt
    privacy = dict(raw.get("privacy") or {})
    privacy.update({k: v for k, v in (("k", args.k), ("noise", args.noise)) if v is not None})
    raw["privacy"] = privacy
    if raw.get("models") == "tiny":
        raw["dtype"] = "fp32"
    scenario = Scenario.from_dict(raw, source=str(args.scenario or "scenario"))
    scenario.validate()
    return scenario


class _Progress:
    """One tqdm bar per round: replies received out of messages sent so far."""

    def __init__(self) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self.bar = None
        self.round = None

    def __call__(self, rnd: int, done: int, sent: int) -> None:
        if rnd != self.round or self.bar is None:
            self.close()
            self.round = rnd
            self.bar = self._tqdm(
                total=sent,
                desc=f"round {rnd}",
                unit="msg",
                leave=True,
                dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 30,
            )
        self.bar.total = sent
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def quiet_libraries() -> None:
    """No weight-loading bars or library deprecation notes between the progress bars (the Ray
    workers inherit the environment)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries()
    progress = None
    try:
        from omnidraft.coordinator.registry import RegistryError
        from omnidraft.shared.engine.catalog import CatalogError
        from omnidraft.shared.util.processes import PeakMemory
        from omnidraft.simulations import report
        from omnidraft.simulations.flower_runner import FlowerRunError
        from omnidraft.simulations.profile_check import stale_notes
        from omnidraft.simulations.scenario import run

        scenario = scenario_from_args(args)
        out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is not a directory")
        out.mkdir(parents=True, exist_ok=True)
        metrics_path = out / "metrics.jsonl"
        progress = _Progress()
        print(
            f"simulating {scenario.devices} devices (+{scenario.probes} probes per target), "
            f"{scenario.rounds} rounds, models {scenario.models}, targets "
            f"{', '.join(scenario.all_targets())} -> {out}",
            flush=True,
        )

        def on_round(record: dict) -> None:
            progress.close()
            with open(metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            line = (
                f"round {record['round']} {record['target']}: "
                + (
                    f"{record['aggregated']}/{record['sampled']} devices trained, "
                    if "sampled" in record
                    else "start, "
                )
                + (
                    f"acceptance at fixed k {record['eval-fixed-k-acceptance']:.3f} (adaptive "
                    f"{record.get('eval-acceptance', float('nan')):.3f}), "
                    if "eval-fixed-k-acceptance" in record
                    else f"acceptance {record.get('eval-acceptance', float('nan')):.3f}, "
                )
                + f"tokens/call {record.get('eval-tokens-per-call', float('nan')):.2f}"
            )
            if record.get("eval-speedup"):
                line += f", speedup {record['eval-speedup']:.2f}x"
            if record.get("new-warm-devices"):
                kind = "-fixed-k" if "new-warm-fixed-k-acceptance" in record else ""
                line += (
                    f", new device warm {record[f'new-warm{kind}-acceptance']:.3f} "
                    f"vs cold {record[f'new-cold{kind}-acceptance']:.3f}"
                )
                if f"veteran{kind}-acceptance" in record:
                    line += f" (veterans {record[f'veteran{kind}-acceptance']:.3f}"
                    cold = record.get(f"veteran-cold{kind}-acceptance")
                    line += f", {cold:.3f} with nothing they hold)" if cold is not None else ")"
            print(line, flush=True)

        t0 = time.perf_counter()
        memory = PeakMemory()  # this process and its descendants (Ray's processes and workers), PSS
        # workers of a cluster joined with --ray-address are not this process's descendants
        memory_scope = "this process only: devices ran on the Ray cluster" if scenario.ray_address else "all processes"
        try:
            run(scenario, out, on_round, progress=progress)
        finally:
            peak_mb = memory.stop()["all"]
        progress.close()
        summaries, path = report.finish(
            out, {**scenario.to_dict(), "devices": scenario.devices}, time.perf_counter() - t0, peak_mb, memory_scope
        )
        if path is not None:
            print("\n" + report.summary_table(summaries) + "\n\n" + report.verdict(summaries))
            print(
                f"\nwrote {out}/: metrics.jsonl, summary.json, plots, {path.name} "
                f"({time.perf_counter() - t0:.0f} s, peak memory {peak_mb / 1024:.1f} GiB, {memory_scope})"
            )
            for note in stale_notes(report.read_metrics(out / "metrics.jsonl"), scenario.to_dict()):
                print(note, file=sys.stderr)
        return 0
    except (ValueError, RegistryError, CatalogError, FlowerRunError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        if progress is not None:
            progress.close()


if __name__ == "__main__":
    raise SystemExit(main())
