"""``omnidraft fleet ...``: the coordinator's registry and its Flower deployment."""

from __future__ import annotations

import json
import os
from pathlib import Path

from omnidraft.cli.common import (
    Parser,
    UsageError,
)


def add_parsers(sub) -> None:
    """This group's commands on the top-level subparsers ``sub``."""
    fleet = sub.add_parser("fleet", help="the coordinator's target registry")
    fsub = fleet.add_subparsers(dest="action", required=True, parser_class=Parser)
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


def _deployment(args) -> int:
    """``fleet init | superlink | register-node | run``: Flower's executables on this coordinator
    directory (``coordinator.deployment``)."""
    from omnidraft.coordinator import deployment
    from omnidraft.shared.util.processes import run_foreground

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
    from omnidraft.coordinator.round_log import last_round

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
    from omnidraft.shared.util.processes import run_foreground

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
        raise UsageError(f"omnidraft fleet superlink: {exc}") from None  # it names the address and why
    try:
        code = run_foreground(dep.superlink_command(database), dep.env())
    finally:
        gateway.should_exit = True
        thread.join(timeout=10)
    if code:
        raise UsageError(f"omnidraft fleet superlink: flower-superlink exited with status {code}")
    return 0


def fleet(args) -> int:
    from omnidraft.coordinator.fleet_pki import PkiError
    from omnidraft.coordinator.registry import RegistryError, TargetRegistry

    if args.action in ("init", "superlink", "register-node", "run"):
        try:
            return _deployment(args)
        except (PkiError, FileNotFoundError) as exc:
            raise UsageError(str(exc)) from None
    from omnidraft.coordinator.round_log import last_round
    from omnidraft.shared.learning.adapters import LoraSpec

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
    from omnidraft.coordinator.round_log import round_history

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
