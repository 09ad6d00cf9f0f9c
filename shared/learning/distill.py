"""The hybrid cross-vocabulary distillation loss (OmniDraft paper, Eq. 3-4).

``L = L_DM + lambda * L_ngram``, averaged over loss terms (one per DM position plus one per
n-gram sub-token):

* ``L_DM``: reverse KL ``KL(q'_theta || p)`` in target space at each direct-mapped position.
  ``q'_theta`` is the drafter's softmax (temperature 1) restricted to the intersection ids and
  renormalized there; ``p`` is the target's distribution, also renormalized over the
  intersection. Only ``p``'s top-k intersection ids are kept (``training_signal``), so both
  distributions are compared on the partition {top-k ids one by one, the rest of the
  intersection as one bucket}: a KL between coarsened distributions, never larger than the
  full one and exact when ``p`` has no mass outside its top-k.
* ``L_ngram``: NLL ``-log q_theta(d_j)`` of every drafter sub-token of an n-gram target token
  the target committed (drafter space). ``lambda`` is a constant (0.2 by default) or, with
  ``dynamic``, the target's ``p(t)`` of that token (a point-wise KL on the n-gram token).

``kind="seq"`` (the default) is sequence-level distillation instead: the NLL of *every* drafter
token of the committed response, DM tokens, n-gram sub-tokens and the tokens that straddle a
target-token boundary alike (``sequence_nll``). Under greedy decoding each committed token is the
target's argmax, so this trains the drafter's top-1 towards exactly what greedy verification
accepts; under sampling each committed token is a sample of ``p``, so it is an unbiased estimate
of the forward-KL (cross-entropy) gradient. Measured on the same one-pass HumanEval stream
(docs/findings.md, "The loss"), it raises the drafter's held-out top-1 agreement with the target
by 0.07 against 0.05 for the hybrid loss.

The softmax temperature inside the loss is 1 whatever the decoding temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

LOSS_KINDS = ("seq", "hybrid")
SEQ_ROWS = 64  # positions whose vocabulary-sized logits exist at once in ``sequence_nll_rows``
LOG_FLOOR = -30.0  # log-probability floor for an (almost) empty rest bucket


@dataclass(frozen=True)
class LossConfig:
    """Which loss: ``kind`` "seq" (sequence-level NLL) or "hybrid"; for the hybrid loss, which
    parts are on and the n-gram weight."""

    kind: str = "seq"
    dm: bool = True
    ngram: bool = True
    lam: float = 0.2
    dynamic: bool = False

    def validate(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss {self.kind!r}: use one of {', '.join(LOSS_KINDS)}")
        if not (self.dm or self.ngram):
            raise ValueError("the loss needs at least one of the DM and n-gram terms")
        if self.lam < 0:
            raise ValueError("lambda must be >= 0")


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, floored at ``LOG_FLOOR``."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -0.693, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x))).clamp(min=LOG_FLOOR)


def coarse_log_probs(top: torch.Tensor) -> torch.Tensor:
    """Append the rest bucket to normalized top-k log-probs ``[n, k]`` -> ``[n, k + 1]``."""
    rest = _log1mexp(torch.logsumexp(top, dim=-1, keepdim=True))
    return torch.cat([top, rest], dim=-1)


def dm_reverse_kl(
    draft_logits: torch.Tensor,
    inter_draft_ids: torch.Tensor,
    top_idx: torch.Tensor,
    top_logp: torch.Tensor,
    inter_logmass: torch.Tensor,
) -> torch.Tensor:
    """Per-position ``KL(q'_theta || p)`` ``[n]`` on the coarsened intersection.

    ``draft_logits`` [n, drafter vocab]: the drafter's logits predicting each DM token;
    ``inter_draft_ids`` [I]: drafter ids of the intersection; ``top_idx`` [n, k]: intersection
    indices of the target's top-k; ``top_logp`` [n, k] / ``inter_logmass`` [n]: the target's
    log-probabilities of those ids and of the whole intersection (full-vocabulary normalized).
    """
    logq_inter = torch.log_softmax(draft_logits.float().index_select(1, inter_draft_ids), dim=-1)
    logq = coarse_log_probs(logq_inter.gather(1, top_idx))
    logp = coarse_log_probs(top_logp - inter_logmass[:, None])
    return (logq.exp() * (logq - logp)).sum(dim=-1)


def ngram_nll(draft_logits: torch.Tensor, sub_ids: torch.Tensor) -> torch.Tensor:
    """Per-sub-token ``-log q_theta(d_j)`` ``[m]`` (drafter vocabulary, temperature 1)."""
    return -torch.log_softmax(draft_logits.float(), dim=-1).gather(1, sub_ids[:, None])[:, 0]


def sequence_nll(draft_logits: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """``(loss, parts)``: the mean NLL of the committed response's drafter tokens ``next_ids``
    [m] under the logits ``draft_logits`` [m, drafter vocab] that predict them."""
    if not next_ids.numel():
        return draft_logits.sum() * 0.0, {"seq_terms": 0}
    nll = ngram_nll(draft_logits, next_ids)
    loss = nll.mean()
    return loss, {"seq_nll": float(loss.detach()), "seq_terms": int(nll.numel()), "loss": float(loss.detach())}


def sequence_nll_rows(
    head, hidden: torch.Tensor, next_ids: torch.Tensor, rows: int = SEQ_ROWS
) -> tuple[torch.Tensor, dict[str, float]]:
    """``sequence_nll`` of the logits ``head(hidden)`` [m, drafter vocab], computed ``rows``
    positions at a time: while training (``hidden`` requires grad) each slice's logits are
    recomputed in the backward pass (``torch.utils.checkpoint``) instead of kept, so one slice's
    float32 logits and their gradient exist at a time, not all m (0.2 GB for 256 positions of
    SmolLM2's 49,152-token vocabulary). The same loss and gradients up to summation order."""
    m = next_ids.numel()
    if not m:
        return hidden.sum() * 0.0, {"seq_terms": 0}

    def nll_sum(h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return ngram_nll(head(h), ids).sum()

    total = hidden.new_zeros((), dtype=torch.float32)
    for lo in range(0, m, rows):
        h, ids = hidden[lo : lo + rows], next_ids[lo : lo + rows]
        total = total + (checkpoint(nll_sum, h, ids, use_reentrant=False) if h.requires_grad else nll_sum(h, ids))
    loss = total / m
    return loss, {"seq_nll": float(loss.detach()), "seq_terms": m, "loss": float(loss.detach())}


def hybrid_loss(
    dm_logits: torch.Tensor,
    inter_draft_ids: torch.Tensor,
    top_idx: torch.Tensor,
    top_logp: torch.Tensor,
    inter_logmass: torch.Tensor,
    ng_logits: torch.Tensor,
    ng_ids: torch.Tensor,
    ng_logp_t: torch.Tensor,
    config: LossConfig = LossConfig(),
) -> tuple[torch.Tensor, dict[str, float]]:
    """``(loss, parts)``: the mean over loss terms of ``KL_DM`` and ``lambda * NLL_ngram``.

    ``parts`` reports ``dm_kl`` and ``ngram_nll`` (means of each term) and the term counts.
    """
    terms = []
    parts = {"dm_terms": 0, "ngram_terms": 0}
    if config.dm and dm_logits.shape[0]:
        kl = dm_reverse_kl(dm_logits, inter_draft_ids, top_idx, top_logp, inter_logmass)
        terms.append(kl)
        parts.update(dm_kl=float(kl.detach().mean()), dm_terms=int(kl.numel()))
    if config.ngram and ng_logits.shape[0]:
        nll = ngram_nll(ng_logits, ng_ids)
        weight = ng_logp_t.exp() if config.dynamic else torch.full_like(nll, config.lam)
        terms.append(weight * nll)
        parts.update(ngram_nll=float(nll.detach().mean()), ngram_terms=int(nll.numel()))
    if not terms:
        return dm_logits.sum() * 0.0, parts
    loss = torch.cat(terms).mean()
    parts["loss"] = float(loss.detach())
    return loss, parts


@torch.no_grad()
def teacher_forced_agreement(
    decoder: torch.nn.Module, lm_head: torch.nn.Module, samples, k: int = 4, autocast: torch.dtype | None = None
) -> dict[str, float]:
    """How well the drafter (``decoder`` + ``lm_head``, adapter applied) predicts the target's
    committed responses in ``samples`` (``TrainingSample``), teacher-forced, without decoding:

    * ``top1``: share of the responses' drafter tokens that are the drafter's argmax;
    * ``k4`` (``k`` = 4): mean over response positions of min(k, run of consecutive argmax hits
      from there) / k;
    * ``rounds_k4``: the acceptance rate of k-token drafts replayed on the fixed text: a round
      starts at the response's first token, accepts the run of hits from there (at most k) and
      the next round starts after the accepted tokens plus the target's own token. Unlike ``k4``,
      which weighs every position alike, it visits positions as decoding does: a hard stretch
      starts a round at almost every token, an easy one only every k + 1 tokens;
    * ``dm_top1``: ``top1`` on direct-mapped tokens only.

    Under greedy decoding the responses do not depend on the drafter, so the same samples
    compare adapters without the noise of decoding (or its cost). ``autocast``: run the forwards
    under CPU autocast to that dtype (as the learner trains:
    ``omnidraft.client.online_learner.default_training_autocast``)."""
    hits = total = dm_hits = dm_total = 0
    runs = 0.0
    accepted = proposed = 0
    for s in samples:
        ids = torch.tensor([s.draft_ids])
        # the LM head under the same autocast as the decoder: the callables of
        # ``DrafterAdapters.decoder_and_head(bf16)`` read their frozen weights in bf16
        with torch.no_grad(), torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            hidden = decoder(input_ids=ids).last_hidden_state[0]
            ok = lm_head(hidden[s.seq_start - 1 : -1]).argmax(-1) == ids[0, s.seq_start :]
            dm = lm_head(hidden.index_select(0, s.dm_pos - 1)).argmax(-1)
        hits, total = hits + int(ok.sum()), total + ok.numel()
        run, run_from = 0, []  # run of hits starting at each position, from the end
        for hit in reversed(ok.tolist()):
            run = run + 1 if hit else 0
            run_from.append(run)
            runs += min(k, run) / k
        run_from.reverse()
        i = 0
        while i < len(run_from):  # replayed k-token drafting rounds
            got = min(k, run_from[i])
            accepted, proposed = accepted + got, proposed + min(k, len(run_from) - i)
            i += got + 1
        dm_hits += int((dm == ids[0, s.dm_pos]).sum())
        dm_total += s.dm_pos.numel()
    return {
        "top1": hits / max(1, total),
        f"k{k}": runs / max(1, total),
        f"rounds_k{k}": accepted / max(1, proposed),
        "dm_top1": dm_hits / max(1, dm_total),
    }
