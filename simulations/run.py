#!/usr/bin/env python3
"""Simulate a fleet of devices federating the shared drafter on Flower's Simulation Engine.

    python simulations/run.py                                   # the default scenario (real models)
    python simulations/run.py --models tiny --devices 50        # tiny models built on the spot

Writes under ``--out`` (default ``runs/<timestamp>/``): ``coordinator/`` (global state per
target), ``devices/`` (each device's own state and text), ``metrics.jsonl`` (one line per round
and target) and ``summary.json`` (the configuration and the final round per target). Re-running
with the same ``--out`` resumes after the last finished round.

Status: the plots and ``report.md``, the TOML scenario file, Dirichlet splits and drift events of
issue 6 are not written yet.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``omnidraft`` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_targets(text: str) -> dict[str, float]:
    """``name:share,name:share`` (shares default to 1)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, share = part.partition(":")
        try:
            out[name] = float(share) if share else 1.0
        except ValueError:
            raise ValueError(f"--targets: bad share in {part!r} (expected NAME:NUMBER)") from None
    if not out:
        raise ValueError("--targets names no target")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="simulations/run.py", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="real", choices=["real", "tiny"])
    p.add_argument("--devices", type=int, default=11)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--fraction", type=float, default=1.0, help="share of devices sampled per round")
    p.add_argument("--targets", default=None,
                   help="target mix, e.g. qwen2.5-coder-0.5b:0.5,gemma3-270m:0.5 (default: two targets)")
    p.add_argument("--data", default=None, help="humaneval | pydoc | PATH.jsonl (a 'prompt' per line)")
    p.add_argument("--prompts-per-device", type=int, default=12)
    p.add_argument("--heldout-per-device", type=int, default=2)
    p.add_argument("--prompts-per-round", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--late-joiners", type=int, default=1, help="devices that join at the last round")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--translate", default="ngram", choices=["ngram", "text"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "int8"],
                   help="target precision (int8: the native int8 runtime where the CPU has AVX-512 VNNI)")
    p.add_argument("--aggregation", default="fedavg", choices=["fedavg", "median", "trimmed"])
    p.add_argument("--clip-norm", type=float, default=None, help="L2 bound on each device's adapter update")
    p.add_argument("--k", type=int, default=5, help="devices that must hold an n-gram before it is released")
    p.add_argument("--noise", type=float, default=0.0, help="Gaussian noise multiplier on n-gram counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster")
    p.add_argument("--out", type=Path, default=None, help="output directory (default runs/<timestamp>)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from omnidraft.coordinator.aggregation import AggregationConfig
        from omnidraft.coordinator.ngram_release import ReleaseConfig
        from omnidraft.coordinator.registry import RegistryError
        from omnidraft.shared.atomic_io import write_bytes_atomic
        from omnidraft.shared.catalog import CatalogError
        from omnidraft.simulations.scenario import Scenario, run

        scenario = Scenario(
            models=args.models, devices=args.devices, rounds=args.rounds, fraction=args.fraction,
            targets=parse_targets(args.targets) if args.targets else None, data=args.data,
            prompts_per_device=args.prompts_per_device, heldout_per_device=args.heldout_per_device,
            prompts_per_round=args.prompts_per_round, max_new_tokens=args.max_new_tokens,
            late_joiners=args.late_joiners, lora_rank=args.lora_rank, lr=args.lr, translate=args.translate,
            dtype="fp32" if args.models == "tiny" else args.dtype, seed=args.seed, ray_address=args.ray_address,
            aggregation=AggregationConfig(method=args.aggregation, clip_norm=args.clip_norm),
            release=ReleaseConfig(k=args.k, noise_multiplier=args.noise))
        scenario.validate()
        out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is not a directory")
        out.mkdir(parents=True, exist_ok=True)
        metrics_path = out / "metrics.jsonl"
        last: dict[str, dict] = {}

        def on_round(record: dict) -> None:
            last[record["target"]] = record
            with open(metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            print(f"round {record['round']} {record['target']}: {record['aggregated']}/{record['sampled']} "
                  f"devices, acceptance {record.get('eval-acceptance', float('nan')):.3f}, "
                  f"tokens/call {record.get('eval-tokens-per-call', float('nan')):.2f}"
                  + (f", new device warm {record['new-warm-acceptance']:.3f} vs cold "
                     f"{record['new-cold-acceptance']:.3f}" if "new-warm-acceptance" in record else ""),
                  flush=True)

        t0 = time.perf_counter()
        run(scenario, out, on_round)
        summary = {"config": {**asdict(scenario), "devices": scenario.devices},
                   "wall_s": time.perf_counter() - t0, "last_round": last}
        write_bytes_atomic(out / "summary.json", json.dumps(summary, indent=1, default=str).encode())
        print(f"wrote {out}/metrics.jsonl and summary.json ({summary['wall_s']:.0f} s)")
        return 0
    except (ValueError, RegistryError, CatalogError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
