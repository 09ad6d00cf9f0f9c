"""Vocabulary bridge between a drafter tokenizer and a target tokenizer.

Everything here is about *bytes*: a token's "bytes" are what it contributes to the decoded text
(UTF-8), independent of how the tokenizer spells it internally (GPT-2 byte-level ``Ġfoo``,
SentencePiece ``▁foo`` or a byte-fallback ``<0x0A>``). Two tokens from different vocabularies
are *directly mapped* when their byte strings are identical.

Conventions (all sizes count token ids, all lengths count bytes):

* ``*_vocab_size`` is the number of *real* ids (1 + the highest id that is a real token); ids at
  or beyond it (GGUF filler ids such as ``[PAD151665]``, padded logit rows) are never produced.
* ``*_logit_rows`` is the number of rows of the model's output head, which may exceed the
  tokenizer (Qwen2.5: 151,665 real ids, 151,936 rows).
* Duplicate byte strings: on the **drafter** side the lowest id wins. On the **target** side the
  *canonical* id wins: a regular token beats a byte-fallback ``<0xNN>`` token, then the lowest
  id. ``draft_to_target`` points at the canonical target id; ``target_to_draft`` maps *every*
  target id whose bytes exist in the drafter vocabulary (so Gemma's ``<0x0A>`` and ``\\n`` both map
  to SmolLM2 ``Ċ``, while ``Ċ`` maps to Gemma's regular ``\\n`` token). Hence
  ``t2d[d2t[d]] == d`` for every mapped drafter id, and ``d2t[t2d[t]]`` has the same bytes as
  ``t`` (equal to ``t`` unless ``t`` is a non-canonical alias).
* Special tokens have no bytes (``None``). They are matched by *role* (``eos``, ``bos``, ``pad``,
  ``unk``, ``turn_start``, ``turn_end``), never by string, and the role matches are also written
  into ``draft_to_target``/``target_to_draft`` so one table lookup covers the hot path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import torch

from omnidraft.shared.vocab.token_healing import TokenHealer

__all__ = [
    "TokenScheme",
    "bytes_to_unicode",
    "VocabBridge",
    "detect_scheme",
    "special_roles",
    "stop_ids",
    "token_bytes_table",
]

# GGUF conversions pad the vocabulary with filler ids spelled "[PAD<id>]".
_FILLER_RE = re.compile(r"\[PAD(\d+)\]\Z")
_BYTE_FALLBACK_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")
_METASPACE = "\u2581"  # "▁"

# Well-known chat / document markers, classified by role. These win over the tokenizer's
# attributes, because converted tokenizers often misuse them (SmolLM2 reports <|im_start|> as
# bos_token and <|im_end|> as pad_token).
_MARKER_ROLES: dict[str, str] = {
    "<|im_start|>": "turn_start",
    "<start_of_turn>": "turn_start",
    "<|start_header_id|>": "turn_start",
    "<|im_end|>": "turn_end",
    "<end_of_turn>": "turn_end",
    "<|eot_id|>": "turn_end",
    "<|end|>": "turn_end",
    "<|endoftext|>": "eos",
    "<|end_of_text|>": "eos",
    "</s>": "eos",
    "<eos>": "eos",
    "<s>": "bos",
    "<bos>": "bos",
    "<|begin_of_text|>": "bos",
    "<pad>": "pad",
    "<unk>": "unk",
}
_ATTRIBUTE_ROLES: tuple[tuple[str, str], ...] = (
    ("eos_token", "eos"),
    ("bos_token", "bos"),
    ("pad_token", "pad"),
    ("unk_token", "unk"),
)
# If the target lacks a role, a drafter special of that role maps to the first fallback present.
_ROLE_FALLBACK: dict[str, tuple[str, ...]] = {"turn_end": ("eos",), "eos": ("turn_end",)}
_STOP_ROLES = ("eos", "turn_end")


@dataclass(frozen=True)
class TokenScheme:
    """How a tokenizer spells bytes: ``kind`` is ``"byte_level"`` (GPT-2 byte-to-unicode
    alphabet) or ``"metaspace"`` (SentencePiece ``▁`` for space); ``byte_fallback`` means
    ``<0xNN>`` tokens stand for single raw bytes."""

    kind: str
    byte_fallback: bool = False


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table (byte 0x20 -> "Ġ", 0x0A -> "Ċ")."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> tuple[dict[int, str], re.Pattern[str]]:
    """``bytes_to_unicode`` inverted into a ``str.translate`` table (unicode char -> latin-1
    char of the byte) plus a regex that finds characters outside the alphabet."""
    forward = bytes_to_unicode()
    table = {ord(c): chr(b) for b, c in forward.items()}
    outside = re.compile("[^" + "".join(re.escape(c) for c in forward.values()) + "]")
    return table, outside


def _backend(tokenizer: Any):
    """The ``tokenizers.Tokenizer`` behind a transformers tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} has no backend_tokenizer (a fast tokenizer is required)")
    return backend


def _component_types(component: Any) -> list[dict]:
    """Flatten a decoder / pre-tokenizer (possibly a ``Sequence``) into its JSON parts."""
    if component is None:
        return []
    state = json.loads(component.__getstate__())
    out, todo = [], [state]
    while todo:
        part = todo.pop(0)
        nested = part.get("decoders") or part.get("pretokenizers")
        if part.get("type") == "Sequence" and nested:
            todo = list(nested) + todo
        else:
            out.append(part)
    return out


def detect_scheme(tokenizer: Any) -> TokenScheme:
    """Detect the token spelling scheme from the tokenizer's decoder (then pre-tokenizer)."""
    backend = _backend(tokenizer)
    decoders = _component_types(backend.decoder)
    types = {d.get("type") for d in decoders}
    byte_fallback = "ByteFallback" in types or bool(getattr(backend.model, "byte_fallback", False))
    if "ByteLevel" in types:
        return TokenScheme("byte_level", byte_fallback)
    metaspace = "Metaspace" in types or any(
        d.get("type") == "Replace" and d.get("pattern", {}).get("String") == _METASPACE and d.get("content") == " "
        for d in decoders
    )
    if metaspace:
        return TokenScheme("metaspace", byte_fallback)
    if not decoders and any(p.get("type") == "ByteLevel" for p in _component_types(backend.pre_tokenizer)):
        return TokenScheme("byte_level", byte_fallback)
    raise ValueError(f"unsupported tokenizer scheme (decoder types {sorted(map(str, types))})")


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids of special/control tokens (added tokens flagged special, plus the named specials)."""
    ids = {i for i, tok in _backend(tokenizer).get_added_tokens_decoder().items() if tok.special}
    ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None)
    return ids


def _filler_ids(strings: Sequence[str | None]) -> set[int]:
    """GGUF filler ids: ``[PAD<id>]`` whose number equals the id itself."""
    out = set()
    for i, s in enumerate(strings):
        if s is not None and s.startswith("[PAD"):
            m = _FILLER_RE.match(s)
            if m and int(m.group(1)) == i:
                out.add(i)
    return out


def _token_strings(tokenizer: Any) -> list[str | None]:
    """Token string of every id ``0..len(tokenizer)-1`` (``None`` for holes)."""
    n = len(tokenizer)
    strings: list[str | None] = [None] * n
    for s, i in _backend(tokenizer).get_vocab(with_added_tokens=True).items():
        if 0 <= i < n:
            strings[i] = s
    return strings


def _table_and_flags(tokenizer: Any) -> tuple[list[bytes | None], set[int], set[int], set[int]]:
    """(bytes table, special ids, filler ids, byte-fallback ids) of ``tokenizer``."""
    scheme = detect_scheme(tokenizer)
    strings = _token_strings(tokenizer)
    specials = _special_ids(tokenizer)
    fillers = _filler_ids(strings)
    added = {i: t.content for i, t in _backend(tokenizer).get_added_tokens_decoder().items()}
    table: list[bytes | None] = [None] * len(strings)
    fallback_ids: set[int] = set()
    if scheme.kind == "byte_level":
        trans, outside = _byte_level_alphabet()
        for i, s in enumerate(strings):
            if s is None or i in specials or i in fillers:
                continue
            if i in added:
                table[i] = added[i].encode("utf-8")
            elif outside.search(s):  # not in the byte alphabet: the decoder passes it through
                table[i] = _mixed_byte_level(s, trans)
            else:
                table[i] = s.translate(trans).encode("latin-1")
    else:
        for i, s in enumerate(strings):
            if s is None or i in specials or i in fillers:
                continue
            if i in added:
                table[i] = added[i].encode("utf-8")
                continue
            if scheme.byte_fallback and s.startswith("<0x"):
                m = _BYTE_FALLBACK_RE.match(s)
                if m:
                    table[i] = bytes([int(m.group(1), 16)])
                    fallback_ids.add(i)
                    continue
            table[i] = s.replace(_METASPACE, " ").encode("utf-8")
    return table, specials, fillers, fallback_ids


def _mixed_byte_level(s: str, trans: dict[int, str]) -> bytes:
    """Byte-level token holding characters outside the alphabet: those are emitted as UTF-8."""
    out = bytearray()
    for c in s:
        mapped = trans.get(ord(c))
        out += mapped.encode("latin-1") if mapped is not None else c.encode("utf-8")
    return bytes(out)


def token_bytes_table(tokenizer: Any) -> list[bytes | None]:
    """Bytes each id ``0..len(tokenizer)-1`` contributes to decoded text.

    GPT-2 byte-level tokens go through the byte-to-unicode table (``Ġ`` = space, ``Ċ`` = newline);
    SentencePiece tokens have ``▁`` replaced by a space and ``<0xNN>`` byte-fallback tokens become
    that single byte; non-special added tokens contribute their content. ``None`` marks special /
    control tokens and GGUF filler ids (``[PAD151665]``). The scheme is detected from the
    tokenizer's decoder. Note: decoders that strip a leading space of the *whole* text (Llama's
    ``Strip``) are not modelled; the table gives the contribution in the middle of a text.
    """
    return _table_and_flags(tokenizer)[0]


def special_roles(tokenizer: Any) -> dict[str, int]:
    """Role -> id of the tokenizer's special tokens (roles: eos, bos, pad, unk, turn_start,
    turn_end). Each special id gets one *primary* role: a well-known marker's role first
    (``<|im_end|>`` is turn_end even if it is also the eos_token), else the attribute naming it.
    If several ids share a role, the lowest id is kept."""
    backend = _backend(tokenizer)
    primary: dict[int, str] = {}
    for i, tok in sorted(backend.get_added_tokens_decoder().items()):
        role = _MARKER_ROLES.get(tok.content)
        if role is not None:
            primary.setdefault(i, role)
    for attr, role in _ATTRIBUTE_ROLES:
        content = getattr(tokenizer, attr, None)
        if content is None:
            continue
        i = backend.token_to_id(str(content))
        if i is not None:
            primary.setdefault(i, _MARKER_ROLES.get(str(content), role))
    roles: dict[str, int] = {}
    for i, role in sorted(primary.items()):
        roles.setdefault(role, i)
    return roles


def stop_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that end generation: the eos_token itself plus every eos / end-of-turn role."""
    roles = special_roles(tokenizer)
    ids = {roles[r] for r in _STOP_ROLES if r in roles}
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return frozenset(ids)


def _match_specials(draft_roles: dict[str, int], target_roles: dict[str, int]) -> dict[int, int]:
    """Drafter special id -> target special id by role (with the eos/turn_end fallback)."""
    out: dict[int, int] = {}
    for role, d in sorted(draft_roles.items(), key=lambda kv: kv[1]):
        for r in (role, *_ROLE_FALLBACK.get(role, ())):
            if r in target_roles:
                out.setdefault(d, target_roles[r])
                break
    return out


def _real_size(table: Sequence[bytes | None], specials: Iterable[int], limit: int) -> int:
    """1 + the highest id below ``limit`` that is a real token (has bytes or is special)."""
    special = set(specials)
    for i in range(min(limit, len(table)) - 1, -1, -1):
        if table[i] is not None or i in special:
            return i + 1
    return 0


@dataclass(eq=False)
class VocabBridge:
    """Direct (byte-identical) and special-role maps between a drafter and a target vocabulary.

    ``draft_to_target`` has ``draft_logit_rows`` entries, ``target_to_draft`` has
    ``target_logit_rows``; ``-1`` means "no direct counterpart". Byte strings are in
    ``draft_bytes`` / ``target_bytes`` (``None`` for specials and filler ids).
    """

    draft_to_target: torch.Tensor
    target_to_draft: torch.Tensor
    d2t: list[int]
    draft_bytes: list[bytes | None]
    target_bytes: list[bytes | None]
    draft_vocab_size: int
    target_vocab_size: int
    target_invalid_mask: torch.Tensor
    target_stop_ids: frozenset[int]
    draft_stop_ids: frozenset[int]
    special_draft_to_target: dict[int, int]
    num_direct: int

    @cached_property
    def draft_healer(self) -> TokenHealer:
        """The drafter vocabulary's token-healing index (built on first use, then shared)."""
        return TokenHealer(self.draft_bytes)

    @classmethod
    def from_tokenizers(
        cls,
        draft_tokenizer: Any,
        target_tokenizer: Any,
        draft_logit_rows: int | None = None,
        target_logit_rows: int | None = None,
    ) -> VocabBridge:
        """Build the bridge. ``*_logit_rows`` default to ``len(tokenizer)``; pass the models'
        output-head sizes (``config.vocab_size``) so the tensors line up with the logits."""
        d_bytes, d_special, _, _ = _table_and_flags(draft_tokenizer)
        t_bytes, t_special, t_filler, t_fallback = _table_and_flags(target_tokenizer)
        d_rows = len(d_bytes) if draft_logit_rows is None else int(draft_logit_rows)
        t_rows = len(t_bytes) if target_logit_rows is None else int(target_logit_rows)
        d_real = _real_size(d_bytes, d_special, d_rows)
        t_real = _real_size(t_bytes, t_special, t_rows)

        # Canonical target id per byte string: regular tokens before byte-fallback ones, then lowest id.
        canonical: dict[bytes, int] = {}
        for t in range(t_real):
            b = t_bytes[t]
            if b and (b not in canonical or (canonical[b] in t_fallback and t not in t_fallback)):
                canonical[b] = t
        # Lowest drafter id per byte string, and its canonical target.
        draft_of: dict[bytes, int] = {}
        d2t = [-1] * d_rows
        for d in range(d_real):
            b = d_bytes[d]
            if b and b not in draft_of:
                draft_of[b] = d
                d2t[d] = canonical.get(b, -1)
        t2d = [-1] * t_rows
        for t in range(t_real):
            b = t_bytes[t]
            if b:
                t2d[t] = draft_of.get(b, -1)
        num_direct = sum(1 for x in d2t if x >= 0)

        matched = _match_specials(special_roles(draft_tokenizer), special_roles(target_tokenizer))
        specials = {d: t for d, t in matched.items() if d < d_rows and t < t_rows}
        for d, t in sorted(specials.items()):
            d2t[d] = t
            if t2d[t] < 0:
                t2d[t] = d

        invalid = torch.zeros(t_rows, dtype=torch.bool)
        invalid[t_real:] = True
        for t in range(t_real):
            if t_bytes[t] is None and t not in t_special:
                invalid[t] = True  # filler ids and holes
        for t in t_filler:
            if t < t_rows:
                invalid[t] = True

        return cls(
            draft_to_target=torch.tensor(d2t, dtype=torch.long),
            target_to_draft=torch.tensor(t2d, dtype=torch.long),
            d2t=d2t,
            draft_bytes=d_bytes,
            target_bytes=t_bytes,
            draft_vocab_size=d_real,
            target_vocab_size=t_real,
            target_invalid_mask=invalid,
            target_stop_ids=frozenset(i for i in stop_ids(target_tokenizer) if i < t_rows),
            draft_stop_ids=frozenset(i for i in stop_ids(draft_tokenizer) if i < d_rows),
            special_draft_to_target=specials,
            num_direct=num_direct,
        )

    def __repr__(self) -> str:
        return (
            f"VocabBridge(draft_vocab_size={self.draft_vocab_size}, target_vocab_size="
            f"{self.target_vocab_size}, draft_logit_rows={len(self.d2t)}, target_logit_rows="
            f"{len(self.target_to_draft)}, num_direct={self.num_direct}, "
            f"special_draft_to_target={self.special_draft_to_target})"
        )

    def target_text_bytes(self, target_ids: Iterable[int] | torch.Tensor) -> bytes:
        """Concatenated bytes of ``target_ids`` (specials and filler ids contribute nothing)."""
        if isinstance(target_ids, torch.Tensor):
            target_ids = target_ids.reshape(-1).tolist()
        table = self.target_bytes
        n = len(table)
        return b"".join(table[i] or b"" for i in target_ids if 0 <= i < n)
