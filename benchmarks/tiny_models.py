"""Tiny drafter/target models built on the spot (no download): byte-level BPE tokenizers with
different vocabularies trained on the same synthetic code corpus, and small Llama models trained
briefly on it so that the drafter agrees with a target often enough to exercise acceptance,
n-gram merging and KV-cache rollback. Tests use them, and so do fleet simulations
(``--models tiny``) through :func:`ensure_tiny_fleet`, which builds them once per directory."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    names = ["alpha", "beta", "gamma", "delta", "count", "total", "value", "index", "items", "result"]
    ops = ["+", "-", "*", "//"]
    out = []
    for _ in range(n):
        f, a, b = rng.sample(names, 3)
        op = rng.choice(ops)
        out.append(
            f"def {f}_{rng.randint(0, 9)}({a}, {b}):\n"
            f'    """Return {a} {op} {b}."""\n'
            f"    {f} = {a} {op} {b}\n"
            f"    return {f}\n\n"
        )
    return out


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def train_model(
    tokenizer, texts: list[str], hidden: int, layers: int, steps: int, seed: int, extra_rows: int = 0
) -> LlamaForCausalLM:
    """A small Llama trained for ``steps`` AdamW steps on ``texts`` (fp32, CPU).

    ``extra_rows`` pads the LM head beyond the tokenizer (like Qwen's padded vocabulary).
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer) + extra_rows,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    ids = tokenizer("".join(texts))["input_ids"]
    data = torch.tensor(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    seq = 64
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (8,), generator=gen)
        batch = torch.stack([data[s : s + seq + 1] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss  # the model shifts labels itself
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.requires_grad_(False)
    return model


@dataclass
class TinyPair:
    drafter: LlamaForCausalLM
    draft_tokenizer: PreTrainedTokenizerFast
    target: LlamaForCausalLM
    target_tokenizer: PreTrainedTokenizerFast
    texts: list[str]


def build_pair(save_dir=None) -> TinyPair:
    texts = corpus()
    d_tok = train_tokenizer(texts, 300)
    t_tok = train_tokenizer(texts, 420)
    drafter = train_model(d_tok, texts, hidden=48, layers=2, steps=120, seed=1)
    target = train_model(t_tok, texts, hidden=64, layers=2, steps=160, seed=2, extra_rows=13)
    pair = TinyPair(drafter, d_tok, target, t_tok, texts)
    if save_dir is not None:
        for name, model, tok in (("drafter", drafter, d_tok), ("target", target, t_tok)):
            model.save_pretrained(save_dir / name)
            tok.save_pretrained(save_dir / name)
    return pair


TINY_FLEET_VERSION = 1
TINY_FLEET = ("tiny-drafter", "tiny-target-a", "tiny-target-b")


def ensure_tiny_fleet(root: str | os.PathLike[str]) -> dict[str, Path]:
    """A tiny drafter and two tiny targets with different tokenizers, as HF directories under
    ``root/tiny-fleet-v<N>/`` (built on first use, about 10 s; then reused). Returns
    {name: directory} for the names in ``TINY_FLEET``."""
    base = Path(root) / f"tiny-fleet-v{TINY_FLEET_VERSION}"
    dirs = {name: base / name for name in TINY_FLEET}
    if _complete(dirs):
        return dirs
    base.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base.parent, prefix=".tiny-fleet-"))
    try:
        texts = corpus()
        d_tok = train_tokenizer(texts, 300)
        built = {
            "tiny-drafter": (train_model(d_tok, texts, hidden=48, layers=2, steps=120, seed=1), d_tok),
        }
        for name, vocab, seed, extra in (("tiny-target-a", 420, 2, 13), ("tiny-target-b", 520, 3, 0)):
            tok = train_tokenizer(texts, vocab)
            built[name] = (train_model(tok, texts, hidden=64, layers=2, steps=160, seed=seed, extra_rows=extra), tok)
        for name, (model, tok) in built.items():
            model.save_pretrained(tmp / name)
            tok.save_pretrained(tmp / name)
        if base.exists() and not _complete(dirs):  # a partial earlier build
            shutil.rmtree(base)
        try:
            os.replace(tmp, base)
        except OSError:
            if not _complete(dirs):  # not a concurrent build that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dirs


def _complete(dirs: dict[str, Path]) -> bool:
    return all((d / "config.json").is_file() and (d / "tokenizer.json").is_file() for d in dirs.values())
