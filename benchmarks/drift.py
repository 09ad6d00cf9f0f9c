"""``omnidraft drift``: how fast the device recovers when its traffic changes.

A stream is a list of phases ``target:dataset:prompts``; consecutive phases switch the target
(``qwen2.5-coder-0.5b:humaneval:24,gemma3-270m:humaneval:24``) or the domain
(``qwen2.5-coder-0.5b:humaneval:24,qwen2.5-coder-0.5b:pydoc:24``). The one drafter is loaded
once and gets one LoRA adapter (and cache) per target; everything learns online. The stream is
run twice, with the n-gram cache growing and with it disabled, and per-prompt acceptance and
tokens per target call are recorded, so recovery after each switch can be compared.
"""

from __future__ import annotations

from tqdm import tqdm

from omnidraft.benchmarks.bench import load_prompts
from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.session import DeviceSession
from omnidraft.shared.engine import model_runner
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec
from omnidraft.shared.vocab.ngram_cache import NgramCache


def parse_stream(spec: str) -> list[tuple[str, str, int]]:
    """``target:dataset:count,...`` -> phases; ValueError with a one-line reason."""
    phases = []
    for part in spec.split(","):
        bits = part.strip().rsplit(":", 2)
        if len(bits) != 3 or not bits[0] or not bits[1]:
            raise ValueError(f"stream phase {part!r} is not TARGET:DATASET:PROMPTS")
        try:
            count = int(bits[2])
        except ValueError:
            raise ValueError(f"stream phase {part!r}: PROMPTS must be an integer") from None
        if count < 1:
            raise ValueError(f"stream phase {part!r}: PROMPTS must be >= 1")
        phases.append((bits[0], bits[1], count))
    if len(phases) < 2:
        raise ValueError("a drift stream needs at least two phases")
    return phases


def phase_prompts(phases: list[tuple[str, str, int]]) -> list[list[str]]:
    """Each phase's prompts; phases drawing on the same dataset get consecutive, disjoint slices."""
    cursor: dict[str, int] = {}
    out = []
    for _, dataset, count in phases:
        pool = load_prompts(dataset, None)
        start = cursor.get(dataset, 0)
        if start + count > len(pool):
            raise ValueError(f"dataset {dataset!r} has {len(pool)} prompts; the stream asks for {start + count}")
        out.append(pool[start : start + count])
        cursor[dataset] = start + count
    return out


def run_drift(
    drafter: str,
    phases: list[tuple[str, str, int]],
    config: GenerationConfig,
    dtype,
    drafter_weights: str = "int8",
    translate: str = "ngram",
    online: OnlineConfig | None = None,
    lora: LoraSpec = LoraSpec(),
) -> dict:
    prompts = phase_prompts(phases)
    model_runner.set_threads()
    d = model_runner.load(drafter, progress=False)
    engines = {}
    for target, _, _ in phases:
        if target not in engines:
            engines[target] = Engine.load(
                drafter, target, dtype, drafter_weights=drafter_weights, drafter_model=d, progress=False
            )
    adapters = DrafterAdapters(d.model, lora, drafter_weights=drafter_weights)
    runs = {}
    for label, grow in (("with cache", True), ("without cache", False)):
        sessions = {}
        for target, engine in engines.items():
            engine.cache = NgramCache(drafter=drafter, target=target)
            sessions[target] = DeviceSession(
                engine,
                target_name=f"{target}#{label}",
                adapters=adapters,
                online=online,
                translate=translate,
                grow_cache=grow,
            )
        rows = []
        for p, ((target, dataset, _), items) in enumerate(zip(phases, prompts)):
            for prompt in tqdm(items, desc=f"{label}: {target} / {dataset}", unit="prompt", leave=False):
                r = sessions[target].generate(prompt, config)
                st = r.stats
                rows.append(
                    {
                        "phase": p,
                        "target": target,
                        "dataset": dataset,
                        "acceptance_rate": st.acceptance_rate or 0.0,
                        "tokens_per_target_call": st.tokens_per_target_call or 0.0,
                        "tokens_per_s": st.tokens_per_s or 0.0,
                        "cache_entries": len(engines[target].cache),
                        "update": sessions[target].last_update is not None,
                    }
                )
        runs[label] = rows
    return {
        "phases": [{"target": t, "dataset": ds, "prompts": n} for t, ds, n in phases],
        "translate": translate,
        "max_new_tokens": config.max_new_tokens,
        "runs": runs,
        "phase_means": {label: [_phase_mean(rows, p) for p in range(len(phases))] for label, rows in runs.items()},
    }


def _phase_mean(rows: list[dict], phase: int) -> dict:
    """Mean acceptance and tokens per call over the first and the second half of a phase."""
    sel = [r for r in rows if r["phase"] == phase]
    mid = max(1, len(sel) // 2)
    first, second = sel[:mid], sel[mid:] or sel

    def mean(part: list[dict], key: str) -> float:
        return sum(r[key] for r in part) / len(part)

    return {
        k: {"first_half": mean(first, k), "second_half": mean(second, k)}
        for k in ("acceptance_rate", "tokens_per_target_call")
    }


def plot_drift(report: dict, path: str, window: int = 4) -> None:
    import matplotlib

    from omnidraft.benchmarks.adapt import save_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, rows in report["runs"].items():
        for ax, key in zip(axes, ("acceptance_rate", "tokens_per_target_call")):
            values = [r[key] for r in rows]
            smooth = [
                sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                for i in range(len(values))
            ]
            ax.plot(range(1, len(values) + 1), smooth, label=label)
    rows = next(iter(report["runs"].values()))
    switches = [i + 1 for i in range(1, len(rows)) if rows[i]["phase"] != rows[i - 1]["phase"]]
    names = " -> ".join(f"{p['target']}/{p['dataset']}" for p in report["phases"])
    for ax, title in zip(axes, ("acceptance", "tokens per target call")):
        for x in switches:
            ax.axvline(x, color="gray", ls="--")
        ax.set(xlabel="prompt in stream", ylabel=title, title=f"{title} (rolling {window})")
        ax.legend(fontsize=8)
    fig.suptitle(names, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
