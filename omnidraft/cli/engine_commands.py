"""``omnidraft models | generate | bench | adapt | drift | profile | doctor``: the engine on this machine."""

from __future__ import annotations

import json
import sys

from omnidraft.cli.common import (
    Parser,
    UsageError,
    dtype_arg,
    generation_config,
    load_engine,
    open_session,
    pair_args,
)


def add_parsers(sub) -> None:
    """This group's commands on the top-level subparsers ``sub``."""
    models = sub.add_parser("models", help="the model catalog")
    msub = models.add_subparsers(dest="action", required=True, parser_class=Parser)
    msub.add_parser("list", help="list catalog models").add_argument("--json", action="store_true")
    pull = msub.add_parser("pull", help="download, verify and store models")
    pull.add_argument("names", nargs="+", metavar="NAME")
    pull.add_argument("--force", action="store_true", help="pull again even if present")
    pull.add_argument(
        "--format",
        choices=("safetensors", "gguf"),
        default=None,
        help="gguf: the GGUF as shipped, packed from it layer by layer at load; safetensors: "
        "converted to float32, six times the disk, a few seconds quicker to load. "
        "Default: the format a model is pulled in, else $OMNIDRAFT_MODEL_FORMAT, else gguf",
    )
    info = msub.add_parser("info", help="show a model's pins and on-disk state")
    info.add_argument("name")

    gen = sub.add_parser("generate", help="generate text for one prompt")
    pair_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--method", default="omnidraft", choices=["omnidraft", "ar"])
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="apply the target's chat template")
    gen.add_argument("--json", action="store_true")

    bench = sub.add_parser(
        "bench",
        help="compare ar, uag, pld, omnidraft, llamacpp and llamacpp-pld on a dataset "
        "(with --state-dir, omnidraft-cold: the same decoder without the learned state)",
    )
    pair_args(bench)
    bench.add_argument(
        "--dataset",
        required=True,
        help="humaneval, pydoc, codebase:<package> (function heads of an installed package) or a JSONL file with a 'prompt' field",
    )
    bench.add_argument("--limit", type=int, default=None)
    bench.add_argument("--methods", default="ar,uag,pld,omnidraft")
    bench.add_argument("--out", default=None, help="write the JSON report here")
    adapt = sub.add_parser("adapt", help="learn online on a prompt stream; held-out speed before/after")
    pair_args(adapt)
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


def doctor(args) -> int:
    from omnidraft.shared.runtime.doctor import diagnose, format_report

    report = diagnose()
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def profile(args) -> int:
    from omnidraft.shared.engine import auto_precision, profiling
    from omnidraft.shared.engine.pair import Engine
    from omnidraft.shared.engine.precision import runner_backend

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
        precision, costs = auto_precision.choose_precision(args.target, refresh=args.refresh)
        auto = {
            "chosen": precision,
            "score_ms": {p: round(auto_precision.verification_score(c), 2) for p, c in costs.items()},
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
    if auto and auto["score_ms"]:
        print(
            "auto: "
            + ", ".join(f"{p} {ms:.1f} ms" for p, ms in auto["score_ms"].items())
            + f" (1-token step + 4-token block) -> {auto['chosen']}"
        )
    elif auto:
        print(f"auto: {auto['chosen']} (the only precision that keeps this target's greedy output here)")
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


def models(args) -> int:
    from omnidraft.shared.engine import catalog

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


def generate(args) -> int:
    config = generation_config(args)
    if not args.prompt:
        raise UsageError("omnidraft generate: --prompt must not be empty")
    engine = load_engine(args)
    if args.state_dir and args.method == "omnidraft":
        result = open_session(args, engine).generate(args.prompt, config, chat=args.chat, learn=False)
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


def bench(args) -> int:
    from omnidraft.benchmarks import bench
    from omnidraft.shared.engine import catalog
    from omnidraft.shared.util.atomic_io import write_bytes_atomic

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
    if "omnidraft-cold" in methods and not args.state_dir:
        raise UsageError(
            "omnidraft bench: omnidraft-cold compares against --state-dir's learned state: give --state-dir"
        )
    config = generation_config(args)
    try:
        prompts = bench.load_prompts(args.dataset, args.limit)
    except ValueError as exc:
        raise UsageError(f"omnidraft bench: {exc}") from None
    engine = load_engine(args)
    session = open_session(args, engine) if args.state_dir and "omnidraft" in methods else None
    report = bench.run_bench(engine, prompts, methods, config, translate=args.translate, session=session)
    print(bench.format_table(report))
    if args.out:
        write_bytes_atomic(args.out, json.dumps(report, indent=2).encode())
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def adapt(args) -> int:
    from omnidraft.benchmarks import adapt as adapt_run
    from omnidraft.benchmarks import bench
    from omnidraft.client.online_learner import OnlineConfig
    from omnidraft.shared.learning.adapters import LoraSpec
    from omnidraft.shared.learning.distill import LossConfig

    if args.limit is not None and args.limit < 2:
        raise UsageError("omnidraft adapt: --limit must be >= 2")
    if args.acceptance_k < 0:
        raise UsageError("omnidraft adapt: --acceptance-k must be >= 0")
    config = generation_config(args)
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
    engine = load_engine(args)
    if args.ablation:
        report = adapt_run.run_ablation(engine, prompts, config, args.train_fraction, online, lora, args.translate)
        report["config"] = dict(vars(args))
        print(adapt_run.format_ablation(report))
        return _write_outputs(args, report, None)
    session = open_session(args, engine, lora=lora, online=online, learn=args.loss != "none", adaptive=not args.no_head)
    report = adapt_run.run_adapt(session, prompts, config, args.train_fraction, fixed_k=args.acceptance_k)
    report["config"] = {k: v for k, v in vars(args).items()}
    print(adapt_run.format_table(report))
    if args.state_dir:
        session.save()
        print(f"saved device state to {session.state.dir}", file=sys.stderr)
    return _write_outputs(args, report, adapt_run.plot_curve)


def drift(args) -> int:
    from omnidraft.benchmarks import drift as drift_run

    config = generation_config(args)
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
    from omnidraft.benchmarks.adapt import write_json

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
