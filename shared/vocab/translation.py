"""Translating a drafted block (drafter ids) into a proposal (target ids).

Two translators, chosen per decoder (``--translate``):

- ``NgramTranslator`` (the OmniDraft paper's rule): left to right, the longest n-gram cache
  match inside the block merges several drafter tokens into one target token; otherwise a
  drafter token maps to the target token with identical bytes, or expands into the target's
  tokenization of its text (one-to-many, e.g. SmolLM2's newline+indent tokens); a drafter token
  with none of these ends the block. Deterministic, and the cache is not modified.
- ``TextTranslator``: the drafted block's text tokenized by the target's own tokenizer. It
  gives the target's canonical tokenization of the drafted text, including merges that cross
  drafter token boundaries and that no many-to-one cache entry can express (Qwen writes
  ``"):\\n"`` as one token where SmolLM2 writes ``"):"`` and ``"\\n"`` + indentation).
  docs/findings.md compares the two; it is the default because it accepts more tokens.

Either way verification keeps the output the target's own: a translator only decides what is
proposed.

A block may begin by re-spelling committed text (``skip`` bytes, token healing:
``omnidraft.shared.vocab.token_healing``): those bytes are not proposed again. The n-gram translator
proposes the new bytes of the token that straddles that boundary as the target's tokenization
of them (a healed ``" if"`` after a committed ``"\n    "`` proposes ``"if"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from omnidraft.shared.vocab.ngram_cache import NgramCache
from omnidraft.shared.vocab.vocab_bridge import VocabBridge

TRANSLATORS = ("text", "ngram")


@dataclass
class Unit:
    """One proposed target token. ``draft_len`` > 0 with ``ngram`` set when it merged the
    drafter tokens ``drafts[draft_start: draft_start + draft_len]`` through the cache."""

    target_id: int
    draft_start: int = -1
    draft_len: int = 0
    ngram: bool = False


@runtime_checkable
class Translator(Protocol):
    """Drafter tokens -> proposed target tokens (``NgramTranslator``, ``TextTranslator``)."""

    def __call__(self, drafts: list[int], skip: int = 0) -> list[Unit]:
        """The target tokens the drafter tokens ``drafts`` propose; their first ``skip`` bytes
        re-spell text already committed."""
        ...


class NgramTranslator:
    """Cache merge, then direct map, then one-to-many expansion; stop at the first gap."""

    def __init__(
        self,
        bridge: VocabBridge,
        cache: NgramCache,
        expand_map: dict[int, tuple[int, ...]],
        encode_target: Callable[[str], list[int]] | None = None,
    ):
        """``encode_target``: the target tokenizer (without special tokens), for the new bytes of
        a token that straddles the end of the committed text; without it such a block proposes
        nothing."""
        self.d2t = bridge.d2t
        self.draft_bytes = bridge.draft_bytes
        self.target_bytes = bridge.target_bytes
        self.cache = cache
        self.expand = expand_map
        self.encode = encode_target

    def __call__(self, drafts: list[int], skip: int = 0) -> list[Unit]:
        """Translate ``drafts`` whose first ``skip`` bytes re-spell committed text."""
        units: list[Unit] = []
        i, k = 0, len(drafts)
        while skip and i < k:
            size = len(self.draft_bytes[drafts[i]])
            if size > skip:  # straddles: propose the target's tokenization of its new bytes
                text = _complete_utf8(self.draft_bytes[drafts[i]][skip:])
                raw = text.encode("utf-8")
                ids = self.encode(text) if text and self.encode is not None else []
                if not ids or b"".join(self.target_bytes[t] or b"" for t in ids) != raw:
                    return units
                units.extend(Unit(t, i, 1) for t in ids)
                if len(raw) < size - skip:  # an incomplete character: stop here
                    return units
                skip = 0
            else:
                skip -= size
            i += 1
        d2t, n_d2t = self.d2t, len(self.d2t)
        while i < k:
            hit = self.cache.match(drafts, i, k)
            if hit is not None:
                n, tid = hit
                units.append(Unit(tid, i, n, True))
                i += n
                continue
            d = drafts[i]
            tid = d2t[d] if d < n_d2t else -1
            if tid >= 0:
                units.append(Unit(tid, i, 1))
            elif d in self.expand:
                units.extend(Unit(t, i, 1) for t in self.expand[d])
            else:
                break
            i += 1
        return units


class TextTranslator:
    """The target tokenizer applied to the drafted text.

    Text stops before the first drafter token without bytes (a special token): that token is
    proposed through its role mapping (e.g. end of turn) if it has one, and ends the block.
    Incomplete UTF-8 at the end is left out.
    """

    def __init__(self, bridge: VocabBridge, encode_target: Callable[[str], list[int]]):
        self.draft_bytes = bridge.draft_bytes
        self.special = bridge.special_draft_to_target
        self.encode = encode_target

    def __call__(self, drafts: list[int], skip: int = 0) -> list[Unit]:
        """Translate ``drafts`` whose first ``skip`` bytes re-spell committed text."""
        raw = bytearray()
        tail: list[Unit] = []
        for d in drafts:
            b = self.draft_bytes[d] if d < len(self.draft_bytes) else None
            if b is None:
                if d in self.special:
                    tail.append(Unit(self.special[d]))
                break
            raw += b
        text = _complete_utf8(bytes(raw[skip:]))
        return [Unit(t) for t in self.encode(text)] + tail if text else tail


def _complete_utf8(raw: bytes) -> str:
    """Decode the longest prefix of ``raw`` that is valid UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return raw[: exc.start].decode("utf-8")


def build_expand_map(bridge: VocabBridge, target_tokenizer) -> dict[int, tuple[int, ...]]:
    """One-to-many translations: drafter tokens with no identical target token, mapped to the
    target's tokenization of their text (e.g. SmolLM2's newline+indent tokens, which Qwen
    writes as a newline token followed by a whitespace token).
    """
    draft_ids, texts = [], []
    for d, tid in enumerate(bridge.d2t[: bridge.draft_vocab_size]):
        raw = bridge.draft_bytes[d]
        if tid >= 0 or not raw or d in bridge.special_draft_to_target:
            continue
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        draft_ids.append(d)
    out: dict[int, tuple[int, ...]] = {}
    encoded = target_tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for d, raw, ids in zip(draft_ids, texts, encoded):
        if ids and b"".join(bridge.target_bytes[i] or b"" for i in ids).decode("utf-8", errors="replace") == raw:
            out[d] = tuple(ids)
    return out
