"""What the gRPC service adds to a request: the same prompts decoded in-process
(``DeviceSession.generate``) and through ``omnidraft.v1.Generation`` on loopback (unary and
streaming), learning off, greedy, alternating so that machine drift hits all three alike.

    python -m omnidraft.benchmarks.service_bench --drafter smollm2-135m --target qwen2.5-coder-0.5b \\
        --dataset humaneval --limit 10 --max-new-tokens 64 [--dtype auto] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


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
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from omnidraft.shared.engine.catalog import CatalogError

    try:
        import grpc

        from omnidraft.benchmarks.bench import load_prompts
        from omnidraft.client.service import GenerationService, ServiceLimits, serve
        from omnidraft.client.session import DeviceSession
        from omnidraft.proto import generation_pb2 as pb
        from omnidraft.proto import generation_pb2_grpc as pb_grpc
        from omnidraft.shared.engine.generation import GenerationConfig
        from omnidraft.shared.engine.pair import Engine

        prompts = load_prompts(args.dataset, args.limit)
        engine = Engine.load(args.drafter, args.target, args.dtype, progress=False)
        session = DeviceSession(engine, target_name=args.target, learn=False)
        config = GenerationConfig(max_new_tokens=args.max_new_tokens)
        service = GenerationService(
            session,
            ServiceLimits(max_new_tokens=args.max_new_tokens),
            base=config,
            precision=engine.precision,
            learn=False,
        )
        server, port = serve(service, "127.0.0.1:0")
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        request = lambda p: pb.GenerateRequest(prompt=p, max_new_tokens=args.max_new_tokens)  # noqa: E731
        session.generate(prompts[0], config, learn=False)  # first-call setup outside the timings
        times: dict[str, list[float]] = {"in-process": [], "grpc-unary": [], "grpc-stream": []}
        texts_equal = True
        for prompt in prompts:
            t0 = time.perf_counter()
            local = session.generate(prompt, config, learn=False)
            times["in-process"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            reply = stub.Generate(request(prompt), timeout=600)
            times["grpc-unary"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            streamed = "".join(c.text for c in stub.GenerateStream(request(prompt), timeout=600))
            times["grpc-stream"].append(time.perf_counter() - t0)
            texts_equal &= local.text == reply.text == streamed
        server.stop(grace=None)
        service.close()
    except (ValueError, CatalogError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base = statistics.mean(times["in-process"])
    report = {
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "precision": engine.precision,
        "texts_equal": texts_equal,
        **{f"{k}-mean-s": statistics.mean(v) for k, v in times.items()},
        **{f"{k}-overhead-ms": 1000 * (statistics.mean(v) - base) for k, v in times.items() if k != "in-process"},
    }
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
