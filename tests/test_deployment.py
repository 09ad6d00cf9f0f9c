"""A real deployment: TLS/node-key material (``fleet init``), the deployed ServerApp's run config,
the request log and the state directory that ``device serve`` and a SuperNode share, and the
loopback federation through Flower's own ``flower-superlink`` / ``flower-supernode`` with TLS
and SuperNode authentication (``deploy/loopback.py``)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from omnidraft.benchmarks.tiny_models import build_pair, corpus
from omnidraft.cli import main as cli
from omnidraft.client.device_state import DeviceState
from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.request_log import RequestLog
from omnidraft.client.session import DeviceSession
from omnidraft.client.state_key import StateCipher
from omnidraft.coordinator import deployment
from omnidraft.coordinator.superlink_app import config_from_run
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.learning.adapters import LoraSpec
from omnidraft.shared.vocab.ngram_cache import NgramCache

REPO = Path(__file__).resolve().parent.parent


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_fleet_init_creates_a_ca_a_server_certificate_and_node_keys(tmp_path, capsys):
    root = tmp_path / "coord"
    assert (
        cli(
            [
                "fleet",
                "init",
                "--root",
                str(root),
                "--superlink",
                "10.0.0.5:9092",
                "--nodes",
                "2",
                "--node",
                "kiosk-7",
                "--san",
                "fleet.example",
            ]
        )
        == 0
    )
    pki = deployment.Deployment(root).pki
    assert mode(pki.root) == 0o700 and mode(pki.root / "nodes") == 0o700
    for key in (pki.ca_key, pki.server_key, pki.node_key("node0"), pki.node_key("kiosk-7")):
        assert mode(key) == 0o600
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"10.0.0.5", "127.0.0.1"}
    assert set(san.get_values_for_type(x509.DNSName)) == {"fleet.example", "localhost"}
    assert pki.nodes() == ["kiosk-7", "node0", "node1"]
    public = pki.node_public_key("node0").read_bytes()
    assert public.startswith(b"ecdsa-sha2-nistp384 ")
    private = serialization.load_ssh_private_key(pki.node_key("node0").read_bytes(), password=None)
    assert (
        private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        == public.rsplit(b" ", 1)[0]
    )
    config = (root / "flwr" / "config.toml").read_text()  # the operator's CLI: the loopback SuperLink
    assert 'address = "127.0.0.1:9093"' in config and str(pki.ca_cert.resolve()) in config
    # again: the CA and the keys are kept, only the new node is added
    before = pki.ca_cert.read_bytes(), pki.node_key("node0").read_bytes()
    assert cli(["fleet", "init", "--root", str(root), "--superlink", "10.0.0.5:9092", "--node", "node9"]) == 0
    assert (pki.ca_cert.read_bytes(), pki.node_key("node0").read_bytes()) == before
    assert "created pki/nodes/node9, pki/nodes/node9.pub" in capsys.readouterr().out
    cmd = deployment.Deployment(root).superlink_command()  # on loopback only, behind the gateway
    assert "--enable-supernode-auth" in cmd and cmd[cmd.index("--port") + 1] == "9093"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and deployment.Deployment(root).address == "10.0.0.5:9092"
    assert deployment.Deployment(root).register_node_command("node1")[-3:] == ["fleet", "--name", "node1"]


def test_the_gateway_serves_the_fleet_api_and_refuses_the_control_api(tmp_path):
    """What devices reach (the gateway on the devices' address) forwards the Fleet API to the
    loopback SuperLink byte for byte, headers included (SuperNode authentication still happens
    there), and refuses the Control and Runtime APIs and anything else with 403, over TLS with
    the fleet's certificate."""
    import socket
    import ssl
    import threading
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.error import HTTPError

    from omnidraft.coordinator.fleet_gateway import serve_gateway

    assert cli(["fleet", "init", "--root", str(tmp_path / "c"), "--superlink", "127.0.0.1:9"]) == 0
    pki = deployment.Deployment(tmp_path / "c").pki
    seen = []

    class Upstream(BaseHTTPRequestHandler):  # stands in for the SuperLink: echoes what it got
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, self.headers.get("x-node-signature"), body))
            self.send_response(200)
            self.send_header("Content-Type", "application/protobuf")
            self.end_headers()
            self.wfile.write(b"reply:" + body)

        def log_message(self, *args):
            pass

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    upstream.socket = context.wrap_socket(upstream.socket, server_side=True)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gateway, thread = serve_gateway(
        "127.0.0.1",
        port,
        f"https://127.0.0.1:{upstream.server_address[1]}",
        ca_cert=pki.ca_cert,
        certfile=pki.server_cert,
        keyfile=pki.server_key,
    )
    client = ssl.create_default_context(cafile=str(pki.ca_cert))

    def post(path: str, body: bytes = b"\x08\x01", method: str = "POST"):
        req = urllib.request.Request(
            f"https://127.0.0.1:{port}{path}",
            data=body if method == "POST" else None,
            method=method,
            headers={"X-Node-Signature": "sig", "Content-Type": "application/protobuf"},
        )
        try:
            with urllib.request.urlopen(req, context=client, timeout=10) as reply:
                return reply.status, reply.read()
        except HTTPError as exc:
            return exc.code, exc.read()

    try:
        assert post("/v1/fleet/pull-messages") == (200, b"reply:\x08\x01")
        assert seen == [("/v1/fleet/pull-messages", "sig", b"\x08\x01")]
        for path, method in (
            ("/v1/control/start-run", "POST"),
            ("/v1/control/create-node-cli", "POST"),
            ("/v1/runtime/pull-task-input", "POST"),
            ("/v1/fleet/../control/start-run", "POST"),
            ("/v1/fleet/pull-messages", "GET"),
            ("/", "GET"),
            ("/docs", "GET"),
        ):
            status, _ = post(path, method=method)
            assert status in (403, 404), (path, method, status)
        assert len(seen) == 1  # nothing but the Fleet API reached the SuperLink
        with pytest.raises(OSError, match="did not start"):  # the port is taken: a clear error
            serve_gateway(
                "127.0.0.1",
                port,
                "https://127.0.0.1:1",
                ca_cert=pki.ca_cert,
                certfile=pki.server_cert,
                keyfile=pki.server_key,
            )
    finally:
        gateway.should_exit = True
        thread.join(timeout=10)
        upstream.shutdown()


def test_a_device_makes_its_own_key_and_the_coordinator_keeps_only_the_public_half(tmp_path, capsys, monkeypatch):
    """``device keygen`` writes the device's pair (private 0600, kept when run again);
    ``fleet register-node --public-key`` stores only the public line, refuses a private key,
    another key type or a second key under the same name, each in one line."""
    key = tmp_path / "board" / "node.key"
    assert cli(["device", "keygen", "--key", str(key), "--name", "board-01"]) == 0
    public = capsys.readouterr().out.strip()
    assert public.startswith("ecdsa-sha2-nistp384 ") and public.endswith(" board-01")
    assert mode(key) == 0o600 and (tmp_path / "board" / "node.key.pub").read_text().strip() == public
    serialization.load_ssh_private_key(key.read_bytes(), password=None)
    assert cli(["device", "keygen", "--key", str(key)]) == 0  # kept, not replaced
    assert capsys.readouterr().out.strip() == public
    root = tmp_path / "coord"
    assert cli(["fleet", "init", "--root", str(root), "--superlink", "127.0.0.1:9092"]) == 0
    ran = []
    monkeypatch.setattr(
        "omnidraft.shared.util.processes.run_foreground", lambda cmd, env=None, **kw: ran.append(cmd) or 0
    )
    assert cli(["fleet", "register-node", "board-01", "--public-key", str(key) + ".pub", "--root", str(root)]) == 0
    pki = deployment.Deployment(root).pki
    assert pki.node_public_key("board-01").read_text().strip() == public and not pki.node_key("board-01").exists()
    assert ran[-1][:4] == ["flwr", "supernode", "register", str(pki.node_public_key("board-01"))]
    other = tmp_path / "other.key"
    assert cli(["device", "keygen", "--key", str(other)]) == 0
    capsys.readouterr()
    for bad, message in (
        (key, "never its private key"),
        (other.with_suffix(".key.pub"), "already has another key"),
        (tmp_path / "board" / "missing.pub", "is not a file"),
    ):
        assert cli(["fleet", "register-node", "board-01", "--public-key", str(bad), "--root", str(root)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    from cryptography.hazmat.primitives.asymmetric import ed25519

    wrong_type = tmp_path / "ed25519.pub"
    wrong_type.write_bytes(
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        + b" someone\n"
    )
    garbage = tmp_path / "garbage.pub"
    garbage.write_text("ecdsa-sha2-nistp384 AAAA-not-base64 someone\n")
    for bad, message in ((wrong_type, "takes an ecdsa-sha2-nistp384 key"), (garbage, "is not an OpenSSH public key")):
        assert cli(["fleet", "register-node", "x", "--public-key", str(bad), "--root", str(root)]) == 2
        assert message in capsys.readouterr().err
    assert cli(["fleet", "register-node", "nobody", "--root", str(root)]) == 2
    assert "--public-key" in capsys.readouterr().err
    assert len(ran) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["fleet", "init", "--superlink", "nohost"], "give host:port"),
        (["fleet", "init", "--superlink", "h:9", "--control-port", "9"], "other than the devices'"),
        (["fleet", "init", "--superlink", "h:1", "--node", "bad name"], "node name"),
        (["fleet", "superlink"], "run omnidraft fleet init first"),
        (["fleet", "run", "--secagg", "--aggregation", "median"], "use --aggregation fedavg with --secagg"),
        (
            ["device", "join", "--drafter", "d", "--target", "t", "--superlink", "h:1", "--state-dir", "s"],
            "give --cert",
        ),
        (
            [
                "device",
                "join",
                "--drafter",
                "d",
                "--target",
                "t",
                "--superlink",
                "h:1",
                "--state-dir",
                "s",
                "--cert",
                "/nonexistent/ca.crt",
                "--key",
                "/nonexistent/k",
            ],
            "is not a file",
        ),
        (
            [
                "device",
                "join",
                "--drafter",
                "d",
                "--target",
                "t",
                "--superlink",
                "h:1",
                "--state-dir",
                "s",
                "--cert",
                __file__,
                "--key",
                __file__,
            ],
            "give --fleet-key",
        ),  # TLS without the fleet key: unsigned states
        (
            [
                "device",
                "join",
                "--drafter",
                "d",
                "--target",
                "t",
                "--superlink",
                "h:1",
                "--state-dir",
                "s",
                "--insecure",
                "--fleet-key",
                "zz",
            ],
            "--fleet-key",
        ),
    ],
)
def test_deployment_commands_reject_bad_input_in_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert cli(argv + (["--root", str(tmp_path / "c")] if argv[0] == "fleet" else [])) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_run_config_of_the_deployed_server_app(tmp_path):
    (tmp_path / "coordinator.json").write_text(json.dumps({"round": 3}))
    config = config_from_run(
        {"fleet-dir": str(tmp_path), "rounds": 2, "fraction": 0.5, "k": 3, "clip-norm": 0.0, "aggregation": "median"},
        tmp_path,
    )
    assert config.rounds == 5  # two more after the three finished
    assert config.fraction == 0.5 and config.release.k == 3 and config.aggregation.clip_norm is None
    assert config.aggregation.method == "median"
    with pytest.raises(ValueError, match="unknown run config key.*round-count"):
        config_from_run({"round-count": 2}, tmp_path)
    with pytest.raises(ValueError, match="fraction"):
        config_from_run({"fraction": 1.5}, tmp_path)
    with pytest.raises(ValueError, match="bad run config"):
        config_from_run({"rounds": "many"}, tmp_path)


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


def test_loopback_deployment_with_tls_and_node_authentication(tmp_path):
    """Flower's SuperLink with TLS + SuperNode auth, two SuperNodes whose ClientApps hand the
    rounds to their devices' generation services (tiny models, loaded once per device), 2 rounds
    of the simulation's ServerApp; an unregistered device is refused."""
    env = {**os.environ, "OMNIDRAFT_TINY_DIR": str(tmp_path / "models")}
    out = tmp_path / "loop"
    done = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "loopback.py"), "--out", str(out), "--rounds", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["version-before"] == 0 and summary["version-after"] == 2
    assert summary["unregistered"]["exit"] == 2 and "refused this device's key" in summary["unregistered"]["error"]
    # a stranger holding ca.crt reaches only the gateway: no Control API, so no key of its own, no app bundle
    for attempt, path in (("register", "/v1/control/register-node"), ("run", "/v1/control/start-run")):
        tried = summary["stranger"][attempt]
        assert tried["exit"] != 0 and "403 Forbidden" in tried["error"] and path in tried["error"], tried
    assert summary["coordinator-holds-private-keys"] is False  # devices made their own pairs
    rounds = summary["rounds"]
    assert [r["round"] for r in rounds] == [1, 2] and all(r["aggregated"] == 2 and not r["rejected"] for r in rounds)
    assert all(r["trained-tokens"] > 0 and r["uplink-bytes-per-device"] > 0 for r in rounds)
    assert rounds[1]["downlink-bytes-per-device"] < rounds[0]["downlink-bytes-per-device"]  # held parts not resent
    for name, device in summary["devices"].items():
        assert device["round"] == 2 and device["next-prompt"] == 4, name  # trained on its 4 served prompts
        assert device["rounds-served"] == 2 and device["new_tokens"] > 0, name  # the rounds ran in the service
        assert not device["reloaded-round-state"]  # no other process wrote the state
        held = json.loads((out / name / "fleet.json").read_text())
        assert held["tokenizer-sha256"]
    # no device text in anything the coordinator keeps
    served = [p.encode() for p in ("def add(a, b):", "def fetch(url, timeout):", "class Reader:")]
    for path in (out / "coordinator").rglob("*"):
        if path.is_file():  # registry, round history, the SuperLink's database
            assert not any(s in path.read_bytes() for s in served), path


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
