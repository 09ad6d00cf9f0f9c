"""The training signal that cross-vocabulary decoding leaves behind, at no extra target call.

Verification already scores every committed target position. ``SignalRecorder`` keeps, per
committed target token ``t``:

* ``log p(t)`` (temperature 1, full target vocabulary), and
* the target distribution gathered onto the *intersection* (target ids with an identical
  drafter token): its ``top_k`` largest log-probabilities, their intersection indices, and the
  log of the total intersection mass (so the rest of the intersection is one bucket).

When the generation ends, ``finish`` aligns the committed tokens with the drafter's own
tokenization of the final text (``DraftContext``):

* a **direct-mapped (DM)** position: one drafter token spells exactly ``t`` and maps to it;
* an **n-gram** position: ``n >= 2`` drafter tokens spell exactly ``t`` (``"flake"`` <->
  ``"f" "la" "ke"``); every sub-token gets an NLL term (paper Eq. 4);
* anything else (a token boundary inside a drafter token) carries no loss.

Drafter index ``j`` of an aligned token is predicted by the drafter's output at ``j - 1``, so
the teacher-forced drafter forward over ``TrainingSample.draft_ids`` gives ``q_theta`` there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from omnidraft.shared.vocab.draft_context import DraftContext
from omnidraft.shared.vocab.vocab_bridge import VocabBridge

TOP_K = 32
# what the recorder keeps per committed token (``SignalRecorder.signal``; see the module docstring)
SIGNAL_KEYS = ("top_idx", "top_logp", "mass", "logp_t")


class Intersection:
    """Paired drafter/target ids of the tokens both vocabularies share (identical bytes).

    ``draft_ids[i]`` and ``target_ids[i]`` spell the same bytes; ``index_of_draft[d]`` is ``i``
    for a shared drafter id ``d`` and -1 otherwise.
    """

    def __init__(self, bridge: VocabBridge, draft_rows: int) -> None:
        pairs = [(d, t) for d, t in enumerate(bridge.d2t[:draft_rows]) if t >= 0]
        self.draft_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
        self.target_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)
        self.index_of_draft = torch.full((draft_rows,), -1, dtype=torch.long)
        self.index_of_draft[self.draft_ids] = torch.arange(len(pairs))
        self.d2t = bridge.d2t

    def __len__(self) -> int:
        return int(self.draft_ids.numel())


@dataclass
class TrainingSample:
    """What one generation teaches the drafter (all indices are drafter positions).

    ``draft_ids``: drafter tokenization of prompt + response. DM positions: ``dm_pos`` [n],
    ``dm_top_idx`` [n, k] (intersection indices), ``dm_top_logp`` [n, k] and ``dm_inter_logmass``
    [n] (target log-probs, temperature 1), ``dm_logp_t`` [n] (log p of the committed token).
    N-gram sub-token positions: ``ng_pos`` [m], ``ng_ids`` [m] (the sub-tokens), ``ng_logp_t``
    [m] (log p of the target token they spell), ``ng_count`` (n-gram target tokens).
    ``target_tokens``: committed target tokens of the response. ``seq_start``: the first
    drafter position of the response that carries a loss (its first aligned token); the
    sequence-level loss covers ``seq_start .. len(draft_ids) - 1``.
    """

    draft_ids: list[int]
    dm_pos: torch.Tensor
    dm_top_idx: torch.Tensor
    dm_top_logp: torch.Tensor
    dm_inter_logmass: torch.Tensor
    dm_logp_t: torch.Tensor
    ng_pos: torch.Tensor
    ng_ids: torch.Tensor
    ng_logp_t: torch.Tensor
    ng_count: int
    target_tokens: int
    seq_start: int

    @property
    def loss_positions(self) -> int:
        """Positions of the hybrid loss (DM tokens + n-gram sub-tokens)."""
        return int(self.dm_pos.numel() + self.ng_pos.numel())

    @property
    def seq_positions(self) -> int:
        """Positions of the sequence-level loss (every drafter token from ``seq_start`` on)."""
        return len(self.draft_ids) - self.seq_start

    def positions(self, kind: str) -> int:
        """Loss positions of the loss ``kind`` ("seq" or "hybrid")."""
        return self.seq_positions if kind == "seq" else self.loss_positions

    def windowed(self, context: int) -> TrainingSample:
        """This sample with at most ``context`` drafter tokens before its first loss position
        (the prompt's start cut off, every position shifted): a training forward's cost and
        activations grow with the tokens it reads, and the far start of a long prompt adds
        little to what the response's tokens teach. Returns ``self`` when nothing is cut."""
        cut = max(0, self.seq_start - 1 - context)  # seq_start: the first DM or n-gram position
        if not cut:
            return self
        return replace(
            self,
            draft_ids=self.draft_ids[cut:],
            dm_pos=self.dm_pos - cut,
            ng_pos=self.ng_pos - cut,
            seq_start=self.seq_start - cut,
        )


class SignalRecorder:
    """Collects the per-token target statistics of one generation (see the module docstring)."""

    def __init__(self, intersection: Intersection, top_k: int = TOP_K) -> None:
        self.inter = intersection
        self.top_k = min(top_k, len(intersection))
        self._rows: list[tuple[torch.Tensor, ...]] = []
        self._tokens: list[int] = []

    def record(self, logits: torch.Tensor, committed: list[int]) -> None:
        """``logits`` [>= len(committed), target vocab]: the verification rows that scored the
        committed tokens (invalid ids already at -inf)."""
        n = len(committed)
        if n == 0:
            return
        logp = torch.log_softmax(logits[:n].float(), dim=-1)
        ids = torch.tensor(committed, dtype=torch.long)
        logp_t = logp.gather(1, ids[:, None])[:, 0]
        inter = logp.index_select(1, self.inter.target_ids)
        mass = torch.logsumexp(inter, dim=-1)
        top = inter.topk(self.top_k, dim=-1)
        self._rows.append((top.indices.to(torch.int32), top.values, mass, logp_t))
        self._tokens.extend(committed)

    @property
    def tokens(self) -> list[int]:
        """The committed target tokens recorded so far."""
        return list(self._tokens)

    def signal(self) -> dict[str, torch.Tensor]:
        """The rows recorded so far, one per committed token (``recordings.Recording.signal``)."""
        if not self._rows:
            return {
                "top_idx": torch.zeros(0, self.top_k, dtype=torch.int32),
                "top_logp": torch.zeros(0, self.top_k),
                "mass": torch.zeros(0),
                "logp_t": torch.zeros(0),
            }
        return dict(zip(SIGNAL_KEYS, (torch.cat(c) for c in zip(*self._rows))))

    @torch.inference_mode(False)
    def finish(self, context: DraftContext, response_start: int, target_bytes) -> TrainingSample:
        """Align the recorded tokens with ``context`` (which must hold the whole response);
        ``response_start`` is the committed-byte offset where the response begins. The sample's
        tensors are normal tensors (usable in autograd) even when decoding ran in inference mode."""
        rows = self.signal()
        top_idx, top_logp, mass, logp_t = rows["top_idx"], rows["top_logp"], rows["mass"], rows["logp_t"]
        ids, d2t = context.ids, self.inter.d2t
        dm_rows, dm_pos, ng_pos, ng_ids, ng_rows = [], [], [], [], []
        ng_count = 0
        pos = response_start
        for i, t in enumerate(self._tokens):
            raw = target_bytes[t] or b""
            a, pos = pos, pos + len(raw)
            if not raw:
                continue
            start = context.text_offset(a)
            if start is None:
                break
            hit = context.span(start, start + len(raw))
            if hit is None or hit[0] == 0:
                continue
            first, last = hit
            if first == last:
                if ids[first] < len(d2t) and d2t[ids[first]] == t:
                    dm_rows.append(i)
                    dm_pos.append(first)
            else:
                sub = ids[first : last + 1]
                ng_count += 1
                ng_pos.extend(range(first, last + 1))
                ng_ids.extend(sub)
                ng_rows.extend([i] * len(sub))
        dm = torch.tensor(dm_rows, dtype=torch.long)
        ng = torch.tensor(ng_rows, dtype=torch.long)
        return TrainingSample(
            draft_ids=list(ids),
            dm_pos=torch.tensor(dm_pos, dtype=torch.long),
            dm_top_idx=top_idx[dm].long(),
            dm_top_logp=top_logp[dm],
            dm_inter_logmass=mass[dm],
            dm_logp_t=logp_t[dm],
            ng_pos=torch.tensor(ng_pos, dtype=torch.long),
            ng_ids=torch.tensor(ng_ids, dtype=torch.long),
            ng_logp_t=logp_t[ng],
            ng_count=ng_count,
            target_tokens=len(self._tokens),
            seq_start=min(dm_pos[:1] + ng_pos[:1], default=len(ids)),
        )


class ReplayedSignal(SignalRecorder):
    """A ``SignalRecorder`` fed from a recording of the same greedy decode
    (``recordings.Recording.signal``) instead of the verification rows: a decode against a
    ``RecordedTarget`` commits the recorded tokens in order, and each ``record`` takes their
    recorded rows (the logits it is given are the recording's own and carry no statistics)."""

    def __init__(
        self, intersection: Intersection, generated: list[int], signal: dict[str, torch.Tensor], top_k: int = TOP_K
    ) -> None:
        super().__init__(intersection, top_k)
        if signal["top_idx"].shape[1:] != (self.top_k,) or any(len(signal[k]) != len(generated) for k in signal):
            raise ValueError("the recorded signal does not fit this pair (recorded again)")
        self._generated = generated
        self._signal = signal

    def record(self, logits: torch.Tensor, committed: list[int]) -> None:
        start, n = len(self._tokens), len(committed)
        if n == 0:
            return
        if self._generated[start : start + n] != committed:
            raise ValueError("the decode left the recording it replays")
        s = self._signal
        self._rows.append(tuple(s[k][start : start + n] for k in SIGNAL_KEYS))
        self._tokens.extend(committed)
