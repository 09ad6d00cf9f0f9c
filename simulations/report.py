"""What a simulation run shows: a summary per target, PNG plots and ``report.md``.

Everything is computed from ``metrics.jsonl`` (one record per round and target; round 0 is the
probes' measurement of the starting state) and ``summary.json``'s configuration, so a report can
be rebuilt from a finished run directory: ``python -m omnidraft.simulations.report RUN_DIR``.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

from omnidraft.shared.util.atomic_io import write_bytes_atomic
from omnidraft.simulations.profile_check import profile_table, stale_notes
from omnidraft.simulations.report_plots import PLOTS, plot


def read_metrics(path: Path) -> list[dict]:
    """The records of ``metrics.jsonl``; a speedup of 0 (devices report 0 when the target alone
    was not run, ``--no-ar``) is dropped: it was not measured."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not (k.endswith("speedup") and v == 0)} for r in records]


def by_target(records: list[dict]) -> dict[str, list[dict]]:
    """Records per target, in round order (a resumed run's repeated rounds: the last one wins)."""
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in records:
        out[r["target"]][r["round"]] = r
    return {t: [rounds[k] for k in sorted(rounds)] for t, rounds in sorted(out.items())}


# the first-session panels: new devices with the global state and without it, veterans with it and
# with nothing they hold (their own cold start on their own prompts)
FIRST_SESSIONS = ("new-warm", "new-cold", "veteran", "veteran-cold")


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def target_summary(rows: list[dict]) -> dict:
    """First and last measured acceptance/speedup, newcomers warm vs cold (means over the
    rounds that measured them), bytes, cache and privacy totals of one target."""
    evals = [r for r in rows if "eval-acceptance" in r]
    newcomers = [r for r in rows if r.get("new-warm-devices")]
    trained = [r for r in rows if r.get("aggregated")]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    return {
        "rounds": [r["round"] for r in rows],
        "acceptance-first": first.get("eval-acceptance"),
        "acceptance-last": last.get("eval-acceptance"),
        "acceptance-k-first": first.get("eval-fixed-k-acceptance"),
        "acceptance-k-last": last.get("eval-fixed-k-acceptance"),
        **{
            f"{who}-acceptance{k}": _mean([r.get(f"{who}{fixed}-acceptance") for r in newcomers])
            for who in FIRST_SESSIONS
            for k, fixed in (("", ""), ("-k", "-fixed-k"))
        },
        "first-round": first.get("round"),
        "last-round": last.get("round"),
        "tokens-per-call-first": first.get("eval-tokens-per-call"),
        "tokens-per-call-last": last.get("eval-tokens-per-call"),
        "speedup-first": first.get("eval-speedup"),
        "speedup-last": last.get("eval-speedup"),
        "decode-speedup-first": first.get("eval-decode-speedup"),
        "decode-speedup-last": last.get("eval-decode-speedup"),
        "modelled-speedup-first": first.get("eval-modelled-speedup"),
        "modelled-speedup-last": last.get("eval-modelled-speedup"),
        "tokens-per-s-last": last.get("eval-tokens-per-s"),
        **{
            f"{who}-modelled-{k}": _mean([r.get(f"{who}-modelled-{k}") for r in newcomers])
            for who in FIRST_SESSIONS
            for k in ("speedup", "tokens-per-s")
        },
        "new-gain-share": gain_share(newcomers),
        "train-replayed": _mean([r.get("train-replayed") for r in trained]),
        "new-devices": sum(int(r.get("new-warm-devices", 0)) for r in newcomers),
        "devices-trained": sum(int(r["aggregated"]) for r in trained),
        "rejected": sum(len(r.get("rejected", [])) for r in rows),
        "uplink-bytes-per-device": _mean([r.get("uplink-bytes-per-device") for r in trained]),
        "downlink-bytes-per-device": _mean([r.get("downlink-bytes-per-device") for r in trained]),
        "cache-entries-last": trained[-1].get("cache-entries") if trained else None,
        "ngrams-released": sum(int(r.get("ngrams", {}).get("released", 0)) for r in trained),
        "epsilon-last": trained[-1].get("ngrams", {}).get("epsilon") if trained else None,
    }


def gain_share(rows: list[dict]) -> float | None:
    """What a new device gains from the global state (its modelled speedup warm over cold, less
    one) as a share of what the veterans gained (with the global state and their own history,
    over their own cold start on the same prompts), pooled over the rounds that measured both;
    None where the veterans gained nothing or it was not measured."""
    rows = [r for r in rows if all(r.get(f"{who}-modelled-speedup") for who in FIRST_SESSIONS)]
    if not rows:
        return None
    warm, cold, veteran, veteran_cold = (
        sum(r[f"{who}-modelled-speedup"] for r in rows) / len(rows) for who in FIRST_SESSIONS
    )
    veterans_gain = veteran / veteran_cold - 1
    return (warm / cold - 1) / veterans_gain if veterans_gain > 0 else None


def _times(v: float | None) -> str:
    """A speedup as ``1.23x`` (``–`` when not measured)."""
    return "–" if v is None else f"{v:.2f}x"


def _speeds(live: float | None, modelled: float | None, decode: float | None = None) -> str:
    """A live speedup, then the live one after the prompt's prefill where measured, with the
    modelled one (decoding only) in parentheses where both were measured."""
    text = _times(live) if decode is None else f"{_times(live)}, {_times(decode)}"
    return text if modelled is None else f"{text} ({_times(modelled)})"


def _fmt(v, spec=".3f") -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and v == float("inf"):
        return "∞"
    return format(v, spec)


def _gib(mb) -> str:
    return f"{mb / 1024:.1f}" if isinstance(mb, (int, float)) else "–"


def _mb(v) -> str:
    return "–" if v is None else f"{v / 1e6:.2f} MB"


def _pair(fixed: float | None, adaptive: float | None) -> str:
    """``fixed-k value (adaptive value)`` where both were measured, else the one that was."""
    if fixed is None or adaptive is None:
        return _fmt(adaptive if fixed is None else fixed)
    return f"{_fmt(fixed)} ({_fmt(adaptive)})"


NOISE = 0.05  # speedup changes smaller than this share are called unchanged (live timings vary)


def _direction(first: float | None, last: float | None) -> int | None:
    """+1 when ``last`` is more than ``NOISE`` above ``first``, -1 when as far below, 0 between,
    None when either was not measured."""
    if first is None or last is None:
        return None
    return 1 if last >= first * (1 + NOISE) else -1 if last <= first * (1 - NOISE) else 0


def verdict(summaries: dict[str, dict]) -> str:
    """One paragraph: per target, whether learning paid in speed this run (the probes' live
    speedup over the target alone, first measured round against the last), with the fixed-k
    acceptance and the new devices' warm start beside it. Where the live speedup and the
    modelled one move in opposite directions the paragraph says so rather than trusting either:
    the live panel's ratio moves with the machine's spells (a slow spell slows the target alone
    more than speculation), the model does not see them."""
    parts = []
    for t, s in summaries.items():
        first, last = s["speedup-first"], s["speedup-last"]
        live = _direction(first, last)
        modelled = _direction(s.get("modelled-speedup-first"), s.get("modelled-speedup-last"))
        disagree = live is not None and modelled is not None and live * modelled < 0 and last >= 1
        if live is None:
            call = "speed was not measured (--no-ar)"
        elif last < 1:
            call = f"devices ran slower than the target alone ({_times(first)} → {_times(last)})"
        elif disagree:
            call = (
                f"the live panel and the model disagree: {_times(first)} → {_times(last)} the target alone's "
                f"speed live, while the modelled speedup {'rose' if modelled > 0 else 'fell'}"
            )
        elif live > 0:
            call = f"learning paid: {_times(first)} → {_times(last)} the target alone's speed"
        elif live < 0:
            call = f"learning did not pay: {_times(first)} → {_times(last)} the target alone's speed"
        else:
            call = f"speed unchanged within {NOISE:.0%} ({_times(first)} → {_times(last)} the target alone's)"
        text = f"**{t}**: {call} from round {s['first-round']} to {s['last-round']}"
        decoding = []
        if s.get("decode-speedup-first") is not None and s.get("decode-speedup-last") is not None:
            decoding.append(
                f"live after the prompt's prefill: {_times(s['decode-speedup-first'])} → "
                f"{_times(s['decode-speedup-last'])}"
            )
        if s.get("modelled-speedup-first") is not None and s.get("modelled-speedup-last") is not None:
            decoding.append(
                f"modelled from the machine's cost profile, decoding only: "
                f"{_times(s['modelled-speedup-first'])} → {_times(s['modelled-speedup-last'])}"
            )
        if decoding:
            text += f" ({'; '.join(decoding)})"
        if disagree:
            text += (
                "; the live ratio moves with the machine's spells, the model does not (see 'The cost profile in use')"
            )
        if s["acceptance-k-first"] is not None:
            text += f"; acceptance at fixed k {_fmt(s['acceptance-k-first'])} → {_fmt(s['acceptance-k-last'])}"
        if s["new-devices"]:
            text += (
                f"; new devices start at {_fmt(s['new-warm-acceptance-k'] or s['new-warm-acceptance'])} "
                f"with the fleet's state vs {_fmt(s['new-cold-acceptance-k'] or s['new-cold-acceptance'])} without"
            )
            if s.get("new-warm-modelled-speedup") is not None:
                text += (
                    f" (modelled speed {_times(s['new-warm-modelled-speedup'])} warm, "
                    f"{_times(s['new-cold-modelled-speedup'])} cold; veterans {_times(s['veteran-modelled-speedup'])}, "
                    f"{_times(s['veteran-cold-modelled-speedup'])} with nothing they hold"
                )
                share = s.get("new-gain-share")
                text += f": a new device starts with {share:.0%} of the veterans' gain)" if share is not None else ")"
        parts.append(text + ".")
    return " ".join(parts)


def summary_table(summaries: dict[str, dict]) -> str:
    """A Markdown table, one row per target (also printed at the end of a run). Where the
    fixed-length acceptance was measured it comes first, the adaptive one in parentheses."""
    head = (
        "| target | acceptance, fixed k (adaptive) (round → round) | tokens/call "
        "| speedup vs target: live, live after the prefill (modelled) "
        "| new device warm / cold / veterans / veterans cold, fixed k (adaptive) "
        "| devices trained | uplink / downlink per device | cache entries | n-grams released | ε |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for t, s in summaries.items():
        rounds = f"{s['first-round']} → {s['last-round']}" if s["first-round"] is not None else ""
        first, last = (_pair(s[f"acceptance-k-{end}"], s[f"acceptance-{end}"]) for end in ("first", "last"))
        first_sessions = " / ".join(_pair(s[f"{who}-acceptance-k"], s[f"{who}-acceptance"]) for who in FIRST_SESSIONS)
        lines.append(
            f"| {t} | {first} → {last} ({rounds}) "
            f"| {_fmt(s['tokens-per-call-first'], '.2f')} → {_fmt(s['tokens-per-call-last'], '.2f')} "
            f"| {_speeds(s['speedup-first'], s['modelled-speedup-first'], s['decode-speedup-first'])} → "
            f"{_speeds(s['speedup-last'], s['modelled-speedup-last'], s['decode-speedup-last'])} "
            f"| {first_sessions} "
            f"({s['new-devices']} device{'s' if s['new-devices'] != 1 else ''}) "
            f"| {s['devices-trained']} | {_mb(s['uplink-bytes-per-device'])} / {_mb(s['downlink-bytes-per-device'])} "
            f"| {_fmt(s['cache-entries-last'], 'd')} | {s['ngrams-released']} | {_fmt(s['epsilon-last'], '.2f')} |"
        )
    return "\n".join(lines)


def _warm_cold(r: dict) -> str:
    """A round's newcomers, warm / cold, and its veterans with the global state / with nothing
    they hold: at fixed k (adaptive) where measured."""
    return " / ".join(_pair(r.get(f"{who}-fixed-k-acceptance"), r.get(f"{who}-acceptance")) for who in FIRST_SESSIONS)


def _warm_cold_speed(r: dict) -> str:
    """A round's newcomers warm / cold and its veterans warm / cold: modelled tok/s (speedup),
    where measured."""
    if r.get("new-warm-modelled-tokens-per-s") is None:
        return "–"
    return " / ".join(
        f"{_fmt(r.get(f'{who}-modelled-tokens-per-s'), '.1f')} ({_times(r.get(f'{who}-modelled-speedup'))})"
        for who in FIRST_SESSIONS
    )


def _trained_speed(r: dict) -> str:
    """The round's training devices: modelled speedup of their learning decodes (share replayed)."""
    if r.get("train-modelled-speedup") is None:
        return "–"
    replayed = r.get("train-replayed")
    return _times(r["train-modelled-speedup"]) + (f" ({replayed:.0%})" if replayed is not None else "")


def round_table(rows: list[dict]) -> str:
    head = (
        "| round | devices serving (switched) | devices trained | state version | acceptance, fixed k "
        "| acceptance | tokens/call "
        "| tok/s | speedup: live, live after the prefill (modelled) | new warm / cold / veterans / veterans cold "
        "| the same: modelled tok/s (speedup) | trained devices: modelled speedup (replayed) "
        "| cache entries | released | ε |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ngrams = r.get("ngrams", {})
        serving = f"{r['devices']} ({r.get('switched', 0)})" if "devices" in r else "–"
        version = str(r.get("version", "–"))
        if "started-from" in r:  # a rollback before the round
            version += " (from v{version}, a rollback to v{restores})".format(**r["started-from"])
        lines.append(
            f"| {r['round']} | {serving} | {r.get('aggregated', '–')} | {version} "
            f"| {_fmt(r.get('eval-fixed-k-acceptance'))} | {_fmt(r.get('eval-acceptance'))} "
            f"| {_fmt(r.get('eval-tokens-per-call'), '.2f')} | {_fmt(r.get('eval-tokens-per-s'), '.1f')} "
            f"| {_speeds(r.get('eval-speedup'), r.get('eval-modelled-speedup'), r.get('eval-decode-speedup'))} "
            f"| {_warm_cold(r)} | {_warm_cold_speed(r)} | {_trained_speed(r)} "
            f"| {_fmt(r.get('cache-entries'), 'd')} | {ngrams.get('released', '–')} | {_fmt(ngrams.get('epsilon'), '.2f')} |"
        )
    return "\n".join(lines)


PHASES = {
    "census": "status and rollout",
    "start-eval": "round 0 evaluation",
    "newcomers": "new devices and veterans",
    "train": "training devices",
    "aggregate": "aggregation",
    "eval": "probes",
}


def time_table(records: list[dict]) -> str | None:
    """Wall seconds of each round's phases (the coordinator's ``phase-s``: one clock for all
    targets of a round), or None when the records carry none."""
    rounds = {r["round"]: r for r in records if "phase-s" in r}
    if not rounds:
        return None
    head = "| round | " + " | ".join(PHASES.values()) + " | round |"
    lines = [head, "|" + "---|" * (len(PHASES) + 2)]
    for rnd, r in sorted(rounds.items()):
        cells = [_fmt(r["phase-s"].get(k), ".0f") for k in PHASES]
        lines.append(f"| {rnd} | " + " | ".join(cells) + f" | {_fmt(r.get('round-s'), '.0f')} |")
    return "\n".join(lines)


def finish(
    run_dir: str | Path,
    config: dict,
    wall_s: float,
    peak_rss_mb: float | None = None,
    peak_rss_scope: str = "not measured",
) -> tuple[dict, Path | None]:
    """Write ``summary.json`` (``config``: the scenario's ``to_dict()``; the run's wall time in
    seconds and peak memory in MiB) and, when ``metrics.jsonl`` has rounds, the plots and
    ``report.md``; returns (the per-target summaries, the report's path or None)."""
    import os

    from omnidraft.shared.engine.profiling import cpu_name

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    per_target = by_target(read_metrics(metrics)) if metrics.exists() else {}
    summaries = {t: target_summary(rows) for t, rows in per_target.items()}
    summary = {
        "config": config,
        "wall_s": round(wall_s, 1),
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs",
        "peak_rss_mb": peak_rss_mb,
        "peak_rss_scope": peak_rss_scope,
        "targets": summaries,
    }
    write_bytes_atomic(run_dir / "summary.json", json.dumps(summary, indent=1, default=str).encode())
    return summaries, write_report(run_dir) if per_target else None


def rejection_reasons(records: list[dict]) -> Counter:
    """Rejected replies, and devices the round skipped, over the whole run by reason (the node,
    numbers and values taken out)."""
    out: Counter = Counter()
    for r in records:
        for reason in r.get("rejected", []) + [f"skipped: {x}" for x in r.get("skipped", [])]:
            why = re.sub(r"^(skipped: )?node \d+( \([^)]*\))?: ", r"\1", reason)
            why = re.sub(r"^(adapter tensor|update) \S+?(:| )", r"\1 T\2", why.split("=")[0])
            out[re.sub(r"-?\d[\d.e+]*", "N", why)] += 1
    return out


def write_report(run_dir: str | Path) -> Path:
    """Plots and ``report.md`` for a finished run directory; returns the report's path."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    per_target = by_target(read_metrics(run_dir / "metrics.jsonl"))
    if not per_target:
        raise ValueError(f"{run_dir}/metrics.jsonl has no rounds")
    cfg = summary["config"]
    summaries = {t: target_summary(r) for t, r in per_target.items()}
    plots = plot(per_target, summaries, run_dir)
    parts = [
        "# OmniDraft Fleet simulation report",
        "",
        verdict(summaries),
        "",
        f"{cfg['devices']} devices ({cfg.get('probes', 0)} probe devices per target in addition), "
        f"{cfg['rounds']} rounds, {cfg['fraction']:.0%} of the joined devices sampled per round, "
        f"models `{cfg['models']}`, targets {', '.join(f'`{t}`' for t in cfg['targets'])}, "
        f"seed {cfg['seed']}. Wall time {summary.get('wall_s', 0):.0f} s, peak memory "
        f"{_gib(summary.get('peak_rss_mb'))} GiB ({summary.get('peak_rss_scope', 'all processes')}), "
        f"on {summary.get('machine', 'this machine')}.",
        "",
        "Acceptance, tokens per target call and speedup are the global state's, measured by the probe "
        "devices (never trained) on the same held-out prompts every round; round 0 is the starting state "
        '(untrained adapter, no n-gram released yet). "Fixed k" acceptance drafts exactly '
        f"k = {cfg.get('acceptance_k', 0)} drafter tokens per round (the paper's protocol) on all "
        f"{cfg.get('probe_heldout', 0)} held-out prompts of each probe, scored against the target's greedy "
        "output recorded once (greedy decoding commits that output whatever is drafted, so the figure is "
        "the live decode's); the adaptive one drafts as the device does, so it also moves with how long the "
        "drafter chooses to draft, and is decoded live and timed on "
        f"{cfg.get('probe_speed_prompts') or cfg.get('probe_heldout', 0)} of them. New devices "
        "are sampled devices that never trained for their target, whose first session runs once without and "
        "once with the global state; veterans are as many sampled devices that trained before, decoding "
        "their own held-out prompts with the same global state in the same round, and once more with "
        "nothing they hold (veterans cold: the base drafter, a new rule, no lookup history); a new device's "
        "share of the veterans' gain compares warm over cold with veterans over veterans cold. A **modelled** speedup "
        "(in parentheses) charges each round the probe decoded its cost in the machine's cached cost "
        "profile (the same figures the draft rule decides from), prompt prefill excluded: it does not move "
        "when the machine is busier or quieter between rounds, the live one does. The live speedup counts "
        "the prompt's prefill (run once, by the target alone, and counted on both sides); the live one "
        "after the prefill leaves it out of both, as the modelled one does. "
        + (
            "Training devices, newcomers and veterans replay the target's greedy output where it was "
            "recorded before (this run or an earlier one on this machine): their drafting, acceptance and "
            "learning are the live ones, their speed is only modelled; the probes' adaptive decodes run the "
            "real target (the live panel)."
            if cfg.get("replay")
            else ""
        ),
        "",
        "## Per target",
        "",
        summary_table(summaries),
        "",
    ]
    for name in plots:
        parts += [f"![{PLOTS[name]}]({name})", "", f"*{PLOTS[name]}.*", ""]
    for t, rows in per_target.items():
        parts += [f"## {t} by round", "", round_table(rows), ""]
    events = [f"{k}: {cfg[k]}" for k in ("rollout", "rollback", "drift") if cfg.get(k)]
    if cfg.get("late_joiners"):
        events.append(f"{cfg['late_joiners']} devices join at round {cfg.get('join_round') or cfg['rounds']}")
    if cfg.get("share_projects"):
        events.append(
            "more devices than the codebases' own stretches: teammates share a project's prompts "
            "(a new device's held-out prompts may be a teammate's training prompts)"
        )
    if cfg.get("attacks"):
        events.append(
            "attacks (share of the training devices): "
            + ", ".join(f"{k} {v:.0%}" for k, v in sorted(cfg["attacks"].items()))
        )
    if events:
        parts += ["## Events", "", *[f"- {e}" for e in events], ""]
    records = [r for rows in per_target.values() for r in rows]
    times = time_table(records)
    if times:
        parts += ["## Where the time went (wall seconds)", "", times, ""]
    checked = profile_table(records)
    if checked:
        parts += [
            "## The cost profile in use",
            "",
            "The probes' forwards timed while decoding live (each process's whole run up to that round) "
            "against the cached profile the draft rule decides from and the modelled speedups read (1.00: "
            "as profiled; the rule weighs drafter steps against target steps, so the second column matters "
            "most). The run keeps its profile, so runs with one "
            "seed decide alike; where it is off by more than 1.5x, or 1.2x in the second column, "
            "`omnidraft profile --refresh` measures it again.",
            "",
            checked,
            "",
            *[f"{note}\n" for note in stale_notes(records, cfg)],
        ]
    reasons = rejection_reasons(records)
    if reasons:
        parts += [
            "## Rejected replies and skipped devices, by reason",
            "",
            "| reason | count |",
            "|---|---|",
            *[f"| {why} | {n} |" for why, n in reasons.most_common()],
            "",
        ]
    parts += ["## Configuration", "", "```json", json.dumps(cfg, indent=1, default=str), "```", ""]
    path = run_dir / "report.md"
    write_bytes_atomic(path, "\n".join(parts).encode())
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m omnidraft.simulations.report RUN_DIR", file=sys.stderr)
        raise SystemExit(2)
    try:
        print(write_report(sys.argv[1]))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
