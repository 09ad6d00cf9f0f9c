"""Tests for omnidraft.shared.vocab.draft_context (incremental drafter-side re-tokenization)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from omnidraft.shared.vocab.draft_context import DraftContext, common_prefix_len, text_encoder
from omnidraft.shared.vocab.vocab_bridge import VocabBridge, token_bytes_table

real = pytest.mark.real_models


# ------------------------------------------------------------------------- helpers


def _complete_prefix(data: bytes) -> str:
    """Longest prefix of ``data`` that is complete UTF-8 (what ``ids`` must spell)."""
    for cut in range(len(data), max(-1, len(data) - 4), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    raise AssertionError("invalid UTF-8 in the middle of the text")


def _replay(
    tokenizer, draft_bytes, pieces: Sequence[bytes], rng: random.Random | None, prompt: str = "", window: int = 8
) -> tuple[DraftContext, list]:
    """Commit ``pieces`` (target token bytes) one by one, or in random chunks of 1..8 when
    ``rng`` is given, and check ``ids == encode(text)`` after every commit."""
    encode = text_encoder(tokenizer)
    ctx = DraftContext(encode, draft_bytes, prompt, window)
    assert ctx.ids == tokenizer.encode(prompt, add_special_tokens=False)
    candidates, i = [], 0
    while i < len(pieces):
        k = rng.randint(1, 8) if rng else 1
        chunk = list(pieces[i : i + k])
        for j, ids in ctx.commit(chunk):
            candidates.append((chunk[j], ids))
        i += k
        text = _complete_prefix(ctx.text_bytes)
        assert ctx.ids == tokenizer.encode(text, add_special_tokens=False), (text[-80:], i)
        assert ctx.pending_bytes == ctx.text_bytes[len(text.encode()) :]
    return ctx, candidates


def _check_candidates(candidates, draft_bytes) -> None:
    for target_piece, ids in candidates:
        assert len(ids) >= 2
        assert b"".join(draft_bytes[t] for t in ids) == target_piece


# ------------------------------------------------------------------------- toy encode (no download)


def _char_encoder():
    """Character-level toy drafter: token id = code point, bytes = its UTF-8."""
    table = [chr(c).encode("utf-8", "surrogatepass") for c in range(0x11000)]
    return (lambda s: [ord(c) for c in s]), table


def test_common_prefix_len():
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len((7,), [8]) == 0


def test_utf8_hold_back_and_replacement():
    encode, table = _char_encoder()
    ctx = DraftContext(encode, table, "ab")
    assert ctx.ids == [ord("a"), ord("b")]
    assert ctx.commit([b"\xe4"]) == []  # first byte of 中: held back
    assert ctx.ids == [ord("a"), ord("b")] and ctx.pending_bytes == b"\xe4"
    ctx.commit([b"\xb8", b"\xad "])
    assert ctx.ids == [ord(c) for c in "ab中 "] and ctx.pending_bytes == b""
    ctx.commit([b"\xff", b"x"])  # invalid UTF-8 becomes U+FFFD
    assert ctx.ids[-2:] == [0xFFFD, ord("x")]
    assert ctx.text_bytes == "ab中 ".encode() + b"\xffx"


def test_candidates_toy():
    encode, table = _char_encoder()
    ctx = DraftContext(encode, table, "")
    got = ctx.commit([b"f", b"lake", b"\xe4\xb8", b"\xad", b" ok"])
    assert got == [(1, tuple(map(ord, "lake"))), (4, tuple(map(ord, " ok")))]


# ------------------------------------------------------------------------- real tokenizers


@real
def test_safe_boundary_fuzz(drafter_tokenizer):
    """Adversarial byte streams (contractions, Unicode spaces, split multi-byte characters,
    whitespace runs) committed in random byte chunks with tiny windows."""
    table = token_bytes_table(drafter_tokenizer)
    pieces = [
        " ",
        "  ",
        "\t",
        "\n",
        "\r\n",
        "\u00a0",
        "\u3000",
        "\x1c",
        "\x85",
        "a",
        "Z",
        "foo",
        " bar",
        "'s",
        "'t",
        "'re",
        "'ll",
        "'",
        "1",
        "4567",
        ".",
        "(",
        "==",
        "->",
        "😀",
        "👍🏽",
        "中",
        "文字",
        "é",
        "e\u0301",
        "\u200b",
        "\u2003",
        "ß",
        "#",
        "__",
        "'S",
        "\x1d",
        "\x04",
        "\U00050000",
        "\U00090000",
    ]  # the last four: bytes SmolLM2 drops
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))).encode()
        cut = rng.randint(0, len(text))
        while 0 < cut < len(text) and 0x80 <= text[cut] < 0xC0:
            cut -= 1  # the prompt must be whole characters
        chunks, i = [], cut
        while i < len(text):
            k = rng.randint(1, 5)
            chunks.append(text[i : i + k])
            i += k
        _replay(drafter_tokenizer, table, chunks, rng, prompt=text[:cut].decode(), window=rng.choice([1, 2, 8]))


@real
def test_qwen_tokens_humaneval(drafter_tokenizer, qwen_tokenizer, qwen_bridge, humaneval_texts):
    """All 164 HumanEval texts as Qwen tokens in random chunks of 1..8 tokens."""
    rng = random.Random(0)
    total = 0
    for n, text in enumerate(humaneval_texts):
        ids = qwen_tokenizer.encode(text, add_special_tokens=False)
        pieces = [qwen_bridge.target_bytes[i] for i in ids]
        assert b"".join(pieces) == text.encode()
        ctx, cands = _replay(drafter_tokenizer, qwen_bridge.draft_bytes, pieces, rng)
        _check_candidates(cands, qwen_bridge.draft_bytes)
        total += len(cands)
        if n < 8:  # a sample one token per commit, with a prompt prefix
            cut = len(ids) // 3
            prompt = b"".join(pieces[:cut]).decode()
            _replay(drafter_tokenizer, qwen_bridge.draft_bytes, pieces[cut:], None, prompt=prompt)
    assert total > 500  # multi-token drafter spellings of single Qwen tokens are common


@real
def test_gemma_tokens_humaneval(drafter_tokenizer, gemma_tokenizer, gemma_bridge, humaneval_texts):
    rng = random.Random(1)
    for text in humaneval_texts:
        ids = gemma_tokenizer.encode(text, add_special_tokens=False)
        pieces = [gemma_bridge.target_bytes[i] for i in ids]
        assert b"".join(pieces) == text.encode()
        _, cands = _replay(drafter_tokenizer, gemma_bridge.draft_bytes, pieces, rng)
        _check_candidates(cands, gemma_bridge.draft_bytes)


@real
@pytest.mark.parametrize("target", ["qwen", "gemma"])
def test_tricky_texts_token_by_token(target, request, drafter_tokenizer, tricky_texts):
    """Unicode / emoji / CJK / whitespace texts one target token per commit. Gemma spells
    characters missing from its vocabulary as <0xNN> byte tokens, so commits end mid-character
    and must be held back."""
    tok = request.getfixturevalue(f"{target}_tokenizer")
    bridge: VocabBridge = request.getfixturevalue(f"{target}_bridge")
    held_back = 0
    for text in tricky_texts:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [bridge.target_bytes[i] for i in ids]
        text = tok.decode(ids)  # Qwen normalizes to NFC: the committed text is what it decodes to
        assert b"".join(pieces) == text.encode()
        for window in (1, 8):
            _, cands = _replay(drafter_tokenizer, bridge.draft_bytes, pieces, None, window=window)
            _check_candidates(cands, bridge.draft_bytes)
        pos = 0
        for p in pieces:
            pos += len(p)
            try:
                text.encode()[:pos].decode()
            except UnicodeDecodeError:
                held_back += 1
        _replay(drafter_tokenizer, bridge.draft_bytes, pieces, random.Random(3))
    if target == "gemma":
        assert held_back > 0


@real
def test_ngram_candidate_example(drafter_tokenizer, qwen_tokenizer, qwen_bridge):
    """A Qwen token the drafter spells with several tokens becomes an n-gram candidate."""
    encode = text_encoder(drafter_tokenizer)
    ctx = DraftContext(encode, qwen_bridge.draft_bytes, "def f(x):\n")
    ids = qwen_tokenizer.encode("    return numbers_sorted", add_special_tokens=False)
    pieces = [qwen_bridge.target_bytes[i] for i in ids]
    cands = dict(ctx.commit(pieces))
    multi = [
        i for i, p in enumerate(pieces) if len(drafter_tokenizer.encode(p.decode(), add_special_tokens=False)) >= 2
    ]
    assert multi and any(i in cands for i in multi)
    for i, d_ids in cands.items():
        assert b"".join(qwen_bridge.draft_bytes[t] for t in d_ids) == pieces[i]
