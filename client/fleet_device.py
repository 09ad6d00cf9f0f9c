"""One device of the fleet, independent of Flower: what it holds, how it takes the global state,
how it runs a round of local sessions, and what it reports.

A device serves one target with the shared drafter. It owns its local prompts (they never leave
it), its device state (``DeviceState``: local adapter, acceptance head, n-gram cache, in
``<state_dir>/<drafter>--<target>/``, the directory ``omnidraft device serve --state-dir`` uses
too) and the last global state it received (``<state_dir>/global/``: manifest, adapter, cache),
so the coordinator sends a state only when the device does not hold it yet.

A simulated device's prompts are listed in its profile; a deployed device (no prompt list)
trains on the prompts its generation service logged since its previous round (``RequestLog``).

A training round (FedAvg semantics): the local adapter restarts from the global one, global cache
entries are merged into the local cache once per global version, the device decodes its next
``prompts_per_round`` local prompts with online learning, flushes the learner, and reports the
adapter, ``NgramStats`` (the target-token ids it learned as n-gram entries this round) and
metrics (acceptance and tokens per target call of the round's first session and of the whole
round; tokens trained; update seconds; payload bytes).

Models are shared: ``EnginePool`` (``engine_pool``) loads each base model once per process, and devices that run
one after the other in the same process swap only their adapters, caches and data.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from omnidraft.client.device_profile import DeviceProfile
from omnidraft.client.device_state import sha256 as _sha256
from omnidraft.client.device_state import slug
from omnidraft.client.engine_pool import EnginePool
from omnidraft.client.evaluation import AdaptivePass, FixedKPass, Phase
from omnidraft.client.recorded_outputs import announce, keep, output, record, record_missing, stored_outputs
from omnidraft.client.resource_policy import DeviceConditions, SystemConditions, UplinkLedger, busy_reason
from omnidraft.client.session import DeviceSession, name_seed
from omnidraft.proto import fleet_pb2
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.engine.recording_decodes import record_together
from omnidraft.shared.engine.recordings import RecordingStore
from omnidraft.shared.runtime.batched_steps import batchable
from omnidraft.shared.util.atomic_io import write_bytes_atomic
from omnidraft.shared.vocab.ngram_cache import NgramCache
from omnidraft.shared.wire import MetricKey, StatusKey, lora_spec, spec_digest

GLOBAL_DIR = "global"
FLEET_FILE = "fleet.json"
HISTORY_FILE = "history.jsonl"
EVAL_PROMPTS = 2  # a deployed device evaluates global states on its latest served prompts


class StateMismatch(ValueError):
    """Global state that does not match its manifest or this device's target (one line)."""


class FleetDevice:
    """A device's fleet-facing operations (see the module docstring)."""

    def __init__(self, profile: DeviceProfile, pool: EnginePool, conditions: DeviceConditions | None = None) -> None:
        """``conditions``: what the device is doing now, for its ``policy`` (default: this
        machine's power supply and request log)."""
        self.profile = profile
        self.pool = pool
        self.dir = Path(profile.state_dir)
        self.global_dir = self.dir / GLOBAL_DIR / slug(profile.target)
        self.conditions = conditions or SystemConditions(self.dir)
        self._unsaved: dict = {}  # what the open session's cache took in, recorded once it is saved

    def at_round(self, round_: int) -> FleetDevice:
        """This device as it is at ``round_`` (see ``DeviceProfile.at_round``)."""
        return FleetDevice(self.profile.at_round(round_), self.pool, self.conditions)

    def busy(self) -> str:
        """Why the owner's policy forbids a federated round now ("" when it allows one)."""
        expected = int(self._fleet_meta().get("last-uplink-bytes", 0))
        return busy_reason(self.profile.policy, self.conditions, UplinkLedger(self.dir), expected)

    def record_uplink(self, sent: int) -> None:
        """Count ``sent`` bytes of a round's reply against the daily uplink budget."""
        UplinkLedger(self.dir).add(sent)
        self._save_fleet_meta({**self._fleet_meta(), "last-uplink-bytes": int(sent)})

    def switch(self, target: str) -> FleetDevice:
        """Serve ``target`` (one this device offers) from now on, as a staged rollout asks; the
        old target stays on offer. Saved in the profile; returns the device as it is now."""
        p = self.profile
        if target == p.target:
            return self
        if target not in p.offers:
            raise StateMismatch(f"this device cannot serve {target!r} (it offers {', '.join(p.offers) or 'nothing'})")
        saved = DeviceProfile.load(p.state_dir)  # the stored profile (``p`` may carry a drift view)
        offers = {**{k: v for k, v in saved.offers.items() if k != target}, saved.target: saved.target_model}
        saved = replace(saved, target=target, target_model=saved.offers[target], offers=offers)
        saved.save()
        return FleetDevice(
            replace(p, target=target, target_model=saved.target_model, offers=offers), self.pool, self.conditions
        )

    # -- what the device holds ----------------------------------------------------------------
    def _fleet_meta(self) -> dict:
        try:
            return json.loads((self.dir / FLEET_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def _save_fleet_meta(self, meta: dict) -> None:
        write_bytes_atomic(self.dir / FLEET_FILE, json.dumps(meta).encode())

    def held_manifest(self) -> fleet_pb2.StateManifest | None:
        """The manifest of the global state this device holds, if its files are intact."""
        try:
            m = fleet_pb2.StateManifest()
            m.ParseFromString((self.global_dir / "manifest.pb").read_bytes())
            adapter = (self.global_dir / "adapter.safetensors").read_bytes()
            cache = (self.global_dir / "cache.pb").read_bytes()
        except Exception:  # missing or unparsable: the device holds nothing usable
            return None
        if _sha256(adapter) != m.adapter_sha256 or _sha256(cache) != m.cache_sha256:
            return None
        return m

    def status(self) -> dict:
        """What the coordinator needs to decide what to send (no local text)."""
        m = self.held_manifest()
        return {
            StatusKey.DEVICE: self.profile.device_id,
            StatusKey.TARGET: self.profile.target,
            StatusKey.CAN_SERVE: ",".join(sorted(self.profile.offers)),
            StatusKey.BUSY: self.busy(),
            StatusKey.JOINS_AT: self.profile.joins_at_round,
            StatusKey.PROBE: self.profile.probe,
            StatusKey.TRAINED: self.profile.target in self._fleet_meta().get("trained", []),
            StatusKey.STATE_VERSION: int(m.version) if m else -1,
            StatusKey.ADAPTER_SHA256: m.adapter_sha256 if m else "",
            StatusKey.CACHE_SHA256: m.cache_sha256 if m else "",
            StatusKey.TOKENIZER_SHA256: self._tokenizer_digest,
        }

    @property
    def _tokenizer_digest(self) -> str:
        """The target vocabulary's digest, kept in ``fleet.json`` so a status query does not load
        the models (a deployed device answers each message in a fresh process)."""
        key = f"{self.profile.drafter}|{self.profile.target_model}"
        meta = self._fleet_meta()
        digest = meta.get("tokenizer-sha256", {}).get(key)
        if digest is None:
            digest = self.pool.tokenizer_digest(self.profile.drafter, self.profile.target_model)
            meta = self._fleet_meta()
            self._save_fleet_meta({**meta, "tokenizer-sha256": {**meta.get("tokenizer-sha256", {}), key: digest}})
        return digest

    @property
    def engine(self) -> Engine:
        """This device's (shared, per-process) drafter/target engine."""
        return self.pool.engine(self.profile.drafter, self.profile.target_model)

    @property
    def target_vocab_size(self) -> int:
        """Tokens in the target's vocabulary (what the n-gram statistics index)."""
        return self.engine.bridge.target_vocab_size

    # -- taking the global state ----------------------------------------------------------------
    def receive(
        self,
        spec: fleet_pb2.TargetSpec,
        manifest_blob: bytes,
        adapter_blob: bytes | None,
        cache_blob: bytes | None,
        signature: bytes = b"",
    ) -> fleet_pb2.StateManifest:
        """Check, then store, a global state (the parts not sent must be the ones already held);
        returns its manifest. Raises StateMismatch, storing nothing (the device keeps its previous
        state), when the manifest's signature does not verify with the pinned fleet key
        (``profile.fleet_key``), the state is for another target or vocabulary, it is older than
        the held one (a replay), or a part fails its manifest checksum."""
        from omnidraft.shared.signing import SignatureError, pinned_keys, verify

        if self.profile.fleet_key:
            try:
                verify(pinned_keys(self.profile.fleet_key), manifest_blob, signature or b"")
            except SignatureError as exc:
                raise StateMismatch(str(exc)) from None
        manifest = fleet_pb2.StateManifest()
        try:
            manifest.ParseFromString(manifest_blob)
        except Exception:  # protobuf's DecodeError
            raise StateMismatch("the state manifest does not parse") from None
        if manifest.target != self.profile.target or spec.name != self.profile.target:
            raise StateMismatch(f"global state for {manifest.target!r}, this device serves {self.profile.target!r}")
        if manifest.spec_sha256 and spec_digest(spec) != manifest.spec_sha256:  # (states signed before it: none)
            raise StateMismatch(f"target {spec.name!r}: the received spec does not match its signed manifest")
        if spec.tokenizer_sha256 != self._tokenizer_digest:
            raise StateMismatch(f"target {spec.name!r}: the coordinator's tokenizer differs from this device's")
        held = self.held_manifest()
        if held is not None and manifest.version < held.version:
            raise StateMismatch(
                f"state version {manifest.version} is older than the held version {held.version} (replayed or stale)"
            )
        for kind, blob, digest in (
            ("adapter", adapter_blob, manifest.adapter_sha256),
            ("cache", cache_blob, manifest.cache_sha256),
        ):
            if blob is None:
                if held is None or getattr(held, f"{kind}_sha256") != digest:
                    raise StateMismatch(
                        f"the coordinator sent no {kind} and this device does not hold version {manifest.version}"
                    )
            elif _sha256(blob) != digest:
                raise StateMismatch(f"the received {kind} does not match its manifest checksum")
        if adapter_blob is not None:  # signed is not the same as usable: never store NaN or Inf weights
            try:
                tensors = load_safetensors(adapter_blob)
            except Exception:  # safetensors' error for a malformed blob
                raise StateMismatch("the received adapter does not parse") from None
            if not all(torch.isfinite(t).all() for t in tensors.values()):
                raise StateMismatch("the received adapter holds NaN or Inf")
        if adapter_blob is not None:
            write_bytes_atomic(self.global_dir / "adapter.safetensors", adapter_blob)
        if cache_blob is not None:
            write_bytes_atomic(self.global_dir / "cache.pb", cache_blob)
        write_bytes_atomic(self.global_dir / "spec.pb", spec.SerializeToString())
        write_bytes_atomic(self.global_dir / "manifest.pb", manifest_blob)
        return manifest

    def _spec(self) -> fleet_pb2.TargetSpec:
        spec = fleet_pb2.TargetSpec()
        spec.ParseFromString((self.global_dir / "spec.pb").read_bytes())
        return spec

    def global_adapter(self) -> dict[str, torch.Tensor]:
        """The tensors of the global adapter this device holds (where a round's training starts)."""
        return load_safetensors((self.global_dir / "adapter.safetensors").read_bytes())

    def session(self, *, use_global: bool = True, fresh: bool = False) -> DeviceSession:
        """A session with this device's local state; ``use_global`` restarts the adapter from the
        held global adapter and merges a newly received global cache (the fleet's released
        n-grams) into the local one. ``fresh`` (with ``use_global=False``): a session with
        nothing this device holds (the base drafter, a new rule and an empty lookup history,
        never saved). A device whose translator reads the n-gram cache (``translate="ngram"``)
        adds what the two tokenizers imply once (``Engine.seed_cache``; the same on every
        device, so never sent). Both are recorded as done when the session is saved (``save``)."""
        if fresh and use_global:
            raise ValueError("a fresh session holds no global state: pass use_global=False")
        manifest = self.held_manifest() if use_global else None
        if use_global and manifest is None:
            raise StateMismatch("this device holds no global state yet")
        lora = lora_spec(self._spec()) if manifest is not None else None
        engine = self.engine
        adapters = self.pool.adapters(self.profile.drafter, lora)
        local = self.profile.target_model  # the name `device serve --target` gives the same state
        engine.cache = NgramCache(max_bytes=self.profile.policy.cache_bytes, drafter=self.profile.drafter, target=local)
        adapters.add(local)
        # what a session initialises from torch's global generator (LoRA weights before they are
        # loaded, a new acceptance head) must not depend on what this worker process ran before
        # (models loaded, adapters added, other devices): a simulation is reproducible only then
        held = f"{manifest.version}:{manifest.adapter_sha256}" if manifest is not None else "local"
        torch.manual_seed(name_seed(f"{self.profile.device_id}/{held}"))
        adapters.reset(local)  # nothing of the previous device in this process
        engine.target_runner.reset()  # nor its last prompt for a prefill to keep (model_runner.prefill)
        session = DeviceSession(
            engine,
            target_name=local,
            state_dir=None if fresh else self.dir,
            adapters=adapters,
            lora=adapters.spec,
            online=self.profile.online,
            translate=self.profile.translate,
            state_key=self.profile.state_key or None,
        )
        meta = self._fleet_meta()
        self._unsaved = {}
        if self.profile.translate == "ngram" and (fresh or not meta.get("cache-seeded")):
            engine.seed_cache(session.cache)  # a fresh session's cache starts as a new device's
            if not fresh:
                self._unsaved["cache-seeded"] = True
        if manifest is not None:
            adapters.load_state_dict(local, self.global_adapter())
            session.drafter_changed()
            if meta.get("cache-merged") != manifest.cache_sha256:
                session.cache.merge(NgramCache.from_bytes((self.global_dir / "cache.pb").read_bytes()))
                self._unsaved["cache-merged"] = manifest.cache_sha256
        return session

    def save(self, session: DeviceSession) -> None:
        """Save ``session``'s state (``DeviceSession.save``), then record what its cache took
        in (``cache-seeded``, ``cache-merged``): a session that is not saved leaves them to the
        next one."""
        session.save()
        if self._unsaved:
            self._save_fleet_meta({**self._fleet_meta(), **self._unsaved})
            self._unsaved = {}

    # -- a round ------------------------------------------------------------------------------
    def train_round(self, round_: int) -> tuple[dict[str, torch.Tensor], set[int], dict]:
        """Run this round's local sessions with online learning; returns (adapter tensors,
        target ids learned as n-gram entries, metrics)."""
        p = self.profile
        reason = self.busy()
        if reason:
            raise StateMismatch(f"busy: {reason}")
        session = self.session()
        cache_before = {e.draft_ids: e.count for e in session.cache.entries()}
        prompts, next_prompt = self._round_prompts()
        first, whole = Phase(), Phase()
        outputs = []
        trained_tokens, update_s, replayed = 0, 0.0, 0
        store = self.recordings()
        # what to replay: the recordings (the missing ones decoded first by the target alone, side by side)
        found = record_missing(store, session, prompts, p.generation, signal=True) if store else [None] * len(prompts)
        for i, (prompt, recording) in enumerate(zip(prompts, found)):
            result = session.generate(prompt, p.generation, learn=True, replay=recording)
            replayed += recording is not None
            if store is not None and session.last_recording is not None:
                keep(store, prompt, p.generation, session.last_recording)
            if i == 0:
                first.add(result)
            whole.add(result)
            outputs.append(result.text)
            trained_tokens += result.training_sample.target_tokens if result.training_sample else 0
            update_s += session.last_update.seconds if session.last_update else 0.0
        if session.learner.buffer:
            update_s += session.learner.update().seconds
        learned = {e.target_id for e in session.cache.entries() if e.count > cache_before.get(e.draft_ids, 0)}
        self.save(session)
        if p.prompts:  # a deployed device's text stays in its request log only
            self._append_history(round_, prompts, outputs)
        meta = self._fleet_meta()
        self._save_fleet_meta(
            {
                **meta,
                "next-prompt": next_prompt,
                "round": round_,
                "trained": sorted({*meta.get("trained", []), p.target}),
            }
        )
        f, w = first.summary(), whole.summary()
        metrics = {
            MetricKey.TRAINED_TOKENS: trained_tokens,
            MetricKey.ACCEPTANCE_FIRST: f["acceptance_rate"],
            MetricKey.TOKENS_PER_CALL_FIRST: f["tokens_per_target_call"],
            MetricKey.ACCEPTANCE: w["acceptance_rate"],
            MetricKey.TOKENS_PER_CALL: w["tokens_per_target_call"],
            MetricKey.MODELLED_SPEEDUP: w["modelled_speedup_vs_ar"] or 0.0,
            MetricKey.REPLAYED: replayed / len(prompts) if prompts else 0.0,
            MetricKey.GENERATED_TOKENS: w["new_tokens"],
            MetricKey.UPDATE_S: update_s,
            MetricKey.CACHE_ENTRIES: len(session.cache),
        }
        return session.adapters.state_dict(p.target_model), learned, metrics

    def _round_prompts(self) -> tuple[list[str], int]:
        """The prompts this device's next round trains on (a deployed device: what it served
        since its previous round) and where the round after starts."""
        p, start = self.profile, self._fleet_meta().get("next-prompt", 0)
        if p.prompts:
            prompts = [p.prompts[(start + i) % len(p.prompts)] for i in range(p.prompts_per_round)]
            return prompts, start + len(prompts)
        served = self.request_log().since(start)[: p.prompts_per_round]
        return [prompt for _, prompt in served], served[-1][0] + 1 if served else start

    def announce(self, *, train: bool, heldout: bool) -> int:
        """Simulations: name to the recording store what this round will ask of this device
        (``recorded_outputs.announce``): its training prompts and the held-out ones an evaluation
        replays (a probe decodes its speed prompts live). Returns how many the store lacks."""
        p, store = self.profile, self.recordings()
        if store is None or not batchable(self.engine.target_runner):  # recorded one by one anyway
            return 0
        lacking = announce(store, self._round_prompts()[0], p.generation, signal=True) if train else 0
        live = len(p.speed_heldout) if p.probe else 0
        return lacking + (announce(store, p.heldout[live:], p.generation) if heldout else 0)

    def recordings(self) -> RecordingStore | None:
        """The store this device's learning decodes replay from and record to (simulations
        only: ``profile.recordings``), or None."""
        p = self.profile
        return self.engine.recordings(p.recordings) if p.recordings and p.generation.greedy else None

    def request_log(self):
        """The prompts this device's generation service logged (``RequestLog``)."""
        from omnidraft.client.request_log import RequestLog
        from omnidraft.client.state_key import StateCipher

        cipher = StateCipher(self.profile.state_key, create=False) if self.profile.state_key else None
        return RequestLog(self.dir, cipher)

    def _append_history(self, round_: int, prompts: list[str], outputs: list[str]) -> None:
        """Keep this round's prompts and outputs in the device's own ``history.jsonl`` (the only
        place local text is stored; nothing here is ever sent)."""
        path = self.dir / HISTORY_FILE
        old = path.read_bytes() if path.exists() else b""
        new = "".join(json.dumps({"round": round_, "prompt": p, "output": o}) + "\n" for p, o in zip(prompts, outputs))
        write_bytes_atomic(path, old + new.encode())

    def history(self) -> list[dict]:
        path = self.dir / HISTORY_FILE
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def evaluate(
        self,
        *,
        use_global: bool = True,
        measure_ar: bool = False,
        fixed_k: int = 0,
        adaptive: bool = True,
        fresh: bool = False,
    ) -> dict:
        """Decode the held-out prompts with the global state (or, ``use_global=False``, with the
        device's local state alone; ``fresh``: with nothing it holds, ``session``), without learning.

        ``adaptive``: decode the first ``profile.speed_prompts`` of them (0: all) as the device
        decodes (adaptive draft length; acceptance, tok/s), and with ``measure_ar`` compare with
        the target alone on the same prompts (``speedup``). ``fixed_k``: also score all of them
        drafting exactly ``fixed_k`` drafter tokens per round (the paper's protocol;
        ``fixed-k-acceptance`` does not depend on how long the drafter chooses to draft). With
        greedy decoding that pass replays the target's recorded output (``RecordedTarget``)
        instead of running the target, the prompts side by side after the adaptive pass
        (``FixedKPass.decode_together``). The target alone's outputs do not change between
        rounds (``_target_alone`` keeps them); its speed is timed in every evaluation."""
        if not adaptive and not fixed_k:
            raise ValueError("an evaluation without the adaptive pass needs a fixed draft length")
        session = self.session(use_global=use_global, fresh=fresh)
        session.learn = False
        p = self.profile
        if not p.heldout:  # a deployed device: its latest served prompts
            p = replace(p, heldout=[prompt for _, prompt in self.request_log().since(0)[-EVAL_PROMPTS:]])
        t0 = time.perf_counter()
        replay = bool(fixed_k) and p.generation.greedy
        timed = adaptive and measure_ar
        # untimed, with a recording store (a simulation's newcomers and veterans; never a probe, the
        # live panel), the adaptive pass replays the target's recorded output too: its speed is modelled
        store = self.recordings()
        replay_adaptive = adaptive and not timed and not p.probe and store is not None
        speed = p.speed_heldout if adaptive else []
        # the recorded outputs the passes replay; a timed evaluation records its speed prompts live
        alone = self._target_alone(session, p, store) if replay_adaptive or (replay and not timed) else None
        adaptive_pass = (
            AdaptivePass(session, p.generation, measure_ar=timed, modelled=replay_adaptive) if adaptive else None
        )
        for i, prompt in enumerate(speed):
            adaptive_pass.decode(prompt, replay=alone[i] if replay_adaptive else None)
            if alone is not None and alone[i] is None:  # decoded live just now: its output is the recording
                alone[i] = record(store, session, prompt, p.generation, adaptive_pass.last.token_ids)
        metrics = adaptive_pass.metrics() if adaptive_pass is not None else {}
        # a panel device keeps its rule's counted acceptance from round to round, as a serving
        # device does (re-fitted for each new adapter), not a cold rule each round
        if adaptive and p.probe and not fresh:
            self.save(session)
        if fixed_k:
            fixed_pass = FixedKPass(session, p.generation, fixed_k)
            if replay and alone is None:  # the speed prompts' outputs were recorded live just now
                alone = self._target_alone(session, p, store, adaptive_pass.alone)
            # the prompts recorded already replay side by side; the others run the target, one by one
            recorded = [i for i in range(len(p.heldout)) if replay and alone[i] is not None]
            fixed_pass.decode_together([p.heldout[i] for i in recorded], [alone[i]["ids"] for i in recorded])
            for i in sorted(set(range(len(p.heldout))) - set(recorded)):
                result = fixed_pass.decode(p.heldout[i])
                if replay:
                    record(store, session, p.heldout[i], p.generation, result.token_ids)
            fixed = fixed_pass.summary()
            metrics[MetricKey.FIXED_K_ACCEPTANCE] = fixed["acceptance_rate"]
            metrics[MetricKey.FIXED_K_TOKENS_PER_CALL] = fixed["tokens_per_target_call"]
            metrics.setdefault(MetricKey.GENERATED_TOKENS, fixed["new_tokens"])
        return {**metrics, MetricKey.EVAL_S: time.perf_counter() - t0}

    def _target_alone(
        self, session: DeviceSession, p: DeviceProfile, store: RecordingStore | None, live: Sequence[dict] = ()
    ) -> list[dict | None]:
        """The target alone on each held-out prompt: {"ids": output ids, "tokens": their count,
        "s": seconds}. ``live``: the runs of the first prompts the evaluation just timed (the
        speed baseline, run in every evaluation beside the speculative decode of the same prompt,
        so a speedup compares two decodes seconds apart, never a baseline from an earlier round on
        a machine whose speed has moved). The other outputs are needed as outputs only ("s" 0):
        from ``store``, the device's recording store where it has one (the missing ones decoded
        first by the target alone side by side, ``recorded_outputs.record_missing``; None where
        one is still missing: the caller decodes that prompt live and keeps its output,
        ``recorded_outputs.record``), else decoded by the target alone side by side
        (``recording_decodes.record_together``) once per (target, prompts, generation length and
        stops) and kept in ``fleet.json`` (only the latest set: a deployed device's prompts change)."""
        g = p.generation
        runs, rest = list(live), p.heldout[len(live) :]
        if store is None and rest:
            key = _sha256(
                json.dumps([p.target_model, rest, g.max_new_tokens, list(g.stop_strings), g.temperature]).encode()
            )[:16]
            held = self._fleet_meta().get("target-alone", {})
            if held.get("key") != key:
                engine = session.engine
                ids = [engine.prompt_ids(prompt)[1] for prompt in rest]
                decoded = record_together(engine.target_runner, engine.bridge, session.inter, ids, g)
                held = {"key": key, "runs": [output(r.generated) for r in decoded]}
                self._save_fleet_meta({**self._fleet_meta(), "target-alone": held})
            return runs + list(held["runs"])
        return runs + stored_outputs(store, session, rest, g)
