"""A fleet device taking and using the coordinator's state, on the tiny fleet (conftest's
``tiny``): it checks the manifest's signature, the parts' hashes and the version before storing
a state (and refuses a NaN adapter), serves a cold first session and then the global state in
one process, loses only the replay to an unwritable recording store, and as a probe scores the
drafter against the target's recorded greedy output, running the target live only on its
timed speed prompts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from omnidraft.coordinator.registry import TargetRegistry
from omnidraft.shared.learning.adapters import LoraSpec

pytestmark = pytest.mark.usefixtures("flower_task")  # hand-made Messages need a task identity


def _probe_profile(tiny, name: str, heldout: list[str], state_dir, **settings):
    """A probe of ``tiny-target-a`` (evaluates only) holding ``heldout``."""
    from omnidraft.client.device_profile import DeviceProfile

    return DeviceProfile(
        device_id=name,
        target="tiny-target-a",
        target_model=str(tiny["tiny-target-a"]),
        drafter=str(tiny["tiny-drafter"]),
        prompts=[],
        heldout=heldout,
        state_dir=state_dir,
        probe=True,
        **settings,
    )


def test_device_checks_signature_hashes_and_version_before_storing(tmp_path, tiny):
    """A device that pins the coordinator's Ed25519 key stores a state only if the manifest's
    signature verifies, every part (the target's spec included) matches the hash the manifest
    signs and the version is not older than the one it holds; otherwise it keeps what it had."""
    from dataclasses import replace

    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice, StateMismatch
    from omnidraft.proto import fleet_pb2

    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    v0 = reg.load("tiny-target-a")
    reg.commit("tiny-target-a", v0.adapter, v0.cache(), round_=1, devices=1, tokens=1)
    v1 = reg.load("tiny-target-a")
    assert v0.signature and v1.signature and v1.manifest.parent_version == 0
    key_file = tmp_path / "coord" / "keys" / "manifest-ed25519.pem"
    assert oct(key_file.stat().st_mode & 0o777) == "0o600" and oct(key_file.parent.stat().st_mode & 0o777) == "0o700"
    profile = DeviceProfile(
        device_id="d",
        target="tiny-target-a",
        target_model=str(tiny["tiny-target-a"]),
        drafter=str(tiny["tiny-drafter"]),
        prompts=["x"],
        heldout=["y"],
        state_dir=tmp_path / "dev",
        fleet_key=reg.public_key(),
    )
    pool = EnginePool("fp32", "fp32")
    device = FleetDevice(profile, pool)
    assert device.receive(v1.spec, v1.manifest_blob, v1.adapter_blob, v1.cache_blob, v1.signature).version == 1
    forged = fleet_pb2.StateManifest()
    forged.ParseFromString(v1.manifest_blob)
    forged.version = 9
    respec = fleet_pb2.TargetSpec()
    respec.CopyFrom(v1.spec)
    respec.lora_rank = 64  # what the device would apply: a spec the coordinator did not sign
    bad = [
        ((respec, v1.manifest_blob, v1.adapter_blob, v1.cache_blob, v1.signature), "spec does not match"),
        ((v1.spec, forged.SerializeToString(), v1.adapter_blob, v1.cache_blob, v1.signature), "signature"),
        ((v1.spec, v1.manifest_blob, v1.adapter_blob, v1.cache_blob, b""), "signature"),
        ((v1.spec, v1.manifest_blob, v1.adapter_blob[:-1] + b"!", v1.cache_blob, v1.signature), "checksum"),
        ((v1.spec, v1.manifest_blob, v1.adapter_blob, v1.cache_blob[:-1] + b"!", v1.signature), "checksum"),
        ((v0.spec, v0.manifest_blob, v0.adapter_blob, v0.cache_blob, v0.signature), "older"),
    ]  # a replay
    for args, reason in bad:
        with pytest.raises(StateMismatch, match=reason):
            device.receive(*args)
        assert device.held_manifest().version == 1  # the previous state is kept, intact
    # the coordinator itself signs a NaN adapter (a bug, or a poisoned aggregate): the device refuses it
    nan = {k: torch.full_like(v, float("nan")) for k, v in v1.adapter.items()}
    reg.commit("tiny-target-a", nan, v1.cache(), round_=2, devices=1, tokens=1)
    v2 = reg.load("tiny-target-a")
    with pytest.raises(StateMismatch, match="NaN or Inf"):
        device.receive(v2.spec, v2.manifest_blob, v2.adapter_blob, v2.cache_blob, v2.signature)
    assert device.held_manifest().version == 1
    stranger = FleetDevice(
        replace(profile, fleet_key=TargetRegistry(tmp_path / "other").public_key(), state_dir=tmp_path / "dev2"), pool
    )
    with pytest.raises(StateMismatch, match="signature"):
        stranger.receive(v1.spec, v1.manifest_blob, v1.adapter_blob, v1.cache_blob, v1.signature)
    assert stranger.held_manifest() is None
    # a session starts from the same random draws whatever the worker process ran before it
    heads = []
    for noise in (0, 1000):
        torch.rand(noise)
        heads.append({k: v.clone() for k, v in device.session().head.state_dict().items()})
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])


def test_a_cold_first_session_then_the_global_state_in_one_process(tmp_path, tiny):
    """A worker whose first session is a cold one (no global state: the default LoRA shape)
    then serves the global state (the same shape, read from the wire) and evaluates at a
    fixed draft length only."""
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice

    assert LoraSpec(rank=8) == LoraSpec(rank=8, alpha=16.0)
    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=8))
    state = reg.load("tiny-target-a")
    profile = DeviceProfile(
        device_id="d",
        target="tiny-target-a",
        target_model=str(tiny["tiny-target-a"]),
        drafter=str(tiny["tiny-drafter"]),
        prompts=["x"],
        heldout=["def f(x):"],
        state_dir=tmp_path / "dev",
    )
    device = FleetDevice(profile, EnginePool("fp32", "fp32"))
    cold = device.evaluate(use_global=False, fixed_k=2, adaptive=False)
    device.receive(state.spec, state.manifest_blob, state.adapter_blob, state.cache_blob, state.signature)
    warm = device.evaluate(fixed_k=2, adaptive=False)
    for metrics in (cold, warm):
        assert 0 <= metrics["fixed-k-acceptance"] <= 1 and metrics["generated-tokens"] > 0
        assert "acceptance" not in metrics and "tokens-per-s" not in metrics
    with pytest.raises(ValueError, match="fixed draft length"):
        device.evaluate(adaptive=False)


def test_the_tokenizers_cache_is_built_on_the_device_and_a_merge_counts_once_saved(tmp_path, tiny):
    """The global cache carries released n-grams only. A device translating through the n-gram
    cache builds the entries the two tokenizers imply itself (the same ones the coordinator's
    release candidates hold); a device translating the drafted text holds none of them. A
    session that merges the global cache but is not saved (a newcomer's evaluation) leaves
    the merge to the next session: a later training round still holds the released n-gram."""
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice

    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    v0 = reg.load("tiny-target-a")
    candidates = reg.candidates("tiny-target-a")
    target_id, draft_ids = next(iter(candidates.items()))
    cache = v0.cache()
    cache.add(draft_ids, target_id, 3)
    reg.commit("tiny-target-a", v0.adapter, cache, round_=1, devices=1, tokens=1)
    v1 = reg.load("tiny-target-a")
    assert len(v0.cache()) == 0 and len(v1.cache()) == 1
    pool = EnginePool("fp32", "fp32")

    def device(name: str, translate: str) -> FleetDevice:
        profile = DeviceProfile(
            device_id=name,
            target="tiny-target-a",
            target_model=str(tiny["tiny-target-a"]),
            drafter=str(tiny["tiny-drafter"]),
            prompts=["def f(x):"],
            heldout=["def g(y):"],
            state_dir=tmp_path / name,
            prompts_per_round=1,
            translate=translate,
        )
        d = FleetDevice(profile, pool)
        d.receive(v1.spec, v1.manifest_blob, v1.adapter_blob, v1.cache_blob, v1.signature)
        return d

    ngram = device("ngram", "ngram").session()
    assert {(ids, t) for t, ids in candidates.items()} <= {(e.draft_ids, e.target_id) for e in ngram.cache.entries()}
    text = device("text", "text")
    session = text.session()
    assert [(e.draft_ids, e.count) for e in session.cache.entries()] == [(draft_ids, 3)]
    text.evaluate(fixed_k=2, adaptive=False)  # not saved: the merge is not marked done
    text.train_round(1)
    after = text.session()  # the saved state, the global cache already merged into it
    assert after.cache.get(draft_ids) == target_id
    assert next(e.count for e in after.cache.entries() if e.draft_ids == draft_ids) >= 3


def test_a_recording_store_that_cannot_be_written_costs_only_the_replay(tmp_path, tiny):
    """A simulated device whose recording store is unwritable (here: a file where the folder
    should be) still trains and evaluates, with the target running instead of a replay."""
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice

    blocked = tmp_path / "recordings"
    blocked.write_text("not a folder")
    profile = DeviceProfile(
        device_id="d",
        target="tiny-target-a",
        target_model=str(tiny["tiny-target-a"]),
        drafter=str(tiny["tiny-drafter"]),
        prompts=["def add(a, b):", "import os\n"],
        heldout=["def f(x):"],
        state_dir=tmp_path / "dev",
        prompts_per_round=2,
        recordings=str(blocked),
    )
    device = FleetDevice(profile, EnginePool("fp32", "fp32"))
    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=8))
    state = reg.load("tiny-target-a")
    device.receive(state.spec, state.manifest_blob, state.adapter_blob, state.cache_blob, state.signature)
    _, _, metrics = device.train_round(1)
    assert metrics["replayed"] == 0.0 and metrics["trained-tokens"] > 0
    cold = device.evaluate(use_global=False, fixed_k=2)  # held-out outputs: the target alone, not the store
    assert 0 <= cold["fixed-k-acceptance"] <= 1 and cold["modelled-speedup"] > 0 and "tokens-per-s" not in cold
    assert blocked.read_text() == "not a folder"


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_probe_with_a_recording_store_runs_the_target_alone_only_on_its_speed_prompts(
    tmp_path, tiny, monkeypatch, dtype
):
    """With a recording store, a probe runs the target alone live (timed: the speed baseline)
    on its ``speed_prompts`` only; its other held-out outputs come from the store, recorded the
    first time by the target alone side by side where the target's kernels allow it (int8:
    ``recording_decodes.record_together``, untimed) and elsewhere from the fixed-k pass's own
    live decode (fp32), so a fresh probe later replays them. The fixed-k figures are the
    store-less probe's."""
    from omnidraft.client import evaluation, recorded_outputs
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice

    heldout = ["def f(x):", "def alpha_3(beta, gamma):\n", "x = 1\n", "    return "]
    pool = EnginePool(dtype, "fp32")

    def probe(name: str, recordings: str) -> FleetDevice:
        return FleetDevice(
            _probe_profile(tiny, name, heldout, tmp_path / name, speed_prompts=1, recordings=recordings), pool
        )

    runs, together = [], []
    real_alone, real_together = evaluation.target_alone, recorded_outputs.record_together
    monkeypatch.setattr(evaluation, "target_alone", lambda *a: runs.append(a[1]) or real_alone(*a))
    monkeypatch.setattr(recorded_outputs, "record_together", lambda *a: together.append(len(a[3])) or real_together(*a))
    store = str(tmp_path / "recordings")
    first = probe("p1", store).evaluate(use_global=False, measure_ar=True, fixed_k=3)
    assert runs == [heldout[:1]] and first["speedup"] > 0  # the timed baseline only, each time
    assert together == ([3] if dtype == "int8" else [])  # the three other prompts, side by side
    # recorded: the prompts the fixed-k pass decoded live (the timed one's baseline runs every time)
    assert len(list((tmp_path / "recordings").rglob("*.safetensors"))) == len(heldout) - 1
    runs.clear()
    second = probe("p2", store).evaluate(use_global=False, measure_ar=True, fixed_k=3)
    assert runs == [heldout[:1]] and together == ([3] if dtype == "int8" else [])
    plain = probe("p3", "").evaluate(use_global=False, measure_ar=True, fixed_k=3)
    for key in ("fixed-k-acceptance", "fixed-k-tokens-per-call"):
        assert first[key] == second[key] == plain[key]


def test_a_new_device_records_its_held_out_outputs_from_its_own_live_decodes(tmp_path, tiny, monkeypatch):
    """A simulated new device (no probe: its speed is modelled) whose held-out prompts are not
    recorded yet decodes them live in its adaptive pass and records the outputs from those
    decodes; the target alone never runs. Its figures are modelled only, and equal those of a
    device with the same state that replays the recordings, live decodes and replays alike."""
    from omnidraft.client import evaluation, fleet_device
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice
    from omnidraft.shared.engine.recorded_target import RecordedTarget

    heldout = ["def f(x):", "def alpha_3(beta, gamma):\n", "x = 1\n"]
    pool = EnginePool("fp32", "fp32")
    store = tmp_path / "recordings"

    def device(name: str) -> FleetDevice:
        profile = DeviceProfile(
            device_id="same",  # one seed: the same untrained adapter and rule in both
            target="tiny-target-a",
            target_model=str(tiny["tiny-target-a"]),
            drafter=str(tiny["tiny-drafter"]),
            prompts=["def add(a, b):"],
            heldout=heldout,
            state_dir=tmp_path / name,
            recordings=str(store),
        )
        return FleetDevice(profile, pool)

    runs, replayed = [], []
    real_alone, real_replay = evaluation.target_alone, RecordedTarget.__init__
    real_together = fleet_device.record_together
    monkeypatch.setattr(evaluation, "target_alone", lambda *a: runs.append(a[1]) or real_alone(*a))
    monkeypatch.setattr(fleet_device, "record_together", lambda *a: runs.append(a[3]) or real_together(*a))
    monkeypatch.setattr(RecordedTarget, "__init__", lambda self, *a: replayed.append(1) or real_replay(self, *a))
    first = device("d1").evaluate(use_global=False, fixed_k=3)
    assert runs == [] and len(list(store.rglob("*.safetensors"))) == len(heldout)
    assert len(replayed) == len(heldout)  # only the fixed-k pass replayed, from the new recordings
    replayed.clear()
    second = device("d2").evaluate(use_global=False, fixed_k=3)
    assert runs == [] and len(replayed) == 2 * len(heldout)  # both passes replay now
    assert "tokens-per-s" not in first and "speedup" not in first and first["modelled-speedup"] > 0
    for key in ("acceptance", "tokens-per-call", "modelled-speedup", "fixed-k-acceptance", "generated-tokens"):
        assert first[key] == second[key], key


def test_probe_evaluation_replays_the_recorded_target(tmp_path, tiny, monkeypatch):
    """A probe's fixed-k pass scores the drafter against the target's greedy output, recorded
    once per prompt set and kept in fleet.json: the figures equal a live decode's, later
    evaluations run the target only on the timed speed prompts (the speed baseline is timed in
    every evaluation), and the adaptive pass decodes only ``speed_prompts``."""
    from omnidraft.client import evaluation, fleet_device
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice

    heldout = ["def f(x):", "def alpha_3(beta, gamma):\n", "x = 1\n", "    return "]
    profile = _probe_profile(tiny, "p", heldout, tmp_path / "probe", speed_prompts=1)
    device = FleetDevice(profile, EnginePool("fp32", "fp32"))
    runs = []
    real_alone, real_together = evaluation.target_alone, fleet_device.record_together
    # the timed runs (evaluation) and the outputs kept (the target alone, side by side where it can)
    monkeypatch.setattr(evaluation, "target_alone", lambda *a: runs.append(a[1]) or real_alone(*a))
    monkeypatch.setattr(fleet_device, "record_together", lambda *a: runs.append(len(a[3])) or real_together(*a))
    first = device.evaluate(use_global=False, measure_ar=True, fixed_k=3)
    again = device.evaluate(use_global=False, measure_ar=True, fixed_k=3)
    assert runs == [heldout[:1], 3, heldout[:1]]  # outputs once; the timed baseline each time
    assert first["fixed-k-acceptance"] == again["fixed-k-acceptance"] and first["speedup"] > 0
    session = device.session(use_global=False)
    live = evaluation.evaluate_fixed_k(session, heldout, profile.generation, 3)
    assert first["fixed-k-acceptance"] == live["acceptance_rate"]
    assert first["fixed-k-tokens-per-call"] == live["tokens_per_target_call"]
    assert first["generated-tokens"] <= profile.generation.max_new_tokens < live["new_tokens"]  # adaptive: 1 prompt
    device.profile = replace(profile, heldout=heldout[:2])  # another prompt set: recorded anew
    device.evaluate(use_global=False, fixed_k=3, adaptive=False)
    assert runs == [heldout[:1], 3, heldout[:1], 2]


def test_a_fresh_evaluation_holds_nothing_the_device_learned_and_changes_nothing(tmp_path, tiny):
    """A veteran's cold reference (``fresh``): after a training round its local session holds a
    trained adapter and a lookup history; a fresh one holds neither, decodes as a device that
    never joined does (the same fixed-k figures), and leaves the saved state as it was."""
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice

    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=8))
    state = reg.load("tiny-target-a")
    pool = EnginePool("fp32", "fp32")

    def device(name: str) -> FleetDevice:
        profile = DeviceProfile(
            device_id=name,
            target="tiny-target-a",
            target_model=str(tiny["tiny-target-a"]),
            drafter=str(tiny["tiny-drafter"]),
            prompts=["def add(a, b):", "import os\n"],
            heldout=["def f(x):", "x = 1\n"],
            state_dir=tmp_path / name,
            prompts_per_round=2,
        )
        return FleetDevice(profile, pool)

    veteran = device("veteran")
    veteran.receive(state.spec, state.manifest_blob, state.adapter_blob, state.cache_blob, state.signature)
    veteran.train_round(1)

    def trained_b(session) -> float:
        tensors = session.adapters.state_dict(session.target)
        return sum(float(v.abs().sum()) for k, v in tensors.items() if "lora_B" in k)

    local = veteran.session(use_global=False)
    assert trained_b(local) > 0 and len(local.lookup.history) > 0
    fresh = veteran.session(use_global=False, fresh=True)
    assert trained_b(fresh) == 0 and len(fresh.lookup.history) == 0

    def held() -> dict[str, bytes]:  # but fleet.json, where an evaluation keeps the target alone's outputs
        return {str(p): p.read_bytes() for p in veteran.dir.rglob("*") if p.is_file() and p.name != "fleet.json"}

    saved = held()
    cold = veteran.evaluate(use_global=False, fresh=True, fixed_k=2)
    assert held() == saved and len(saved) > 3
    never = device("never").evaluate(use_global=False, fixed_k=2)
    keys = ("fixed-k-acceptance", "fixed-k-tokens-per-call", "acceptance", "tokens-per-call")
    assert {k: cold[k] for k in keys} == {k: never[k] for k in keys}
    with pytest.raises(ValueError, match="no global state"):
        veteran.session(fresh=True)


def test_an_evaluations_fixed_k_pass_reports_what_a_separate_pass_does(tmp_path, tiny):
    """The fixed-k pass of an evaluation (after its adaptive pass, replaying the outputs the
    target alone recorded beside it) gives the acceptance a separate fixed-k pass with the live
    target gives (``tests/test_lockstep.py``: replayed side by side, the same figures)."""
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.evaluation import evaluate_fixed_k
    from omnidraft.client.fleet_device import FleetDevice

    body = "".join(f"    value_{i} = compute_{i}(value_{i - 1}, key={i})\n" for i in range(1, 6))
    heldout = [f"def task_{n}(value_0):\n{body}" for n in range(3)]
    profile = _probe_profile(tiny, "p", heldout, tmp_path / "probe", speed_prompts=0)  # all: both passes
    device = FleetDevice(profile, EnginePool("fp32", "fp32"))
    metrics = device.evaluate(use_global=False, measure_ar=True, fixed_k=3)
    session = device.session(use_global=False)
    separate = evaluate_fixed_k(session, heldout, profile.generation, 3)  # its own pass, live target
    assert metrics["fixed-k-acceptance"] == pytest.approx(separate["acceptance_rate"])


def test_prompts_announced_by_several_devices_are_recorded_together(tmp_path, tiny, monkeypatch):
    """Simulated devices that name a round's prompts ahead (``FleetDevice.announce``: their
    training prompts, and their held-out ones where a panel will evaluate them) have them all
    recorded by the first decode that lacks one, in one ``record_together``, whichever device
    it runs for; the others then record nothing. Every device's round and evaluation report
    what they report without the announcement (int8: the kernels that decode side by side)."""
    from omnidraft.client import recorded_outputs
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.engine_pool import EnginePool
    from omnidraft.client.fleet_device import FleetDevice
    from omnidraft.shared.runtime.native_kernels import native_error, native_library

    if native_library() is None:
        pytest.skip(f"no native kernels: {native_error()}")
    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=8))
    state = reg.load("tiny-target-a")
    pool = EnginePool("int8", "fp32")
    train = [["def add(a, b):", "class Point:\n"], ["import os\n", "def alpha_3(beta, gamma):\n"]]
    heldout = [["x = 1\n"], ["def f(x):", "    return ", "for i in range(3):\n"]]

    def device(i: int, store) -> FleetDevice:
        profile = DeviceProfile(
            device_id=f"d{i}",  # the same seeds in both runs
            target="tiny-target-a",
            target_model=str(tiny["tiny-target-a"]),
            drafter=str(tiny["tiny-drafter"]),
            prompts=train[i],
            prompts_per_round=2,
            heldout=heldout[i],
            state_dir=store.parent / f"d{i}",
            recordings=str(store),
        )
        d = FleetDevice(profile, pool)
        d.receive(state.spec, state.manifest_blob, state.adapter_blob, state.cache_blob, state.signature)
        return d

    together = []
    real = recorded_outputs.record_together
    monkeypatch.setattr(recorded_outputs, "record_together", lambda *a: together.append(len(a[3])) or real(*a))
    reports = []
    for run, announced in (("plain", False), ("announced", True)):
        devices = [device(i, tmp_path / run / "recordings") for i in range(2)]
        if announced:
            assert devices[0].announce(train=True, heldout=False) == 2
            assert devices[1].announce(train=True, heldout=True) == 5
        together.clear()
        trained = [d.train_round(1) for d in devices]
        evaluated = devices[1].evaluate(use_global=False, fixed_k=3)
        assert together == ([2 + 2 + 3] if announced else [2, 2, 3])
        reports.append((trained, evaluated))
    (plain, plain_eval), (ahead, ahead_eval) = reports
    for (tensors, learned, metrics), (tensors2, learned2, metrics2) in zip(plain, ahead):
        assert learned == learned2 and all(torch.equal(tensors[k], tensors2[k]) for k in tensors)
        assert {k: v for k, v in metrics.items() if k != "update-s"} == {
            k: v for k, v in metrics2.items() if k != "update-s"
        }
    assert {k: v for k, v in plain_eval.items() if k != "eval-s"} == {
        k: v for k, v in ahead_eval.items() if k != "eval-s"
    }
