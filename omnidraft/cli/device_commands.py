"""``omnidraft device serve | join | ask | health | keygen | export-adapter``: the device side."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from omnidraft.cli.common import (
    Parser,
    UsageError,
    generation_config,
    load_engine,
    open_session,
    pair_args,
)


def add_parsers(sub) -> None:
    """This group's commands on the top-level subparsers ``sub``."""
    device = sub.add_parser("device", help="the on-device generation service (gRPC) and its client")
    dsub = device.add_subparsers(dest="action", required=True, parser_class=Parser)
    serve = dsub.add_parser("serve", help="serve omnidraft.v1.Generation over gRPC, learning between requests")
    pair_args(serve)
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
    pair_args(join)
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


def _export_adapter(args) -> int:
    """A device's learned adapter as a directory ``peft.PeftModel.from_pretrained`` loads."""
    import torch

    from omnidraft.client.device_state import DeviceState
    from omnidraft.client.state_key import StateCipher
    from omnidraft.shared.engine import model_runner
    from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec

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


def device(args) -> int:
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
    from omnidraft.client.device_profile import DeviceProfile
    from omnidraft.client.online_learner import OnlineConfig
    from omnidraft.client.supernode import REFUSED_LOG, JoinSettings, write_profile
    from omnidraft.shared.util.processes import run_foreground

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
    config = generation_config(args)
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
    base = generation_config(args)
    handler = logging.StreamHandler()  # the service's own notes (state reloads, learning failures)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("omnidraft").addHandler(handler)
    logging.getLogger("omnidraft").setLevel(logging.INFO)
    from omnidraft.shared.runtime.engine_thread import EngineThread

    engine_thread = EngineThread()  # the models load, decode and learn on this thread only
    engine = engine_thread.run(load_engine, args)
    session = engine_thread.run(open_session, args, engine, online=OnlineConfig(interval=args.interval, lr=args.lr))
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
        engine_thread=engine_thread,
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
