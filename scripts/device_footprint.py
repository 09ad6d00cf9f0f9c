"""A device's footprint: disk and memory of a drafter/target pair generating and learning.

Loads the pair as ``omnidraft device serve`` does (``Engine.load`` with the target in int8 and
a ``DeviceSession`` that learns), generates ``--prompts`` HumanEval prompts with an adapter
update every ``--interval`` of them, and prints one JSON object: the models' bytes on disk and
their format, the seconds to load, and the process's memory read from ``/proc/self/status``
(``VmRSS`` resident, ``RssAnon`` of it not backed by a file, ``VmHWM`` the peak) after loading
and after the generations. It acts as a board (``--memory-mb``, default 4096, sets
``OMNIDRAFT_MEMORY_MB``: what the process does where memory is short, e.g. handing a re-pack's
temporaries back layer by layer). Run it in a fresh process per measurement:

    omnidraft models pull smollm2-135m qwen2.5-coder-1.5b --format gguf
    python scripts/device_footprint.py --drafter smollm2-135m --target qwen2.5-coder-1.5b
    python scripts/device_footprint.py --lora-rank 8 --ffa    # the default simulation's device recipe
    python scripts/device_footprint.py --float32-training    # as a CPU without native bf16 trains (AVX2, Arm)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def memory_mb() -> dict[str, int]:
    """This process's VmRSS, RssAnon and VmHWM in MB (``/proc/self/status``)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "VmHWM"):
            fields[key] = int(value.split()[0]) // 1024
    return fields


def non_negative(text: str) -> int:
    """An argparse type: an integer >= 0 (else argparse's one-line usage error, exit 2)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="smollm2-135m")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=4, help="HumanEval prompts generated")
    ap.add_argument("--interval", type=int, default=2, help="prompts per adapter update")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--recompute-layers",
        type=non_negative,
        help="the learner's recompute_layers (default: as --memory-mb decides, 1 on a board; 0 holds "
        "every layer's activations, as on larger machines)",
    )
    ap.add_argument(
        "--lora-rank",
        type=non_negative,
        default=32,
        help="the drafter adapter's rank (default 32: a device learning alone; a fleet sets its own, 8 by default)",
    )
    ap.add_argument("--ffa", action="store_true", help="FFA-LoRA as a fleet may set it: A frozen, only B trained")
    ap.add_argument(
        "--float32-training",
        action="store_true",
        help="train in float32, as the learner does on CPUs without native bf16 (AVX2, most Arm boards)",
    )
    ap.add_argument(
        "--memory-mb",
        type=non_negative,
        default=4096,
        help="the board's memory the process acts on (OMNIDRAFT_MEMORY_MB; default 4096; 0: this machine's)",
    )
    args = ap.parse_args()
    if args.lora_rank < 1:
        ap.error("--lora-rank must be >= 1")
    from omnidraft.shared.runtime.heap import MEMORY_ENV

    if args.memory_mb:
        os.environ[MEMORY_ENV] = str(args.memory_mb)

    from omnidraft.benchmarks.bench import load_prompts
    from omnidraft.client.online_learner import OnlineConfig
    from omnidraft.client.session import DeviceSession
    from omnidraft.shared.engine import catalog
    from omnidraft.shared.engine.generation import GenerationConfig
    from omnidraft.shared.engine.pair import Engine
    from omnidraft.shared.learning.adapters import LoraSpec

    start = time.perf_counter()
    engine = Engine.load(args.drafter, args.target, "int8", progress=False)
    load_s = time.perf_counter() - start
    after_load = memory_mb()
    online = OnlineConfig(
        interval=args.interval,
        recompute_layers=args.recompute_layers,
        bf16_autocast=False if args.float32_training else None,
    )
    lora = LoraSpec(rank=args.lora_rank, ffa=args.ffa)
    session = DeviceSession(engine, target_name=args.target, online=online, lora=lora)
    updates = []
    for prompt in load_prompts("humaneval", args.prompts):
        session.generate(prompt, GenerationConfig(max_new_tokens=args.max_new_tokens))
        if session.last_update is not None:
            updates.append(session.last_update.seconds)
    models = {
        name: {
            "format": catalog.pulled_format(name) or "directory",
            "bytes_on_disk": disk_bytes(catalog.resolve(name, progress=False)),
        }
        for name in (args.drafter, args.target)
    }
    print(
        json.dumps(
            {
                "models": models,
                "disk_mb": sum(m["bytes_on_disk"] for m in models.values()) // 2**20,
                "target_backend": engine.target_runner.backend if hasattr(engine.target_runner, "backend") else "torch",
                "load_s": round(load_s, 1),
                "after_load_mb": after_load,
                "after_generating_and_learning_mb": memory_mb(),
                "adapter_updates": len(updates),
                "recompute_layers": session.learner.recompute_layers,
                "memory_mb": args.memory_mb,
                "lora": {"rank": args.lora_rank, "ffa": args.ffa},
                "training_dtype": "bfloat16" if session.learner.autocast else "float32",
                "update_s": [round(t, 1) for t in updates],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
