"""The PNG plots of a simulation's report (``report.write_report``), by round and target:
acceptance, speedup (live and modelled), global cache entries, bytes per device, and new
devices warm / cold against veterans."""

from __future__ import annotations

from pathlib import Path

PLOTS = {
    "acceptance.png": "Acceptance of the global state on the probes' held-out prompts, by round "
    "(solid: drafting a fixed k tokens per round; dashed: adaptive draft length)",
    "speedup.png": "Speedup over the target alone (same prompts, same machine), by round: live (solid), live "
    "after the prompt's prefill (dotted) and "
    "modelled from the machine's cost profile, decoding only (dashed)",
    "cache.png": "Global n-gram cache entries, by round",
    "bytes.png": "Bytes per device and round (uplink: adapter + n-gram statistics; downlink: state sent)",
    "newcomers.png": "First session of a new device: with the global state (warm) vs without (cold), "
    "and devices that trained before (veterans) with the same state vs with nothing they hold: "
    "acceptance, and where measured the modelled speedup",
}


def plot(per_target: dict[str, list[dict]], summaries: dict[str, dict], out: Path) -> list[str]:
    """Write the PNGs of ``PLOTS`` under ``out`` from each target's round records and its
    ``report.target_summary``; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    def series(
        key: str,
        fig_name: str,
        ylabel: str,
        *,
        scale: float = 1.0,
        marker="o",
        dashed: str | None = None,
        dashed_label: str = "adaptive",
        dotted: str | None = None,
        dotted_label: str = "",
    ) -> None:
        """``key`` by round per target; ``dashed`` and ``dotted``: more keys drawn dashed and
        dotted in the same colour (labelled ``dashed_label``, ``dotted_label``)."""
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for t, rows in per_target.items():
            pts = [(r["round"], r[key] / scale) for r in rows if r.get(key) is not None]
            if pts:
                (line,) = ax.plot(*zip(*pts), marker=marker, label=t)
            for more_key, style, label in ((dashed, "--", dashed_label), (dotted, ":", dotted_label)):
                more = [(r["round"], r[more_key] / scale) for r in rows if more_key and r.get(more_key) is not None]
                if more:
                    ax.plot(
                        *zip(*more),
                        style,
                        marker=".",
                        color=line.get_color() if pts else None,
                        label=f"{t} ({label})" if pts else t,
                    )
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fig_name, dpi=110)
        plt.close(fig)

    if any(r.get("eval-fixed-k-acceptance") is not None for rows in per_target.values() for r in rows):
        series("eval-fixed-k-acceptance", "acceptance.png", "acceptance (probes)", dashed="eval-acceptance")
    else:
        series("eval-acceptance", "acceptance.png", "acceptance (probes)")
    series(
        "eval-speedup",
        "speedup.png",
        "speedup vs target alone (x)",
        dashed="eval-modelled-speedup",
        dashed_label="modelled",
        dotted="eval-decode-speedup",
        dotted_label="live after the prefill",
    )
    series("cache-entries", "cache.png", "global cache entries")

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for t, rows in per_target.items():
        for key, style in (("uplink-bytes-per-device", "-o"), ("downlink-bytes-per-device", "--s")):
            pts = [(r["round"], r[key] / 1e6) for r in rows if r.get(key) is not None and r.get("aggregated")]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{t} {key.split('-')[0]}")
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("MB per device")
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bytes.png", dpi=110)
    plt.close(fig)

    names = list(per_target)
    summaries = [summaries[t] for t in names]
    fixed = all(s["new-warm-acceptance-k"] is not None for s in summaries)
    speed = all(s["new-warm-modelled-speedup"] is not None for s in summaries)
    fig, axes = plt.subplots(1, 2 if speed else 1, figsize=(10 if speed else 6, 3.6), squeeze=False)

    def bars(ax, key: str, ylabel: str, fmt: str) -> None:
        """New devices cold / warm, veterans cold / warm per target, ``{who}-{key}`` of the summaries."""
        who = ("new-cold", "new-warm", "veteran-cold", "veteran")
        groups = [[s[f"{w}-{key}"] or 0.0 for s in summaries] for w in who]
        xs = range(len(names))
        for offset, values, label in zip(
            (-0.3, -0.1, 0.1, 0.3),
            groups,
            (
                "new, cold (no global state)",
                "new, warm (global state)",
                "veterans, cold (nothing they hold)",
                "veterans (global state, own history)",
            ),
        ):
            ax.bar_label(ax.bar([x + offset for x in xs], values, width=0.2, label=label), fmt=fmt, fontsize=7)
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1.35 * max([v for g in groups for v in g] + [0.01]))  # headroom: the legend sits above the bars
        ax.legend(fontsize=7, loc="upper center", ncol=2)

    bars(
        axes[0][0],
        "acceptance-k" if fixed else "acceptance",
        "first-session acceptance" + (", fixed k" if fixed else ""),
        "%.3f",
    )
    if speed:
        bars(axes[0][1], "modelled-speedup", "speedup vs target alone, modelled (x)", "%.2f")
    fig.tight_layout()
    fig.savefig(out / "newcomers.png", dpi=110)
    plt.close(fig)
    return list(PLOTS)
