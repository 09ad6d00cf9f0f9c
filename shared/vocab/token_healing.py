"""Token healing: let the drafter re-spell the last token of its context.

The drafter's context is its own tokenization of the committed text (``DraftContext``), but
the committed text ends wherever the target's last token ended, and that is often not where the
drafter's tokenization of the *finished* text will have a token boundary. The common case is
indentation: SmolLM2 writes ``"\\n    if"`` as ``"\\n   "`` + ``" if"`` (the last space belongs
to the word), so a context that ends in the committed ``"\\n    "`` ends in a token the drafter
only ever saw before a newline, and it drafts as if the line were over. Measured on held-out
prompts (docs/findings.md, "Token healing"), one drafting round in six (Qwen) to four (Gemma)
starts at such a point, and almost none of those rounds' drafts were accepted.

Healing re-opens the last context token ``L``: the drafter predicts from the position before
it, its choice restricted to the tokens that can stand there in its tokenization of the finished
text: ``L`` itself, a token that extends it (``"return"`` after a committed ``"ret"``), or, when
``L`` ends with a space, the token spelling ``L`` without that space (the byte-level
pre-tokenizer gives a whitespace run's last space to the next word). In the last case the next
token must then start with the space (``" if"``). Among them it takes its most likely token: the
most likely tokenization of text that begins with the committed bytes. When that is ``L``
itself, drafting goes on from the last position as without healing, so healing costs one more
logits row per round; when it re-spells, the first drafted token carries only the new bytes
(and the space-dropping case costs one drafter step that proposes nothing).

Other re-spellings (a shorter token followed by a longer one, ``"ba"`` + ``"sel"`` for ``"bas"``)
are left out: choosing them by the first token's probability alone overrates them, and scoring
them needs more drafter steps than they win back.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import torch

__all__ = ["TokenHealer"]


class TokenHealer:
    """Which drafter tokens may re-spell the end of the committed text (see the module docstring)."""

    def __init__(self, draft_bytes: Sequence[bytes | None], max_cached: int = 4096) -> None:
        """``draft_bytes``: the bytes of every drafter id (None for special tokens, which never
        take part)."""
        pairs = sorted((b, i) for i, b in enumerate(draft_bytes) if b)
        self._keys = [b for b, _ in pairs]
        self._ids = [i for _, i in pairs]
        self._cache: dict[tuple[bytes, str], torch.Tensor] = {}  # (bytes, kind) -> ids
        self._max_cached = max_cached

    def candidates(self, last: bytes) -> torch.Tensor:
        """Drafter ids that may replace a last context token spelling ``last``: ``last`` and
        its extensions, and ``last`` minus a final space (sorted, int64)."""
        if not (len(last) > 1 and last.endswith(b" ")):
            return self.extensions(last)
        key = (last, "candidates")
        hit = self._cache.get(key)
        if hit is None:  # once per token: this runs every drafting round
            hit = torch.unique(torch.cat([self.extensions(last), self.extensions(last[:-1], exact=True)]))
            self._remember(key, hit)
        return hit

    def extensions(self, pending: bytes, exact: bool = False) -> torch.Tensor:
        """Drafter ids whose bytes start with ``pending`` (or, with ``exact``, equal it);
        sorted, int64; empty when ``pending`` is empty."""
        key = (pending, "exact" if exact else "extensions")
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        keys, ids = self._keys, []
        j = bisect_left(keys, pending) if pending else len(keys)
        while j < len(keys) and (keys[j] == pending if exact else keys[j].startswith(pending)):
            ids.append(self._ids[j])
            j += 1
        out = torch.tensor(sorted(ids), dtype=torch.long)
        self._remember(key, out)
        return out

    def _remember(self, key: tuple[bytes, str], ids: torch.Tensor) -> None:
        if len(self._cache) >= self._max_cached:
            self._cache.clear()
        self._cache[key] = ids
