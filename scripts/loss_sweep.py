"""Which distillation loss learns fastest: an offline replay of one online pass.

Under greedy decoding the committed text is the target's own output whatever the drafter
drafted, so the training samples of a stream (``TrainingSample``: the drafter's tokenization of
the response plus the target statistics verification computed) do not depend on the adapter.
This script decodes HumanEval once, keeps every sample, then replays the first ``--train``
samples through ``OnlineLearner`` (the device's own schedule: an update every 8 prompts) once per
loss variant, each from a fresh adapter, and measures on the held-out samples the drafter's
teacher-forced agreement with the target:

* ``top1``: share of the response's drafter tokens that are the drafter's argmax;
* ``k4``: mean over positions of min(4, run of consecutive argmax hits from there) / 4, a
  teacher-forced stand-in for the acceptance rate of 4-token drafts;
* ``dm_top1``: ``top1`` on direct-mapped tokens only.

    python scripts/loss_sweep.py collect --target qwen2.5-coder-1.5b --out samples.pt
    python scripts/loss_sweep.py sweep --target qwen2.5-coder-1.5b --samples samples.pt \
        --variants base,seq,hybrid,hybrid-lam1,hybrid-span,hybrid-fkl,seq-lr1e-3,hybrid-lr1e-3,hybrid-lr3e-4

Variants: ``base`` (no training); ``seq`` / ``hybrid`` (the project's losses); ``hybrid-lam1``
(λ = 1); ``hybrid-span`` (hybrid + NLL on the drafter tokens that straddle a target-token
boundary); ``hybrid-fkl`` (L_DM as forward KL(p ‖ q') on the same coarsened support). Suffixes set the
schedule: ``-lrX`` the learning rate (default 1e-4; ``hybrid-fkl`` defaults to 1e-3), ``-eN``
passes over each update's samples (default 1), ``-sN`` optimizer steps per pass (default 8),
``-rN`` past samples of the stream trained on again in each update (rehearsal; default 0),
``-p1`` the sequence loss on the prompt's tokens too (those of the training window).
``collect --dataset codebase:<package>`` decodes a personal codebase instead of HumanEval
(``--train`` then sets its training part, e.g. 48 of 60).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import re
import time

import torch

from omnidraft.benchmarks import bench
from omnidraft.client.online_learner import OnlineConfig, OnlineLearner, default_training_autocast
from omnidraft.client.session import DeviceSession
from omnidraft.shared.engine.catalog import CatalogError
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec
from omnidraft.shared.learning.distill import (
    LossConfig,
    coarse_log_probs,
    hybrid_loss,
    ngram_nll,
    teacher_forced_agreement,
)
from omnidraft.shared.learning.training_signal import Intersection

DRAFTER = "smollm2-135m"


def collect(args) -> None:
    engine = Engine.load(DRAFTER, args.target, args.dtype)
    session = DeviceSession(engine, target_name=args.target, adaptive=False, grow_cache=False)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    samples = []
    t0 = time.perf_counter()
    for i, prompt in enumerate(bench.load_prompts(args.dataset, args.limit)):
        samples.append(session.generate(prompt, config, learn=True, observe=False).training_sample)
        print(f"{i + 1} prompts, {time.perf_counter() - t0:.0f} s", flush=True)
    torch.save(samples, args.out)


class VariantLearner(OnlineLearner):
    """``OnlineLearner`` with the experimental losses (``hybrid-span``, ``hybrid-fkl``)."""

    variant = ""
    rehearse = 0  # past samples trained on again in each update
    prompt = 0  # 1: the sequence loss also covers the (windowed) prompt's tokens

    def observe(self, sample):
        if self.prompt:  # the training window first, then every token of it carries the loss
            window = self.config.max_context
            sample = dataclasses.replace(sample.windowed(window) if window else sample, seq_start=1)
        return super().observe(sample)

    def update_steps(self):  # what ``update`` and ``observe`` run
        if self.rehearse:
            past = getattr(self, "past", [])
            fresh = list(self.buffer)
            self.buffer = fresh + random.Random(self.updates).sample(past, min(self.rehearse, len(past)))
            self.past = past + fresh
        return (yield from super().update_steps())

    def _sample_loss(self, s, grad):
        if self.variant not in ("span", "fkl"):
            return super()._sample_loss(s, grad)
        decoder, lm_head = self.adapters.decoder_and_head()
        ids = torch.tensor([s.draft_ids], dtype=torch.long)
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with ctx, self._autocast():
            hidden = decoder(input_ids=ids).last_hidden_state[0]
            dm_logits = lm_head(hidden.index_select(0, s.dm_pos - 1)).float()
            ng_logits = lm_head(hidden.index_select(0, s.ng_pos - 1)).float()
            if self.variant == "span":
                mask = torch.zeros(len(s.draft_ids), dtype=torch.bool)
                mask[s.seq_start :] = True
                mask[s.dm_pos] = False
                mask[s.ng_pos] = False
                straddle = mask.nonzero()[:, 0]
                st_logits = lm_head(hidden.index_select(0, straddle - 1)).float()
        if self.variant == "span":
            loss, parts = hybrid_loss(
                dm_logits,
                self.inter.draft_ids,
                s.dm_top_idx,
                s.dm_top_logp,
                s.dm_inter_logmass,
                ng_logits,
                s.ng_ids,
                s.ng_logp_t,
                self.config.loss,
            )
            nll = ngram_nll(st_logits, ids[0, straddle])
            n = s.loss_positions
            return (loss * n + nll.sum()) / (n + nll.numel()), parts, None, None
        logq = coarse_log_probs(
            torch.log_softmax(dm_logits.index_select(1, self.inter.draft_ids), -1).gather(1, s.dm_top_idx)
        )
        logp = coarse_log_probs(s.dm_top_logp - s.dm_inter_logmass[:, None])
        kl = (logp.exp() * (logp - logq)).sum(-1)
        nll = ngram_nll(ng_logits, s.ng_ids)
        return torch.cat([kl, self.config.loss.lam * nll]).mean(), {}, None, None


def agreement(adapters: DrafterAdapters, name: str, samples) -> dict:
    adapters.activate(name)
    dtype = default_training_autocast()
    return teacher_forced_agreement(*adapters.decoder_and_head(dtype), samples, autocast=dtype)


def parse_variant(name: str) -> tuple[str, LossConfig, dict]:
    """``(variant, loss, schedule)`` of a name ``LOSS[-lrX][-eN][-sN][-rN][-pN]``: learning rate,
    epochs per update, optimizer steps per update, past samples rehearsed per update, whether
    the prompt's tokens carry the loss."""
    base, *opts = re.split(r"-(?=[a-z])", name)
    if opts and opts[0] in ("lam1", "span", "fkl"):
        base = f"{base}-{opts.pop(0)}"
    kinds = {
        "seq": ("", LossConfig(kind="seq")),
        "hybrid": ("", LossConfig(kind="hybrid")),
        "hybrid-lam1": ("", LossConfig(kind="hybrid", lam=1.0)),
        "hybrid-span": ("span", LossConfig(kind="hybrid", lam=1.0)),
        "hybrid-fkl": ("fkl", LossConfig(kind="hybrid")),
    }
    if base not in kinds:
        raise SystemExit(f"loss_sweep: unknown variant {name!r}")
    variant, loss = kinds[base]
    schedule = {"lr": 1e-3 if variant == "fkl" else 1e-4, "epochs": 1, "steps": 8, "rehearse": 0, "prompt": 0}
    keys = {
        "lr": ("lr", float),
        "e": ("epochs", int),
        "s": ("steps", int),
        "r": ("rehearse", int),
        "p": ("prompt", int),
    }
    for opt in opts:
        prefix = "lr" if opt.startswith("lr") else opt[:1]
        if prefix not in keys:
            raise SystemExit(f"loss_sweep: unknown option {opt!r} in {name!r}")
        key, kind = keys[prefix]
        try:
            schedule[key] = kind(opt[len(prefix) :])
        except ValueError:
            raise SystemExit(f"loss_sweep: bad option {opt!r} in {name!r}") from None
    return variant, loss, schedule


def sweep(args) -> None:
    names = args.variants.split(",")
    for name in names:  # unknown names fail before anything loads
        if name != "base":
            parse_variant(name)
    torch.manual_seed(0)
    samples = torch.load(args.samples, weights_only=False)  # before the models: a bad path fails fast
    engine = Engine.load(DRAFTER, args.target, args.dtype)
    train, test = samples[: args.train], samples[args.train :]
    inter = Intersection(engine.bridge, engine.drafter.logit_rows)
    adapters = DrafterAdapters(engine.drafter.model, LoraSpec(rank=32), drafter_weights=engine.drafter_weights)
    for i, name in enumerate(names):
        adapters.add(f"v{i}")
        row = {"variant": name}
        if name != "base":
            variant, loss, sched = parse_variant(name)
            config = OnlineConfig(
                lr=sched["lr"], epochs=sched["epochs"], steps_per_update=sched["steps"], loss=loss, head=False
            )
            learner = VariantLearner(adapters, f"v{i}", inter, None, config)
            learner.variant = variant
            learner.rehearse = sched["rehearse"]
            learner.prompt = sched["prompt"]
            t0 = time.perf_counter()
            for s in train:
                learner.observe(s)
            if learner.buffer:
                learner.update()
            row.update(**sched, train_s=round(time.perf_counter() - t0, 1))
        row.update(agreement(adapters, f"v{i}", test))
        print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--target", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--limit", type=int)
    c.add_argument("--dataset", default="humaneval", help="humaneval, codebase:<package> or a JSONL file")
    c.add_argument("--dtype", default="int8")
    s = sub.add_parser("sweep")
    s.add_argument("--target", required=True)
    s.add_argument("--samples", required=True)
    s.add_argument(
        "--train", type=int, default=131, help="samples in the training stream (default: 80 %% of HumanEval)"
    )
    s.add_argument("--variants", default="base,seq,hybrid")
    s.add_argument("--dtype", default="int8")
    args = p.parse_args()
    try:
        collect(args) if args.command == "collect" else sweep(args)
    except (CatalogError, OSError, ValueError, RuntimeError) as exc:  # a missing samples file, an unknown target
        raise SystemExit(f"loss_sweep: {exc}") from None


if __name__ == "__main__":
    main()
