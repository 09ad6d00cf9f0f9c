"""One owner of the models on a device: the SuperNode's ClientApp asks the running generation
service (``client.fleet_service`` / ``client.served_device``) to receive states, train and
evaluate, on the service's own models. Tiny models; the served round must equal the same round
run in-process, load no model, leave the service serving the trained state, and refuse callers
without the owner token."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from omnidraft.benchmarks.tiny_models import corpus
from omnidraft.client import owner_token
from omnidraft.client.device_profile import DeviceProfile
from omnidraft.client.engine_pool import EnginePool
from omnidraft.client.fleet_device import FleetDevice, StateMismatch
from omnidraft.client.fleet_service import DeviceFleetService
from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.served_device import ServedDevice, ServiceUnavailable, served_device
from omnidraft.client.service import GenerationService, serve
from omnidraft.client.session import DeviceSession
from omnidraft.coordinator.registry import TargetRegistry
from omnidraft.proto import device_fleet_pb2 as fpb
from omnidraft.proto import device_fleet_pb2_grpc as fpb_grpc
from omnidraft.proto import generation_pb2 as gpb
from omnidraft.proto import generation_pb2_grpc as gpb_grpc
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.learning.adapters import LoraSpec

TEXTS = [t[:40] for t in corpus(10, seed=5)]


def _profile(tiny, state_dir, fleet_key: str, **kw) -> DeviceProfile:
    return DeviceProfile(
        device_id="d",
        target="tiny-target-a",
        target_model=str(tiny["tiny-target-a"]),
        drafter=str(tiny["tiny-drafter"]),
        prompts=TEXTS[:4],
        heldout=TEXTS[4:7],
        state_dir=state_dir,
        prompts_per_round=4,
        generation=GenerationConfig(max_new_tokens=12),
        online=OnlineConfig(interval=2, lr=1e-2),
        fleet_key=fleet_key,
        **kw,
    )


def _session(engine: Engine, target: str, state_dir) -> DeviceSession:
    return DeviceSession(engine, target_name=target, state_dir=state_dir, online=OnlineConfig(interval=2, lr=1e-2))


@pytest.fixture
def served(tiny, tmp_path):
    """A registry, a device served by a running service (its profile offers target b), and a
    copy of the device to run the same operations in-process; yields a dict of them."""
    reg = TargetRegistry(tmp_path / "coord")
    reg.register("tiny-target-a", str(tiny["tiny-target-a"]), str(tiny["tiny-drafter"]), LoraSpec(rank=2))
    offers = {"tiny-target-b": str(tiny["tiny-target-b"])}
    profile = _profile(tiny, tmp_path / "dev", reg.public_key(), offers=offers)
    profile.save()
    reference = FleetDevice(_profile(tiny, tmp_path / "ref", reg.public_key()), EnginePool("fp32", "fp32"))
    engine = Engine.load(profile.drafter, profile.target_model, "fp32", drafter_weights="fp32", progress=False)
    token = owner_token.load_or_create(tmp_path / "dev" / owner_token.TOKEN_FILE)
    service = GenerationService(_session(engine, profile.target_model, tmp_path / "dev"), owner=token)
    fleet = DeviceFleetService(service, tmp_path / "dev", token, dtype="fp32")
    server, port = serve(service, "127.0.0.1:0", fleet=fleet)
    try:
        yield {
            "reg": reg,
            "service": service,
            "fleet": fleet,
            "port": port,
            "token": token,
            "device": served_device(tmp_path / "dev", f"127.0.0.1:{port}"),
            "reference": reference,
        }
    finally:
        server.stop(grace=None).wait()
        service.close()


def _receive(device, state) -> int:
    return device.receive(
        state.spec, state.manifest_blob, state.adapter_blob, state.cache_blob, state.signature
    ).version


def test_a_served_round_equals_the_round_in_process_and_loads_no_model(served, monkeypatch):
    device, reference, service = served["device"], served["reference"], served["service"]
    state = served["reg"].load("tiny-target-a")
    assert _receive(reference, state) == 0
    ref_tensors, ref_learned, ref_metrics = reference.train_round(1)
    ref_eval = reference.evaluate(fixed_k=2, adaptive=False)

    def no_load(*args, **kwargs):
        raise AssertionError("a served device must not load a model")

    monkeypatch.setattr(Engine, "load", no_load)  # neither the proxy nor the service loads one
    status = device.status()
    assert status["device"] == "d" and status["state-version"] == -1 and status["can-serve"] == "tiny-target-b"
    assert _receive(device, state) == 0 and device.status()["state-version"] == 0
    tensors, learned, metrics = device.at_round(1).train_round(1)
    assert sorted(tensors) == sorted(ref_tensors) and all(torch.equal(tensors[k], ref_tensors[k]) for k in tensors)
    assert learned == ref_learned
    assert {k: v for k, v in metrics.items() if k != "update-s"} == {
        k: v for k, v in ref_metrics.items() if k != "update-s"
    }
    assert isinstance(metrics["trained-tokens"], int) and metrics["trained-tokens"] > 0
    evaluated = device.evaluate(fixed_k=2, adaptive=False)
    assert {k: v for k, v in evaluated.items() if k != "eval-s"} == {k: v for k, v in ref_eval.items() if k != "eval-s"}
    # the service serves the state the round trained (saved by the round, loaded again after it)
    session = service.session
    held = session.adapters.state_dict(session.target)
    assert all(torch.equal(held[k], tensors[k]) for k in tensors)
    assert session.adapters.spec == LoraSpec(rank=2)  # it adopted the fleet's LoRA settings
    # and answers requests as before: greedy output equal to the target alone
    stub = gpb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{served['port']}"))
    for prompt in TEXTS[7:9]:
        reply = stub.Generate(gpb.GenerateRequest(prompt=prompt, max_new_tokens=16), timeout=60)
        assert reply.text == session.engine.generate(prompt, GenerationConfig(max_new_tokens=16), method="ar").text
    assert list(served["fleet"].pool._engines.values()) == [session.engine]


def test_only_the_owner_may_call_and_refusals_are_one_line(served, tmp_path):
    port, state = served["port"], served["reg"].load("tiny-target-a")
    stub = fpb_grpc.DeviceFleetStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    for metadata in (None, owner_token.metadata("0" * 64)):
        with pytest.raises(grpc.RpcError) as err:
            stub.Train(fpb.FleetQuery(round=1), metadata=metadata, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    device = served["device"]
    with pytest.raises(StateMismatch, match="checksum"):
        device.receive(
            state.spec, state.manifest_blob, state.adapter_blob[:-1] + b"!", state.cache_blob, state.signature
        )
    with pytest.raises(StateMismatch, match="holds no global state") as err:
        device.train_round(1)
    assert "\n" not in str(err.value)
    with pytest.raises(StateMismatch, match="cannot serve"):
        device.switch("tiny-target-c")
    # a profile naming another pair than the one served is refused, not loaded beside it
    other = DeviceProfile.load(tmp_path / "dev")
    from dataclasses import replace

    replace(other, state_dir=tmp_path / "dev", target_model=str(tmp_path / "elsewhere")).save()
    with pytest.raises(StateMismatch, match="this service serves"):
        device.status()
    stopped = ServedDevice(other, "127.0.0.1:1", served["token"])
    with pytest.raises(ServiceUnavailable, match="does not answer"):
        stopped.status()
    with pytest.raises(ValueError, match="loopback"):
        ServedDevice(other, "10.0.0.1:50051", served["token"])


def test_a_rollout_switches_the_served_target_live(served, tiny):
    device, service = served["device"], served["service"]
    old_engine, old_adapters = service.session.engine, service.session.adapters
    status = device.switch("tiny-target-b").status()
    assert status["target"] == "tiny-target-b" and status["can-serve"] == "tiny-target-a"
    session = service.session
    assert session.target == str(tiny["tiny-target-b"]) and session.engine is not old_engine
    assert session.engine.drafter is old_engine.drafter  # one drafter, shared, with one set of adapters
    assert session.adapters is old_adapters and len(session.adapters.names) == 2  # one adapter per target
    assert list(served["fleet"].pool._engines.values()) == [session.engine]  # target a is dropped
    stub = gpb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{served['port']}"))
    reply = stub.Generate(gpb.GenerateRequest(prompt=TEXTS[0], max_new_tokens=16), timeout=60)
    assert reply.text == session.engine.generate(TEXTS[0], GenerationConfig(max_new_tokens=16), method="ar").text
    assert json.loads(json.dumps(status)) == status


def test_the_supernode_app_delegates_when_its_node_config_names_the_service(served, tmp_path):
    from types import SimpleNamespace

    from omnidraft.client.supernode import JoinSettings
    from omnidraft.client.supernode_app import device_from_node_config

    settings = JoinSettings(
        superlink="127.0.0.1:9092",
        state_dir=tmp_path / "dev",
        root_certificates=None,
        private_key=None,
        service=f"127.0.0.1:{served['port']}",
        service_token=str(tmp_path / "dev" / owner_token.TOKEN_FILE),
    )
    assert 'service="127.0.0.1:' in settings.node_config()
    config = {"state-dir": str(tmp_path / "dev"), "service": settings.service, "service-token": settings.service_token}
    device = device_from_node_config(SimpleNamespace(node_config=config))
    assert isinstance(device, ServedDevice) and device.status()["device"] == "d"
