"""The device's fleet operations served by the process that owns its models (``omnidraft.v1.DeviceFleet``).

``omnidraft device serve`` loads the drafter and the target once. Flower's SuperNode starts a
fresh ClientApp process for every message; without this service each of those processes loads
(and int8-packs) the models again, and during a round the device holds them twice. With
``omnidraft device join --service HOST:PORT`` the ClientApp (``client.served_device``) asks the
serving process instead: every operation here runs ``FleetDevice`` on the service's own engine
and drafter adapters (``EnginePool.holding``), with the engine lent by the generation service
(``GenerationService.lend_engine``: requests wait, the served state is saved before and loaded
after). A rollout's ``Switch`` loads the new target, sharing the drafter, serves it from the next
request on and drops the old one.

Only the owner may call: every call must present the owner token (``client.owner_token``), on
loopback too. A refused or failed operation aborts with a one-line reason.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from safetensors.torch import save as save_safetensors

from omnidraft.client import owner_token
from omnidraft.client.device_profile import cached_profile
from omnidraft.client.engine_pool import EnginePool
from omnidraft.client.fleet_device import FleetDevice, StateMismatch
from omnidraft.client.service import GenerationService
from omnidraft.proto import device_fleet_pb2 as pb
from omnidraft.proto import device_fleet_pb2_grpc as pb_grpc

log = logging.getLogger("omnidraft.service")


class DeviceFleetService(pb_grpc.DeviceFleetServicer):
    """The servicer (see the module docstring). ``dtype``: the precision a rollout's new target
    loads at (the served one's)."""

    def __init__(self, service: GenerationService, state_dir: str | Path, owner: str, dtype: str = "fp32") -> None:
        if not owner:
            raise ValueError("the device's fleet operations need an owner token")
        self.service = service
        self.state_dir = Path(state_dir)
        self.owner = owner
        s = service.session
        self.pool = EnginePool.holding(s.engine, s.target, s.adapters, dtype)

    def _device(self, round_: int) -> FleetDevice:
        """The device this service's state directory describes (``device join`` wrote its
        profile); StateMismatch when it names another target than the one served."""
        try:
            profile = cached_profile(self.state_dir)
        except FileNotFoundError:
            raise StateMismatch(f"{self.state_dir} has no device profile: run omnidraft device join on it") from None
        served = self.service.session.target
        if profile.target_model != served or profile.drafter != self.service.session.drafter_name:
            raise StateMismatch(
                f"the device joined the fleet with {profile.drafter} -> {profile.target_model}; "
                f"this service serves {self.service.session.drafter_name} -> {served}"
            )
        return FleetDevice(profile, self.pool).at_round(round_ or 1)

    def _call(
        self, context: grpc.ServicerContext, name: str, round_: int, operation: Callable[[], object], lend: bool = True
    ):
        """Run ``operation`` for the owner only, with the engine lent (``lend``: it decodes, trains
        or switches; a status or a received state only reads the tokenizer's digest and writes
        the global state's files, so requests need not wait); a refusal aborts with its reason."""
        if not owner_token.presented_by(context.invocation_metadata(), self.owner):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "the device's fleet operations need the owner token")
        t0 = time.perf_counter()
        try:
            out = self.service.lend_engine(operation) if lend else operation()
        except (StateMismatch, ValueError, OSError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            log.info("fleet %s (round %d) refused: %s", name, round_, reason)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        if name in ("train", "evaluate", "switch"):
            log.info("fleet %s (round %d) ran on the served models: %.1f s", name, round_, time.perf_counter() - t0)
        return out

    def Status(self, request: pb.FleetQuery, context: grpc.ServicerContext) -> pb.DeviceStatus:
        return pb.DeviceStatus(
            json=json.dumps(
                self._call(context, "status", request.round, lambda: self._device(request.round).status(), lend=False)
            )
        )

    def Switch(self, request: pb.FleetQuery, context: grpc.ServicerContext) -> pb.DeviceStatus:
        def switch() -> dict:
            before = self._device(request.round)
            device = before.switch(request.target)
            model = device.profile.target_model
            if model != self.service.session.target:
                log.info("rollout: serving %s from now on (was %s)", model, self.service.session.target)
                self.service.replace_session(self.service.session.switched(device.engine, model))
                self.pool.drop(before.profile.drafter, before.profile.target_model)
            return device.status()

        return pb.DeviceStatus(json=json.dumps(self._call(context, "switch", request.round, switch)))

    def Receive(self, request: pb.GlobalStateParts, context: grpc.ServicerContext) -> pb.Received:
        from omnidraft.proto import fleet_pb2

        def receive() -> None:
            spec = fleet_pb2.TargetSpec()
            spec.ParseFromString(request.spec)
            self._device(request.round).receive(
                spec,
                request.manifest,
                request.adapter if request.HasField("adapter") else None,
                request.cache if request.HasField("cache") else None,
                request.signature,
            )

        self._call(context, "receive", request.round, receive, lend=False)
        return pb.Received()

    def Train(self, request: pb.FleetQuery, context: grpc.ServicerContext) -> pb.TrainReply:
        def train() -> pb.TrainReply:
            device = self._device(request.round)
            tensors, learned, metrics = device.train_round(request.round)
            return pb.TrainReply(
                adapter=save_safetensors({k: v.contiguous() for k, v in tensors.items()}),
                learned=sorted(learned),
                metrics_json=json.dumps(metrics),
                target_vocab_size=device.target_vocab_size,
            )

        return self._call(context, "train", request.round, train)

    def Evaluate(self, request: pb.EvaluateQuery, context: grpc.ServicerContext) -> pb.EvaluateReply:
        def evaluate() -> dict:
            return self._device(request.round).evaluate(
                use_global=request.use_global,
                measure_ar=request.measure_ar,
                fixed_k=request.fixed_k,
                adaptive=request.adaptive,
                fresh=request.fresh,
            )

        return pb.EvaluateReply(metrics_json=json.dumps(self._call(context, "evaluate", request.round, evaluate)))


def add_to_server(servicer: DeviceFleetService, server: grpc.Server) -> None:
    pb_grpc.add_DeviceFleetServicer_to_server(servicer, server)
