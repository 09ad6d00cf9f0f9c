"""Online learning on the tiny drafter/target pair (conftest's ``pair_dir``): LoRA adapters
(gradients reach only the adapter, two adapters stay independent, one packing serves them all),
the learner (the loss decreases, epochs and optimizers, bf16 training bit-identical on frozen
weight copies held in bf16), the acceptance head labelled from the update's own forwards,
training samples aligned to the response, and greedy output identical to the target's after
training."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from tiny_pair import CONFIG, PROMPTS, _engine

from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.session import DeviceSession
from omnidraft.shared.engine import model_runner
from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec
from omnidraft.shared.learning.distill import LossConfig


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


def test_a_windowed_sample_keeps_its_loss_positions_on_the_same_tokens(pair_dir):
    """``TrainingSample.windowed`` cuts the prompt's start only: every loss position still
    points at the same drafter token, ``context`` tokens precede the first one, and the
    learner buffers what ``max_context`` allows."""
    engine = _engine(pair_dir)
    session = DeviceSession(engine, target_name="t", lora=LoraSpec(rank=8))
    sample = session.generate(PROMPTS[0], CONFIG, observe=False).training_sample
    assert sample.seq_start >= 3 and sample.windowed(sample.seq_start) is sample
    short = sample.windowed(1)
    cut = len(sample.draft_ids) - len(short.draft_ids)
    assert cut == sample.seq_start - 2 and short.seq_start == 2  # one token of context, one predicting
    assert short.draft_ids[short.seq_start :] == sample.draft_ids[sample.seq_start :]
    for pos in ("dm_pos", "ng_pos"):
        assert [short.draft_ids[j] for j in getattr(short, pos).tolist()] == [
            sample.draft_ids[j] for j in getattr(sample, pos).tolist()
        ]
    assert short.positions("seq") == sample.positions("seq") and short.positions("hybrid") == sample.positions("hybrid")
    online = OnlineConfig(interval=9, max_context=1)
    learner = DeviceSession(engine, target_name="t2", lora=LoraSpec(rank=8), online=online).learner
    learner.observe(sample)
    assert learner.buffer[0].draft_ids == short.draft_ids
    with pytest.raises(ValueError, match="max_context"):
        OnlineConfig(max_context=-1).validate()


def test_gradients_reach_only_the_adapter_and_two_adapters_stay_independent(pair_dir):
    engine = _engine(pair_dir)
    base = {
        n.replace(".parametrizations.weight.original", ".weight"): p.detach().clone()
        for n, p in engine.drafter.model.named_parameters()
    }
    adapters = DrafterAdapters(engine.drafter.model, LoraSpec(rank=4), drafter_weights="fp32")
    a = DeviceSession(engine, target_name="target-a", adapters=adapters, online=OnlineConfig(interval=2, lr=1e-2))
    DeviceSession(engine, target_name="target-b", adapters=adapters)  # registers target-b's adapter
    b_before = adapters.state_dict("target-b")
    for prompt in PROMPTS[:4]:
        a.generate(prompt, CONFIG)
    assert a.learner.updates == 2
    assert all(p.grad is None for p in adapters.peft.parameters())  # not held between updates
    trainable = {n for n, p in adapters.peft.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and ".t_target_a." in n for n in trainable)
    # base weights untouched (compare through the unwrapped names; the frozen Linear weights
    # held in bf16 since Engine.load)
    for n, p in adapters.peft.get_base_model().named_parameters():
        key = n.replace(".base_layer", "").replace(".parametrizations.weight.original", ".weight")
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


def test_adding_an_adapter_raises_no_future_warning(pair_dir):
    """Wrapping the drafter in peft shows a device's user no FutureWarning (peft reads
    transformers' deprecated ``is_gradient_checkpointing`` alias while wrapping)."""
    engine = _engine(pair_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        adapters = DrafterAdapters(engine.drafter.model, LoraSpec(rank=4), drafter_weights="fp32")
        assert adapters.add("t") in adapters.names


def test_training_on_frozen_weights_held_in_bf16_is_bit_identical(pair_dir):
    """The first training forward holds the frozen Linear weights in bf16 (in place). Under bf16
    autocast, training on them gives the same logits and adapter gradients, bit for bit, as
    the float32 weights autocast casts at every call; without autocast (CPUs without native
    bf16), the forward computes in float32 on the bf16 values: bit for bit what float32
    weights rounded to bf16 give. The tied LM head's bf16 copy is made once per drafter and
    again after a respec (test below)."""
    import copy

    engine = _engine(pair_dir)
    model = model_runner.load(str(pair_dir / "drafter"), progress=False).model  # as loaded: float32, not held
    adapters = DrafterAdapters(model, LoraSpec(rank=4), drafter_weights="fp32")
    adapters.add("t")
    with torch.no_grad():  # a trained adapter: B != 0, so the LoRA path counts
        for n, p in adapters.peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ids = torch.tensor([engine.drafter.tokenizer.encode(PROMPTS[0] + PROMPTS[1])])

    def forward_backward(peft_model, decoder, head, autocast):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = head(decoder(input_ids=ids).last_hidden_state).float()
        logits.logsumexp(-1).sum().backward()
        grads = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.grad is not None}
        peft_model.zero_grad(set_to_none=True)
        return logits.detach(), grads

    def plain(peft_model):
        base = peft_model.get_base_model()
        return base.get_decoder(), base.get_output_embeddings()

    rounded = copy.deepcopy(adapters.peft)  # the float32 model with its frozen weights rounded to bf16
    base = rounded.get_base_model()
    with torch.no_grad():
        for n, m in base.named_modules():
            if (
                isinstance(m, torch.nn.Linear)
                and ".lora_" not in f".{n}"
                and m.weight is not base.get_input_embeddings().weight
            ):
                m.weight.copy_(m.weight.to(torch.bfloat16).float())
    ref_autocast = forward_backward(adapters.peft, *plain(adapters.peft), autocast=True)  # before holding
    ref_fp32 = forward_backward(rounded, *plain(rounded), autocast=False)
    for autocast, (ref_logits, ref_grads) in ((True, ref_autocast), (False, ref_fp32)):
        decoder, head = adapters.decoder_and_head(torch.bfloat16 if autocast else None)
        logits, grads = forward_backward(adapters.peft, decoder, head, autocast)
        assert adapters.held_dtype == torch.bfloat16 and ref_grads and torch.equal(logits, ref_logits)
        assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    in_decoder, in_head = copies = adapters._frozen[torch.bfloat16]
    assert not in_decoder and not in_head  # every frozen weight is held and read as held: no copies
    adapters.decoder_and_head(torch.bfloat16)
    assert adapters._frozen[torch.bfloat16] is copies  # made once
    adapters.respec(LoraSpec(rank=4, modules="attn"))
    assert not adapters._frozen


@pytest.mark.parametrize("tied", [False, True])
def test_the_first_training_forward_holds_the_frozen_drafter_weights_in_bf16(pair_dir, tied):
    """Where the drafter drafts on packings and its weights are not held yet (a model given to
    the adapters without ``Engine.load``, which holds them itself), its first training forward
    (with or without bf16 autocast) holds the frozen Linear weights in bf16 in place (the float32 originals are
    freed), read as float32 outside autocast: the base packing, built before, drafts exactly as
    before; a tied LM head stays the float32 input embedding; an adapter added afterwards still
    trains in float32."""
    from torch.nn.utils import parametrize

    engine = _engine(pair_dir)
    model = model_runner.load(str(pair_dir / "drafter"), progress=False).model  # as loaded: float32, not held
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight

    def frozen_linears():
        return [
            m
            for n, m in list(model.get_decoder().named_modules()) + [("lm_head", model.lm_head)]
            if isinstance(m, torch.nn.Linear) and ".lora_" not in f".{n}" and not (tied and n == "lm_head")
        ]

    def held(m):
        return m.parametrizations.weight.original if parametrize.is_parametrized(m, "weight") else m.weight

    adapters = DrafterAdapters(model, LoraSpec(rank=4), drafter_weights="fp32")
    adapters.add("a")
    ids = engine.drafter.tokenizer.encode(PROMPTS[0])
    untrained = adapters.runner().forward(ids).clone()
    fp32_bytes = sum(held(m).nbytes for m in frozen_linears())
    decoder, head = adapters.decoder_and_head()
    assert adapters.held_dtype == torch.bfloat16
    assert all(held(m).dtype == torch.bfloat16 and m.weight.dtype == torch.float32 for m in frozen_linears())
    assert sum(held(m).nbytes for m in frozen_linears()) * 2 == fp32_bytes
    assert model.get_input_embeddings().weight.dtype == torch.float32
    if tied:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    runner = adapters.runner()
    runner.reset()
    assert torch.equal(runner.forward(ids), untrained)  # the base packing is the float32 one
    logits = head(decoder(input_ids=torch.tensor([ids])).last_hidden_state)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    adapters.add("b")
    lora = [p for n, p in adapters.peft.named_parameters() if ".t_b." in n]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    decoder, head = adapters.decoder_and_head(torch.bfloat16)
    if tied:  # autocast would cast the float32 embedding at every call: a bf16 copy, made once
        (weight,) = adapters._frozen[torch.bfloat16][1].values()
        assert (
            weight.dtype == torch.bfloat16 and adapters.decoder_and_head(torch.bfloat16) and len(adapters._frozen) == 1
        )
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


def test_a_new_session_starts_from_the_same_state_whatever_ran_before(pair_dir):
    """A session that builds its own adapters initialises the LoRA matrices and the acceptance
    head from a seed of the drafter and target names, not from whatever torch's global generator
    holds after earlier work; and it leaves that generator as it found it."""

    def fresh(draws: int) -> tuple[dict, dict]:
        torch.manual_seed(draws)
        torch.rand(draws)  # earlier work in the process moved the global generator
        before = torch.random.get_rng_state()
        session = DeviceSession(_engine(pair_dir), target_name="t", online=OnlineConfig(interval=2, lr=1e-2))
        assert torch.equal(torch.random.get_rng_state(), before)
        return session.adapters.state_dict("t"), {k: v.clone() for k, v in session.head.state_dict().items()}

    (lora1, head1), (lora2, head2) = fresh(3), fresh(1000)
    assert any("lora_A" in k for k in lora1) and lora1.keys() == lora2.keys()
    assert all(torch.equal(lora1[k], lora2[k]) for k in lora1)
    assert all(torch.equal(head1[k], head2[k]) for k in head1)
    other = DeviceSession(_engine(pair_dir), target_name="u").adapters.state_dict("u")
    assert any(not torch.equal(other[k], lora1[k]) for k in lora1 if "lora_A" in k)


def test_a_second_session_on_one_engine_shares_the_drafters_adapters_and_keeps_their_training(pair_dir):
    """peft injects the LoRA layers into the drafter model itself: a second session on the same
    engine used to wrap it again, which re-initialized the first session's adapter (its training
    lost, with peft's 'modify a model with PEFT for a second time' warning). It now shares the
    adapters the model carries; another LoRA shape on that model, or a second
    ``DrafterAdapters`` on it, is a ValueError."""
    engine = _engine(pair_dir)
    first = DeviceSession(engine, target_name="t", lora=LoraSpec(rank=4))
    with torch.no_grad():  # what an update does: B moves off zero
        for name, param in first.adapters.peft.named_parameters():
            if "lora_B" in name:
                param.add_(0.25)
    trained = {k: v.clone() for k, v in first.adapters.state_dict("t").items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # peft's double-wrap warnings would fail here
        second = DeviceSession(engine, target_name="t", lora=LoraSpec(rank=4))
        other = DeviceSession(engine, target_name="u", lora=LoraSpec(rank=4))
    assert (
        second.adapters is first.adapters is other.adapters
        and DrafterAdapters.of(engine.drafter.model) is first.adapters
    )
    assert all(torch.equal(v, first.adapters.state_dict("t")[k]) for k, v in trained.items())
    assert len(first.adapters.names) == 2  # one adapter per target: t's and u's
    with pytest.raises(ValueError, match="already carries adapters"):
        DeviceSession(engine, target_name="t", lora=LoraSpec(rank=8))
    with pytest.raises(ValueError, match="already carries adapters"):
        DrafterAdapters(engine.drafter.model, LoraSpec(rank=4))


def test_a_snapshot_decodes_with_the_state_it_copied_while_the_session_learns_on(pair_dir):
    """``DeviceSession.snapshot`` (``omnidraft adapt``'s starting state, decoded beside the
    learned one): after the session trains, the snapshot still decodes exactly as the session did
    when it was taken (same drafts, same decisions); it learns nothing itself, and decoding with
    it leaves the session's adapter, head, lookup history and n-gram cache as they were."""
    engine = _engine(pair_dir)
    session = DeviceSession(engine, target_name="t", online=OnlineConfig(interval=2, lr=2e-2))
    for prompt in PROMPTS[:4]:
        session.generate(prompt, CONFIG)  # some state to copy: an adapter, a head, a history
    start = session.snapshot("before")
    probe = PROMPTS[10]

    def decode(who):
        r = who.generate(probe, CONFIG, learn=False)
        s = r.stats
        return r.token_ids, (s.target_calls, s.drafter_steps, s.lookup_rounds, s.plain_rounds, s.proposed_tokens)

    expected = decode(session)
    for prompt in PROMPTS[4:8]:
        session.generate(prompt, CONFIG)
    assert session.learner.updates == 4 and start.learner.updates == 0
    trained = {k: v.clone() for k, v in session.adapters.state_dict("t").items()}
    history, entries = session.lookup.history_tensor().clone(), len(session.cache)
    assert decode(start) == expected  # the state as it was, whatever the session learned since
    assert not all(torch.equal(v, start.adapters.state_dict(start.target)[k]) for k, v in trained.items())
    start.generate(PROMPTS[11], CONFIG)  # a snapshot never learns (nor saves: it has no state dir)
    assert start.learner.updates == 0 and start.state is None
    assert all(torch.equal(v, session.adapters.state_dict("t")[k]) for k, v in trained.items())
    assert torch.equal(session.lookup.history_tensor(), history) and len(session.cache) == entries
    assert session.cache is engine.cache and start.cache is not engine.cache
