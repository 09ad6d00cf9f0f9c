"""Tests for omnidraft.shared.vocab.vocab_bridge (token bytes tables and the drafter<->target bridge)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from omnidraft.shared.vocab.vocab_bridge import (
    TokenScheme,
    VocabBridge,
    _special_ids,
    detect_scheme,
    special_roles,
    token_bytes_table,
)

real = pytest.mark.real_models
TOKENIZERS = ["drafter_tokenizer", "qwen_tokenizer", "gemma_tokenizer"]


def _check_bridge_invariants(b: VocabBridge) -> None:
    """Shapes, identical bytes on every direct pair, d2t/t2d inverse on mapped ids."""
    d2t, t2d = b.draft_to_target.tolist(), b.target_to_draft.tolist()
    assert d2t == b.d2t
    assert len(b.target_invalid_mask) == len(t2d)
    specials = b.special_draft_to_target
    for d, t in enumerate(d2t):
        if t < 0:
            continue
        if d in specials:
            assert specials[d] == t
            assert b.draft_bytes[d] is None and b.target_bytes[t] is None
        else:
            assert b.draft_bytes[d] is not None and b.draft_bytes[d] == b.target_bytes[t]
        assert t2d[t] == d, "t2d must invert d2t on mapped drafter ids"
        assert not b.target_invalid_mask[t]
    for t, d in enumerate(t2d):
        if d >= 0:
            assert d2t[d] >= 0
            assert b.target_bytes[d2t[d]] == b.target_bytes[t], "target aliases share bytes"
    assert b.num_direct == sum(1 for d, t in enumerate(d2t) if t >= 0 and d not in specials)


# ------------------------------------------------------------------------- toy tokenizers


def test_toy_schemes_and_roles(toy_byte_level_tokenizer, toy_metaspace_tokenizer):
    assert detect_scheme(toy_byte_level_tokenizer) == TokenScheme("byte_level", False)
    assert detect_scheme(toy_metaspace_tokenizer) == TokenScheme("metaspace", True)
    # Markers beat misused attributes: <|im_start|> is bos_token but its role is turn_start.
    assert special_roles(toy_byte_level_tokenizer) == {"eos": 0, "turn_start": 1, "turn_end": 2}
    roles = special_roles(toy_metaspace_tokenizer)
    assert {r: toy_metaspace_tokenizer.convert_ids_to_tokens(i) for r, i in roles.items()} == {
        "pad": "<pad>",
        "eos": "<eos>",
        "bos": "<bos>",
        "unk": "<unk>",
        "turn_start": "<start_of_turn>",
        "turn_end": "<end_of_turn>",
    }


def test_toy_bytes_table(toy_byte_level_tokenizer, toy_metaspace_tokenizer):
    bl = token_bytes_table(toy_byte_level_tokenizer)
    assert bl[:3] == [None, None, None]
    assert bl[toy_byte_level_tokenizer.convert_tokens_to_ids("Ġfoo")] == b" foo"
    assert bl[toy_byte_level_tokenizer.convert_tokens_to_ids("Ċ")] == b"\n"
    ms = token_bytes_table(toy_metaspace_tokenizer)
    ids = toy_metaspace_tokenizer.convert_tokens_to_ids(["▁foo", "<0x0A>", "<0xC3>", "\n", "<eos>"])
    assert [ms[i] for i in ids] == [b" foo", b"\n", b"\xc3", b"\n", None]
    assert ms[-2:] == [None, None]  # [PAD<id>] filler ids


def test_toy_bridge(toy_byte_level_tokenizer, toy_metaspace_tokenizer):
    d_tok, t_tok = toy_byte_level_tokenizer, toy_metaspace_tokenizer
    rows = len(t_tok) + 3  # output head larger than the tokenizer
    b = VocabBridge.from_tokenizers(d_tok, t_tok, target_logit_rows=rows)
    _check_bridge_invariants(b)
    d = d_tok.convert_tokens_to_ids
    t = t_tok.convert_tokens_to_ids
    # Regular "\n" is canonical; the <0x0A> alias still maps back to the drafter's Ċ.
    assert b.d2t[d("Ċ")] == t("\n")
    assert b.target_to_draft[t("<0x0A>")] == d("Ċ")
    assert b.d2t[d("Ġfoo")] == t("▁foo")
    assert b.d2t[d("Ã")] == t("<0xC3>")  # a lone byte maps to the byte-fallback token
    assert b.special_draft_to_target == {0: t("<eos>"), 1: t("<start_of_turn>"), 2: t("<end_of_turn>")}
    assert b.target_stop_ids == frozenset({t("<eos>"), t("<end_of_turn>")})
    assert b.draft_stop_ids == frozenset({0, 2})
    n = len(t_tok)
    assert b.target_vocab_size == n - 2
    assert b.target_invalid_mask.nonzero().flatten().tolist() == list(range(n - 2, rows))
    assert (b.target_to_draft[n - 2 :] == -1).all()
    assert b.target_text_bytes(t_tok.encode(" foo\né", add_special_tokens=False)) == " foo\né".encode()
    assert b.target_text_bytes(torch.tensor([t("<bos>"), t("▁foo")])) == b" foo"


# ------------------------------------------------------------------------- real tokenizers


@real
def test_detect_scheme(drafter_tokenizer, qwen_tokenizer, gemma_tokenizer):
    assert detect_scheme(drafter_tokenizer).kind == "byte_level"
    assert detect_scheme(qwen_tokenizer).kind == "byte_level"
    assert detect_scheme(gemma_tokenizer) == TokenScheme("metaspace", True)


@real
@pytest.mark.parametrize("name", TOKENIZERS)
def test_bytes_table_matches_single_token_decode(name, request):
    """Every id with bytes decodes (alone) to exactly those bytes (lossy where partial UTF-8)."""
    tok = request.getfixturevalue(name)
    table = token_bytes_table(tok)
    assert len(table) == len(tok)
    ids = [i for i, b in enumerate(table) if b is not None]
    decoded = tok.backend_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    bad = [(i, table[i]) for i, s in zip(ids, decoded) if table[i].decode("utf-8", "replace") != s]
    assert not bad[:10]


@real
@pytest.mark.parametrize("name", TOKENIZERS)
def test_bytes_table_reproduces_decode(name, request, tricky_texts, humaneval_texts):
    tok = request.getfixturevalue(name)
    table = token_bytes_table(tok)
    specials = sorted(_special_ids(tok))
    for text in tricky_texts + humaneval_texts[:20]:
        ids = tok.encode(text, add_special_tokens=False)
        joined = b"".join(table[i] or b"" for i in ids)
        assert joined.decode("utf-8") == tok.decode(ids), text
    real_ids = [i for i, b in enumerate(table) if b is not None]
    rng = random.Random(1234)
    for _ in range(300):  # random real ids (may be invalid UTF-8) mixed with specials
        ids = [rng.choice(real_ids) if rng.random() > 0.05 else rng.choice(specials) for _ in range(rng.randint(1, 30))]
        joined = b"".join(table[i] or b"" for i in ids)
        assert joined.decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=True)


@real
def test_qwen_filler_ids(qwen_tokenizer):
    table = token_bytes_table(qwen_tokenizer)
    assert len(table) == 151936
    assert qwen_tokenizer.convert_ids_to_tokens(151665) == "[PAD151665]"
    assert all(b is None for b in table[151665:])  # GGUF filler
    assert all(table[i] is None for i in _special_ids(qwen_tokenizer))
    assert table[qwen_tokenizer.convert_tokens_to_ids("<tool_call>")] == b"<tool_call>"  # added, not special
    assert table[220] == b" " and table[198] == b"\n"


@real
def test_gemma_byte_fallback_tokens(gemma_tokenizer, gemma_bridge, drafter_tokenizer):
    table = token_bytes_table(gemma_tokenizer)
    for b in range(256):
        assert table[gemma_tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>")] == bytes([b])
    newline_byte = gemma_tokenizer.convert_tokens_to_ids("<0x0A>")
    c_newline = drafter_tokenizer.convert_tokens_to_ids("Ċ")
    assert gemma_bridge.target_to_draft[newline_byte] == c_newline
    assert gemma_bridge.d2t[c_newline] == gemma_tokenizer.convert_tokens_to_ids("\n")  # canonical
    assert gemma_bridge.d2t[drafter_tokenizer.convert_tokens_to_ids("Ġfoo")] == gemma_tokenizer.convert_tokens_to_ids(
        "▁foo"
    )


@real
def test_qwen_bridge(drafter_tokenizer, qwen_tokenizer, qwen_bridge):
    t0 = time.perf_counter()
    b = VocabBridge.from_tokenizers(drafter_tokenizer, qwen_tokenizer, 49152, 151936)
    build_s = time.perf_counter() - t0
    assert build_s < 5.0, f"bridge build took {build_s:.2f} s"
    _check_bridge_invariants(b)
    assert 30000 < b.num_direct < 49152
    assert b.draft_vocab_size == 49152 and b.target_vocab_size == 151665
    assert b.draft_to_target.shape == (49152,) and b.target_to_draft.shape == (151936,)
    d, q = drafter_tokenizer.convert_tokens_to_ids, qwen_tokenizer.convert_tokens_to_ids
    for s in ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]:
        assert b.special_draft_to_target[d(s)] == q(s)
        assert b.d2t[d(s)] == q(s)
    assert b.target_stop_ids == frozenset({q("<|im_end|>"), q("<|endoftext|>")})
    assert b.draft_stop_ids == frozenset({d("<|im_end|>"), d("<|endoftext|>")})
    # GGUF filler rows: invalid and unmapped; specials stay valid (EOS must be producible).
    assert b.target_invalid_mask[151665:].all() and not b.target_invalid_mask[:151665].any()
    assert (b.target_to_draft[151665:] == -1).all()
    assert not (b.draft_to_target >= 151665).any()
    assert b.d2t[d("Ġfoo")] == q("Ġfoo")
    assert b.target_text_bytes([q("<|im_start|>"), q("def"), q("Ġfoo")]) == b"def foo"


@real
def test_gemma_bridge(drafter_tokenizer, gemma_tokenizer, gemma_bridge):
    b = gemma_bridge
    _check_bridge_invariants(b)
    assert 30000 < b.num_direct < 49152
    assert b.target_vocab_size == 262144 and not b.target_invalid_mask.any()
    d, g = drafter_tokenizer.convert_tokens_to_ids, gemma_tokenizer.convert_tokens_to_ids
    # SmolLM2's eos_token is <|im_end|> (role turn_end) -> Gemma <end_of_turn>;
    # SmolLM2 <|endoftext|> (role eos) -> Gemma <eos>.
    assert b.special_draft_to_target == {
        d("<|endoftext|>"): g("<eos>"),
        d("<|im_start|>"): g("<start_of_turn>"),
        d("<|im_end|>"): g("<end_of_turn>"),
    }
    assert b.special_draft_to_target[drafter_tokenizer.eos_token_id] == g("<end_of_turn>")
    assert b.target_stop_ids == frozenset({g("<eos>"), g("<end_of_turn>")})


@real
def test_humaneval_direct_map_share(qwen_tokenizer, qwen_bridge, gemma_tokenizer, gemma_bridge, humaneval_texts):
    """Share of target tokens (target tokenization of HumanEval prompt+solution) that are
    directly mapped to one drafter token. Measured: Qwen 85.8 %, Gemma 98.1 %."""
    for tok, bridge in ((qwen_tokenizer, qwen_bridge), (gemma_tokenizer, gemma_bridge)):
        t2d = bridge.target_to_draft.tolist()
        total = mapped = 0
        for text in humaneval_texts:
            ids = tok.encode(text, add_special_tokens=False)
            total += len(ids)
            mapped += sum(1 for i in ids if t2d[i] >= 0)
        assert mapped / total > 0.8, (type(tok).__name__, mapped / total)
