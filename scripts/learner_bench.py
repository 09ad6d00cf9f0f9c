"""What one training device's learner update costs, on real samples of the default scenario.

Decodes ``--samples`` prompts of the simulation's personal-codebase corpus (seeded choice) with
the default pairing (SmolLM2-135M drafting for Qwen2.5-Coder-1.5B in int8) to get their training
samples, then times ``OnlineLearner.update`` over them in groups of ``--interval`` (a training
device's round: 4 prompts), from a seeded untrained adapter, and prints the seconds of each
update and the sha256 of the adapter tensors after the last one, so two commits compare on the
same work and the same result (``git stash`` or ``git checkout`` between two runs):

    python scripts/learner_bench.py --samples 8 --interval 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=8, help="prompts decoded for training samples")
    ap.add_argument("--interval", type=int, default=4, help="samples per update (a device's round)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from omnidraft.client.online_learner import OnlineConfig
    from omnidraft.client.session import DeviceSession
    from omnidraft.shared.engine.generation import GenerationConfig
    from omnidraft.shared.engine.pair import Engine
    from omnidraft.simulations.data import load_corpus

    corpus = load_corpus("codebases")
    prompts = random.Random(args.seed).sample(corpus.prompts, args.samples)
    engine = Engine.load("smollm2-135m", "qwen2.5-coder-1.5b", "int8")
    decoder = DeviceSession(engine, target_name="qwen2.5-coder-1.5b", online=OnlineConfig(interval=10**9))
    samples = [decoder.generate(p, GenerationConfig(max_new_tokens=48), observe=False).training_sample for p in prompts]
    torch.manual_seed(args.seed)
    session = DeviceSession(engine, target_name="bench", online=OnlineConfig(interval=args.interval, lr=args.lr))
    seconds = []
    for i in range(0, len(samples) - args.interval + 1, args.interval):
        session.learner.buffer = list(samples[i : i + args.interval])
        seconds.append(round(session.learner.update().seconds, 2))
    state = session.adapters.state_dict("bench")
    digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
    print(
        json.dumps(
            {
                "update_s": seconds,
                "drafter_tokens": [len(s.draft_ids) for s in samples],
                "adapter_sha256": digest[:16],
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
