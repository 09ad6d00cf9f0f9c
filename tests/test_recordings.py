"""Learning from recordings of earlier live decodes, on the tiny pair (conftest's
``pair_dir``): a replayed learning decode drafts, accepts and trains bit for bit as the live one
without running the target, and the recording store finds a recording only under its own prompt
and settings, reads damaged or foreign files as missing and refuses misuse."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_pair import CONFIG, PROMPTS, _engine

from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.session import DeviceSession
from omnidraft.shared.engine.pair import Engine


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
        # one target name: its seed gives both sessions the same LoRA A and head to start from
        session = DeviceSession(engine, target_name="t", online=online)
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
        runs[mode] = (results, session.adapters.state_dict("t"), session.learner.updates)
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


@pytest.mark.parametrize("dtype", ["int8", "fp64"])
def test_recordings_decoded_by_the_target_alone_side_by_side_are_the_live_ones(pair_dir, tmp_path, dtype, monkeypatch):
    """The target alone's decodes of several prompts (``record_together``: side by side where
    the target's kernels allow it, int8 here, where one native call takes every prompt's step;
    fp64 one after another) give each prompt, training signal included, bit for bit the
    recording a live speculative learning decode of it leaves. ``record_missing`` decodes so
    the prompts a store lacks (where they go side by side; elsewhere the live decode records
    them), keeps them, and never decodes a prompt the store holds."""
    from omnidraft.client.recorded_outputs import record_missing
    from omnidraft.shared.engine.recording_decodes import record_together
    from omnidraft.shared.runtime import batched_steps

    engine = Engine.load(str(pair_dir / "drafter"), str(pair_dir / "target"), dtype, progress=False)
    session = DeviceSession(engine, target_name="t", online=OnlineConfig(interval=2, lr=2e-2))
    prompts = PROMPTS[:6]
    live = []
    for prompt in prompts:
        session.generate(prompt, CONFIG)
        live.append(session.last_recording)
    widths = []
    real = batched_steps._forward_rows
    monkeypatch.setattr(batched_steps, "_forward_rows", lambda calls: widths.append(len(calls)) or real(calls))
    ids = [engine.prompt_ids(prompt)[1] for prompt in prompts]
    decoded = record_together(engine.target_runner, engine.bridge, session.inter, ids, CONFIG)
    assert max(widths) == len(prompts) if dtype == "int8" else not widths  # six prompts' steps in one call
    for want, got in zip(live, decoded):
        assert got.ids == want.ids and got.prompt_tokens == want.prompt_tokens
        assert got.signal.keys() == want.signal.keys()
        assert all(torch.equal(got.signal[k], want.signal[k]) for k in want.signal)
    store = engine.recordings(tmp_path)
    store.put(prompts[0], CONFIG, live[0])
    widths.clear()
    found = record_missing(store, session, prompts + prompts[1:2], CONFIG, signal=True)  # one prompt twice
    if dtype == "fp64":
        assert found[0].ids == live[0].ids and found[1:] == [None] * 6
        return
    assert max(widths) == len(prompts) - 1  # the five prompts the store lacked, each once
    assert found[-1] is found[1]
    for want, got, prompt in zip(live, found, prompts):
        assert got.ids == want.ids and all(torch.equal(got.signal[k], want.signal[k]) for k in want.signal)
        assert store.get(prompt, CONFIG, signal=True).ids == want.ids
    widths.clear()
    assert [r.ids for r in record_missing(store, session, prompts, CONFIG)] == [r.ids for r in live]
    assert not widths  # all held now: nothing decoded
