"""What every command group shares: the one-line usage error, the parser that raises it, and
the arguments and objects of a drafter/target pair (precision, generation settings, the engine,
the device session)."""

from __future__ import annotations

import argparse
import os
import sys


class UsageError(Exception):
    """A bad input the user can fix; printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
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


def version_string() -> str:
    """The installed distribution's version ("unknown" when run from a tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omnidraft-fleet")
    except PackageNotFoundError:
        return "unknown"


def pair_args(sp) -> None:
    """The arguments of a command that loads a drafter/target pair."""
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
        "--confidence threshold, nothing measured; auto = cost (this machine's costs are "
        "measured on first use and cached under $OMNIDRAFT_HOME/profiles)",
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
    sp.add_argument("--state-dir", default=None, help="device state directory (adapter, head, n-gram cache per target)")
    sp.add_argument(
        "--state-key",
        default=os.environ.get("OMNIDRAFT_STATE_KEY"),
        help="key file that encrypts the device state at rest (AES-256-GCM; created "
        "0600 if missing; keep it outside --state-dir; default $OMNIDRAFT_STATE_KEY)",
    )
    sp.add_argument("--seed-cache", action="store_true", help="warm-start the n-gram cache from the two tokenizers")


def generation_config(args):
    from omnidraft.shared.engine.generation import GenerationConfig

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


def load_engine(args):
    from omnidraft.shared.engine.lookup_drafts import lookup_drafter
    from omnidraft.shared.engine.pair import Engine

    engine = Engine.load(
        args.drafter, args.target, args.dtype, drafter_weights=args.drafter_weights, seed_cache=args.seed_cache
    )
    engine.lookup = lookup_drafter(args.lookup)
    return engine


def open_session(args, engine, **kwargs):
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
