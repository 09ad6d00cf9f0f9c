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
import sys

from omnidraft.cli import device_commands, engine_commands, fleet_commands
from omnidraft.cli.common import Parser, UsageError, version_string

HANDLERS = {
    "models": engine_commands.models,
    "generate": engine_commands.generate,
    "bench": engine_commands.bench,
    "adapt": engine_commands.adapt,
    "drift": engine_commands.drift,
    "profile": engine_commands.profile,
    "doctor": engine_commands.doctor,
    "fleet": fleet_commands.fleet,
    "device": device_commands.device,
}  # command -> its handler (args -> exit status)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="omnidraft", description="Cross-vocabulary speculative decoding on the device.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version_string()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    engine_commands.add_parsers(sub)
    device_commands.add_parsers(sub)
    fleet_commands.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from omnidraft.shared.engine.catalog import CatalogError

    try:
        args = build_parser().parse_args(argv)
        handler = HANDLERS[args.command]
        return handler(args)
    except (UsageError, CatalogError, ValueError) as exc:
        # ValueError: input the engine rejects (e.g. a prompt with no drafter token)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
