"""The ``omnidraft`` command line.

    omnidraft models list | pull NAME... [--format gguf] | info NAME
    omnidraft generate --drafter NAME --target NAME --prompt TEXT [...]
    omnidraft bench --drafter NAME --target NAME --dataset humaneval|PATH.jsonl [...]
    omnidraft adapt --drafter NAME --target NAME --dataset humaneval|PATH.jsonl [...]
    omnidraft profile --drafter NAME --target NAME [...]
    omnidraft fleet register-target NAME --model NAME|DIR [--root DIR] | fleet status [--root DIR]
    omnidraft fleet init --superlink HOST:PORT --node NAME ... | fleet superlink | fleet register-node NAME [--public-key F]
    omnidraft fleet run [--rounds N ...] | fleet rollback NAME [--to V] | fleet public-key
    omnidraft device serve --drafter NAME --target NAME --state-dir DIR [--listen ADDR]
    omnidraft device join --superlink HOST:PORT --cert CA.crt --key NODE_KEY --drafter NAME --target NAME --state-dir DIR
    omnidraft device ask "PROMPT" [--server ADDR] [--stream] | device health [--server ADDR] | device keygen --key PATH

Every user error prints one line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class UsageError(Exception):
    """A bad input the user can fix; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise UsageError(f"{self.prog}: {message}")


def dtype_arg(sp) -> None:
    sp.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "int8", "fp64"],
        help="target precision; auto = the cheapest verification measured on this machine "
        "(measured once, cached under $OMNIDRAFT_HOME/profiles); fp64 = exact-arithmetic "
        "reference for checking losslessness (slow)",
    )


def _version() -> str:
    """The installed distribution's version ("unknown" when run from a tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omnidraft-fleet")
    except PackageNotFoundError:
        return "unknown"


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="omnidraft", description="Cross-vocabulary speculative decoding on the device.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    models = sub.add_parser("models", help="the model catalog")
    msub = models.add_subparsers(dest="action", required=True, parser_class=_Parser)
    msub.add_parser("list", help="list catalog models").add_argument("--json", action="store_true")
    pull = msub.add_parser("pull", help="download, verify and store models")
    pull.add_argument("names", nargs="+", metavar="NAME")
    pull.add_argument("--force", action="store_true", help="pull again even if present")
    pull.add_argument(
        "--format",
        choices=("safetensors", "gguf"),
        default=None,
        help="safetensors: converted to float32, quick to load; gguf: the GGUF as shipped, "
        "a sixth of the disk, packed from it layer by layer at load (a device's footprint). "
        "Default: the format a model is pulled in, else $OMNIDRAFT_MODEL_FORMAT, else "
        "safetensors",
    )
    info = msub.add_parser("info", help="show a model's pins and on-disk state")
    info.add_argument("name")

    def pair(sp):
        sp.add_argument("--drafter", required=True, help="catalog name or local HF directory")
        sp.add_argument("--target", required=True, help="catalog name or local HF directory")
        dtype_arg(sp)
        sp.add_argument(
            "--drafter-weights",
            default="int8",
            choices=["int8", "bf16", "fp32", "hf"],
            help="drafter kernels (never changes the output): fast runner in int8/bf16/fp32, "
            "or the plain transformers forward (hf)",
        )
        sp.add_argument("--max-new-tokens", type=int, default=128)
        sp.add_argument("--k-max", type=int, default=10, help="most drafter tokens per round")
        sp.add_argument(
            "--draft-stop",
            default="auto",
            choices=["auto", "cost", "confidence"],
            help="what each round drafts: cost = the throughput rule (a plain target step, a "
            "model-free draft from the device's own text or a drafter draft, whichever "
            "commits the most tokens per second by this machine's cached costs and the "
            "counted acceptance); confidence = always the drafter, stopping under the "
            "--confidence threshold; auto = cost (confidence where no profile exists)",
        )
        sp.add_argument(
            "--lookup",
            default="history",
            choices=["history", "context", "off"],
            help="model-free drafts looked up in this generation and the device's recent "
            "ones (history, default), this generation only (context), or none (off)",
        )
        sp.add_argument(
            "--confidence",
            type=float,
            default=0.4,
            help="with --draft-stop confidence: stop drafting when the drafter's top probability falls below this",
        )
        sp.add_argument(
            "--translate",
            default="text",
            choices=["text", "ngram"],
            help="drafted block -> target tokens: the target tokenizer on the drafted "
            "text (default) or the paper's n-gram-cache merge with the direct map",
        )
        sp.add_argument(
            "--state-dir", default=None, help="device state directory (adapter, head, n-gram cache per target)"
        )
        sp.add_argument(
            "--state-key",
            default=os.environ.get("OMNIDRAFT_STATE_KEY"),
            help="key file that encrypts the device state at rest (AES-256-GCM; created "
            "0600 if missing; keep it outside --state-dir; default $OMNIDRAFT_STATE_KEY)",
        )
        sp.add_argument("--seed-cache", action="store_true", help="warm-start the n-gram cache from the two tokenizers")

    gen = sub.add_parser("generate", help="generate text for one prompt")
    pair(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--method", default="omnidraft", choices=["omnidraft", "ar"])
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="apply the target's chat template")
    gen.add_argument("--json", action="store_true")

    bench = sub.add_parser("bench", help="compare ar, uag, pld, omnidraft, llamacpp and llamacpp-pld on a dataset")
    pair(bench)
    bench.add_argument(
        "--dataset",
        required=True,
        help="humaneval, pydoc, codebase:<package> (function heads of an installed package) or a JSONL file with a 'prompt' field",
    )
    bench.add_argument("--limit", type=int, default=None)
    bench.add_argument("--methods", default="ar,uag,pld,omnidraft")
    bench.add_argument("--out", default=None, help="write the JSON report here")
    adapt = sub.add_parser("adapt", help="learn online on a prompt stream; held-out speed before/after")
    pair(adapt)
    adapt.add_argument(
        "--dataset",
        required=True,
        help="humaneval, pydoc, codebase:<package> (function heads of an installed package) or a JSONL file with a 'prompt' field",
    )
    adapt.add_argument("--limit", type=int, default=None)
    adapt.add_argument("--train-fraction", type=float, default=0.8)
    adapt.add_argument("--out", default=None, help="write the JSON report here")
    adapt.add_argument("--plot", default=None, help="write the learning curve PNG here")
    adapt.add_argument("--interval", type=int, default=8, help="prompts per drafter update")
    adapt.add_argument("--lr", type=float, default=1e-4, help="adapter learning rate (AdamW, constant)")
    adapt.add_argument(
        "--steps-per-update",
        type=int,
        default=8,
        help="optimizer steps per update (the buffer split into this many batches)",
    )
    adapt.add_argument("--lora-rank", type=int, default=32)
    adapt.add_argument("--lora-modules", default="all", help="all | attn | mlp | qv")
    adapt.add_argument(
        "--loss",
        default="seq",
        choices=["seq", "hybrid", "dm", "ngram", "none"],
        help="seq = NLL of every drafter token of the target's output; hybrid = L_DM + "
        "lambda L_ngram (the paper's); none = no adapter training (cache only)",
    )
    adapt.add_argument("--lam", type=float, default=0.2, help="n-gram loss weight lambda")
    adapt.add_argument("--dynamic-lambda", action="store_true", help="lambda = p(t) per n-gram token")
    adapt.add_argument("--no-head", action="store_true", help="no learned adaptive drafting")
    adapt.add_argument(
        "--acceptance-k",
        type=int,
        default=4,
        help="also measure held-out acceptance at this fixed draft length (drafter "
        "tokens per round, the paper's protocol) before and after; 0 = skip",
    )
    adapt.add_argument(
        "--ablation",
        action="store_true",
        help="one split, each part in turn: cache only / L_DM / L_DM + lambda L_ngram / L_seq / + head",
    )
    drift = sub.add_parser("drift", help="recovery after a target or domain switch, with and without the n-gram cache")
    drift.add_argument("--drafter", required=True)
    drift.add_argument(
        "--stream", required=True, help="phases TARGET:DATASET:PROMPTS,... (dataset: humaneval, pydoc or a JSONL file)"
    )
    dtype_arg(drift)
    drift.add_argument("--drafter-weights", default="int8", choices=["int8", "bf16", "fp32", "hf"])
    drift.add_argument("--translate", default="ngram", choices=["text", "ngram"])
    drift.add_argument("--max-new-tokens", type=int, default=64)
    drift.add_argument("--k-max", type=int, default=10)
    drift.add_argument("--confidence", type=float, default=0.4)
    drift.add_argument("--out", default=None)
    drift.add_argument("--plot", default=None)
    prof = sub.add_parser("profile", help="measure target and drafter forward costs on this machine")
    prof.add_argument("--drafter", required=True)
    prof.add_argument("--target", required=True)
    dtype_arg(prof)
    prof.add_argument("--drafter-weights", default="int8", choices=["int8", "bf16", "fp32", "hf"])
    prof.add_argument(
        "--blocks", default=None, help="target block sizes in tokens (default: the decoder's profile, 1..16)"
    )
    prof.add_argument("--refresh", action="store_true", help="measure again instead of reading the cache")
    prof.add_argument("--json", action="store_true")

    doctor = sub.add_parser("doctor", help="this machine's CPU, native kernels, models on disk and what is missing")
    doctor.add_argument("--json", action="store_true")

    device = sub.add_parser("device", help="the on-device generation service (gRPC) and its client")
    dsub = device.add_subparsers(dest="action", required=True, parser_class=_Parser)
    serve = dsub.add_parser("serve", help="serve omnidraft.v1.Generation over gRPC, learning between requests")
    pair(serve)
    serve.add_argument(
        "--listen",
        default="127.0.0.1:50051",
        help="host:port (default loopback only; another address needs --tls-cert/--tls-key and serves the owner only)",
    )
    serve.add_argument(
        "--owner-token",
        default=None,
        help="file with the owner's token (created if missing; default <state-dir>/owner.token): only "
        "requests presenting it teach the device (learning, the request log its rounds train on)",
    )
    serve.add_argument("--tls-cert", default=None, help="PEM certificate chain for a TLS listener")
    serve.add_argument("--tls-key", default=None, help="PEM private key for a TLS listener")
    serve.add_argument("--max-queue", type=int, default=8, help="requests waiting or running at once")
    serve.add_argument("--max-prompt-tokens", type=int, default=4096)
    serve.add_argument(
        "--max-new-tokens-limit", type=int, default=1024, help="largest max_new_tokens a request may ask"
    )
    serve.add_argument("--no-learn", action="store_true", help="serve without online learning")
    serve.add_argument("--interval", type=int, default=8, help="generations per adapter update")
    serve.add_argument("--lr", type=float, default=1e-4, help="adapter learning rate")
    serve.add_argument(
        "--keep-prompts",
        type=int,
        default=256,
        help="served prompts kept in the state directory for this device's federated "
        "rounds (never sent; encrypted with --state-key); 0: keep none",
    )
    join = dsub.add_parser("join", help="run this device as a Flower SuperNode of a fleet (TLS + node key)")
    pair(join)
    join.add_argument("--superlink", required=True, help="the SuperLink's host:port")
    join.add_argument("--cert", default=None, help="the fleet's CA certificate (ca.crt from omnidraft fleet init)")
    join.add_argument("--key", default=None, help="this device's private key (nodes/NAME from omnidraft fleet init)")
    join.add_argument("--insecure", action="store_true", help="no TLS and no node key (a test network only)")
    join.add_argument(
        "--fleet-key",
        default=None,
        help="the coordinator's public key (omnidraft fleet public-key); every global state "
        "must carry its signature (required unless --insecure)",
    )
    join.add_argument("--target-name", default=None, help="the target's registry name (default: --target)")
    join.add_argument("--device-id", default=None, help="this device's id in the fleet (default: the key's name)")
    join.add_argument(
        "--offer",
        action="append",
        default=[],
        metavar="NAME=MODEL",
        help="another target this device can run (registry name = catalog name or directory); "
        "a staged rollout (omnidraft fleet rollout NAME) may move the device to it",
    )
    join.add_argument("--prompts-per-round", type=int, default=8, help="served prompts one round trains on")
    join.add_argument("--interval", type=int, default=4, help="generations per adapter update in a round")
    join.add_argument(
        "--service",
        default=None,
        metavar="HOST:PORT",
        help="this device's running omnidraft device serve (loopback): rounds run on its models, "
        "loaded once, instead of loading them for every Flower message",
    )
    join.add_argument(
        "--owner-token",
        default=None,
        help="the service's owner token file (default: STATE_DIR/owner.token, as device serve makes it)",
    )
    join.add_argument(
        "--runtime-port",
        type=int,
        default=9094,
        help="the SuperNode's local Runtime API port (one per SuperNode on a host)",
    )
    join.add_argument("--max-retries", type=int, default=None, help="reconnection attempts before giving up")
    join.add_argument("--cache-mb", type=float, default=0.0, help="n-gram cache memory budget in MB (0: no byte limit)")
    join.add_argument(
        "--train-when",
        default="always",
        choices=["always", "idle", "power", "idle+power"],
        help="when federated rounds may train: idle = no request for --idle-s, power = on mains",
    )
    join.add_argument("--idle-s", type=float, default=300.0, help="seconds without a request that count as idle")
    join.add_argument(
        "--uplink-mb-per-day",
        type=float,
        default=0.0,
        help="most MB federated rounds may send per UTC day (0: no limit)",
    )
    for sp in (serve, join):
        sp.add_argument("--max-threads", type=int, default=0, help="torch threads (0: every core)")
    export = dsub.add_parser("export-adapter", help="write a device's learned adapter as a peft adapter directory")
    export.add_argument(
        "--drafter", required=True, help="catalog name or local HF directory (as the state was saved with)"
    )
    export.add_argument("--target", required=True, help="the target (registry) name the state was saved for")
    export.add_argument("--state-dir", required=True)
    export.add_argument(
        "--state-key", default=os.environ.get("OMNIDRAFT_STATE_KEY"), help="the state's key file, if it is encrypted"
    )
    export.add_argument("--out", required=True, help="directory for adapter_config.json and adapter_model.safetensors")
    keygen = dsub.add_parser(
        "keygen",
        help="make this device's SuperNode key pair (the private key stays here; give the operator the .pub file)",
    )
    keygen.add_argument("--key", required=True, help="private key file to create (the public key goes to KEY.pub)")
    keygen.add_argument("--name", default=None, help="comment in the public key line (default: the host name)")
    ask = dsub.add_parser("ask", help="send one prompt to a running service")
    ask.add_argument("prompt")
    ask.add_argument("--max-new-tokens", type=int, default=0, help="0: the service's default")
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--top-p", type=float, default=1.0)
    ask.add_argument("--seed", type=int, default=None)
    ask.add_argument("--stop", action="append", default=[])
    ask.add_argument("--chat", action="store_true")
    ask.add_argument("--stream", action="store_true", help="print text as it is verified")
    ask.add_argument("--json", action="store_true")
    health = dsub.add_parser("health", help="a running service's status")
    health.add_argument("--json", action="store_true")
    for sp in (ask, health):
        sp.add_argument("--server", default="127.0.0.1:50051")
        sp.add_argument(
            "--owner-token",
            default=None,
            help="the device's owner token file: the request teaches the device (device serve's "
            "--owner-token, default <state-dir>/owner.token)",
        )
        sp.add_argument("--tls-ca", default=None, help="PEM CA certificate of a TLS service")
        sp.add_argument("--timeout", type=float, default=600.0, help="seconds")

    fleet = sub.add_parser("fleet", help="the coordinator's target registry")
    fsub = fleet.add_subparsers(dest="action", required=True, parser_class=_Parser)
    reg = fsub.add_parser(
        "register-target",
        help="create a target's global state (untrained adapter, cache seeded from the two tokenizers)",
    )
    reg.add_argument("name", help="registry name (letters, digits, '.', '_', '-')")
    reg.add_argument("--model", required=True, help="catalog name or local HF directory of the target")
    reg.add_argument("--drafter", default="smollm2-135m", help="the fleet's shared drafter")
    reg.add_argument("--lora-rank", type=int, default=8)
    reg.add_argument("--lora-modules", default="all", choices=["all", "attn", "mlp", "qv"])
    reg.add_argument("--ffa", action="store_true", help="FFA-LoRA: freeze A, train and average only B (exact)")
    status = fsub.add_parser("status", help="registered targets and their global state versions")
    status.add_argument("--json", action="store_true")
    pubkey = fsub.add_parser(
        "public-key",
        help="the Ed25519 key that signs every published state (hex; devices pin it), created on first use",
    )
    rollout = fsub.add_parser(
        "rollout", help="move a share of the devices that can run a target to it (staged; from the next round)"
    )
    rollout.add_argument("name")
    rollout.add_argument(
        "--fraction",
        type=float,
        required=True,
        help="share of the capable devices that serve it (raising it keeps those already moved)",
    )
    rollback = fsub.add_parser("rollback", help="publish an earlier state of a target again, as a new version")
    rollback.add_argument("name")
    rollback.add_argument("--to", type=int, default=None, help="version to restore (default: the previous one)")
    init = fsub.add_parser("init", help="TLS certificates and device key pairs for a SuperLink deployment")
    init.add_argument("--superlink", required=True, help="host:port the devices will connect to")
    init.add_argument("--node", action="append", default=[], help="a device name to create a key pair for (repeat)")
    init.add_argument("--nodes", type=int, default=0, help="create key pairs node0 .. node<N-1>")
    init.add_argument("--san", action="append", default=[], help="another host name or IP the certificate is valid for")
    init.add_argument(
        "--control-port",
        type=int,
        default=None,
        help="loopback port of the SuperLink itself, for the operator's CLI (default: the devices' port + 1)",
    )
    superlink = fsub.add_parser(
        "superlink",
        help="run flower-superlink (TLS, SuperNode authentication) on loopback "
        "behind a gateway that serves the devices the Fleet API only",
    )
    superlink.add_argument(
        "--listen-host", default=None, help="interface the gateway listens on (default: the init address's host)"
    )
    superlink.add_argument(
        "--database",
        default=None,
        help="SQLite file for the SuperLink's state (registered nodes survive a restart); "
        "default in memory: nodes must be registered again after a restart",
    )
    regnode = fsub.add_parser("register-node", help="let a device's key in (flwr supernode register)")
    regnode.add_argument("name")
    regnode.add_argument(
        "--public-key",
        default=None,
        help="the device's own public key file (omnidraft device keygen on the device); "
        "default: the pair fleet init made for NAME",
    )
    frun = fsub.add_parser("run", help="run federated rounds on the SuperLink's connected devices (flwr run)")
    frun.add_argument("--rounds", type=int, default=1, help="rounds to run now")
    frun.add_argument("--fraction", type=float, default=1.0, help="share of joined devices sampled per round")
    frun.add_argument("--min-devices", type=int, default=1, help="devices connected before a round starts")
    frun.add_argument("--wait-s", type=float, default=120.0, help="longest wait for them (seconds)")
    frun.add_argument("--round-timeout-s", type=float, default=1800.0)
    frun.add_argument("--k", type=int, default=5, help="devices that must hold an n-gram before it is released")
    frun.add_argument("--noise", type=float, default=0.0, help="Gaussian noise multiplier on n-gram counts")
    frun.add_argument("--aggregation", default="fedavg", choices=["fedavg", "median", "trimmed"])
    frun.add_argument("--no-evaluate", action="store_true", help="skip evaluating each new global state")
    frun.add_argument(
        "--secagg",
        action="store_true",
        help="sum the adapter updates with Flower's SecAgg+ (the coordinator sees only their mean)",
    )
    for sp in (reg, status, pubkey, rollback, rollout, init, superlink, regnode, frun):
        sp.add_argument(
            "--root",
            default=os.environ.get("OMNIDRAFT_FLEET_DIR", "fleet"),
            help="coordinator directory (default: $OMNIDRAFT_FLEET_DIR or ./fleet)",
        )
    return p


def _deployment(args) -> int:
    """``fleet init | superlink | register-node | run``: Flower's executables on this coordinator
    directory (``coordinator.deployment``)."""
    from omnidraft.coordinator import deployment
    from omnidraft.shared.processes import run_foreground

    if args.action == "init":
        if args.nodes < 0:
            raise UsageError("omnidraft fleet init: --nodes must be >= 0")
        nodes = list(dict.fromkeys(args.node + [f"node{i}" for i in range(args.nodes)]))
        dep, created = deployment.init(args.root, args.superlink, nodes, args.san, args.control_port)
        print(
            f"{dep.root}: devices connect to {args.superlink}, the operator's CLI to {dep.control_address}; "
            f"created {', '.join(created) or 'nothing (all present)'}"
        )
        print(
            f"devices: copy {dep.pki.ca_cert} and their own key from {dep.pki.root / 'nodes'}; "
            f"register each with: omnidraft fleet register-node NAME --root {dep.root}"
        )
        return 0
    if args.action == "run":  # flags first, then the directory
        if min(args.rounds, args.min_devices) < 1 or not 0 < args.fraction <= 1:
            raise UsageError("omnidraft fleet run: --rounds and --min-devices must be >= 1, --fraction in (0, 1]")
        if args.secagg and args.aggregation != "fedavg":
            raise UsageError(
                "omnidraft fleet run: SecAgg+ reveals only the weighted mean: use --aggregation fedavg with --secagg"
            )
    dep = deployment.Deployment(Path(args.root))
    _ = dep.address  # PkiError (one line) when `fleet init` has not prepared the directory
    if args.action == "superlink":
        return _superlink(dep, args.listen_host, args.database)
    elif args.action == "register-node":
        if args.public_key is not None:
            from omnidraft.coordinator.fleet_pki import add_public_key

            path = Path(args.public_key)
            if not path.is_file():
                raise UsageError(f"omnidraft fleet register-node: {path} is not a file")
            add_public_key(dep.pki, args.name, path.read_bytes(), str(path))
        cmd = dep.register_node_command(args.name)
    else:
        cmd = dep.run_command(
            {
                "rounds": args.rounds,
                "fraction": args.fraction,
                "min-devices": args.min_devices,
                "wait-s": args.wait_s,
                "round-timeout-s": args.round_timeout_s,
                "k": args.k,
                "noise": args.noise,
                "aggregation": args.aggregation,
                "evaluate": not args.no_evaluate,
                "secagg": args.secagg,
            }
        )
    from omnidraft.coordinator.server_app import last_round

    before = last_round(dep.root)
    code = run_foreground(cmd, dep.env())
    if code:
        raise UsageError(f"omnidraft fleet {args.action}: {cmd[0]} exited with status {code}")
    if args.action == "run" and last_round(dep.root) < before + args.rounds:
        # `flwr run --stream` returns 0 even when the ServerApp died
        raise UsageError(
            f"omnidraft fleet run: the federation stopped after round {last_round(dep.root)} of "
            f"{before + args.rounds} (the SuperLink's log says why)"
        )
    return 0


def _superlink(dep, listen_host: str | None, database: str | None) -> int:
    """``fleet superlink``: Flower's SuperLink on the loopback control address, and the gateway
    (``coordinator.fleet_gateway``) on the devices' address, until the SuperLink exits."""
    from omnidraft.coordinator.deployment import split_address
    from omnidraft.coordinator.fleet_gateway import serve_gateway
    from omnidraft.shared.processes import run_foreground

    host, port = split_address(dep.address)
    pki = dep.pki
    try:
        gateway, thread = serve_gateway(
            listen_host or host,
            port,
            f"https://{dep.control_address}",
            ca_cert=pki.ca_cert,
            certfile=pki.server_cert,
            keyfile=pki.server_key,
        )
    except OSError as exc:
        raise UsageError(f"omnidraft fleet superlink: cannot listen on {listen_host or host}:{port}: {exc}") from None
    try:
        code = run_foreground(dep.superlink_command(database), dep.env())
    finally:
        gateway.should_exit = True
        thread.join(timeout=10)
    if code:
        raise UsageError(f"omnidraft fleet superlink: flower-superlink exited with status {code}")
    return 0


def _fleet(args) -> int:
    from omnidraft.coordinator.fleet_pki import PkiError
    from omnidraft.coordinator.registry import RegistryError, TargetRegistry

    if args.action in ("init", "superlink", "register-node", "run"):
        try:
            return _deployment(args)
        except (PkiError, FileNotFoundError) as exc:
            raise UsageError(str(exc)) from None
    from omnidraft.coordinator.server_app import last_round
    from omnidraft.shared.adapters import LoraSpec

    try:
        registry = TargetRegistry(args.root)
        if args.action == "rollback":
            m = registry.rollback(args.name, args.to)
            print(f"{args.name}: version {m.version} restores version {m.restored_from} (was {m.parent_version})")
            return 0
        if args.action == "public-key":
            print(registry.public_key())
            return 0
        if args.action == "register-target":
            m = registry.register(
                args.name,
                args.model,
                args.drafter,
                LoraSpec(rank=args.lora_rank, modules=args.lora_modules, ffa=args.ffa),
                progress=True,
            )
            print(
                f"registered {args.name}: version {m.version}, adapter {m.adapter_bytes} bytes, "
                f"cache {m.cache_bytes} bytes ({registry.root})"
            )
            return 0
        if args.action == "rollout":
            registry.rollout(args.name, args.fraction)
            print(f"{args.name}: {args.fraction:.0%} of the devices that can run it serve it from the next round")
            return 0
        rows = fleet_status(registry)
    except RegistryError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"last_round": last_round(registry.root), "targets": rows}, indent=1))
    elif not rows:
        print(f"no targets registered in {registry.root}")
    else:
        print(f"last finished round: {last_round(registry.root)}")
        print(
            f"{'target':<22} {'version':>9} {'rollout':>7} {'devices':>7} {'rounds':>6}  {'acceptance (last rounds)':<28}"
            f" {'cache':>7} {'moved':>9}"
        )
        for r in rows:
            version = f"v{r['version']}" + (f"<-v{r['restored_from']}" if r["restored_from"] is not None else "")
            trend = " ".join(f"{a:.2f}" for a in r["acceptance_trend"]) or "-"
            rollout = f"{r['rollout_fraction']:.0%}" if r["rollout_fraction"] is not None else "-"
            print(
                f"{r['target']:<22} {version:>9} {rollout:>7} {r['devices'] if r['devices'] is not None else '-':>7} "
                f"{r['rounds']:>6}  {trend:<28} {r['cache_entries'] if r['cache_entries'] is not None else '-':>7} "
                f"{r['bytes_moved'] / 1e6:>7.2f}MB"
            )
    return 0


def fleet_status(registry) -> list[dict]:
    """Per target: the published state and what its rounds recorded (``rounds.jsonl``):
    devices serving it, evaluation acceptance of the last rounds, cache size, bytes moved."""
    from omnidraft.coordinator.server_app import round_history

    history = round_history(registry.root)
    rollouts = registry.rollouts()
    rows = []
    for name in registry.names():
        spec, m = registry.spec(name), registry.manifest(name)
        rounds = [r for r in history if r.get("target") == name and r.get("round", 0) > 0]
        trend = [r["eval-acceptance"] for r in history if r.get("target") == name and "eval-acceptance" in r]
        moved = sum(
            r.get("uplink-bytes-per-device", 0) * r.get("aggregated", 0)
            + r.get("downlink-bytes-per-device", 0) * r.get("sampled", 0)
            for r in rounds
        )
        last = rounds[-1] if rounds else {}
        rows.append(
            {
                "target": name,
                "model": spec.model,
                "drafter": spec.drafter,
                "version": m.version,
                "restored_from": m.restored_from if m.HasField("restored_from") else None,
                "rollout_fraction": rollouts.get(name),
                "round": m.round,
                "rounds": len(rounds),
                "devices": last.get("devices", last.get("sampled")),
                "devices_total": m.devices_total,
                "tokens_total": m.tokens_total,
                "acceptance_trend": [round(a, 4) for a in trend[-5:]],
                "cache_entries": last.get("cache-entries"),
                "adapter_bytes": m.adapter_bytes,
                "cache_bytes": m.cache_bytes,
                "bytes_moved": int(moved),
            }
        )
    return rows


def _doctor(args) -> int:
    from omnidraft.shared.doctor import diagnose, format_report

    report = diagnose()
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _profile(args) -> int:
    from omnidraft.shared import profiling
    from omnidraft.shared.engine import Engine
    from omnidraft.shared.precision import runner_backend

    blocks = profiling.PROFILE_BLOCKS
    if args.blocks is not None:
        try:
            blocks = tuple(sorted({int(b) for b in args.blocks.split(",") if b.strip()}))
        except ValueError:
            raise UsageError("omnidraft profile: --blocks takes comma-separated integers") from None
        if not blocks or blocks[0] < 1:
            raise UsageError("omnidraft profile: block sizes must be >= 1")
    auto = None
    if args.dtype == "auto":
        precision, costs = profiling.choose_precision(args.target, refresh=args.refresh)
        auto = {
            "chosen": precision,
            "score_ms": {p: round(profiling.verification_score(c), 2) for p, c in costs.items()},
        }
    engine = Engine.load(
        args.drafter, args.target, auto["chosen"] if auto else args.dtype, drafter_weights=args.drafter_weights
    )
    target = engine.target_runner
    profile = engine.cost_profile(refresh=args.refresh)
    target_ms = profile.target_ms
    if args.blocks is not None:  # other block sizes than the profile's: measured (cached) on their own
        target_ms = profiling.target_costs(
            target, engine.target.path, engine.precision, runner_backend(target), blocks=blocks, refresh=args.refresh
        )
    report = {
        "cpu": profiling.cpu_name(),
        "cpu_capability": profiling.machine_fingerprint()["capability"],
        "threads": profiling.machine_fingerprint()["threads"],
        "dtype": engine.precision,
        "target_backend": runner_backend(target),
        "drafter_backend": runner_backend(engine.drafter_runner),
        "target_ms": {str(b): round(ms, 3) for b, ms in target_ms.items()},
        **{k: v for k, v in profile.to_dict().items() if k != "target_ms"},
        "auto": auto,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"cpu: {report['cpu']} ({report['cpu_capability']}, {report['threads']} threads)")
    if auto:
        print(
            "auto: "
            + ", ".join(f"{p} {ms:.1f} ms" for p, ms in auto["score_ms"].items())
            + f" (1-token step + 4-token block) -> {auto['chosen']}"
        )
    print(f"target {engine.precision} ({report['target_backend']}):")
    for b, ms in target_ms.items():
        print(f"  forward of {b:>3} new tokens: {ms:8.1f} ms  ({ms / b:6.1f} ms/token)")
    print(
        f"drafter ({report['drafter_backend']}): step {profile.drafter_ms_per_token:.2f} ms; feeding "
        + ", ".join(f"{b} tokens {ms:.1f} ms" for b, ms in profile.drafter_block_ms.items())
    )
    print(
        f"work outside the forwards: {profile.round_overhead_ms:.2f} ms per drafter round, "
        f"{profile.step_overhead_ms:.2f} ms per plain or model-free round"
    )
    return 0


def _models(args) -> int:
    from omnidraft.shared import catalog

    if args.action == "list":
        rows = [catalog.info(n) for n in catalog.CATALOG]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                state = f"pulled ({r['format']})" if r["pulled"] else "not pulled"
                print(f"{r['name']:<20} {r['role']:<8} {r['gguf_bytes'] / 1e6:8.0f} MB  {state:<20} {r['description']}")
        return 0
    if args.action == "pull":
        for name in args.names:
            catalog.spec(name)  # every name checked before anything is downloaded
        for name in args.names:
            print(catalog.pull(name, force=args.force, fmt=args.format))
        return 0
    print(json.dumps(catalog.info(args.name), indent=2))
    return 0


def _config(args):
    from omnidraft.shared.generation import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=getattr(args, "temperature", 0.0),
        top_p=getattr(args, "top_p", 1.0),
        seed=getattr(args, "seed", None),
        stop_strings=tuple(getattr(args, "stop", ())),
        k_max=args.k_max,
        confidence=args.confidence,
        draft_stop=getattr(args, "draft_stop", "auto"),
    )
    try:
        config.validate()
    except ValueError as exc:
        raise UsageError(f"omnidraft {args.command}: {exc}") from None
    state_dir = getattr(args, "state_dir", None)
    if state_dir and os.path.exists(state_dir) and not os.path.isdir(state_dir):
        raise UsageError(f"omnidraft {args.command}: --state-dir {state_dir} is not a directory")
    return config


def _engine(args):
    from omnidraft.shared.engine import Engine
    from omnidraft.shared.lookup_drafts import lookup_drafter

    engine = Engine.load(
        args.drafter, args.target, args.dtype, drafter_weights=args.drafter_weights, seed_cache=args.seed_cache
    )
    engine.lookup = lookup_drafter(args.lookup)
    return engine


def _session(args, engine, **kwargs):
    """The device session over ``engine`` with ``--state-dir`` loaded (problems reported)."""
    from omnidraft.client.session import DeviceSession

    session = DeviceSession(
        engine,
        target_name=args.target,
        state_dir=args.state_dir,
        translate=args.translate,
        state_key=getattr(args, "state_key", None),
        lookup=args.lookup,
        **kwargs,
    )
    for problem in session.problems:
        print(f"warning: {problem}", file=sys.stderr)
    return session


def _generate(args) -> int:
    config = _config(args)
    if not args.prompt:
        raise UsageError("omnidraft generate: --prompt must not be empty")
    engine = _engine(args)
    if args.state_dir and args.method == "omnidraft":
        result = _session(args, engine).generate(args.prompt, config, chat=args.chat, learn=False)
    else:
        result = engine.generate(args.prompt, config, method=args.method, chat=args.chat, translate=args.translate)
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        print(result.text)
        s = result.stats
        extra = (
            f", acceptance {s.acceptance_rate:.2f}, {s.tokens_per_target_call:.2f} tokens/target call"
            if args.method == "omnidraft" and s.acceptance_rate is not None
            else ""
        )
        print(f"[{s.new_tokens} tokens in {s.wall_s:.2f} s, {s.tokens_per_s or 0:.2f} tok/s{extra}]", file=sys.stderr)
    return 0


def _bench(args) -> int:
    from omnidraft.shared import bench, catalog
    from omnidraft.shared.atomic_io import write_bytes_atomic

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in bench.METHODS]
    if unknown or not methods:
        raise UsageError(
            f"omnidraft bench: unknown method(s) {', '.join(unknown) or '(none)'}; "
            f"choose from {', '.join(bench.METHODS)}"
        )
    llama = [m for m in methods if m in bench.LLAMACPP_METHODS]
    if llama and args.target not in catalog.CATALOG:
        raise UsageError(f"omnidraft bench: {llama[0]} needs a catalog target (it runs the catalog's GGUF file)")
    if llama and bench.llamacpp_missing():
        print(f"note: skipping {', '.join(llama)}: {bench.llamacpp_missing()}", file=sys.stderr)
        methods = [m for m in methods if m not in llama]
        if not methods:
            raise UsageError("omnidraft bench: no method left to run")
    if args.limit is not None and args.limit < 1:
        raise UsageError("omnidraft bench: --limit must be >= 1")
    config = _config(args)
    try:
        prompts = bench.load_prompts(args.dataset, args.limit)
    except ValueError as exc:
        raise UsageError(f"omnidraft bench: {exc}") from None
    engine = _engine(args)
    session = _session(args, engine) if args.state_dir and "omnidraft" in methods else None
    report = bench.run_bench(engine, prompts, methods, config, translate=args.translate, session=session)
    print(bench.format_table(report))
    if args.out:
        write_bytes_atomic(args.out, json.dumps(report, indent=2).encode())
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _adapt(args) -> int:
    from omnidraft.client import adapt_run
    from omnidraft.client.online_learner import OnlineConfig
    from omnidraft.shared import bench
    from omnidraft.shared.adapters import LoraSpec
    from omnidraft.shared.distill import LossConfig

    if args.limit is not None and args.limit < 2:
        raise UsageError("omnidraft adapt: --limit must be >= 2")
    if args.acceptance_k < 0:
        raise UsageError("omnidraft adapt: --acceptance-k must be >= 0")
    config = _config(args)
    loss = LossConfig(
        kind="seq" if args.loss in ("seq", "none") else "hybrid",
        dm=args.loss != "ngram",
        ngram=args.loss != "dm",
        lam=args.lam,
        dynamic=args.dynamic_lambda,
    )
    online = OnlineConfig(interval=args.interval, lr=args.lr, steps_per_update=args.steps_per_update, loss=loss)
    lora = LoraSpec(rank=args.lora_rank, modules=args.lora_modules)
    try:
        online.validate()
        lora.validate()
        prompts = bench.load_prompts(args.dataset, args.limit)
        adapt_run.split(prompts, args.train_fraction)
    except ValueError as exc:
        raise UsageError(f"omnidraft adapt: {exc}") from None
    if args.plot:
        _require_matplotlib("adapt")
    engine = _engine(args)
    if args.ablation:
        report = adapt_run.run_ablation(engine, prompts, config, args.train_fraction, online, lora, args.translate)
        report["config"] = dict(vars(args))
        print(adapt_run.format_ablation(report))
        return _write_outputs(args, report, None)
    session = _session(args, engine, lora=lora, online=online, learn=args.loss != "none", adaptive=not args.no_head)
    report = adapt_run.run_adapt(session, prompts, config, args.train_fraction, fixed_k=args.acceptance_k)
    report["config"] = {k: v for k, v in vars(args).items()}
    print(adapt_run.format_table(report))
    if args.state_dir:
        session.save()
        print(f"saved device state to {session.state.dir}", file=sys.stderr)
    return _write_outputs(args, report, adapt_run.plot_curve)


def _drift(args) -> int:
    from omnidraft.client import drift_run

    config = _config(args)
    try:
        phases = drift_run.parse_stream(args.stream)
        drift_run.phase_prompts(phases)
    except ValueError as exc:
        raise UsageError(f"omnidraft drift: {exc}") from None
    if args.plot:
        _require_matplotlib("drift")
    report = drift_run.run_drift(
        args.drafter, phases, config, args.dtype, drafter_weights=args.drafter_weights, translate=args.translate
    )
    for label, means in report["phase_means"].items():
        cells = [
            f"{m['tokens_per_target_call']['first_half']:.2f} -> {m['tokens_per_target_call']['second_half']:.2f}"
            for m in means
        ]
        print(f"{label:<14} tokens/call per phase (first half -> second half): {' | '.join(cells)}")
    return _write_outputs(args, report, drift_run.plot_drift)


def _write_outputs(args, report: dict, plot) -> int:
    """``--out`` (JSON) and ``--plot`` (PNG through ``plot(report, path)``), atomically."""
    from omnidraft.client.adapt_run import write_json

    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}", file=sys.stderr)
    if getattr(args, "plot", None) and plot is not None:
        plot(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _require_matplotlib(command: str) -> None:
    try:
        import matplotlib  # noqa: F401  (fail before the run, not after it)
    except ImportError:
        raise UsageError(f"omnidraft {command}: --plot needs matplotlib (pip install 'omnidraft-fleet[sim]')") from None


def _export_adapter(args) -> int:
    """A device's learned adapter as a directory ``peft.PeftModel.from_pretrained`` loads."""
    import torch

    from omnidraft.client.device_state import DeviceState
    from omnidraft.client.state_key import StateCipher
    from omnidraft.shared import model_runner
    from omnidraft.shared.adapters import DrafterAdapters, LoraSpec

    if not os.path.isdir(args.state_dir):
        raise UsageError(f"omnidraft device export-adapter: --state-dir {args.state_dir} is not a directory")
    cipher = StateCipher(args.state_key, create=False) if args.state_key else None
    loaded = DeviceState(args.state_dir, args.drafter, args.target, cipher=cipher).load()
    if loaded.adapter is None:
        raise UsageError(
            f"omnidraft device export-adapter: no valid adapter for {args.drafter} -> {args.target} in {args.state_dir}"
        )
    drafter = model_runner.load(args.drafter, torch.float32)
    adapters = DrafterAdapters(drafter.model, LoraSpec(**loaded.meta.get("lora", {})), drafter_weights="hf")
    adapters.add(args.target)
    adapters.load_state_dict(args.target, loaded.adapter)
    out = adapters.export_peft(args.target, args.out)
    print(f'wrote {out} (load it with peft.PeftModel.from_pretrained(<{args.drafter}>, "{out}"))')
    return 0


def _keygen(args) -> int:
    """``device keygen``: this device's SuperNode key pair; an existing pair is kept (its public
    line printed again), so the command is safe to repeat."""
    import socket

    from omnidraft.shared.node_keys import checked_public_key, public_key_path, write_node_key

    key, public = Path(args.key), public_key_path(args.key)
    if key.exists() or public.exists():
        if not (key.is_file() and public.is_file()):
            raise UsageError(f"omnidraft device keygen: {key} or {public} exists without the other; move it away first")
        try:
            line = checked_public_key(public.read_bytes(), str(public))
        except ValueError as exc:
            raise UsageError(f"omnidraft device keygen: {exc}") from None
        print(f"kept the existing key {key}; its public key ({public}):", file=sys.stderr)
    else:
        try:
            line = write_node_key(key, args.name or socket.gethostname())
        except OSError as exc:
            raise UsageError(f"omnidraft device keygen: cannot write {key}: {exc.strerror}") from None
        print(f"wrote {key} (private, stays on this device) and {public}; give the operator {public}:", file=sys.stderr)
    print(line.decode().strip())
    return 0


def _device(args) -> int:
    if args.action == "serve":
        return _serve(args)
    if args.action == "join":
        return _join(args)
    if args.action == "export-adapter":
        return _export_adapter(args)
    if args.action == "keygen":
        return _keygen(args)
    import grpc
    from google.protobuf.json_format import MessageToDict

    from omnidraft.client import owner_token
    from omnidraft.proto import generation_pb2 as pb
    from omnidraft.proto import generation_pb2_grpc as pb_grpc

    meta = ()
    try:
        if args.owner_token:
            meta = owner_token.metadata(owner_token.read(args.owner_token))
        credentials = grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes()) if args.tls_ca else None
    except OSError as exc:
        raise UsageError(f"omnidraft device {args.action}: {exc.filename}: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"omnidraft device {args.action}: {exc}") from None
    try:
        with (
            grpc.secure_channel(args.server, credentials) if credentials else grpc.insecure_channel(args.server)
        ) as channel:
            stub = pb_grpc.GenerationStub(channel)
            if args.action == "health":
                reply = stub.Health(pb.HealthRequest(), timeout=args.timeout, metadata=meta)
                if args.json:
                    print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True)))
                else:
                    print(
                        f"{reply.status}: {reply.drafter} -> {reply.target} ({reply.precision}), "
                        f"{reply.requests} requests, {reply.updates} updates, {reply.queued} in flight"
                    )
                return 0
            request = pb.GenerateRequest(
                prompt=args.prompt,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                stop=args.stop,
                chat=args.chat,
                **({"seed": args.seed} if args.seed is not None else {}),
            )
            if args.stream:
                stats = None
                for chunk in stub.GenerateStream(request, timeout=args.timeout, metadata=meta):
                    if chunk.done:
                        stats = chunk.stats
                    elif not args.json:
                        print(chunk.text, end="", flush=True)
                if not args.json:
                    print()
                reply = pb.GenerateReply(stats=stats)
            else:
                reply = stub.Generate(request, timeout=args.timeout, metadata=meta)
                if not args.json:
                    print(reply.text)
    except grpc.RpcError as exc:
        raise UsageError(f"omnidraft device {args.action}: {exc.code().name}: {exc.details()}") from None
    if args.json:
        print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True), ensure_ascii=False))
    else:
        s = reply.stats
        print(
            f"[{s.new_tokens} tokens in {s.decode_s:.2f} s ({s.tokens_per_s:.1f} tok/s), acceptance "
            f"{s.acceptance_rate:.2f}, {s.tokens_per_target_call:.2f} tokens/target call, queued "
            f"{s.queue_s:.2f} s]",
            file=sys.stderr,
        )
    return 0


def _join(args) -> int:
    from omnidraft.client.fleet_device import DeviceProfile
    from omnidraft.client.online_learner import OnlineConfig
    from omnidraft.client.supernode import REFUSED_LOG, JoinSettings, write_profile
    from omnidraft.shared.processes import run_foreground

    if not args.state_dir:
        raise UsageError("omnidraft device join: --state-dir is required (shared with omnidraft device serve)")
    if not args.insecure and not (args.cert and args.key):
        raise UsageError(
            "omnidraft device join: give --cert (the fleet's CA) and --key (this device's key), or --insecure"
        )
    for flag, path in (("--cert", args.cert), ("--key", args.key)):
        if path and not args.insecure and not os.path.isfile(path):
            raise UsageError(f"omnidraft device join: {flag} {path} is not a file")
    if not args.insecure and not args.fleet_key:
        raise UsageError(
            "omnidraft device join: give --fleet-key (the coordinator's public key: omnidraft fleet "
            "public-key) so the device applies only signed states, or --insecure (a test network)"
        )
    if min(args.prompts_per_round, args.interval) < 1:
        raise UsageError("omnidraft device join: --prompts-per-round and --interval must be >= 1")
    token_file = ""
    if args.service:
        from omnidraft.client import owner_token

        if not owner_token.is_loopback(args.service):
            raise UsageError(f"omnidraft device join: --service {args.service}: the device service must be on loopback")
        token_file = str(Path(args.owner_token or Path(args.state_dir) / owner_token.TOKEN_FILE).resolve())
        try:
            owner_token.read(token_file)
        except ValueError as exc:
            raise UsageError(
                f"omnidraft device join: {exc} (start omnidraft device serve on this state "
                f"directory first, or give --owner-token)"
            ) from None
    if args.fleet_key:
        from omnidraft.shared.signing import SignatureError, pinned_keys

        try:
            pinned_keys(args.fleet_key)
        except SignatureError as exc:
            raise UsageError(f"omnidraft device join: --fleet-key: {exc}") from None
    from omnidraft.client.resource_policy import ResourcePolicy

    policy = ResourcePolicy(
        max_threads=args.max_threads,
        cache_mb=args.cache_mb,
        train_when=args.train_when,
        idle_s=args.idle_s,
        uplink_mb_per_day=args.uplink_mb_per_day,
    )
    try:
        policy.validate()
    except ValueError as exc:
        raise UsageError(f"omnidraft device join: {exc}") from None
    if args.max_threads:
        os.environ["OMNIDRAFT_THREADS"] = str(args.max_threads)  # inherited by the ClientApp processes
    offers = {}
    for offer in args.offer:
        name, sep, model = offer.partition("=")
        if not sep or not name or not model:
            raise UsageError(f"omnidraft device join: --offer {offer!r}: expected NAME=MODEL")
        offers[name] = model
    config = _config(args)
    device_id = args.device_id or (Path(args.key).name if args.key else os.uname().nodename)
    write_profile(
        DeviceProfile(
            device_id=device_id,
            target=args.target_name or args.target,
            target_model=args.target,
            drafter=args.drafter,
            prompts=[],
            heldout=[],
            state_dir=Path(args.state_dir).resolve(),
            prompts_per_round=args.prompts_per_round,
            generation=config,
            online=OnlineConfig(interval=args.interval),
            translate=args.translate,
            offers=offers,
            policy=policy,
            fleet_key=args.fleet_key or "",
            state_key=str(Path(args.state_key).resolve()) if args.state_key else "",
        )
    )
    settings = JoinSettings(
        superlink=args.superlink,
        state_dir=Path(args.state_dir),
        root_certificates=None if args.insecure else Path(args.cert).resolve(),
        private_key=None if args.insecure else Path(args.key).resolve(),
        runtime_port=args.runtime_port,
        dtype=args.dtype,
        service=args.service or "",
        service_token=token_file,
        drafter_weights=args.drafter_weights,
        max_retries=args.max_retries,
    )
    print(
        f"device {device_id}: joining {args.superlink} as a SuperNode ({args.drafter} -> {args.target}); "
        f"state in {args.state_dir}",
        file=sys.stderr,
        flush=True,
    )
    refused = []
    try:
        code = run_foreground(
            settings.command(),
            settings.env(),
            on_line=lambda line: refused.append(line) if REFUSED_LOG in line else None,
        )
    except FileNotFoundError as exc:
        raise UsageError(f"omnidraft device join: {exc}") from None
    if code and refused:
        raise UsageError(
            f"omnidraft device join: the SuperLink refused this device's key "
            f"(register it: omnidraft fleet register-node {device_id})"
        )
    if code:
        raise UsageError(f"omnidraft device join: flower-supernode exited with status {code}")
    return 0


def _serve(args) -> int:
    import logging
    import signal
    import threading

    from omnidraft.client.online_learner import OnlineConfig
    from omnidraft.client.service import GenerationService, ServiceLimits, serve

    if not args.state_dir:
        raise UsageError("omnidraft device serve: --state-dir is required (the device's adapter, head and cache)")
    if args.keep_prompts < 0 or args.max_threads < 0:
        raise UsageError("omnidraft device serve: --keep-prompts and --max-threads must be >= 0")
    if args.max_threads:
        os.environ["OMNIDRAFT_THREADS"] = str(args.max_threads)
    if min(args.max_queue, args.max_prompt_tokens, args.max_new_tokens_limit, args.interval) < 1:
        raise UsageError(
            "omnidraft device serve: --max-queue, --max-prompt-tokens, --max-new-tokens-limit "
            "and --interval must be >= 1"
        )
    from omnidraft.client import owner_token

    loopback = owner_token.is_loopback(args.listen)
    token_file = args.owner_token or str(Path(args.state_dir) / owner_token.TOKEN_FILE)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("omnidraft device serve: give both --tls-cert and --tls-key")
    if not loopback and not args.tls_cert:
        raise UsageError(
            f"omnidraft device serve: {args.listen} is not loopback: give --tls-cert and --tls-key "
            f"(only the owner is served there)"
        )
    try:
        tls = (Path(args.tls_cert).read_bytes(), Path(args.tls_key).read_bytes()) if args.tls_cert else None
        owner = owner_token.load_or_create(token_file)
    except OSError as exc:
        raise UsageError(f"omnidraft device serve: {exc.filename}: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"omnidraft device serve: {exc}") from None
    base = _config(args)
    handler = logging.StreamHandler()  # the service's own notes (state reloads, learning failures)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("omnidraft").addHandler(handler)
    logging.getLogger("omnidraft").setLevel(logging.INFO)
    engine = _engine(args)
    session = _session(args, engine, online=OnlineConfig(interval=args.interval, lr=args.lr))
    limits = ServiceLimits(
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens_limit,
        default_new_tokens=min(args.max_new_tokens, args.max_new_tokens_limit),
        max_queue=args.max_queue,
    )
    request_log = None
    if args.keep_prompts > 0:
        from omnidraft.client.request_log import RequestLog
        from omnidraft.client.state_key import StateCipher

        request_log = RequestLog(
            args.state_dir, StateCipher(args.state_key) if args.state_key else None, keep=args.keep_prompts
        )
    service = GenerationService(
        session,
        limits,
        base=base,
        precision=engine.precision,
        learn=not args.no_learn,
        request_log=request_log,
        owner=owner,
        serve_strangers=loopback,
    )
    from omnidraft.client.fleet_service import DeviceFleetService

    fleet = DeviceFleetService(service, args.state_dir, owner, dtype=engine.precision)
    try:
        server, port = serve(service, args.listen, tls=tls, fleet=fleet)
    except (ValueError, RuntimeError) as exc:
        service.close()
        raise UsageError(f"omnidraft device serve: cannot listen on {args.listen}: {exc}") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    host = args.listen.rsplit(":", 1)[0]
    print(
        f"serving omnidraft.v1.Generation and DeviceFleet on {host}:{port}{' (TLS)' if tls else ''} ({engine.drafter_name} -> "
        f"{args.target}, {engine.precision}); state in {args.state_dir}; requests presenting {token_file} teach "
        f"the device{', others are served without learning' if loopback else ', others are refused'}",
        file=sys.stderr,
        flush=True,
    )
    stop.wait()
    server.stop(grace=5).wait()
    service.close()
    print("stopped; device state saved", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from omnidraft.shared.catalog import CatalogError

    try:
        args = _build_parser().parse_args(argv)
        handler = {
            "models": _models,
            "generate": _generate,
            "bench": _bench,
            "adapt": _adapt,
            "drift": _drift,
            "profile": _profile,
            "doctor": _doctor,
            "fleet": _fleet,
            "device": _device,
        }[args.command]
        return handler(args)
    except (UsageError, CatalogError, ValueError) as exc:
        # ValueError: input the engine rejects (e.g. a prompt with no drafter token)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
