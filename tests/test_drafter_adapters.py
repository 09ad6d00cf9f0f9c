"""The drafter's adapters on int8 packings: every adapter drafts on a fork of one base packing
with its own KV cache, a trained adapter is merged into its runner's weights, and a runner that
already merged the matrices it is given keeps its packing (devices of one fleet loading the same
global adapter in turn)."""

from __future__ import annotations

import weakref

import pytest
import torch
from tiny_pair import CONFIG, PROMPTS, _engine

from omnidraft.client import online_learner
from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.session import DeviceSession
from omnidraft.shared.engine import model_runner
from omnidraft.shared.engine.precision import DRAFTER_PREFILL_ACTIVATION_BITS
from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec
from omnidraft.shared.runtime.fast_drafter import FastLlamaRunner
from omnidraft.shared.runtime.held_weights import held_dtype, hold_frozen_weights


def _float32_drafter(pair_dir) -> torch.nn.Module:
    """The tiny pair's drafter as loaded, its frozen weights still float32 (``Engine.load``
    holds them in bf16 once the base is packed)."""
    return model_runner.load(str(pair_dir / "drafter"), progress=False).model


def test_the_engine_packs_the_drafter_from_float32_then_holds_its_frozen_weights_in_bf16(pair_dir):
    """``Engine.load`` packs the drafter's base from its float32 weights, then holds them in
    bf16 (half the bytes): the engine's drafter runner and an untrained adapter's draft on that
    one packing, exactly as a runner packed from the float32 model."""
    engine = _engine(pair_dir)
    assert held_dtype(engine.drafter.model) == torch.bfloat16
    reference = FastLlamaRunner(
        _float32_drafter(pair_dir),
        weights=engine.drafter_weights,
        prefill_activation_bits=DRAFTER_PREFILL_ACTIVATION_BITS,
    )
    adapters = DrafterAdapters(engine.drafter.model, LoraSpec(rank=4), drafter_weights=engine.drafter_weights)
    adapters.add("a")
    ids = [1, 2, 3]
    want = reference.forward(ids)
    assert torch.equal(adapters.runner().forward(ids), want)
    assert torch.equal(engine.drafter_runner.forward(ids), want)
    assert adapters.runner()._packing is engine.drafter_runner._packing


def test_one_packing_serves_every_adapter(pair_dir):
    """Adapters draft on forks of one base packing, each with its own KV cache; a trained
    adapter is merged into its own runner's weights: training, loading and resetting an
    adapter change its runner's logits and nobody else's."""
    model = _float32_drafter(pair_dir)
    adapters = DrafterAdapters(model, LoraSpec(rank=4), drafter_weights="fp32")
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
    # once every adapter drafts on its own packing nothing holds the base one: it is freed,
    # and packed again (the same weights: nothing trained here) for an adapter that needs it
    held = weakref.ref(ra._packing)
    adapters.activate("a")
    adapters.load_state_dict("a", tensors)
    assert adapters.runner().lora_rank == 4 and held() is None
    adapters.add("c")
    rc = adapters.runner()
    assert rc.lora_rank == 0 and ra._packing is not rc._packing is rc._base_packing
    torch.testing.assert_close(rc.forward(ids), base)
    adapters.activate("b")
    adapters.reset("b")
    torch.testing.assert_close(adapters.runner().forward(ids), base)
    assert rb._packing is rc._packing  # both untrained ones share the one base packing again


def test_loading_the_matrices_a_runner_merged_last_keeps_its_packing(pair_dir, monkeypatch):
    """Devices that load the same global adapter in turn (a fleet's round in one process) merge
    it once: loading matrices equal to the runner's last merge skips the ~1 s merge (the cache
    is still emptied, as a merge would), different matrices are merged, and so are equal ones
    once the base weights were held in another dtype."""
    model = _float32_drafter(pair_dir)
    adapters = DrafterAdapters(model, LoraSpec(rank=4), drafter_weights="fp32")
    adapters.add("t")
    merges = []
    real = FastLlamaRunner.set_lora
    monkeypatch.setattr(
        FastLlamaRunner, "set_lora", lambda self, layers: merges.append(layers is not None) or real(self, layers)
    )
    ids = [1, 2, 3]
    global_state = {k: v + 0.05 for k, v in adapters.state_dict("t").items()}
    adapters.load_state_dict("t", global_state)
    runner = adapters.runner()
    merged = runner.forward(ids).clone()
    trained = {k: v + 0.01 for k, v in global_state.items()}  # a device's update, never drafted with
    adapters.load_state_dict("t", trained)
    adapters.load_state_dict("t", global_state)  # the next device: the global state again
    assert adapters.runner() is runner and runner.length == 0 and merges == [True]
    torch.testing.assert_close(runner.forward(ids), merged)
    adapters.load_state_dict("t", trained)
    adapters.runner()
    assert merges == [True, True]
    hold_frozen_weights(model)  # as Engine.load does (or a first training forward)
    adapters.load_state_dict("t", trained)
    adapters.runner()
    assert merges == [True, True, True]


def test_an_update_on_a_board_drops_the_drafting_weights_it_is_about_to_change(pair_dir, monkeypatch):
    """On a board an adapter update releases its drafting runner's packing before it trains
    (re-packed after it anyway: a learning device's peak then does not hold it, 0.13 GB for
    SmolLM2-135M; elsewhere it is kept for a merge the next device may skip): a forward on the
    released runner raises instead of reading freed weights, and the next ``runner()`` packs the
    adapter as trained, as a runner packed from scratch has it."""
    monkeypatch.setattr(online_learner, "small_machine", lambda: True)
    session = DeviceSession(
        _engine(pair_dir), target_name="t", lora=LoraSpec(rank=4), online=OnlineConfig(interval=100, lr=3e-3)
    )
    learner, adapters = session.learner, session.adapters
    samples = [session.generate(p, CONFIG, observe=False).training_sample for p in PROMPTS[:3]]
    learner.buffer = list(samples)
    learner.update()
    runner = session.drafting_runner()
    assert runner.lora_rank == 4  # drafts on its own packing, the adapter merged
    packing = weakref.ref(runner._packing)
    held_while_training = []
    first_layer = adapters.peft.get_base_model().model.layers[0]
    hook = first_layer.register_forward_pre_hook(lambda *_: held_while_training.append(packing() is not None))
    learner.buffer = list(samples)
    learner.update()
    hook.remove()
    assert held_while_training and not any(held_while_training)  # freed before the first training forward
    with pytest.raises(RuntimeError, match="release_packing"):
        runner.forward([1, 2])
    ids = [1, 2, 3]
    fresh = adapters._base_runner().fork()
    fresh.set_lora(adapters.lora_layers(adapters.active))
    assert session.drafting_runner() is runner and torch.equal(runner.forward(ids), fresh.forward(ids))
    monkeypatch.setattr(online_learner, "small_machine", lambda: False)
    kept = weakref.ref(runner._packing)
    learner.buffer = list(samples)
    learner.update()
    assert kept() is not None and runner._packing is kept()  # elsewhere: kept until the next merge
