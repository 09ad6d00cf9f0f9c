"""Which federated recipe lets a fleet's drafter learn: an offline replay of federated rounds.

Under greedy decoding the committed text is the target's own output whatever the drafter
drafted, so a device's training samples do not depend on the adapter it holds. This script
decodes the simulation's data once per device (the same sources and Dirichlet split as
``simulations/run.py``), then replays rounds of federated learning under several recipes, each
from the same untrained global adapter:

* each round a seeded sample of devices trains from the global adapter on its next
  ``--prompts-per-round`` samples with the device's own ``OnlineLearner`` (``epochs`` passes
  over them, AdamW or SGD);
* the coordinator aggregates the updates weighted by trained tokens and applies the server
  step (``omnidraft.coordinator.server_opt``: plain FedAvg, server momentum, or server Adam);
* after every round the global adapter is scored on the probe devices' held-out samples by the
  drafter's teacher-forced agreement with the target (``top1``, ``k4``, ``rounds_k4``; see
  ``omnidraft.shared.learning.distill.teacher_forced_agreement``).

    python scripts/fed_sweep.py collect --target qwen2.5-coder-0.5b --out fed-samples.pt
    python scripts/fed_sweep.py sweep --target qwen2.5-coder-0.5b --samples fed-samples.pt \\
        --recipes 'fedavg:adamw,lr=1e-3,epochs=1' 'adamw,lr=1e-3,epochs=4;server=adam,slr=3e-3'

A recipe is ``LOCAL[;server=KIND,slr=X]``, LOCAL being ``adamw|sgd,lr=X,epochs=N``; a leading
``NAME:`` labels it.

Two more commands compare the global adapters a simulation committed (``--run``, the
``--out`` of ``simulations/run.py``; versions ``adapter-v<N>.safetensors`` of the target):

* ``score``: each version's teacher-forced agreement on the probe samples of ``--samples``
  (what ``sweep`` measures);
* ``decode``: each version's acceptance when decoding, drafting exactly ``--k`` tokens per
  round, the held-out prompts of the run's first training devices that serve the target (their
  text stays in the run's ``devices/`` folders on this machine), with an empty n-gram cache
  (``--no-heal``: without token healing; ``--replay``: the target runs once per prompt and its
  greedy output is replayed for every version, the same figures at the drafter's cost).

* ``pooled``: one adapter trained on *all* the training devices' samples of ``--samples``
  (the fleet's data pooled on one device, ``--epochs`` passes), scored both ways before and
  after each pass: the upper bound of what the fleet's data can teach the drafter.

    python scripts/fed_sweep.py score --target gemma3-270m --samples fed-samples.pt --run runs/x
    python scripts/fed_sweep.py decode --target gemma3-270m --run runs/x --prompts 30 --translate text
    python scripts/fed_sweep.py pooled --target gemma3-270m --samples fed-samples.pt --run runs/x \\
        --epochs 2 --translate text
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from omnidraft.client.online_learner import OPTIMIZERS, OnlineConfig, OnlineLearner, default_training_autocast
from omnidraft.client.session import DeviceSession
from omnidraft.coordinator.server_opt import ServerOptConfig, ServerOptimizer
from omnidraft.shared.engine.catalog import CatalogError
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec
from omnidraft.shared.learning.distill import teacher_forced_agreement
from omnidraft.shared.learning.training_signal import Intersection

DRAFTER = "smollm2-135m"


def _generation(args) -> GenerationConfig:
    """Greedy decoding of ``--max-new-tokens`` tokens: what ``collect`` records, ``decode`` and
    ``pooled`` score and ``--replay`` replays."""
    return GenerationConfig(max_new_tokens=args.max_new_tokens)


def collect(args) -> None:
    from omnidraft.simulations import data

    corpus = data.load_corpus(args.data)
    parts = data.split(corpus, args.devices + args.probes, args.per_device, alpha=args.alpha, seed=args.seed)
    engine = Engine.load(DRAFTER, args.target, args.dtype)
    session = DeviceSession(engine, target_name=args.target, adaptive=False, grow_cache=False)
    config = _generation(args)
    devices = []
    t0 = time.perf_counter()
    for d, part in enumerate(parts):
        samples = [session.generate(corpus.prompts[i], config, learn=True, observe=False).training_sample for i in part]
        devices.append(
            {
                "probe": d >= args.devices,
                "samples": [s for s in samples if s is not None],
                "labels": [corpus.labels[i] for i in part],
            }
        )
        print(f"{d + 1}/{len(parts)} devices, {time.perf_counter() - t0:.0f} s", flush=True)
    torch.save({"devices": devices, "args": vars(args)}, args.out)


def parse_recipe(text: str) -> tuple[str, dict, ServerOptConfig]:
    """``[NAME:]LOCAL[;server=KIND,slr=X,...]`` -> (name, local settings, server config)."""
    name, _, body = text.rpartition(":") if ":" in text else (text, "", text)
    local_text, _, server_text = body.partition(";")
    kind, *pairs = local_text.split(",")
    local = {"optimizer": kind, "lr": 1e-3, "epochs": 1}
    for pair in pairs:
        key, _, value = pair.partition("=")
        local[key] = int(value) if key == "epochs" else float(value)
    server = {}
    for pair in filter(None, server_text.split(",")):
        key, _, value = pair.partition("=")
        server[{"server": "kind", "slr": "lr"}.get(key, key)] = value if key == "server" else float(value)
    if local["optimizer"] not in OPTIMIZERS:
        raise SystemExit(f"fed_sweep: unknown local optimizer {local['optimizer']!r} in {text!r}")
    config = ServerOptConfig(**server)
    config.validate()
    return name or text, local, config


def local_update(adapters: DrafterAdapters, name: str, inter: Intersection, samples, local: dict) -> dict:
    """Train ``name``'s adapter (already holding the global one) on ``samples``; returns its tensors."""
    learner = OnlineLearner(
        adapters,
        name,
        inter,
        None,
        OnlineConfig(
            interval=len(samples), lr=local["lr"], head=False, epochs=local["epochs"], optimizer=local["optimizer"]
        ),
    )
    learner.buffer = list(samples)
    learner.update()
    return adapters.state_dict(name)


def load_samples(path: str) -> dict:
    """A ``collect`` file: ``{"devices": [{"probe", "samples", "labels"}, ...], "args"}``."""
    import pickle

    try:
        saved = torch.load(path, weights_only=False)
    except (pickle.UnpicklingError, EOFError, RuntimeError, AttributeError, ImportError):
        raise ValueError(f"{path} is not a fed_sweep collect file") from None
    if not (
        isinstance(saved, dict)
        and isinstance(saved.get("devices"), list)
        and all(isinstance(d, dict) and {"probe", "samples"} <= d.keys() for d in saved["devices"])
    ):
        raise ValueError(f"{path} is not a fed_sweep collect file")
    return saved


def training_samples(saved: dict) -> list:
    """The training devices' samples of a ``collect`` file, device by device."""
    return [s for d in saved["devices"] if not d["probe"] for s in d["samples"]]


def probe_samples(saved: dict) -> list:
    """The probe devices' held-out samples of a ``collect`` file (what every score uses)."""
    return [s for d in saved["devices"] if d["probe"] for s in d["samples"]]


def score(adapters: DrafterAdapters, name: str, samples) -> dict:
    adapters.activate(name)
    dtype = default_training_autocast()
    return teacher_forced_agreement(*adapters.decoder_and_head(dtype), samples, autocast=dtype)


def sweep(args) -> None:
    recipes = [parse_recipe(r) for r in args.recipes]  # bad recipes fail before anything loads
    saved = load_samples(args.samples)
    engine = Engine.load(DRAFTER, args.target, args.dtype)
    inter = Intersection(engine.bridge, engine.drafter.logit_rows)
    members = [d for d in saved["devices"] if not d["probe"]]
    heldout = probe_samples(saved)
    adapters = DrafterAdapters(engine.drafter.model, LoraSpec(rank=args.rank), drafter_weights=engine.drafter_weights)
    torch.manual_seed(args.seed)
    adapters.add("global")
    start = adapters.state_dict("global")
    print(json.dumps({"recipe": "untrained", **score(adapters, "global", heldout)}), flush=True)
    for name, local, server_config in recipes:
        rng = random.Random(args.seed)
        server = ServerOptimizer(server_config)
        glob = {k: v.clone() for k, v in start.items()}
        cursor = [0] * len(members)
        curve = []
        t0 = time.perf_counter()
        for rnd in range(1, args.rounds + 1):
            updates, weights = [], []
            for d in sorted(rng.sample(range(len(members)), args.per_round)):
                samples = members[d]["samples"]
                mine = [samples[(cursor[d] + i) % len(samples)] for i in range(args.prompts_per_round)]
                cursor[d] += args.prompts_per_round
                adapters.load_state_dict("global", glob)
                updates.append(local_update(adapters, "global", inter, mine, local))
                weights.append(float(sum(s.target_tokens for s in mine)))
            total = sum(weights)
            mean = {k: sum(u[k] * (w / total) for u, w in zip(updates, weights)) for k in glob}
            glob = {
                k: torch.from_numpy(v)
                for k, v in server.step(
                    {k: v.numpy() for k, v in glob.items()}, {k: v.numpy() for k, v in mean.items()}
                ).items()
            }
            adapters.load_state_dict("global", glob)
            curve.append({"round": rnd, **score(adapters, "global", heldout)})
        print(
            json.dumps(
                {
                    "recipe": name,
                    "local": local,
                    "server": server_config.as_dict(),
                    "seconds": round(time.perf_counter() - t0, 1),
                    "curve": curve,
                }
            ),
            flush=True,
        )


def _versions(args) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """The run's committed global adapters of ``args.target`` as (version, tensors), oldest first."""
    from safetensors.torch import load_file

    folder = Path(args.run) / "coordinator" / "targets" / args.target
    found = sorted((int(f.stem.rpartition("-v")[2]), f) for f in folder.glob("adapter-v*.safetensors"))
    if args.versions:
        found = [(v, f) for v, f in found if v in args.versions]
    if not found:
        raise ValueError(f"no global adapter versions of {args.target!r} under {folder}")
    return [(v, load_file(str(f))) for v, f in found]


def _run_lora(args) -> LoraSpec:
    """The LoRA settings the run's coordinator registered for the target."""
    from omnidraft.proto import fleet_pb2
    from omnidraft.shared.wire import lora_spec

    spec = fleet_pb2.TargetSpec()
    spec.ParseFromString((Path(args.run) / "coordinator" / "targets" / args.target / "spec.pb").read_bytes())
    return lora_spec(spec)


def score_versions(args) -> None:
    heldout = probe_samples(load_samples(args.samples))
    versions = _versions(args)
    engine = Engine.load(DRAFTER, args.target, args.dtype)
    adapters = DrafterAdapters(engine.drafter.model, _run_lora(args), drafter_weights=engine.drafter_weights)
    adapters.add("global")
    for version, tensors in versions:
        adapters.load_state_dict("global", tensors)
        print(
            json.dumps({"version": version, "samples": len(heldout), **score(adapters, "global", heldout)}), flush=True
        )


def _heldout_prompts(args) -> list[str]:
    """The first ``args.prompts`` held-out prompts of the run's training devices that serve
    ``args.target`` (their text stays in the run's ``devices/`` folders on this machine)."""
    from omnidraft.client.device_profile import DeviceProfile

    prompts = []
    for folder in sorted((Path(args.run) / "devices").iterdir()):
        try:
            profile = DeviceProfile.load(folder)
        except (OSError, ValueError, KeyError, TypeError):
            raise ValueError(f"{folder} holds no readable device profile (not a simulations/run.py output?)") from None
        if profile.target == args.target and not profile.probe:
            prompts += profile.heldout
    if not prompts:
        raise ValueError(f"no training device of {args.run!r} serves {args.target!r}")
    return prompts[: args.prompts]


def _decoding_session(args) -> tuple[Engine, DeviceSession]:
    """An engine and a non-learning session with the run's LoRA settings, for fixed-k decoding."""
    engine = Engine.load(DRAFTER, args.target, args.dtype)
    session = DeviceSession(
        engine,
        target_name=args.target,
        adaptive=False,
        learn=False,
        grow_cache=False,
        lora=_run_lora(args),
        translate=args.translate,
        heal=not args.no_heal,
    )
    return engine, session


def _decoded(args, session: DeviceSession, prompts: list[str], recordings: list[list[int]] | None = None) -> dict:
    """Fixed-k decoding of ``prompts`` with the session's current adapter (``recordings``: the
    target's greedy outputs, replayed instead of running the target)."""
    from omnidraft.client.evaluation import evaluate_fixed_k

    t0 = time.perf_counter()
    out = evaluate_fixed_k(session, prompts, _generation(args), args.k, recordings=recordings)
    return {
        "prompts": len(prompts),
        "translate": args.translate,
        "heal": not args.no_heal,
        "replayed": recordings is not None,
        **out,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _recordings(args, session: DeviceSession, prompts: list[str]) -> list[list[int]] | None:
    """With ``--replay``: the target alone's greedy output on each prompt (run once)."""
    from omnidraft.client.evaluation import target_alone

    if not args.replay:
        return None
    return [r.token_ids for r in target_alone(session, prompts, _generation(args))]


def decode_versions(args) -> None:
    prompts = _heldout_prompts(args)
    versions = _versions(args)
    _, session = _decoding_session(args)
    recordings = _recordings(args, session, prompts)
    for version, tensors in versions:
        session.adapters.load_state_dict(args.target, tensors)
        print(json.dumps({"version": version, **_decoded(args, session, prompts, recordings)}), flush=True)


def pooled(args) -> None:
    """The fleet's data pooled on one device: the upper bound of what it can teach the drafter.

    One adapter (the run's LoRA settings, from the untrained state) trains on every training
    device's samples of ``--samples`` in order, ``interval`` samples per update as a device
    does, for ``--epochs`` passes; before training and after each pass it is scored by
    teacher-forced agreement on the probe samples and by fixed-k decoding of the run's held-out
    prompts (as ``score`` and ``decode``)."""
    saved = load_samples(args.samples)
    train, heldout = training_samples(saved), probe_samples(saved)
    tokens = sum(s.target_tokens for s in train)
    prompts = _heldout_prompts(args)
    engine, session = _decoding_session(args)
    recordings = _recordings(args, session, prompts)
    name = args.target

    def report(epoch: int, seconds: float = 0.0) -> None:
        print(
            json.dumps(
                {
                    "epoch": epoch,
                    "trained-tokens": epoch * tokens,
                    "train-s": round(seconds, 1),
                    "teacher-forced": score(session.adapters, name, heldout),
                    "decoded": _decoded(args, session, prompts, recordings),
                }
            ),
            flush=True,
        )

    report(0)
    learner = OnlineLearner(
        session.adapters,
        name,
        Intersection(engine.bridge, engine.drafter.logit_rows),
        None,
        OnlineConfig(interval=args.interval, lr=args.lr, head=False),
    )
    train_s = 0.0
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        for i in range(0, len(train), args.interval):
            learner.buffer = train[i : i + args.interval]
            learner.update()
        train_s += time.perf_counter() - t0
        report(epoch, train_s)


def _version_list(text: str) -> set[int]:
    try:
        versions = {int(v) for v in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of versions: {text!r}") from None
    if min(versions) < 0:
        raise argparse.ArgumentTypeError("versions are >= 0")
    return versions


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, not {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text!r}")
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--target", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--data", help="as simulations/run.py --data (default: humaneval,stdlib,pydoc)")
    c.add_argument("--devices", type=int, default=50)
    c.add_argument("--probes", type=int, default=8)
    c.add_argument("--per-device", type=int, default=6)
    c.add_argument("--alpha", type=float, default=0.5)
    c.add_argument("--max-new-tokens", type=int, default=32)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--dtype", default="int8")
    s = sub.add_parser("sweep")
    s.add_argument("--target", required=True)
    s.add_argument("--samples", required=True)
    s.add_argument("--recipes", nargs="+", required=True)
    s.add_argument("--rounds", type=int, default=8)
    s.add_argument("--per-round", type=int, default=5, help="devices sampled per round")
    s.add_argument("--prompts-per-round", type=int, default=2)
    s.add_argument("--rank", type=int, default=8)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", default="int8")
    for name in ("score", "decode", "pooled"):
        v = sub.add_parser(name)
        v.add_argument("--target", required=True)
        v.add_argument("--run", required=True, help="a simulations/run.py --out folder")
        v.add_argument("--dtype", default="int8")
        if name != "pooled":
            v.add_argument("--versions", type=_version_list, help="comma-separated versions (default: all)")
        if name != "decode":
            v.add_argument("--samples", required=True, help="a collect file")
        if name == "pooled":
            v.add_argument("--epochs", type=_positive, default=1)
            v.add_argument("--lr", type=_positive_float, default=1e-3)
            v.add_argument("--interval", type=_positive, default=8, help="samples per update")
        if name != "score":
            v.add_argument("--prompts", type=_positive, default=30)
            v.add_argument("--k", type=_positive, default=4)
            v.add_argument("--translate", default="ngram", choices=("ngram", "text"))
            v.add_argument("--no-heal", action="store_true", help="draft without token healing")
            v.add_argument("--max-new-tokens", type=int, default=32)
            v.add_argument(
                "--replay",
                action="store_true",
                help="run the target once per prompt and replay its greedy output for every "
                "adapter (the same acceptance, at the drafter's cost)",
            )
    args = p.parse_args()
    commands = {
        "collect": collect,
        "sweep": sweep,
        "score": score_versions,
        "decode": decode_versions,
        "pooled": pooled,
    }
    try:
        commands[args.command](args)
    except (CatalogError, OSError, ValueError, RuntimeError) as exc:  # a missing samples file, an unknown target
        raise SystemExit(f"fed_sweep: {exc}") from None


if __name__ == "__main__":
    main()
