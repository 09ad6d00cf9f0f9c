"""The adaptation's loss math against hand computations: the DM reverse KL over the shared
vocabulary (with its rest bucket), the n-gram NLL and the hybrid weighting, the sequence NLL,
the acceptance head's soft labels and bounded replay buffer, and teacher-forced agreement."""

from __future__ import annotations

import math

import pytest
import torch

from omnidraft.shared.learning.acceptance_head import ReplayBuffer, soft_labels
from omnidraft.shared.learning.distill import (
    LossConfig,
    dm_reverse_kl,
    hybrid_loss,
    ngram_nll,
    sequence_nll,
    sequence_nll_rows,
)


def test_dm_reverse_kl_matches_hand_computation_when_top_k_covers_the_intersection():
    # drafter vocab of 4; ids 1, 2, 3 are shared with the target (intersection order: 1, 2, 3)
    draft_logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    inter = torch.tensor([1, 2, 3])
    p_full = torch.tensor([0.5, 0.3, 0.1])  # target probs of the shared ids; 0.1 elsewhere
    top_idx = torch.tensor([[0, 1, 2]])
    kl = dm_reverse_kl(draft_logits, inter, top_idx, p_full.log()[None], p_full.sum().log()[None])
    q = torch.tensor([0.2, 0.3, 0.4]) / 0.9  # q' renormalized over the intersection
    p = p_full / 0.9
    expected = float((q * (q / p).log()).sum())
    assert float(kl[0]) == pytest.approx(expected, rel=1e-5)


def test_dm_reverse_kl_rest_bucket():
    draft_logits = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25]]))
    inter = torch.tensor([0, 1, 2, 3])
    p = torch.tensor([0.6, 0.2, 0.15, 0.05])
    top_idx = torch.tensor([[0, 1]])  # only the two largest kept: rest = {2, 3}
    kl = dm_reverse_kl(draft_logits, inter, top_idx, p[:2].log()[None], torch.zeros(1))
    qb = torch.tensor([0.25, 0.25, 0.5])
    pb = torch.tensor([0.6, 0.2, 0.2])
    assert float(kl[0]) == pytest.approx(float((qb * (qb / pb).log()).sum()), rel=1e-5)
    # identical distributions: zero
    same = dm_reverse_kl(p.log()[None], inter, top_idx, p[:2].log()[None], torch.zeros(1))
    assert float(same[0]) == pytest.approx(0.0, abs=1e-6)


def test_ngram_nll_and_hybrid_weighting():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    nll = ngram_nll(logits, torch.tensor([1, 2]))
    assert nll.tolist() == pytest.approx([math.log(4), -math.log(0.8)], rel=1e-5)

    dm_logits = torch.log(torch.tensor([[0.5, 0.5, 0.0 + 1e-9]]))
    inter = torch.tensor([0, 1])
    top_idx, top_logp, mass = torch.tensor([[0, 1]]), torch.log(torch.tensor([[0.5, 0.5]])), torch.zeros(1)
    kl = float(dm_reverse_kl(dm_logits, inter, top_idx, top_logp, mass)[0])
    p_t = torch.log(torch.tensor([0.3, 0.3]))
    loss, parts = hybrid_loss(
        dm_logits, inter, top_idx, top_logp, mass, logits, torch.tensor([1, 2]), p_t, LossConfig(lam=0.2)
    )
    assert float(loss) == pytest.approx((kl + 0.2 * float(nll.sum())) / 3, rel=1e-5)
    assert parts["dm_terms"] == 1 and parts["ngram_terms"] == 2
    dyn, _ = hybrid_loss(
        dm_logits, inter, top_idx, top_logp, mass, logits, torch.tensor([1, 2]), p_t, LossConfig(dynamic=True)
    )
    assert float(dyn) == pytest.approx((kl + 0.3 * float(nll.sum())) / 3, rel=1e-5)
    dm_only, parts = hybrid_loss(
        dm_logits, inter, top_idx, top_logp, mass, logits, torch.tensor([1, 2]), p_t, LossConfig(ngram=False)
    )
    assert float(dm_only) == pytest.approx(kl, abs=1e-6) and parts["ngram_terms"] == 0


def test_sequence_nll_hand_computation():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [0.7, 0.2, 0.1]]))
    loss, parts = sequence_nll(logits, torch.tensor([0, 2, 1]))
    assert float(loss) == pytest.approx((math.log(2) - math.log(0.8) - math.log(0.2)) / 3, rel=1e-5)
    assert parts["seq_terms"] == 3
    empty, parts = sequence_nll(logits[:0], torch.tensor([], dtype=torch.long))
    assert float(empty) == 0.0 and parts["seq_terms"] == 0
    with pytest.raises(ValueError, match="unknown loss"):
        LossConfig(kind="kl").validate()


def test_the_sequence_loss_in_slices_of_positions_is_the_whole_one():
    """``sequence_nll_rows`` (what an update computes: the LM head's logits a slice of positions
    at a time, recomputed in backward) gives ``sequence_nll``'s loss and gradients, for slices
    that divide the positions and one that does not, with and without autograd."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(7, 8)
    ids = torch.randint(0, 11, (7,))
    h0 = hidden.clone().requires_grad_()
    whole, parts0 = sequence_nll(head(h0), ids)
    whole.backward()
    grads0 = (h0.grad.clone(), head.weight.grad.clone())
    for rows in (1, 3, 7, 64):
        head.weight.grad = None
        h = hidden.clone().requires_grad_()
        loss, parts = sequence_nll_rows(head, h, ids, rows=rows)
        loss.backward()
        assert parts["seq_terms"] == parts0["seq_terms"] == 7
        torch.testing.assert_close(loss, whole)
        torch.testing.assert_close(h.grad, grads0[0])
        torch.testing.assert_close(head.weight.grad, grads0[1])
        with torch.no_grad():
            torch.testing.assert_close(sequence_nll_rows(head, hidden, ids, rows=rows)[0], whole.detach())
    empty, parts = sequence_nll_rows(head, hidden[:0], ids[:0])
    assert float(empty) == 0.0 and parts["seq_terms"] == 0


def test_soft_labels_hand_computation():
    # drafter argmax is id 2 (q = 0.5), shared as intersection index 1; p there = 0.25
    logits = torch.log(torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]]))
    index_of_draft = torch.tensor([-1, 0, 1])
    top_idx = torch.tensor([[1, 0], [1, 0]])
    top_logp = torch.log(torch.tensor([[0.25, 0.5], [0.9, 0.05]]))
    labels, keep = soft_labels(logits, index_of_draft, top_idx, top_logp)
    assert keep.tolist() == [True, False]  # row 2's argmax (id 0) has no target counterpart
    assert float(labels[0]) == pytest.approx(0.5)  # min(1, 0.25 / 0.5)


def test_replay_buffer_is_bounded():
    buf = ReplayBuffer(capacity=10)
    for i in range(5):
        buf.push(torch.full((4, 3), float(i)), torch.full((4,), 0.5))
    assert buf.size <= 13 and buf.size >= 10
    hidden, labels = buf.sample(6)
    assert hidden.shape == (6, 3) and float(hidden.min()) >= 2  # the oldest rows were evicted


def test_teacher_forced_agreement_hand_computation():
    from types import SimpleNamespace

    from omnidraft.shared.learning.distill import teacher_forced_agreement

    # the drafter's argmax after position j is (j + 1) % 3 for j < 5: a fixed "decoder" whose
    # hidden state at j is the one-hot of its prediction, and an identity LM head
    preds = [1, 2, 0, 1, 2, 0]

    def decoder(input_ids):
        return SimpleNamespace(
            last_hidden_state=torch.nn.functional.one_hot(torch.tensor([preds[: input_ids.shape[1]]]), 3).float()
        )

    head = torch.nn.Identity()
    # response = positions 2..5 (seq_start 2): predicted by rows 1..4 -> 2, 0, 1, 2
    ids = [0, 0, 2, 0, 0, 2]  # hits at 2, 3 and 5, a miss at 4
    sample = SimpleNamespace(draft_ids=ids, seq_start=2, dm_pos=torch.tensor([3, 4]))
    got = teacher_forced_agreement(decoder, head, [sample], k=2)
    assert got["top1"] == pytest.approx(3 / 4)
    # runs of hits from each response position, capped at k = 2: 2, 1, 0, 1
    assert got["k2"] == pytest.approx((1 + 0.5 + 0 + 0.5) / 4)
    # replayed rounds: 2 drafted, 2 accepted, then the target's own token covers the miss at 4;
    # the last round has one position left: 1 drafted, 1 accepted
    assert got["rounds_k2"] == pytest.approx(3 / 3)
    sample_miss_first = SimpleNamespace(draft_ids=[0, 0, 0, 0, 0, 2], seq_start=2, dm_pos=torch.tensor([3]))
    # hits: miss, hit, miss, hit -> rounds at 0 (0 of 2), 1 (1 of 2), 3 (1 of 1)
    assert teacher_forced_agreement(decoder, head, [sample_miss_first], k=2)["rounds_k2"] == pytest.approx(2 / 5)
    assert got["dm_top1"] == pytest.approx(1 / 2)
