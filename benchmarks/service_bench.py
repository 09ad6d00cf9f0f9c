"""What the gRPC service adds to a request: the same prompts decoded in-process
(``DeviceSession.generate``) and through ``omnidraft.v1.Generation`` on loopback (unary and
streaming), learning off, greedy, taking turns (each first on a third of the prompts) so that
machine drift and the order hit all three alike; with ``--learn-interval`` the service learns
from its replies (as a device's owner's requests teach it) and is timed against the target alone
(``ar``) in-process. Every decode runs on the thread that loaded the models, as ``device serve``
does (``EngineThread``), and reads its whole prompt.

    python -m omnidraft.benchmarks.service_bench --drafter smollm2-135m --target qwen2.5-coder-1.5b \\
        --dataset humaneval --limit 9 --max-new-tokens 64 [--dtype auto] [--learn-interval 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m omnidraft.benchmarks.service_bench", description=__doc__.splitlines()[0]
    )
    p.add_argument("--drafter", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "int8", "fp64"])
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--learn-interval",
        type=int,
        default=0,
        help="samples per adapter update: the service learns from its replies while it is timed "
        "against the target alone (ar) in-process; 0 (default): learning off, in-process vs gRPC",
    )
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.learn_interval < 0:
        print("error: --learn-interval must be 0 (off) or a positive number of samples", file=sys.stderr)
        return 2
    from omnidraft.shared.engine.catalog import CatalogError

    try:
        times, tokens, texts_equal, updates, precision = _measure(args)
    except (ValueError, CatalogError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base = "ar" if args.learn_interval else "in-process"
    report = {
        "prompts": len(times[base]),
        "max_new_tokens": args.max_new_tokens,
        "precision": precision,
        "texts_equal": texts_equal,
        **{f"{k}-mean-s": statistics.mean(v) for k, v in times.items()},
    }
    if args.learn_interval:
        third = max(1, len(times[base]) // 3)
        for k in times:
            report[f"{k}-tok-s"] = sum(tokens[k]) / sum(times[k])
            report[f"{k}-last-third-tok-s"] = sum(tokens[k][-third:]) / sum(times[k][-third:])
        report["speedup-vs-ar"] = report["grpc-unary-tok-s"] / report["ar-tok-s"]
        report["adapter-updates"] = updates
    else:
        mean = statistics.mean(times[base])
        report |= {f"{k}-overhead-ms": 1000 * (statistics.mean(v) - mean) for k, v in times.items() if k != base}
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return 0


def _measure(args) -> tuple[dict[str, list[float]], dict[str, list[int]], bool, int, str]:
    """Time every call on every prompt: (seconds and new tokens per call by name, whether all
    calls wrote the same text, adapter updates made, the target's precision)."""
    import grpc

    from omnidraft.benchmarks.bench import load_prompts
    from omnidraft.client.online_learner import OnlineConfig
    from omnidraft.client.service import GenerationService, ServiceLimits, serve
    from omnidraft.client.session import DeviceSession
    from omnidraft.proto import generation_pb2 as pb
    from omnidraft.proto import generation_pb2_grpc as pb_grpc
    from omnidraft.shared.engine.generation import GenerationConfig
    from omnidraft.shared.engine.pair import Engine
    from omnidraft.shared.runtime.engine_thread import EngineThread

    prompts = load_prompts(args.dataset, args.limit)
    learning = args.learn_interval > 0
    engine_thread = EngineThread()  # as `device serve` runs them: the models on one thread
    engine = engine_thread.run(Engine.load, args.drafter, args.target, args.dtype, progress=False)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory(prefix="omnidraft-service-bench-") as state_dir:
        session = engine_thread.run(  # it builds the drafter's adapters: torch work, on that thread too
            DeviceSession,
            engine,
            target_name=args.target,
            learn=learning,
            state_dir=state_dir if learning else None,
            online=OnlineConfig(interval=args.learn_interval) if learning else None,
        )
        service = GenerationService(
            session,
            ServiceLimits(max_new_tokens=args.max_new_tokens),
            base=config,
            precision=engine.precision,
            learn=learning,
            engine_thread=engine_thread,
        )
        server, port = serve(service, "127.0.0.1:0")
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        request = lambda p: pb.GenerateRequest(prompt=p, max_new_tokens=args.max_new_tokens)  # noqa: E731

        def in_process(prompt: str, method: str = "omnidraft") -> tuple[str, int]:
            if method == "ar":
                result = engine_thread.run(engine.generate, prompt, config, method="ar")
            else:
                result = engine_thread.run(session.generate, prompt, config, learn=False)
            return result.text, len(result.token_ids)

        def unary(prompt: str) -> tuple[str, int]:
            reply = stub.Generate(request(prompt), timeout=600)
            return reply.text, reply.stats.new_tokens

        def stream(prompt: str) -> tuple[str, int]:
            chunks = list(stub.GenerateStream(request(prompt), timeout=600))
            return "".join(c.text for c in chunks), chunks[-1].stats.new_tokens

        def cold() -> None:
            """Every timed decode reads its whole prompt: the runners keep the positions a prompt
            shares with the decode before, which would favour the later calls of a prompt."""
            engine.target_runner.reset()
            session.drafting_runner().reset()

        # each returns (text, new tokens); with learning the service learns from its replies
        calls: dict[str, Callable[[str], tuple[str, int]]] = (
            {"ar": lambda p: in_process(p, "ar"), "grpc-unary": unary}
            if learning
            else {"in-process": in_process, "grpc-unary": unary, "grpc-stream": stream}
        )
        for call in calls.values():  # first-call setup outside the timings (a prompt of its own)
            call("def hello_world():\n")
        times: dict[str, list[float]] = {name: [] for name in calls}
        tokens: dict[str, list[int]] = {name: [] for name in calls}
        texts_equal = True
        names = list(calls)
        for i, prompt in enumerate(prompts):
            texts = set()
            turn = i % len(names)
            for name in names[turn:] + names[:turn]:  # each goes first on its share of the prompts
                engine_thread.run(cold)
                t0 = time.perf_counter()
                text, new = calls[name](prompt)
                times[name].append(time.perf_counter() - t0)
                tokens[name].append(new)
                texts.add(text)
            texts_equal &= len(texts) == 1
        server.stop(grace=None)
        service.close()
        return times, tokens, texts_equal, session.learner.updates, engine.precision


if __name__ == "__main__":
    raise SystemExit(main())
