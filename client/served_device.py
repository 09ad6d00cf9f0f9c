"""A device whose models are owned by its generation service: the SuperNode's side of
``client.fleet_service``.

``ServedDevice`` is the ``FleetDevice`` the ClientApp handlers act on when ``omnidraft device
join --service HOST:PORT`` named the device's running ``omnidraft device serve``: what needs the
models (status, switch, receiving a state, a training round, an evaluation) is asked of that
process over loopback with the owner token; what is only files in the state directory (the held
global adapter, the uplink ledger) is read here. The ClientApp process never loads a model.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import torch
from safetensors.torch import load as load_safetensors

from omnidraft.client import owner_token
from omnidraft.client.device_profile import DeviceProfile, cached_profile
from omnidraft.client.fleet_device import FleetDevice, StateMismatch
from omnidraft.proto import device_fleet_pb2 as pb
from omnidraft.proto import device_fleet_pb2_grpc as pb_grpc
from omnidraft.proto import fleet_pb2

MAX_MESSAGE_BYTES = 256 * 2**20  # a global state (adapter and cache) rides in one message
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]  # both ends of the channel
CALL_TIMEOUT_S = 3600.0  # a training round on a slow board; the service runs one operation at a time


class ServiceUnavailable(ConnectionError):
    """The device's generation service did not answer (one line)."""


class ServedDevice(FleetDevice):
    """``FleetDevice`` whose model work runs in the device service at ``address`` (see the
    module docstring). ``token``: the owner token the service was started with."""

    def __init__(self, profile: DeviceProfile, address: str, token: str, round_: int = 1) -> None:
        if not owner_token.is_loopback(address):
            raise ValueError(f"the device service must be on this device's loopback address, not {address!r}")
        super().__init__(profile, pool=None)
        self.address = address
        self.token = token
        self.round = round_
        self._vocab_size: int | None = None

    def at_round(self, round_: int) -> ServedDevice:
        return ServedDevice(self.profile.at_round(round_), self.address, self.token, round_)

    def _ask(self, method: str, request):
        with grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
            call = getattr(pb_grpc.DeviceFleetStub(channel), method)
            try:
                return call(request, metadata=owner_token.metadata(self.token), timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise StateMismatch(details) from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    raise ServiceUnavailable(
                        f"the device service at {self.address} does not answer: start "
                        f"omnidraft device serve on this state directory"
                    ) from None
                raise ServiceUnavailable(f"the device service at {self.address}: {code.name}: {details}") from None

    @property
    def engine(self):
        raise RuntimeError("this device's models are in its generation service (ServedDevice)")

    @property
    def target_vocab_size(self) -> int:
        if self._vocab_size is None:
            raise RuntimeError("the target's vocabulary size comes with a training round's reply")
        return self._vocab_size

    def status(self) -> dict:
        return json.loads(self._ask("Status", pb.FleetQuery(round=self.round)).json)

    def switch(self, target: str) -> ServedDevice:
        self._ask("Switch", pb.FleetQuery(round=self.round, target=target))
        return ServedDevice(cached_profile(self.dir).at_round(self.round), self.address, self.token, self.round)

    def receive(
        self,
        spec: fleet_pb2.TargetSpec,
        manifest_blob: bytes,
        adapter_blob: bytes | None,
        cache_blob: bytes | None,
        signature: bytes = b"",
    ) -> fleet_pb2.StateManifest:
        request = pb.GlobalStateParts(
            round=self.round, spec=spec.SerializeToString(), manifest=manifest_blob, signature=signature or b""
        )
        if adapter_blob is not None:
            request.adapter = adapter_blob
        if cache_blob is not None:
            request.cache = cache_blob
        self._ask("Receive", request)
        manifest = fleet_pb2.StateManifest()
        manifest.ParseFromString(manifest_blob)  # the service parsed and checked it
        return manifest

    def train_round(self, round_: int) -> tuple[dict[str, torch.Tensor], set[int], dict]:
        reply = self._ask("Train", pb.FleetQuery(round=round_))
        self._vocab_size = int(reply.target_vocab_size)
        return load_safetensors(reply.adapter), set(reply.learned), json.loads(reply.metrics_json)

    def evaluate(
        self,
        *,
        use_global: bool = True,
        measure_ar: bool = False,
        fixed_k: int = 0,
        adaptive: bool = True,
        fresh: bool = False,
    ) -> dict:
        reply = self._ask(
            "Evaluate",
            pb.EvaluateQuery(
                round=self.round,
                use_global=use_global,
                measure_ar=measure_ar,
                fixed_k=fixed_k,
                adaptive=adaptive,
                fresh=fresh,
            ),
        )
        return json.loads(reply.metrics_json)


def served_device(state_dir: str | Path, address: str, token_file: str | Path | None = None) -> ServedDevice:
    """The device in ``state_dir`` served at ``address``; ``token_file``: the owner token
    (default ``<state_dir>/owner.token``, the one ``device serve`` creates)."""
    token = owner_token.read(token_file or Path(state_dir) / owner_token.TOKEN_FILE)
    return ServedDevice(cached_profile(state_dir), address, token)
