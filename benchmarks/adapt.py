"""``omnidraft adapt``: learn online on a prompt stream, measure held-out speed before and after.

The prompts are split in order: the first ``train_fraction`` is the training stream, the rest
is held out. Held-out prompts are decoded before training (target alone = ``ar``, interleaved
with cold ``omnidraft``), then the training stream is decoded once with online learning, then
the held-out prompts are decoded again with the learned state (no learning; held-out
generations never join the lookup history, so the second pass cannot look up the first's output).
In that second pass a snapshot of the starting state (``DeviceSession.snapshot``, taken before
anything ran) decodes every prompt too, the two states taking turns going first, and the target
alone runs on each prompt as well. ``speed_after_over_before`` is the learned state's tok/s over
the starting state's in that one pass: measured on the same prompts within seconds of each
other, it leaves out how the machine's speed drifts between passes minutes apart (±10 % on the
2-core machines, enough to hide the effect). The ratios between the two passes (each speedup
over its own pass's ``ar``) are reported beside it (``across_passes``), and ``before_repeated``
says whether the snapshot made the first pass's decisions again (its rule decides from counts,
not timings, so it should). Greedy outputs after training are compared with ``ar``'s token by
token.

Acceptance depends on how long the drafter drafts: a drafter that learned to draft longer runs
sees a lower rate on the longer tail. So, besides the deployed draft rule's numbers, each
held-out pass is also decoded at a fixed draft length of ``fixed_k`` drafter tokens (no head, no
stopping rule: the paper's protocol), whose acceptance compares drafters at equal length.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from tqdm import tqdm

from omnidraft.benchmarks.bench import format_ms_per_call, format_time_shares
from omnidraft.client.evaluation import Phase, evaluate, evaluate_fixed_k, warm_up
from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.session import DeviceSession
from omnidraft.shared.engine.generation import GenerationConfig, GenerationStats
from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec
from omnidraft.shared.learning.distill import LossConfig
from omnidraft.shared.util.atomic_io import write_bytes_atomic
from omnidraft.shared.vocab.ngram_cache import NgramCache


def split(prompts: list[str], train_fraction: float) -> tuple[list[str], list[str]]:
    if not 0 < train_fraction < 1:
        raise ValueError("--train-fraction must be in (0, 1)")
    n_train = int(round(len(prompts) * train_fraction))
    train, test = prompts[:n_train], prompts[n_train:]
    if not train or not test:
        raise ValueError(
            f"{len(prompts)} prompts leave an empty train or held-out part at "
            f"--train-fraction {train_fraction}: use more prompts"
        )
    return train, test


def _fixed_k(
    session: DeviceSession, test: list[str], config: GenerationConfig, k: int, label: str, ar: Phase
) -> dict | None:
    """The held-out prompts at a fixed draft length of ``k`` (0: skipped); greedy decoding replays
    the target alone's outputs ``ar`` of the same prompts."""
    if not k:
        return None
    recordings = ar.token_ids if config.greedy else None
    return evaluate_fixed_k(session, test, config, k, f"held-out {label}, k={k}", recordings=recordings)


def run_adapt(
    session: DeviceSession,
    prompts: list[str],
    config: GenerationConfig,
    train_fraction: float = 0.8,
    warmup: bool = True,
    fixed_k: int = 4,
) -> dict:
    """The whole experiment (see the module docstring); returns the JSON report. ``fixed_k``
    0 skips the fixed-length passes."""
    train, test = split(prompts, train_fraction)
    start = session.snapshot("before")  # decoded again beside the learned state after training
    if warmup:
        warm_up(session, test[0])
        warm_up(start, test[0])
    ar = Phase()
    before = evaluate(session, test, config, "held-out before", ar=ar)
    ar_tps, ar_decode_tps = ar.stats.tokens_per_s, ar.stats.decode_tokens_per_s
    # the fixed-length passes replay the target's greedy outputs ``ar`` just decoded (the same
    # figures as running it again, at the drafter's cost)
    before_k = _fixed_k(session, test, config, fixed_k, "before", ar)

    curve, updates = [], []
    window = Phase()
    t0 = time.perf_counter()
    for i, prompt in enumerate(tqdm(train, desc="online training", unit="prompt", leave=False), 1):
        result = session.generate(prompt, config, learn=True)
        window.add(result)
        report = session.last_update
        if report is not None:
            updates.append(report.to_dict())
            point = {
                "prompts": i,
                **{k: v for k, v in window.summary(ar_tps).items() if k not in ("new_tokens", "wall_s")},
                "update_s": report.seconds,
                "loss": report.loss,
            }
            curve.append(point)
            window = Phase()
    train_s = time.perf_counter() - t0

    ar_after, again = Phase(), Phase()
    after = evaluate(session, test, config, "held-out after", ar=ar_after, beside=(start, again))
    after_k = _fixed_k(session, test, config, fixed_k, "after", ar_after)
    identical = sum(a == b for a, b in zip(after.token_ids, ar.token_ids))
    update_s = [u["seconds"] for u in updates]
    before_s = before.summary(ar_tps, ar_decode_tps)
    after_s = after.summary(ar_after.stats.tokens_per_s, ar_after.stats.decode_tokens_per_s)
    again_s = again.summary(ar_after.stats.tokens_per_s, ar_after.stats.decode_tokens_per_s)
    return {
        "before": {**before_s, "fixed_k": before_k},
        "after": {**after_s, "fixed_k": after_k},
        "before_again": again_s,
        # the state from before training made the same decisions again (counts, not timings)
        "before_repeated": _decisions(again.stats) == _decisions(before.stats),
        "ar": ar.summary(ar_tps),
        "ar_after": ar_after.summary(ar_after.summary()["tokens_per_s"]),
        "curve": curve,
        "updates": updates,
        "train_prompts": len(train),
        "heldout_prompts": len(test),
        "train_wall_s": train_s,
        "update_seconds_mean": sum(update_s) / len(update_s) if update_s else None,
        "identical_to_ar_after": identical,
        "ar_deterministic": ar_after.token_ids == ar.token_ids,
        # learned and starting state decoded prompt by prompt in the same pass: one ar divides both
        "speed_after_over_before": _ratio(after_s["tokens_per_s"], again_s["tokens_per_s"]),
        "decode_speed_after_over_before": _ratio(after_s["decode_tokens_per_s"], again_s["decode_tokens_per_s"]),
        "modelled_speed_after_over_before": _ratio(
            after_s["modelled_speedup_vs_ar"], again_s["modelled_speedup_vs_ar"]
        ),
        # the same ratios between the two passes (minutes apart; each speedup over its own pass's ar)
        "across_passes": {
            "speed_after_over_before": _ratio(after_s["speedup_vs_ar"], before_s["speedup_vs_ar"]),
            "tokens_per_s_after_over_before": _ratio(after_s["tokens_per_s"], before_s["tokens_per_s"]),
            "decode_speed_after_over_before": _ratio(after_s["decode_speedup_vs_ar"], before_s["decode_speedup_vs_ar"]),
        },
        "throughput_rule": session.rule.state() if session.rule is not None else None,
        "profile_check": session.engine.check_profile(),
        "problems": session.problems,
    }


def _decisions(stats: GenerationStats) -> tuple[int, ...]:
    """What a decode decided, in counts (tokens, target calls, drafter steps, model-free rounds)."""
    return (stats.new_tokens, stats.target_calls, stats.drafter_steps, stats.lookup_rounds, stats.plain_rounds)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def format_table(report: dict) -> str:
    """The report as a text table; each pass's speedup is over the ``ar`` run interleaved in it."""
    rows = [("", "acceptance", "tokens/call", "tok/s", "speedup vs ar", "modelled")]
    for name in ("ar", "before", "ar_after", "before_again", "after"):
        if name not in report:
            continue
        s = report[name]
        speed, modelled = s["speedup_vs_ar"], None if name.startswith("ar") else s.get("modelled_speedup_vs_ar")
        rows.append(
            (
                name,
                f"{s['acceptance_rate']:.3f}" if not name.startswith("ar") else "-",
                f"{s['tokens_per_target_call']:.2f}",
                f"{s['tokens_per_s']:.2f}",
                f"{speed:.2f}x" if speed else "-",
                f"{modelled:.2f}x" if modelled else "-",
            )
        )
    for name in ("before", "after"):
        fk = report[name].get("fixed_k")
        if fk:
            rows.append(
                (
                    f"{name}, k={fk['k']}",
                    f"{fk['acceptance_rate']:.3f}",
                    f"{fk['tokens_per_target_call']:.2f}",
                    "-",
                    "-",
                    "-",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in rows]
    if report.get("speed_after_over_before"):
        modelled, across = report.get("modelled_speed_after_over_before"), report["across_passes"]
        lines.append(
            f"held-out tok/s, after / before (both states in the second pass, prompt by prompt): "
            f"{report['speed_after_over_before']:.3f}"
            + (
                f"; after the prompt's prefill: {decode:.3f}"
                if (decode := report.get("decode_speed_after_over_before"))
                else ""
            )
            + (f"; modelled from the cost profile, decoding only: {modelled:.3f}" if modelled else "")
        )
        if across["speed_after_over_before"]:
            lines.append(
                f"across the two passes: speedup over each pass's ar {across['speed_after_over_before']:.3f}, "
                f"raw tok/s {across['tokens_per_s_after_over_before']:.3f}; the starting state "
                + ("made the same decisions again" if report["before_repeated"] else "decided differently the 2nd time")
            )
    shares = format_time_shares({n: report.get(n, {}).get("decode_time_shares") for n in ("before_again", "after")})
    if shares:
        lines.append(shares)
    per_call = format_ms_per_call({n: report.get(n, {}).get("ms_per_target_call") for n in ("before_again", "after")})
    if per_call:
        lines.append(per_call)
    lines.append(
        f"held-out prompts: {report['heldout_prompts']}, trained on {report['train_prompts']}; "
        f"{len(report['updates'])} updates, "
        + (f"{report['update_seconds_mean']:.2f} s per update; " if report["update_seconds_mean"] else "")
        + f"greedy outputs identical to ar after training: {report['identical_to_ar_after']}/{report['heldout_prompts']}"
    )
    return "\n".join(lines)


def write_json(path: str, report: dict) -> None:
    write_bytes_atomic(path, json.dumps(report, indent=1).encode())


def plot_curve(report: dict, path: str) -> None:
    """The learning curve (acceptance and speedup vs prompts seen) as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'omnidraft-fleet[sim]')") from None
    curve = report["curve"]
    x = [p["prompts"] for p in curve]
    panels = (
        ("acceptance_rate", "acceptance rate"),
        ("tokens_per_target_call", "tokens per target call"),
        ("speedup_vs_ar", "speedup vs ar"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 3.8))
    for ax, (key, title) in zip(axes, panels):
        ax.plot(x, [p[key] or 0 for p in curve], marker="o", label="training stream (per update window)")
        ax.axhline(report["before"][key] or 0, color="gray", ls="--", label="held-out before")
        ax.axhline(report["after"][key] or 0, color="green", ls="--", label="held-out after")
        for name, color in (("before", "gray"), ("after", "green")):
            fixed = report[name].get("fixed_k")
            if fixed and key in fixed:  # the paper's protocol: exactly k drafter tokens per round
                ax.axhline(fixed[key], color=color, ls=":", label=f"held-out {name}, k={fixed['k']}")
        ax.set(xlabel="prompts seen", ylabel=title, title=title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def save_figure(fig, path: str) -> None:
    """Write a matplotlib figure as PNG, atomically, and close it."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())


ABLATION_VARIANTS = {
    # name: (learn the adapter, loss, learned adaptive drafting)
    "cache only": (False, None, False),
    "L_DM": (True, LossConfig(kind="hybrid", ngram=False), False),
    "L_DM + lambda L_ngram": (True, LossConfig(kind="hybrid"), False),
    "L_seq": (True, LossConfig(kind="seq"), False),
    "L_seq + adaptive head": (True, LossConfig(kind="seq"), True),
}


def run_ablation(
    engine,
    prompts: list[str],
    config: GenerationConfig,
    train_fraction: float,
    online: OnlineConfig,
    lora: LoraSpec,
    translate: str,
) -> dict:
    """Each part's contribution on one split: the held-out set cold (fresh cache, base drafter),
    then per variant a fresh cache and adapter trained on the same stream and evaluated again.
    ``ar`` runs once, interleaved with the cold pass."""
    train, test = split(prompts, train_fraction)
    adapters = DrafterAdapters(engine.drafter.model, lora, drafter_weights=engine.drafter_weights)

    def session(name: str, learn: bool, loss: LossConfig | None, head: bool) -> DeviceSession:
        engine.cache = NgramCache(drafter=engine.drafter_name, target=engine.target_name)
        cfg = replace(online, loss=loss or online.loss)
        return DeviceSession(
            engine,
            target_name=f"{engine.target_name}#{name}",
            adapters=adapters,
            online=cfg,
            translate=translate,
            learn=learn,
            adaptive=head,
        )

    cold = session("cold", False, None, False)
    warm_up(cold, test[0])
    ar = Phase()
    rows = {"cold": evaluate(cold, test, config, "cold", ar=ar)}
    ar_tps = ar.summary()["tokens_per_s"]
    updates = {}
    for name, (learn, loss, head) in ABLATION_VARIANTS.items():
        s = session(name, learn, loss, head)
        for prompt in tqdm(train, desc=f"train: {name}", unit="prompt", leave=False):
            s.generate(prompt, config)
        rows[name] = evaluate(s, test, config, f"held-out: {name}")
        updates[name] = len(s.learner.reports)
    return {
        "ar": ar.summary(ar_tps),
        "variants": {k: v.summary(ar_tps) for k, v in rows.items()},
        "updates": updates,
        "train_prompts": len(train),
        "heldout_prompts": len(test),
        "identical_to_ar": {k: sum(a == b for a, b in zip(v.token_ids, ar.token_ids)) for k, v in rows.items()},
    }


def format_ablation(report: dict) -> str:
    rows = [("variant", "acceptance", "tokens/call", "tok/s", "speedup vs ar")]
    for name, s in report["variants"].items():
        rows.append(
            (
                name,
                f"{s['acceptance_rate']:.3f}",
                f"{s['tokens_per_target_call']:.2f}",
                f"{s['tokens_per_s']:.2f}",
                f"{s['speedup_vs_ar']:.2f}x",
            )
        )
    a = report["ar"]
    rows.append(("ar (target alone)", "-", "1.00", f"{a['tokens_per_s']:.2f}", "1.00x"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(
        "  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in rows
    )
