"""Online adaptation: the loss math, LoRA adapters, the learner, the acceptance head, device
state on disk, and that learning never changes what the target outputs (tiny models)."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from dataclasses import replace

import pytest
import torch

from omnidraft.benchmarks.tiny_models import build_pair, corpus
from omnidraft.client.device_state import ADAPTER_FILE, CACHE_FILE, HEAD_FILE, MANIFEST_FILE, DeviceState
from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.session import DeviceSession
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.learning.acceptance_head import ReplayBuffer, soft_labels
from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec
from omnidraft.shared.learning.distill import LossConfig, dm_reverse_kl, hybrid_loss, ngram_nll, sequence_nll

# -- the loss, against hand computations ---------------------------------------------------------


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


def test_sequence_loss_covers_every_response_token(pair_dir):
    engine = _engine(pair_dir)
    session = DeviceSession(engine, target_name="t", lora=LoraSpec(rank=8))
    sample = session.generate(PROMPTS[0], CONFIG, observe=False).training_sample
    aligned = torch.cat([sample.dm_pos, sample.ng_pos])
    assert sample.seq_start == int(aligned.min())
    # every aligned position is in the sequence loss, and so are the tokens between them
    assert int(aligned.max()) < len(sample.draft_ids)
    assert sample.seq_positions == len(sample.draft_ids) - sample.seq_start >= sample.loss_positions
    assert sample.positions("seq") == sample.seq_positions and sample.positions("hybrid") == sample.loss_positions


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


# -- tiny models ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_pair")
    build_pair(d)
    return d


def _engine(pair_dir):
    return Engine.load(
        str(pair_dir / "drafter"), str(pair_dir / "target"), "fp64", drafter_weights="fp32", progress=False
    )


PROMPTS = [t[:28] for t in corpus(24, seed=11)]
CONFIG = GenerationConfig(max_new_tokens=24)


def test_gradients_reach_only_the_adapter_and_two_adapters_stay_independent(pair_dir):
    engine = _engine(pair_dir)
    base = {n: p.detach().clone() for n, p in engine.drafter.model.named_parameters()}
    adapters = DrafterAdapters(engine.drafter.model, LoraSpec(rank=4), drafter_weights="fp32")
    a = DeviceSession(engine, target_name="target-a", adapters=adapters, online=OnlineConfig(interval=2, lr=1e-2))
    DeviceSession(engine, target_name="target-b", adapters=adapters)  # registers target-b's adapter
    b_before = adapters.state_dict("target-b")
    for prompt in PROMPTS[:4]:
        a.generate(prompt, CONFIG)
    assert a.learner.updates == 2
    trainable = {n for n, p in adapters.peft.named_parameters() if p.grad is not None}
    assert trainable and all("lora_" in n and ".t_target_a." in n for n in trainable)
    # base weights untouched (compare through the unwrapped names); under bf16 autocast the
    # frozen Linear weights are held in bf16: exactly the cast of the originals
    for n, p in adapters.peft.get_base_model().named_parameters():
        key = n.replace(".base_layer", "")
        if "lora_" not in n:
            assert torch.equal(p, base[key].to(p.dtype)), n
    a_sd, b_sd = adapters.state_dict("target-a"), adapters.state_dict("target-b")
    assert any(not torch.equal(a_sd[k], b_before[k]) for k in a_sd)  # A learned
    assert all(torch.equal(b_sd[k], b_before[k]) for k in b_sd)  # B did not move
    # switching adapters switches the drafting weights, without reloading the drafter
    adapters.activate("target-a")
    ra = adapters.runner()
    adapters.activate("target-b")
    rb = adapters.runner()
    ids = engine.drafter.tokenizer.encode(PROMPTS[0])
    ra.reset(), rb.reset()
    assert not torch.allclose(ra.forward(ids), rb.forward(ids))
    assert adapters.peft.get_base_model() is engine.drafter.model


@pytest.mark.parametrize("kind", ["seq", "hybrid"])
def test_loss_decreases_on_a_fixed_stream(pair_dir, kind):
    engine = _engine(pair_dir)
    session = DeviceSession(
        engine,
        target_name="t",
        lora=LoraSpec(rank=8),
        online=OnlineConfig(interval=100, lr=3e-3, loss=LossConfig(kind=kind)),
    )
    samples = [session.generate(p, CONFIG).training_sample for p in PROMPTS[:6]]
    assert all(s.loss_positions > 0 for s in samples)
    learner = session.learner
    first = learner.loss_on(samples)
    for _ in range(8):
        learner.buffer = list(samples)
        learner.update()
    assert learner.loss_on(samples) < 0.8 * first


def test_epochs_repeat_the_pass_and_the_optimizer_is_configurable(pair_dir):
    engine = _engine(pair_dir)
    session = DeviceSession(
        engine,
        target_name="t",
        lora=LoraSpec(rank=8),
        adaptive=False,
        online=OnlineConfig(interval=100, lr=3e-3, steps_per_update=2, epochs=3),
    )
    samples = [session.generate(p, CONFIG, observe=False).training_sample for p in PROMPTS[:4]]
    learner = session.learner
    steps = []
    learner.optimizer.register_step_post_hook(lambda opt, args, kwargs: steps.append(1))
    before = learner.loss_on(samples)
    learner.buffer = list(samples)
    report = learner.update()
    assert len(steps) == 2 * 3  # two batches per pass, three passes
    assert 0 < learner.loss_on(samples) < report.loss <= 1.01 * before  # the report: the first pass's loss
    sgd = DeviceSession(
        engine, target_name="u", lora=LoraSpec(rank=8), adaptive=False, online=OnlineConfig(optimizer="sgd", lr=0.5)
    )
    assert isinstance(sgd.learner.optimizer, torch.optim.SGD)
    for bad, match in (({"epochs": 0}, "epochs"), ({"optimizer": "lion"}, "unknown optimizer")):
        with pytest.raises(ValueError, match=match):
            OnlineConfig(**bad).validate()


def test_bf16_training_on_frozen_weight_copies_is_bit_identical(pair_dir):
    """Under bf16 autocast, a training forward that reads bf16 copies of the frozen Linear
    weights gives the same logits and adapter gradients, bit for bit, as the fp32 weights
    autocast casts at every call; the copies hold frozen weights only, are made once per
    drafter and are rebuilt after a respec (other modules carry LoRA then)."""
    engine = _engine(pair_dir)
    adapters = DrafterAdapters(engine.drafter.model, LoraSpec(rank=4), drafter_weights="fp32")
    adapters.add("t")
    with torch.no_grad():  # a trained adapter: B != 0, so the LoRA path counts
        for n, p in adapters.peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ids = torch.tensor([engine.drafter.tokenizer.encode(PROMPTS[0] + PROMPTS[1])])

    def forward_backward(frozen_dtype):
        decoder, head = adapters.decoder_and_head(frozen_dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head(decoder(input_ids=ids).last_hidden_state).float()
        logits.logsumexp(-1).sum().backward()
        grads = {n: p.grad.clone() for n, p in adapters.peft.named_parameters() if p.grad is not None}
        adapters.peft.zero_grad(set_to_none=True)
        return logits.detach(), grads

    ref_logits, ref_grads = forward_backward(None)
    logits, grads = forward_backward(torch.bfloat16)
    assert ref_grads and torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    in_decoder, in_head = copies = adapters._frozen[torch.bfloat16]
    assert in_decoder and all(".lora_" not in n and t.dtype == torch.bfloat16 for n, t in in_decoder.items())
    assert list(in_head) == ["weight"]
    adapters.decoder_and_head(torch.bfloat16)
    assert adapters._frozen[torch.bfloat16] is copies  # made once
    adapters.respec(LoraSpec(rank=4, modules="attn"))
    assert not adapters._frozen


@pytest.mark.parametrize("tied", [False, True])
def test_training_under_bf16_autocast_holds_the_frozen_drafter_weights_in_bf16(pair_dir, tied):
    """Where the drafter drafts on packings, its first bf16 training forward converts the frozen
    Linear weights in place (the float32 originals are freed; the gradients are bit-identical,
    see above): the base packing, built before, drafts exactly as before; a tied LM head stays
    the float32 input embedding; an adapter added afterwards still trains in float32; a
    float32 forward of the model is refused with a clear error."""
    engine = _engine(pair_dir)
    model = engine.drafter.model
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight

    def frozen_linears():
        return [
            m.weight
            for n, m in model.get_decoder().named_modules()
            if isinstance(m, torch.nn.Linear) and ".lora_" not in f".{n}"
        ]

    adapters = DrafterAdapters(model, LoraSpec(rank=4), drafter_weights="fp32")
    adapters.add("a")
    ids = engine.drafter.tokenizer.encode(PROMPTS[0])
    untrained = adapters.runner().forward(ids).clone()
    fp32_bytes = sum(w.nbytes for w in frozen_linears())
    adapters.decoder_and_head(torch.bfloat16)
    assert adapters.held_dtype == torch.bfloat16
    assert all(w.dtype == torch.bfloat16 for w in frozen_linears())
    assert sum(w.nbytes for w in frozen_linears()) * 2 == fp32_bytes
    assert model.get_input_embeddings().weight.dtype == torch.float32
    if tied:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    else:
        assert model.lm_head.weight.dtype == torch.bfloat16
    runner = adapters.runner()
    runner.reset()
    assert torch.equal(runner.forward(ids), untrained)  # the base packing is the float32 one
    with pytest.raises(ValueError, match="held in torch.bfloat16"):
        adapters.decoder_and_head()
    adapters.add("b")
    lora = [p for n, p in adapters.peft.named_parameters() if ".t_b." in n]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    decoder, head = adapters.decoder_and_head(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(decoder(input_ids=torch.tensor([ids])).last_hidden_state).float()
    logits.logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in adapters.trainable_parameters())


def test_the_update_labels_the_acceptance_head_from_its_own_forwards(pair_dir):
    """The acceptance head's replay rows come from the update's training forwards (one row per
    labelled DM position of the samples, no forward of their own), with bf16 autocast on."""
    engine = _engine(pair_dir)
    session = DeviceSession(
        engine, target_name="t", lora=LoraSpec(rank=4), online=OnlineConfig(interval=100, lr=3e-3, bf16_autocast=True)
    )
    samples = [session.generate(p, CONFIG, observe=False).training_sample for p in PROMPTS[:3]]
    learner = session.learner
    forwards = []
    learner._sample_loss = (lambda f: lambda s, grad: (forwards.append(grad), f(s, grad))[1])(learner._sample_loss)
    learner.buffer = list(samples)
    report = learner.update()
    assert forwards == [True] * len(samples)  # the training forwards only
    assert 0 < report.head_rows == learner.replay.size <= sum(s.dm_pos.numel() for s in samples)
    assert session.head.trained_steps == 1


def test_one_packing_serves_every_adapter(pair_dir):
    """Adapters draft on forks of one base packing, each with its own KV cache; a trained
    adapter is merged into its own runner's weights: training, loading and resetting an
    adapter change its runner's logits and nobody else's."""
    engine = _engine(pair_dir)
    adapters = DrafterAdapters(engine.drafter.model, LoraSpec(rank=4), drafter_weights=engine.drafter_weights)
    adapters.add("a")
    ra = adapters.runner()
    adapters.add("b")
    rb = adapters.runner()
    assert rb is not ra and rb._packing is ra._packing  # shared packed weights, separate runners
    assert ra.lora_rank == rb.lora_rank == 0  # untrained adapters: the base weights
    ids = [1, 2, 3]
    base = rb.forward(ids).clone()
    tensors = {k: v + 0.05 for k, v in adapters.state_dict("b").items()}
    adapters.load_state_dict("b", tensors)
    assert adapters.runner() is rb and rb.lora_rank == 4 and rb._packing is not ra._packing  # merged
    trained = rb.forward(ids).clone()
    assert not torch.allclose(trained, base)
    adapters.activate("a")
    ra.reset()
    torch.testing.assert_close(adapters.runner().forward(ids), base)  # a is still untrained
    adapters.activate("b")
    adapters.reset("b")
    assert adapters.runner().lora_rank == 0
    torch.testing.assert_close(rb.forward(ids), base)
    adapters.load_state_dict("b", tensors)
    torch.testing.assert_close(adapters.runner().forward(ids), trained)  # set_lora resets the cache


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


def test_greedy_output_identical_to_target_after_training(pair_dir):
    engine = _engine(pair_dir)
    session = DeviceSession(engine, target_name="t", online=OnlineConfig(interval=2, lr=2e-2))
    for prompt in PROMPTS[:8]:
        session.generate(prompt, CONFIG)
    assert session.learner.updates == 4 and session.head.ready
    ar = engine.ar()
    # the throughput rule fed by the learned head, and the confidence rule without it
    for config in (CONFIG, replace(CONFIG, draft_stop="confidence")):
        for prompt in PROMPTS[8:14]:
            text, ids = engine.prompt_ids(prompt)
            expected = ar.generate(ids, config).token_ids
            out = session.decoder().generate(text, ids, config)
            assert out.token_ids == expected
    assert sum(session.rule.tables["head"].seen) > 0  # the head's predictions were calibrated


def test_training_sample_alignment(pair_dir):
    engine = _engine(pair_dir)
    session = DeviceSession(engine, target_name="t", learn=True)
    sample = session.generate(PROMPTS[0], CONFIG).training_sample
    ids = sample.draft_ids
    d2t, bridge = engine.bridge.d2t, engine.bridge
    assert sample.target_tokens == CONFIG.max_new_tokens
    inter_target = session.inter.target_ids
    for row, j in enumerate(sample.dm_pos.tolist()):
        # the top-k row's best target id is a shared id, and the aligned drafter token maps 1:1
        assert d2t[ids[j]] >= 0
        assert int(sample.dm_top_idx[row].max()) < len(inter_target)
    for j, d in zip(sample.ng_pos.tolist(), sample.ng_ids.tolist()):
        assert ids[j] == d
    assert float(sample.dm_logp_t.max()) <= 0 and float(sample.dm_inter_logmass.max()) <= 1e-5
    assert bridge is engine.bridge


def test_a_replayed_learning_decode_is_the_live_one_without_the_target(pair_dir, tmp_path):
    """A device that learns from recordings of earlier live decodes (``recordings``) drafts,
    accepts, trains and ends with the same adapter bit for bit as the device that ran the
    target, and the target never runs while it replays."""
    online = OnlineConfig(interval=2, lr=2e-2)
    runs = {}
    for mode in ("live", "replay"):
        # each mode on a drafter as loaded: a learner under bf16 autocast leaves the drafter's
        # frozen weights in bf16, and an adapter added after that starts from peft's
        # initialization cast to bf16 (another random start)
        engine = _engine(pair_dir)
        store = engine.recordings(tmp_path / "rec")
        torch.manual_seed(7)
        session = DeviceSession(engine, target_name=mode, online=online)
        results = []
        for prompt in PROMPTS[:6]:
            recording = store.get(prompt, CONFIG, signal=True) if mode == "replay" else None
            if mode == "replay":
                assert recording is not None and recording.signal is not None
                engine.target_runner.forward = None  # any target forward would fail
            try:
                results.append(session.generate(prompt, CONFIG, replay=recording))
            finally:
                engine.__dict__["target_runner"].__dict__.pop("forward", None)
            if mode == "live":
                assert session.last_recording.generated == results[-1].token_ids
                store.put(prompt, CONFIG, session.last_recording)
            else:
                assert session.last_recording is None  # a replay records nothing new
        runs[mode] = (results, session.adapters.state_dict(mode), session.learner.updates)
    (live, live_adapter, live_updates), (replayed, replayed_adapter, replayed_updates) = runs["live"], runs["replay"]
    assert live_updates == replayed_updates == 3
    for a, b in zip(live, replayed):
        assert a.token_ids == b.token_ids
        for name in (
            "proposed_tokens",
            "accepted_tokens",
            "target_calls",
            "drafter_steps",
            "lookup_rounds",
            "plain_rounds",
        ):
            assert getattr(a.stats, name) == getattr(b.stats, name), name
        assert a.stats.modelled_s == b.stats.modelled_s
        sa, sb = a.training_sample, b.training_sample
        assert sa.draft_ids == sb.draft_ids and sa.target_tokens == sb.target_tokens
        for name in ("dm_pos", "dm_top_idx", "dm_top_logp", "dm_inter_logmass", "dm_logp_t", "ng_pos", "ng_logp_t"):
            assert torch.equal(getattr(sa, name), getattr(sb, name)), name
    assert live_adapter.keys() == replayed_adapter.keys()
    assert all(torch.equal(live_adapter[k], replayed_adapter[k]) for k in live_adapter)


def test_recording_store_keys_damage_and_misuse(pair_dir, tmp_path):
    """A recording is found only under its own prompt and generation settings; a damaged file
    or a foreign one reads as missing; sampling cannot be recorded; a replay that leaves its
    recording, or of another prompt, is refused."""
    from omnidraft.shared.engine.recordings import Recording
    from omnidraft.shared.learning.training_signal import ReplayedSignal

    engine = _engine(pair_dir)
    store = engine.recordings(tmp_path)
    session = DeviceSession(engine, target_name="t")
    session.generate(PROMPTS[0], CONFIG)
    recording = session.last_recording
    path = store.put(PROMPTS[0], CONFIG, recording)
    assert store.get(PROMPTS[0], CONFIG, signal=True).ids == recording.ids
    assert store.get(PROMPTS[1], CONFIG) is None
    assert store.get(PROMPTS[0], replace(CONFIG, max_new_tokens=23)) is None
    ids_only = Recording(recording.ids, recording.prompt_tokens)
    store.put(PROMPTS[2], CONFIG, ids_only)
    assert store.get(PROMPTS[2], CONFIG).ids == recording.ids and store.get(PROMPTS[2], CONFIG, signal=True) is None
    other = engine.recordings(tmp_path)
    other.identity["machine"] = {"cpu": "another"}
    assert type(other)(other.identity, tmp_path).get(PROMPTS[0], CONFIG) is None  # another machine's store
    path.write_bytes(path.read_bytes()[:40])
    assert store.get(PROMPTS[0], CONFIG) is None
    with pytest.raises(ValueError, match="greedy"):
        store.get(PROMPTS[0], replace(CONFIG, temperature=0.7))
    with pytest.raises(ValueError, match="recording of this prompt"):
        session.generate(PROMPTS[1], CONFIG, replay=recording)
    with pytest.raises(ValueError, match="training signal"):
        session.generate(PROMPTS[0], CONFIG, replay=ids_only)
    short = Recording(recording.ids, recording.prompt_tokens, {k: v[:-1] for k, v in recording.signal.items()})
    with pytest.raises(ValueError, match="does not fit"):
        session.generate(PROMPTS[0], CONFIG, replay=short)
    replayed = ReplayedSignal(session.inter, recording.generated, recording.signal)
    replayed.record(None, recording.generated[:2])
    with pytest.raises(ValueError, match="left the recording"):
        replayed.record(None, [recording.generated[2] + 1])


# -- device state on disk --------------------------------------------------------------------------


def test_state_round_trip(pair_dir, tmp_path):
    engine = _engine(pair_dir)
    s = DeviceSession(engine, target_name="t", state_dir=tmp_path, online=OnlineConfig(interval=2, lr=1e-2))
    for prompt in PROMPTS[:4]:
        s.generate(prompt, CONFIG)
    s.save()
    saved_adapter = s.adapters.state_dict("t")
    saved_cache = engine.cache.to_bytes()
    files = {p.name for p in s.state.dir.iterdir()}
    assert {ADAPTER_FILE, HEAD_FILE, CACHE_FILE, MANIFEST_FILE} <= files

    engine2 = _engine(pair_dir)
    s2 = DeviceSession(engine2, target_name="t", state_dir=tmp_path)
    assert s2.problems == []
    assert all(torch.equal(saved_adapter[k], v) for k, v in s2.adapters.state_dict("t").items())
    assert engine2.cache.to_bytes() == saved_cache
    assert s2.head.ready and s2.learner.updates == 2
    assert all(torch.equal(a, b) for a, b in zip(s.head.state_dict().values(), s2.head.state_dict().values()))


@pytest.mark.parametrize("victim", [ADAPTER_FILE, HEAD_FILE, CACHE_FILE, MANIFEST_FILE])
@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupted_state_is_set_aside_and_rebuilt(pair_dir, tmp_path, victim, damage):
    engine = _engine(pair_dir)
    s = DeviceSession(engine, target_name="t", state_dir=tmp_path, online=OnlineConfig(interval=2, lr=1e-2))
    for prompt in PROMPTS[:2]:
        s.generate(prompt, CONFIG)
    s.save()
    path = s.state.dir / victim
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 7)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s2 = DeviceSession(_engine(pair_dir), target_name="t", state_dir=tmp_path)
    assert s2.problems and victim in s2.problems[0]
    assert any("set aside" in str(w.message) for w in caught)
    assert list(s2.state.dir.glob(f"{victim}.corrupt-*"))  # kept for inspection, not deleted
    # the damaged part starts fresh; the session still works and saves a consistent state
    if victim in (ADAPTER_FILE, MANIFEST_FILE):
        assert all(float(v.abs().max()) == 0 for k, v in s2.adapters.state_dict("t").items() if "lora_B" in k)
    s2.generate(PROMPTS[3], CONFIG)
    s2.save()
    s3 = DeviceSession(_engine(pair_dir), target_name="t", state_dir=tmp_path)
    assert s3.problems == []


def test_state_dir_that_is_a_file_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        DeviceState(f, "d", "t")


# -- the commands ----------------------------------------------------------------------------------


def _jsonl(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def test_adapt_command_end_to_end(pair_dir, tmp_path, capsys):
    from omnidraft.cli import main

    data = _jsonl(tmp_path / "p.jsonl", PROMPTS[:6])
    out, plot, state = tmp_path / "a.json", tmp_path / "a.png", tmp_path / "state"
    pair = [
        "--drafter",
        str(pair_dir / "drafter"),
        "--target",
        str(pair_dir / "target"),
        "--dtype",
        "fp64",
        "--drafter-weights",
        "fp32",
        "--max-new-tokens",
        "8",
    ]
    rc = main(
        [
            "adapt",
            *pair,
            "--dataset",
            data,
            "--train-fraction",
            "0.67",
            "--interval",
            "2",
            "--lr",
            "1e-2",
            "--state-dir",
            str(state),
            "--out",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    for phase in ("before", "after"):
        assert set(report[phase]) >= {"acceptance_rate", "tokens_per_target_call", "tokens_per_s", "speedup_vs_ar"}
        fixed = report[phase]["fixed_k"]  # the paper's protocol: exactly 4 drafter tokens per round
        assert fixed["k"] == 4 and 0 <= fixed["acceptance_rate"] <= 1
        assert 1 <= fixed["tokens_per_target_call"] <= 4 + 1
    assert len(report["curve"]) == 2 and report["train_prompts"] == 4 and report["heldout_prompts"] == 2
    assert report["identical_to_ar_after"] == 2  # fp32: greedy output is the target's own
    # the target alone ran in both passes; each speedup is over its own pass's ar
    assert report["ar_deterministic"] and report["ar_after"]["new_tokens"] == report["ar"]["new_tokens"]
    for phase, ar in (("before", "ar"), ("after", "ar_after")):
        assert report[phase]["speedup_vs_ar"] == pytest.approx(
            report[phase]["tokens_per_s"] / report[ar]["tokens_per_s"]
        )
    assert report["speed_after_over_before"] == pytest.approx(
        report["after"]["speedup_vs_ar"] / report["before"]["speedup_vs_ar"]
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "after" in capsys.readouterr().out
    # the learned state is used by bench and generate
    rc = main(
        [
            "bench",
            *pair,
            "--dataset",
            data,
            "--limit",
            "2",
            "--methods",
            "ar,omnidraft",
            "--state-dir",
            str(state),
            "--out",
            str(tmp_path / "b.json"),
        ]
    )
    assert rc == 0
    bench = json.loads((tmp_path / "b.json").read_text())
    assert bench["config"]["state_dir"] and bench["methods"]["omnidraft"]["identical_prompts"] == 2
    assert main(["generate", *pair, "--prompt", PROMPTS[0], "--state-dir", str(state)]) == 0


def test_adapt_ablation_and_drift_commands(pair_dir, tmp_path):
    from omnidraft.cli import main

    data = _jsonl(tmp_path / "p.jsonl", PROMPTS[:6])
    pair = [
        "--drafter",
        str(pair_dir / "drafter"),
        "--target",
        str(pair_dir / "target"),
        "--dtype",
        "fp64",
        "--drafter-weights",
        "fp32",
        "--max-new-tokens",
        "8",
    ]
    out = tmp_path / "ab.json"
    assert (
        main(
            [
                "adapt",
                *pair,
                "--dataset",
                data,
                "--train-fraction",
                "0.67",
                "--interval",
                "2",
                "--ablation",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert list(report["variants"]) == [
        "cold",
        "cache only",
        "L_DM",
        "L_DM + lambda L_ngram",
        "L_seq",
        "L_seq + adaptive head",
    ]
    assert report["updates"]["cache only"] == 0 and report["updates"]["L_DM"] == 2
    assert all(v == 2 for v in report["identical_to_ar"].values())

    other = _jsonl(tmp_path / "q.jsonl", [t[:20] for t in corpus(6, seed=99)])
    target = str(pair_dir / "target")
    out = tmp_path / "drift.json"
    assert (
        main(
            [
                "drift",
                "--drafter",
                str(pair_dir / "drafter"),
                "--stream",
                f"{target}:{data}:3,{target}:{other}:3",
                "--dtype",
                "fp64",
                "--drafter-weights",
                "fp32",
                "--max-new-tokens",
                "8",
                "--out",
                str(out),
                "--plot",
                str(tmp_path / "drift.png"),
            ]
        )
        == 0
    )
    drift = json.loads(out.read_text())
    assert set(drift["runs"]) == {"with cache", "without cache"}
    assert all(len(rows) == 6 for rows in drift["runs"].values())
    assert drift["runs"]["without cache"][-1]["cache_entries"] == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["adapt", "--dataset", "humaneval", "--train-fraction", "1.5"], "--train-fraction must be in (0, 1)"),
        (["adapt", "--dataset", "humaneval", "--limit", "1"], "--limit must be >= 2"),
        (["adapt", "--dataset", "humaneval", "--acceptance-k", "-1"], "--acceptance-k must be >= 0"),
        (["adapt", "--dataset", "humaneval", "--lora-modules", "nope"], "unknown LoRA module set"),
        (["adapt", "--dataset", "humaneval", "--interval", "0"], "interval must be >= 1"),
        (["adapt", "--dataset", "/no/such.jsonl"], "an existing JSONL file"),
        (["adapt", "--dataset", "humaneval", "--state-dir", __file__], "is not a directory"),
        (["bench", "--dataset", "humaneval", "--state-dir", __file__], "is not a directory"),
    ],
)
def test_adapt_bad_input_is_one_line_error(argv, message, capsys):
    from omnidraft.cli import main

    rc = main([argv[0], "--drafter", "smollm2-135m", "--target", "qwen2.5-coder-0.5b", *argv[1:]])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def test_drift_stream_spec_errors():
    from omnidraft.benchmarks.drift import parse_stream

    assert parse_stream("a:humaneval:3,b:pydoc:4") == [("a", "humaneval", 3), ("b", "pydoc", 4)]
    for bad in ("a:humaneval:3", "a:humaneval:x,b:pydoc:1", "a:humaneval:0,b:pydoc:1", "humaneval:3,b:pydoc:1"):
        with pytest.raises(ValueError):
            parse_stream(bad)


def test_encrypted_state_round_trip_wrong_key_and_migration(pair_dir, tmp_path):
    """With a key file the state is AES-GCM encrypted at rest; a wrong or missing key is a clear
    error that leaves the files untouched; a plaintext state is refused under a key that existed
    before, and read and encrypted at the next save under a key created for it."""
    from omnidraft.client.state_key import StateCipher, StateKeyError

    state, key = tmp_path / "state", tmp_path / "keys" / "state.key"
    s = DeviceSession(
        _engine(pair_dir), target_name="t", state_dir=state, state_key=key, online=OnlineConfig(interval=2, lr=1e-2)
    )
    for prompt in PROMPTS[:2]:
        s.generate(prompt, CONFIG)
    s.save()
    assert oct(key.stat().st_mode & 0o777) == "0o600" and len(key.read_bytes()) == 32
    on_disk = {p.name: p.read_bytes() for p in s.state.dir.iterdir()}
    assert all(b.startswith(b"ODS1") for b in on_disk.values())
    assert b'"updates"' not in on_disk[MANIFEST_FILE] and b"lora_A" not in on_disk[ADAPTER_FILE]
    s2 = DeviceSession(_engine(pair_dir), target_name="t", state_dir=state, state_key=key)
    assert s2.problems == [] and s2.learner.updates == 1
    assert all(torch.equal(s.adapters.state_dict("t")[k], v) for k, v in s2.adapters.state_dict("t").items())
    with pytest.raises(StateKeyError, match="wrong key"):
        DeviceSession(_engine(pair_dir), target_name="t", state_dir=state, state_key=tmp_path / "other.key")
    with pytest.raises(StateKeyError, match="encrypted: give its key"):
        DeviceSession(_engine(pair_dir), target_name="t", state_dir=state)
    assert {p.name: p.read_bytes() for p in s.state.dir.iterdir()} == on_disk  # nothing set aside
    with pytest.raises(ValueError, match="outside the state directory"):
        DeviceSession(_engine(pair_dir), target_name="t", state_dir=state, state_key=state / "k")
    key.chmod(0o644)
    with pytest.raises(StateKeyError, match="chmod 600"):
        StateCipher(key)
    key.chmod(0o600)
    plain = tmp_path / "plain"
    p = DeviceSession(_engine(pair_dir), target_name="t", state_dir=plain)
    p.generate(PROMPTS[0], CONFIG)
    p.save()
    # someone who can write the state directory swaps the encrypted state for a plaintext one of
    # their own: with the existing key it is refused, untouched
    shutil.rmtree(s.state.dir)
    shutil.copytree(p.state.dir, s.state.dir)
    with pytest.raises(StateKeyError, match="refused in plaintext"):
        DeviceSession(_engine(pair_dir), target_name="t", state_dir=state, state_key=key)
    # the migration: a plaintext state and a key file created now
    m = DeviceSession(_engine(pair_dir), target_name="t", state_dir=plain, state_key=tmp_path / "keys" / "new.key")
    assert m.problems == []
    m.save()
    assert all(f.read_bytes().startswith(b"ODS1") for f in m.state.dir.iterdir())


def test_cli_reports_a_wrong_state_key_in_one_line(pair_dir, tmp_path, capsys):
    from omnidraft.cli import main

    base = [
        "generate",
        "--drafter",
        str(pair_dir / "drafter"),
        "--target",
        str(pair_dir / "target"),
        "--dtype",
        "fp64",
        "--drafter-weights",
        "fp32",
        "--prompt",
        PROMPTS[0],
        "--max-new-tokens",
        "4",
        "--state-dir",
        str(tmp_path / "s"),
    ]
    s = DeviceSession(
        _engine(pair_dir), target_name=str(pair_dir / "target"), state_dir=tmp_path / "s", state_key=tmp_path / "k1"
    )
    s.save()
    assert main(base + ["--state-key", str(tmp_path / "k1")]) == 0
    capsys.readouterr()
    assert main(base + ["--state-key", str(tmp_path / "k2")]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the weight-loading bars
    assert err.startswith("error:") and "wrong key" in err


def test_a_learned_adapter_exports_to_a_directory_peft_loads(pair_dir, tmp_path, capsys):
    """`omnidraft device export-adapter` writes what peft itself writes: PeftModel.from_pretrained
    on the base drafter loads it, with the device's learned weights."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from omnidraft.cli import main

    state = tmp_path / "state"
    s = DeviceSession(_engine(pair_dir), target_name="t", state_dir=state, online=OnlineConfig(interval=2, lr=1e-2))
    for prompt in PROMPTS[:2]:
        s.generate(prompt, CONFIG)
    s.save()
    assert s.learner.updates == 1
    drafter = str(pair_dir / "drafter")
    assert (
        main(
            [
                "device",
                "export-adapter",
                "--drafter",
                drafter,
                "--target",
                "t",
                "--state-dir",
                str(state),
                "--out",
                str(tmp_path / "peft"),
            ]
        )
        == 0
    )
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "peft").iterdir()}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(drafter), str(tmp_path / "peft"))
    loaded = get_peft_model_state_dict(model)
    learned = s.adapters.state_dict("t")
    assert set(loaded) == set(learned) and all(torch.equal(loaded[k], learned[k]) for k in learned)
    assert any(torch.count_nonzero(v) for k, v in learned.items() if "lora_B" in k)  # it did learn
    assert (
        main(
            [
                "device",
                "export-adapter",
                "--drafter",
                drafter,
                "--target",
                "other",
                "--state-dir",
                str(state),
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )  # nothing saved for that target: one line, exit 2
    assert "no valid adapter" in capsys.readouterr().err
