"""A deployed device beside its generation service: the request log that keeps the newest
prompts encrypted, the state directory that ``device serve`` and a SuperNode's ClientApp share
(a state saved by the other process is seen and never overwritten; a service session adopts the
LoRA shape a round saved), and the resource policy and system conditions (power, activity, the
daily uplink budget) that decide when the device may train."""

from __future__ import annotations

import pytest
import torch

from omnidraft.benchmarks.tiny_models import build_pair, corpus
from omnidraft.client.device_state import DeviceState
from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.request_log import RequestLog
from omnidraft.client.session import DeviceSession
from omnidraft.client.state_key import StateCipher
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.learning.adapters import LoraSpec
from omnidraft.shared.vocab.ngram_cache import NgramCache


def test_request_log_keeps_the_newest_prompts_encrypted(tmp_path):
    cipher = StateCipher(tmp_path / "key")
    log = RequestLog(tmp_path / "dev", cipher, keep=3)
    for i in range(5):
        assert log.append(f"secret prompt {i}") == i
    assert log.since(0) == [(2, "secret prompt 2"), (3, "secret prompt 3"), (4, "secret prompt 4")]
    assert log.since(4) == [(4, "secret prompt 4")] and log.since(5) == []
    assert b"secret" not in (tmp_path / "dev" / "requests.log").read_bytes()
    (tmp_path / "dev" / "requests.log").write_bytes(b"not json")  # a damaged log starts anew
    plain = RequestLog(tmp_path / "dev")
    assert plain.since(0) == [] and (tmp_path / "dev" / "requests.log.corrupt").exists()
    # another local process writes a plaintext log of prompts it wants the device to train on:
    # under the existing key it is set aside, never read
    (tmp_path / "dev" / "requests.log").write_text('{"next": 1, "entries": [[0, "poison"]]}')
    again = RequestLog(tmp_path / "dev", StateCipher(tmp_path / "key"), keep=3)
    assert again.since(0) == []


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 2), value)}


def test_a_state_saved_by_another_process_is_seen_and_never_overwritten(tmp_path):
    serve = DeviceState(tmp_path, "d", "t")
    round_ = DeviceState(tmp_path, "d", "t")  # the SuperNode's ClientApp, another process
    assert serve.save(_tensors(1.0), None, NgramCache(), {}, if_unchanged=True)
    assert not serve.changed_on_disk() and round_.changed_on_disk()
    round_.load()
    assert round_.save(_tensors(2.0), None, NgramCache(), {"round": 1})  # the round's result
    assert serve.changed_on_disk()
    assert not serve.save(_tensors(3.0), None, NgramCache(), {}, if_unchanged=True)  # refused
    loaded = serve.load()
    assert torch.equal(loaded.adapter["w"], _tensors(2.0)["w"]) and loaded.meta["round"] == 1
    assert serve.save(_tensors(4.0), None, NgramCache(), {}, if_unchanged=True)
    assert not (tmp_path / ".d--t.lock").read_bytes() and not list((tmp_path / "d--t").glob(".*"))


def test_a_service_session_adopts_the_lora_shape_a_round_saved(tmp_path):
    build_pair(tmp_path / "pair")
    engine = Engine.load(
        str(tmp_path / "pair" / "drafter"),
        str(tmp_path / "pair" / "target"),
        "fp32",
        drafter_weights="fp32",
        progress=False,
    )
    served = DeviceSession(
        engine, target_name="t", state_dir=tmp_path / "s", lora=LoraSpec(rank=8), online=OnlineConfig(interval=1)
    )
    served.save()
    # a federated round (another session on the same directory) saves a rank-2 adapter
    from omnidraft.shared.learning.adapters import DrafterAdapters

    other = DrafterAdapters(
        Engine.load(
            str(tmp_path / "pair" / "drafter"),
            str(tmp_path / "pair" / "target"),
            "fp32",
            drafter_weights="fp32",
            progress=False,
        ).drafter.model,
        LoraSpec(rank=2),
        drafter_weights="fp32",
    )
    round_ = DeviceSession(
        engine,
        target_name="t",
        state_dir=tmp_path / "s",
        adapters=other,
        lora=LoraSpec(rank=2),
        online=OnlineConfig(interval=1),
    )
    assert round_.problems and "starts fresh" in round_.problems[0]  # shared adapters keep their shape
    with torch.no_grad():
        for p in round_.adapters.trainable_parameters():
            p.add_(0.01)
    round_.save()
    assert served.refresh()
    assert served.adapters.spec.rank == 2 and not served.problems
    want = round_.adapters.state_dict("t")
    got = served.adapters.state_dict("t")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    result = served.generate(corpus(3, seed=5)[0][:20], GenerationConfig(max_new_tokens=6))
    assert result.stats.new_tokens == 6
    assert served.learner.updates == 1  # it trains the adopted adapter (interval 1)


class FakeConditions:
    """A device whose power and activity the test sets."""

    def __init__(self, power: bool = True, quiet_s: float = 1e9) -> None:
        self.power, self.quiet_s = power, quiet_s

    def on_power(self) -> bool:
        return self.power

    def seconds_since_last_request(self) -> float:
        return self.quiet_s


def test_resource_policy_decides_when_a_device_may_train(tmp_path):
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.fleet_device import FleetDevice, StateMismatch
    from omnidraft.client.resource_policy import ResourcePolicy, UplinkLedger

    policy = ResourcePolicy(train_when="idle+power", idle_s=60, uplink_mb_per_day=0.07, cache_mb=1.5)
    profile = DeviceProfile(
        device_id="d",
        target="t",
        target_model="m",
        drafter="dr",
        prompts=["x"],
        heldout=[],
        state_dir=tmp_path / "d",
        policy=policy,
    )
    profile.save()
    assert DeviceProfile.load(tmp_path / "d").policy == policy  # the owner's limits survive a restart
    now = FakeConditions()
    device = FleetDevice(profile, pool=None, conditions=now)
    assert device.busy() == ""
    now.power = False
    assert device.busy() == "on battery (train-when power)"
    with pytest.raises(StateMismatch, match="busy: on battery"):  # a train message that comes anyway
        device.train_round(1)
    now.power, now.quiet_s = True, 5
    assert device.busy().startswith("in use (last request 5 s ago")
    now.quiet_s = 600
    device.record_uplink(30_000)
    assert device.busy() == ""  # 30 kB sent; the next round's 30 kB fits in 70 kB
    device.record_uplink(30_000)
    assert device.busy() == "uplink budget spent (60000 of 70000 bytes today)"  # another would not
    day = [1_700_000_000.0]
    ledger = UplinkLedger(tmp_path / "l", clock=lambda: day[0])
    ledger.add(10)
    ledger.add(5)
    assert ledger.used_today() == 15
    day[0] += 86_400  # a new UTC day starts a new budget
    assert ledger.used_today() == 0
    with pytest.raises(ValueError, match="train-when"):
        ResourcePolicy(train_when="sometimes").validate()


def test_system_conditions_read_the_power_supply_and_the_request_log(tmp_path):
    from omnidraft.client.resource_policy import SystemConditions

    sys_dir = tmp_path / "power_supply"
    conditions = SystemConditions(tmp_path / "state", sys_dir)
    assert conditions.on_power()  # no battery: a board on mains
    (sys_dir / "BAT0").mkdir(parents=True)
    (sys_dir / "BAT0" / "type").write_text("Battery\n")
    (sys_dir / "BAT0" / "status").write_text("Discharging\n")
    (sys_dir / "AC").mkdir()
    (sys_dir / "AC" / "type").write_text("Mains\n")
    (sys_dir / "AC" / "online").write_text("0\n")
    assert not conditions.on_power()
    (sys_dir / "AC" / "online").write_text("1\n")
    assert conditions.on_power()
    assert conditions.seconds_since_last_request() == float("inf")
    RequestLog(tmp_path / "state").append("hello")
    assert conditions.seconds_since_last_request() < 60
