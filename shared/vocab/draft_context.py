"""Reverse translation: keep the drafter's own tokenization of the text the target committed.

The target commits tokens (as byte strings); the drafter must condition on the same *text* in
its own vocabulary. Re-tokenizing everything every round is O(text) per round, and tokenizing
only the new suffix is wrong because BPE merges across the boundary. ``DraftContext`` re-encodes
from a *safe boundary* instead and keeps ``ids == encode(committed_text)`` exactly.

Safe-boundary rule (for GPT-2-style byte-level pre-tokenizers, whose regex is
``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``):
a byte offset ``p`` (a drafter token boundary, counted in bytes of the decoded text) is safe when
the pre-tokenizer must start a new pre-token there *whatever text follows*, which holds if either

  (a) the character at ``p`` is an ASCII space and the character after it is not whitespace
      (the space is the optional prefix of the next pre-token: ``" foo"``, ``" ("``, ``" 1"``), or
  (b) the character before ``p`` is whitespace other than the ASCII space (newline, tab, ...)
      and the character at ``p`` is not whitespace (``"\\n" | "def"``),

and every character the rule looks at was already decoded before this commit. At such a ``p``
the regex scan of the whole text and the scan of ``text[p:]`` agree from ``p`` on, pre-tokens are
BPE-encoded independently, so ``encode(text) == ids_before_p + encode(text[p:])``. The search
starts ``window_tokens`` tokens back from the end and walks further back until a safe boundary
is found (falling back to offset 0, i.e. the whole text, e.g. inside one long CJK run).
"Whitespace" is Unicode White_Space, which is what ``\\s`` matches in the tokenizer's regex.
"""

from __future__ import annotations

import codecs
import re
from bisect import bisect_left
from collections.abc import Callable, Sequence
from itertools import accumulate

__all__ = ["DraftContext", "common_prefix_len", "text_encoder"]

# Unicode White_Space (what \s matches in the pre-tokenizer regex).
_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(chr(c) for c in range(0x2000, 0x200B))
)
_ASCII_WS = frozenset(b"\t\n\x0b\x0c\r ")
_SPACE = 0x20


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length (tokens) of the longest common prefix of ``a`` and ``b``: how much of the drafter's
    KV cache (fed with ``a``) stays valid for the new ids ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """``encode`` for ``DraftContext``: the drafter tokenizer without special tokens added, and
    with special-token strings in the text encoded as plain text (committed text is text)."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    return encode


_DROPPED_CACHE: dict[int, tuple[Sequence[bytes | None], frozenset[int]]] = {}


def _dropped_bytes(draft_bytes: Sequence[bytes | None]) -> frozenset[int]:
    """Byte values with no single-byte drafter token (cached per table object; the cache keeps
    the table alive so its id cannot be reused)."""
    hit = _DROPPED_CACHE.get(id(draft_bytes))
    if hit is not None and hit[0] is draft_bytes:
        return hit[1]
    present = set(draft_bytes)
    dropped = frozenset(x for x in range(256) if bytes([x]) not in present)
    if len(_DROPPED_CACHE) >= 8:
        _DROPPED_CACHE.clear()
    _DROPPED_CACHE[id(draft_bytes)] = (draft_bytes, dropped)
    return dropped


def _char_len(lead: int) -> int:
    """Length in bytes of the UTF-8 character starting with byte ``lead``."""
    if lead < 0x80:
        return 1
    if lead >= 0xF0:
        return 4
    if lead >= 0xE0:
        return 3
    return 2


def _is_ws_at(text: bytes | bytearray, pos: int) -> bool:
    """Whether the character starting at byte ``pos`` is Unicode whitespace."""
    lead = text[pos]
    if lead < 0x80:
        return lead in _ASCII_WS
    return bytes(text[pos : pos + _char_len(lead)]).decode("utf-8", "replace") in _WHITESPACE


def _is_safe(text: bytearray, p: int, known: int) -> bool:
    """Rule (a)/(b) above at byte offset ``p``, looking only at bytes below ``known``."""
    if p <= 0:
        return True
    if p >= known or 0x80 <= text[p] < 0xC0:  # not decoded before, or not a character start
        return False
    if text[p] == _SPACE:  # (a)
        nxt = p + 1
        return nxt < known and not _is_ws_at(text, nxt)
    if _is_ws_at(text, p):
        return False
    q = p - 1  # (b): start of the character before p
    while q > 0 and 0x80 <= text[q] < 0xC0:
        q -= 1
    return text[q] != _SPACE and _is_ws_at(text, q)


class DraftContext:
    """The drafter-side view of the committed text.

    ``ids`` are drafter token ids whose bytes are exactly the committed text so far, minus a
    held-back incomplete UTF-8 tail (at most 3 bytes); ``ids == encode(decoded_text)`` always.
    Invalid UTF-8 (which no tokenizer can take as text) is replaced by U+FFFD. Byte values the
    drafter has no token for are dropped by its tokenizer, so ``ids`` spell the text without them.
    Offsets are in bytes of the decoded text; counts in tokens.
    """

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        draft_bytes: Sequence[bytes | None],
        prompt_text: str,
        window_tokens: int = 8,
        verify: bool = False,
    ) -> None:
        """``encode``: drafter tokenizer without special tokens (see ``text_encoder``);
        ``draft_bytes``: bytes of every drafter id (``VocabBridge.draft_bytes``);
        ``window_tokens``: re-encode at least this many trailing tokens per commit;
        ``verify``: re-encode the whole text after each commit and assert equality (debug)."""
        self._encode = encode
        self._draft_bytes = draft_bytes
        # Byte values the drafter has no token for: its tokenizer silently drops them (SmolLM2
        # lacks 0x04 0x06 0x13 0x14 0x16 0x1D 0xC0 0xC1 0xF1 0xF2 0xF5-0xFF).
        self._dropped = _dropped_bytes(draft_bytes)
        self._dropped_re = (
            re.compile(b"[" + b"".join(re.escape(bytes([x])) for x in sorted(self._dropped)) + b"]")
            if self._dropped
            else None
        )
        self._window = max(1, int(window_tokens))
        self._verify = verify
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        prompt = prompt_text.encode("utf-8")
        self._raw = bytearray(prompt)  # every committed byte, pending tail included
        self._text = bytearray(prompt)  # UTF-8 of the decoded text that ``ids`` spell
        self._delta = 0  # len(text) - decoded raw bytes (grows only with U+FFFD replacements)
        self.ids: list[int] = []
        self._ends: list[int] = []  # byte end offset (in _text) of each token of ids
        self._set_tokens(0, self._encode(prompt_text))

    @property
    def text_bytes(self) -> bytes:
        """The whole committed text in bytes, including the pending incomplete UTF-8 tail."""
        return bytes(self._raw)

    @property
    def pending_bytes(self) -> bytes:
        """Committed bytes not yet in ``ids`` (an incomplete UTF-8 character)."""
        return self._decoder.getstate()[0]

    def commit(self, new_bytes: Sequence[bytes]) -> list[tuple[int, tuple[int, ...]]]:
        """Append the byte strings of newly committed target tokens (one entry per token).

        Returns n-gram candidates ``(i, drafter_ids)``: new token ``i`` whose byte span starts
        and ends on drafter token boundaries of the new tokenization and covers >= 2 drafter
        tokens (e.g. target ``"flake"`` <-> drafter ``("f", "la", "ke")``).
        """
        starts, pos = [], len(self._raw)
        for b in new_bytes:
            starts.append(pos)
            pos += len(b)
        chunk = b"".join(new_bytes)
        self._raw += chunk
        known = len(self._text)
        delta_before = self._delta
        decoded = self._decoder.decode(chunk)
        if not decoded:
            return []
        self._text += decoded.encode("utf-8")
        self._delta = len(self._text) - (len(self._raw) - len(self._decoder.getstate()[0]))
        self._retokenize(known)
        if self._verify:
            assert self.ids == self._encode(self._text.decode("utf-8")), "DraftContext out of sync"
        if self._delta != delta_before:  # replacement characters: raw and text offsets differ
            return []
        return self._candidates(starts, new_bytes)

    def _retokenize(self, known: int) -> None:
        """Re-encode from the last safe boundary at least ``window`` tokens back."""
        k = max(0, len(self.ids) - self._window)
        while k > 0 and not _is_safe(self._text, self._ends[k - 1], known):
            k -= 1
        p = self._ends[k - 1] if k else 0
        self._set_tokens(k, self._encode(self._text[p:].decode("utf-8")))

    def _set_tokens(self, k: int, new_ids: list[int]) -> None:
        """Replace tokens ``k:`` by ``new_ids`` (which spell ``_text`` from token ``k`` on)."""
        start = self._ends[k - 1] if k else 0
        table = self._draft_bytes
        for t in new_ids:
            if table[t] is None:
                raise ValueError(
                    f"drafter encode produced special id {t}: encode text with special-token "
                    "strings split (see text_encoder)"
                )
        if self._dropped_re is None or not self._dropped_re.search(self._text, start):
            ends = list(accumulate((len(table[t]) for t in new_ids), initial=start))[1:]
            end = ends[-1] if ends else start
        else:
            ends, end = self._align(start, new_ids)
        if end != len(self._text):
            raise ValueError(f"drafter tokens spell {end} bytes, text has {len(self._text)}")
        del self.ids[k:], self._ends[k:]
        self.ids.extend(new_ids)
        self._ends.extend(ends)

    def _align(self, pos: int, new_ids: list[int]) -> tuple[list[int], int]:
        """Token end offsets when the text holds bytes the drafter drops: a dropped byte is
        counted at the start of the following token (so a token ends right after its last
        byte). Returns (ends, offset after trailing dropped bytes)."""
        text, dropped, table = self._text, self._dropped, self._draft_bytes
        ends = []
        for t in new_ids:
            for byte in table[t]:
                while pos < len(text) and text[pos] != byte:
                    if text[pos] not in dropped:
                        raise ValueError(f"drafter token {t} does not match the text at byte {pos}")
                    pos += 1
                if pos == len(text):
                    raise ValueError(f"drafter token {t} runs past the end of the text")
                pos += 1
            ends.append(pos)
        while pos < len(text) and text[pos] in dropped:
            pos += 1
        return ends, pos

    def span(self, start: int, end: int) -> tuple[int, int] | None:
        """Drafter tokens that spell exactly the bytes ``[start, end)`` of the decoded text:
        ``(first, last)`` indices into ``ids`` (inclusive), or None when ``start`` or ``end``
        is not a drafter token boundary."""
        ends = self._ends
        first = 0
        if start:
            j = bisect_left(ends, start)
            if j == len(ends) or ends[j] != start:
                return None
            first = j + 1
        last = bisect_left(ends, end, first)
        if last == len(ends) or ends[last] != end or last < first:
            return None
        return first, last

    def text_offset(self, raw_offset: int) -> int | None:
        """Offset in the decoded text of committed byte ``raw_offset``; None once invalid UTF-8
        was replaced (raw and decoded offsets then differ)."""
        return raw_offset if self._delta == 0 else None

    def _candidates(self, starts: list[int], new_bytes: Sequence[bytes]) -> list[tuple[int, tuple[int, ...]]]:
        """N-gram candidates for the new target tokens (see ``commit``)."""
        out = []
        limit, delta = len(self._text), self._delta
        for i, (a, b) in enumerate(zip(starts, new_bytes)):
            a += delta
            z = a + len(b)
            if len(b) < 2 or z > limit:
                continue
            hit = self.span(a, z)
            if hit is not None and hit[1] > hit[0]:
                ids = tuple(self.ids[hit[0] : hit[1] + 1])
                if self._dropped_re is None or b"".join(self._draft_bytes[t] for t in ids) == b:
                    out.append((i, ids))
        return out
