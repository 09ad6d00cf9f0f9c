"""What a draft's lookup tail adds, measured in one process (docs/speed.md, "A draft carries the
device's text that continues it").

Two speculative decoders on the same loaded pair and the same cached cost profile, each with its
own throughput rule and lookup history, one with lookup tails (``ThroughputRule.extend_draft``)
and one without, decode every prompt in turn with the target alone (their order alternating
from prompt to prompt, so the machine's slow spells hit both alike). Greedy outputs are checked
identical to the target alone's. Prints tok/s (prefill included), decode tok/s (after the
prompt's prefill), tokens per target call and the tails' counts, and writes them as JSON.

    python scripts/lookup_tail_ab.py --dataset codebase:peft --limit 60 --skip 48 --out runs/tail-peft.json
"""

from __future__ import annotations

import argparse
import json
import sys

from omnidraft.benchmarks.bench import load_prompts
from omnidraft.shared.engine.catalog import CatalogError
from omnidraft.shared.engine.decoding import CrossVocabDecoder
from omnidraft.shared.engine.draft_policy import ThroughputRule
from omnidraft.shared.engine.generation import GenerationConfig, GenerationStats
from omnidraft.shared.engine.lookup_drafts import LookupDrafter
from omnidraft.shared.engine.pair import Engine


def summary(s: GenerationStats) -> dict:
    decode_s = s.wall_s - s.prefill_s
    return {
        "tokens_per_s": s.new_tokens / s.wall_s,
        "decode_tokens_per_s": s.new_tokens / decode_s,
        "tokens_per_target_call": s.new_tokens / s.target_calls,
        "drafter_steps": s.drafter_steps,
        "lookup_rounds": s.lookup_rounds,
        "tail_proposed": s.tail_proposed,
        "tail_accepted": s.tail_accepted,
        "modelled_s": s.modelled_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="smollm2-135m")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="int8")
    ap.add_argument("--dataset", default="humaneval", help="a bench dataset (humaneval, codebase:<package>, a .jsonl)")
    ap.add_argument("--limit", type=int, default=80, help="prompts read from the dataset")
    ap.add_argument(
        "--skip", type=int, default=64, help="of those, the first ones left out (an adapt run's training part)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        prompts = load_prompts(args.dataset, args.limit)[args.skip :]
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    if not prompts:
        sys.exit("error: no prompts left after --skip")
    try:
        engine = Engine.load(args.drafter, args.target, args.dtype, progress=False)
    except (CatalogError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    profile = engine.cost_profile()

    def decoder(tails: bool) -> CrossVocabDecoder:
        return CrossVocabDecoder(
            engine.drafter_runner,
            engine.drafter.tokenizer,
            engine.target_runner,
            engine.bridge,
            engine.cache,
            expand_map=engine.expand_map,
            target_tokenizer=engine.target.tokenizer,
            rule=ThroughputRule(profile),
            lookup=LookupDrafter(),
            timings=engine.timings,
            lookup_tails=tails,
        )

    decoders = {"tails": decoder(True), "no tails": decoder(False)}
    ar = engine.ar()
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    totals = {name: GenerationStats() for name in ("ar", *decoders)}
    warm_text, warm_ids = engine.prompt_ids("def hello_world():\n")
    for d in decoders.values():  # first-call allocations
        d.generate(warm_text, warm_ids, config, remember=False)
    for i, prompt in enumerate(prompts):
        text, ids = engine.prompt_ids(prompt)
        alone = ar.generate(ids, config)
        totals["ar"].add(alone.stats)
        for name in list(decoders)[:: 1 if i % 2 == 0 else -1]:
            result = decoders[name].generate(text, ids, config)
            if result.token_ids != alone.token_ids:
                sys.exit(f"error: prompt {i}: {name} decoded other tokens than the target alone")
            totals[name].add(result.stats)
    report = {
        "dataset": args.dataset,
        "prompts": len(prompts),
        "profile_target_ms": profile.target_ms,
        **{name: summary(s) for name, s in totals.items()},
    }
    for name in totals:
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in report[name].items()})
    tails, plain = report["tails"], report["no tails"]
    print(
        f"tails / no tails: tok/s {tails['tokens_per_s'] / plain['tokens_per_s']:.3f}, decode "
        f"{tails['decode_tokens_per_s'] / plain['decode_tokens_per_s']:.3f}, tokens per call "
        f"{tails['tokens_per_target_call'] / plain['tokens_per_target_call']:.3f}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
