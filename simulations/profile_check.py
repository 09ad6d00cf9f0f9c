"""The live panel's check of the cached cost profile, read from a run's records.

Each round the probes time their forwards while decoding live and compare them with the cached
profile the draft rule decides from and the modelled speedups read
(``client.evaluation.profile_check_metrics``): a one-token target step in use over its figure,
and the drafter's step over the target's (the ratio the rule weighs). A run keeps the profile it
started with, so runs with one seed decide alike; where the last round found it off, the run
says so and gives the command that measures it again for the next run.
"""

from __future__ import annotations

from omnidraft.shared.engine.profiling import RELATIVE_STALE_RATIO, STALE_RATIO, off_by_more_than
from omnidraft.simulations.scenario import REAL_DRAFTER

STEP, RELATIVE = "eval-profile-target-step", "eval-profile-drafter-vs-target"


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def profile_table(records: list[dict]) -> str | None:
    """Per round and target, the live panel's check of the cached cost profile, or None when
    no record has one."""
    rows = [r for r in records if STEP in r or RELATIVE in r]
    if not rows:
        return None
    lines = [
        "| round | target | one-token target step, in use / profile | drafter step against it, in use / profile |",
        "|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["round"], r["target"])):
        lines.append(f"| {r['round']} | {r['target']} | {_fmt(r.get(STEP))} | {_fmt(r.get(RELATIVE))} |")
    return "\n".join(lines)


def stale_notes(records: list[dict], config: dict) -> list[str]:
    """One line per target whose profile the last checked round found off: a one-token target
    step more than ``STALE_RATIO`` from its figure either way, or the drafter's step against it
    more than ``RELATIVE_STALE_RATIO``; with the real models, the command that measures it again
    (the profile the run's devices read: its threads, precision and kernels)."""

    last: dict[str, dict] = {}
    for r in sorted((r for r in records if STEP in r or RELATIVE in r), key=lambda r: r["round"]):
        last[r["target"]] = r
    notes = []
    for target, r in sorted(last.items()):
        step, relative = r.get(STEP), r.get(RELATIVE)
        if not (off_by_more_than(step, STALE_RATIO) or off_by_more_than(relative, RELATIVE_STALE_RATIO)):
            continue
        note = (
            f"note: {target}'s cost profile is off on this machine now (round {r['round']}: a one-token "
            f"target step took {_fmt(step)}x its figure, the drafter's step against it {_fmt(relative)}x)"
        )
        if config.get("models") == "real":
            note += (
                f"; measure it again before the next run: OMNIDRAFT_THREADS={config.get('cpus_per_device', 1)} "
                f"omnidraft profile --drafter {REAL_DRAFTER} --target {target} --dtype {config.get('dtype')} --refresh"
            )
        notes.append(note)
    return notes
