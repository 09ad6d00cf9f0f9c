"""A real deployment: TLS/node-key material (``fleet init``), the gateway that serves devices the
Fleet API only, node keys a device makes itself, the deployment commands' one-line errors, the
deployed ServerApp's run config, and the loopback federation through Flower's own
``flower-superlink`` / ``flower-supernode`` with TLS and SuperNode authentication
(``deploy/loopback.py``). The device's side of a deployment is in test_deployed_device.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from omnidraft.cli import main as cli
from omnidraft.coordinator import deployment
from omnidraft.coordinator.superlink_app import config_from_run

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


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # a taken port: no thread traceback
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
        with pytest.raises(OSError, match="did not start on .*address already in use"):  # the port is taken: one line
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


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_gateway_without_its_certificate_says_which_file_in_one_line(tmp_path):
    from omnidraft.coordinator.fleet_gateway import serve_gateway

    assert cli(["fleet", "init", "--root", str(tmp_path / "c"), "--superlink", "127.0.0.1:9"]) == 0
    pki = deployment.Deployment(tmp_path / "c").pki
    missing = tmp_path / "gone.crt"
    with pytest.raises(OSError, match=f"did not start on 127.0.0.1:0: no file {missing}$"):
        serve_gateway(
            "127.0.0.1", 0, "https://127.0.0.1:1", ca_cert=pki.ca_cert, certfile=missing, keyfile=pki.server_key
        )


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
