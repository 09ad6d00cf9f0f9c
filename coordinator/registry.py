"""The coordinator's target registry and each target's global state, on disk.

Layout under the coordinator root::

    targets/<slug>/spec.pb                 omnidraft.v1.TargetSpec
    targets/<slug>/candidates.pb           every (drafter ids -> target id) pair the two
                                           tokenizers imply (NgramCache, unbounded): released
                                           target ids are turned back into cache entries here
    targets/<slug>/adapter-v<N>.safetensors  the global LoRA adapter of version N
    targets/<slug>/cache-v<N>.pb           the global n-gram cache of version N (the released n-grams)
    targets/<slug>/manifest-v<N>.pb        the manifest of version N (kept for rollback)
    targets/<slug>/manifest-v<N>.sig       Ed25519 signature over manifest.pb's bytes of version N
    targets/<slug>/server-opt-v<N>.safetensors  the server optimizer's state after version N
                                           (coordinator-private; absent for a plain FedAvg
                                           step, version 0 and a rollback)
    targets/<slug>/manifest.pb             omnidraft.v1.StateManifest naming version N, written last
    targets/<slug>/privacy-v<N>.json       the n-gram release's privacy ledger after version N
                                           (written with the version it accounts for, so a
                                           round that did not commit is not charged; a
                                           rollback carries the ledger forward, never back)
    targets/<slug>/rollout.json            the share of capable devices moved to this target
    keys/manifest-ed25519.pem              the signing key (0600; devices pin its public key)

Every file is written atomically, and a new version's files are complete before the manifest
that names them replaces the old one, so a coordinator killed at any point restarts from the
last committed version. The last ``KEEP_VERSIONS`` versions are kept (``manifest-v<N>.pb`` with
their files) so that ``rollback`` can publish an earlier state again as a new version.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import AutoConfig, AutoTokenizer

from omnidraft.proto import fleet_pb2
from omnidraft.shared.engine import catalog
from omnidraft.shared.engine.pair import seed_cache_from_bridge
from omnidraft.shared.learning.adapters import DrafterAdapters, LoraSpec
from omnidraft.shared.util.atomic_io import file_lock, write_bytes_atomic
from omnidraft.shared.vocab.ngram_cache import NgramCache, NgramCacheError
from omnidraft.shared.vocab.vocab_bridge import VocabBridge
from omnidraft.shared.wire import lora_spec, spec_digest, tokenizer_digest  # noqa: F401 (re-exported)

SPEC_FILE = "spec.pb"
MANIFEST_FILE = "manifest.pb"
SIGNING_KEY = "keys/manifest-ed25519.pem"  # under the coordinator root
CANDIDATES_FILE = "candidates.pb"
LEGACY_PRIVACY_FILE = "privacy.json"  # the ledger before it was versioned (read when no versioned one exists)
ROLLOUT_FILE = "rollout.json"
GLOBAL_CACHE_ENTRIES = 65536  # capacity of a global cache (entries)
KEEP_VERSIONS = 5  # versions kept on disk per target (what `rollback` can restore)
_CANDIDATE_LIMIT = 1 << 22  # the candidates table keeps every pair


class RegistryError(Exception):
    """A registry problem meant for the user as one line (unknown target, corrupt state...)."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


@dataclass
class GlobalState:
    """One target's committed global state; ``adapter_blob``/``cache_blob`` are the exact bytes
    the manifest's sha256 values describe (what devices receive)."""

    spec: fleet_pb2.TargetSpec
    manifest: fleet_pb2.StateManifest
    adapter_blob: bytes
    cache_blob: bytes
    manifest_blob: bytes = b""  # the exact manifest bytes the signature covers
    signature: bytes = b""  # Ed25519 over manifest_blob (empty for states committed before signing)

    @property
    def adapter(self) -> dict[str, torch.Tensor]:
        return load_safetensors(self.adapter_blob)

    def cache(self, **capacity) -> NgramCache:
        return NgramCache.from_bytes(self.cache_blob, **capacity)


class TargetRegistry:
    """Targets and their global states under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise RegistryError(f"coordinator directory {self.root} is not a directory")
        self._candidates: dict[str, dict[int, tuple[int, ...]]] = {}

    def _dir(self, name: str) -> Path:
        return self.root / "targets" / slug(name)

    def names(self) -> list[str]:
        """Registered target names, sorted."""
        base = self.root / "targets"
        if not base.is_dir():
            return []
        return sorted(self.spec_of(d.name).name for d in base.iterdir() if (d / SPEC_FILE).is_file())

    def signing_key(self):
        """The coordinator's Ed25519 key (``<root>/keys/manifest-ed25519.pem``, created once)."""
        from omnidraft.shared.signing import SignatureError, load_or_create_key

        try:
            return load_or_create_key(self.root / SIGNING_KEY)
        except SignatureError as exc:
            raise RegistryError(str(exc)) from None

    def public_key(self) -> str:
        """The public key devices pin (hex)."""
        from omnidraft.shared.signing import public_key_hex

        return public_key_hex(self.signing_key())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (self._dir(name) / MANIFEST_FILE).is_file()

    # -- registration -------------------------------------------------------------------------
    def register(
        self,
        name: str,
        model: str,
        drafter: str,
        lora: LoraSpec = LoraSpec(rank=8),
        *,
        seed: int = 0,
        progress: bool = False,
    ) -> fleet_pb2.StateManifest:
        """Create ``name``'s state: an untrained adapter (B = 0, so the drafter is unchanged) and
        an empty global cache. The global cache carries only what the fleet released: the entries
        the two tokenizers alone give (``seed_cache_from_bridge``, also this target's release
        candidates) are the same on every device, so a device whose translator reads the cache
        builds them itself (``FleetDevice.session``) instead of downloading them. Loads the
        drafter (for the adapter's shapes) and the target's tokenizer and config, never the
        target's weights."""
        if not name or len(name) > 128 or slug(name) != name:
            raise RegistryError(f"bad target name {name!r}: use letters, digits, '.', '_' and '-'")
        if name in self:
            raise RegistryError(f"target {name!r} is already registered (version {self.manifest(name).version})")
        lora.validate()
        from omnidraft.shared.engine import model_runner  # torch model loading only when registering

        target_path = catalog.resolve(model, progress=progress)
        t_tok = AutoTokenizer.from_pretrained(target_path)
        t_config = AutoConfig.from_pretrained(target_path)
        d = model_runner.load(drafter, torch.float32, progress=progress)
        t_rows = getattr(t_config.get_text_config(), "vocab_size", None) or len(t_tok)
        bridge = VocabBridge.from_tokenizers(d.tokenizer, t_tok, d.logit_rows, t_rows)
        torch.manual_seed(seed)
        adapters = DrafterAdapters(d.model, lora, drafter_weights="hf")
        adapters.add(name)
        adapter = adapters.state_dict(name)
        candidates = NgramCache(max_entries=_CANDIDATE_LIMIT, drafter=drafter, target=name)
        seed_cache_from_bridge(candidates, bridge, d.tokenizer)
        cache = NgramCache(max_entries=GLOBAL_CACHE_ENTRIES, drafter=drafter, target=name)
        spec = fleet_pb2.TargetSpec(
            name=name,
            model=str(model),
            drafter=str(drafter),
            lora_rank=lora.rank,
            lora_alpha=float(lora.alpha),
            lora_modules=lora.modules,
            lora_ffa=lora.ffa,
            target_vocab_size=bridge.target_vocab_size,
            tokenizer_sha256=tokenizer_digest(bridge),
            registered_at=time.time(),
        )
        out = self._dir(name)
        write_bytes_atomic(out / CANDIDATES_FILE, candidates.to_bytes())
        write_bytes_atomic(out / SPEC_FILE, spec.SerializeToString())
        return self._commit(name, fleet_pb2.StateManifest(target=name), adapter, cache)

    # -- reading ------------------------------------------------------------------------------
    def spec_of(self, dirname: str) -> fleet_pb2.TargetSpec:
        spec = fleet_pb2.TargetSpec()
        spec.ParseFromString((self.root / "targets" / dirname / SPEC_FILE).read_bytes())
        return spec

    def spec(self, name: str) -> fleet_pb2.TargetSpec:
        self._require(name)
        return self.spec_of(slug(name))

    def manifest(self, name: str) -> fleet_pb2.StateManifest:
        return self._manifest(name)[0]

    def _manifest(self, name: str) -> tuple[fleet_pb2.StateManifest, bytes]:
        self._require(name)
        m = fleet_pb2.StateManifest()
        try:
            blob = (self._dir(name) / MANIFEST_FILE).read_bytes()
            m.ParseFromString(blob)
        except Exception as exc:  # protobuf raises DecodeError; OSError for unreadable files
            raise RegistryError(f"target {name!r}: unreadable manifest ({exc})") from None
        return m, blob

    def load(self, name: str) -> GlobalState:
        """The committed state of ``name``; RegistryError if a file fails its checksum."""
        m, manifest_blob = self._manifest(name)
        blobs = []
        for kind, digest in (("adapter", m.adapter_sha256), ("cache", m.cache_sha256)):
            path = self._dir(name) / self._file(kind, m.version)
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise RegistryError(f"target {name!r}: {path.name} unreadable ({exc.strerror})") from None
            if sha256(data) != digest:
                raise RegistryError(f"target {name!r}: {path.name} does not match its manifest checksum")
            blobs.append(data)
        sig = self._dir(name) / self._file("signature", m.version)
        signature = sig.read_bytes() if sig.is_file() else b""
        return GlobalState(self.spec(name), m, *blobs, manifest_blob=manifest_blob, signature=signature)

    def candidates(self, name: str) -> dict[int, tuple[int, ...]]:
        """target id -> the drafter ids that spell it (from the tokenizers alone)."""
        if name not in self._candidates:
            self._require(name)
            try:
                table = NgramCache.from_bytes(
                    (self._dir(name) / CANDIDATES_FILE).read_bytes(), max_entries=_CANDIDATE_LIMIT
                )
            except (OSError, NgramCacheError) as exc:
                raise RegistryError(f"target {name!r}: candidates unreadable ({exc})") from None
            out: dict[int, tuple[int, ...]] = {}
            for e in table.entries():
                out.setdefault(e.target_id, e.draft_ids)
            self._candidates[name] = out
        return self._candidates[name]

    def privacy_ledger(self, name: str) -> dict | None:
        """The n-gram release's ledger as of the current version (None: nothing spent yet)."""
        version = self.manifest(name).version
        for path in (self._dir(name) / self._file("privacy", version), self._dir(name) / LEGACY_PRIVACY_FILE):
            try:
                return json.loads(path.read_text())
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:  # never restart a ledger from zero silently
                raise RegistryError(f"target {name!r}: privacy ledger {path.name} is unreadable ({exc})") from None
        return None

    # -- committing a round -------------------------------------------------------------------
    def commit(
        self,
        name: str,
        adapter: dict[str, torch.Tensor],
        cache: NgramCache,
        *,
        round_: int,
        devices: int,
        tokens: int,
        server_state: dict[str, torch.Tensor] | None = None,
        privacy_ledger: dict | None = None,
    ) -> fleet_pb2.StateManifest:
        """Write version N+1 of ``name``'s state (adapter, cache, the server optimizer's
        ``server_state``, the release's ``privacy_ledger`` (default: carried over), then
        manifest), holding the target's lock: a ``fleet rollback`` or
        another writer waits, so no version number is written twice."""
        with self._lock(name):
            return self._commit_next(
                name,
                adapter,
                cache,
                round_=round_,
                devices=devices,
                tokens=tokens,
                server_state=server_state,
                privacy_ledger=privacy_ledger,
            )

    def _lock(self, name: str):
        """The target's writer lock (an advisory ``flock`` on ``<target>/.lock``)."""
        return file_lock(self._dir(name) / ".lock")

    def _commit_next(
        self,
        name: str,
        adapter: dict[str, torch.Tensor],
        cache: NgramCache,
        *,
        round_: int,
        devices: int,
        tokens: int,
        server_state: dict[str, torch.Tensor] | None,
        privacy_ledger: dict | None,
    ) -> fleet_pb2.StateManifest:
        old = self.manifest(name)
        m = fleet_pb2.StateManifest(
            target=name,
            version=old.version + 1,
            round=round_,
            parent_version=old.version,
            devices_total=old.devices_total + devices,
            tokens_total=old.tokens_total + tokens,
        )
        if server_state:
            write_bytes_atomic(
                self._dir(name) / self._file("server-opt", m.version),
                save_safetensors({k: v.contiguous() for k, v in server_state.items()}),
            )
        self._write_ledger(name, m.version, privacy_ledger if privacy_ledger is not None else self.privacy_ledger(name))
        return self._commit(name, m, adapter, cache)

    def _write_ledger(self, name: str, version: int, ledger: dict | None) -> None:
        if ledger is not None:
            write_bytes_atomic(self._dir(name) / self._file("privacy", version), json.dumps(ledger).encode())

    def server_state(self, name: str) -> dict[str, torch.Tensor]:
        """The server optimizer's state saved with the current version ({} if none, or unreadable:
        the optimizer then starts afresh)."""
        version = self.manifest(name).version
        try:
            return load_safetensors((self._dir(name) / self._file("server-opt", version)).read_bytes())
        except (OSError, SafetensorError):  # missing, or unreadable: fresh moments
            return {}

    def _commit(
        self, name: str, m: fleet_pb2.StateManifest, adapter: dict[str, torch.Tensor], cache: NgramCache
    ) -> fleet_pb2.StateManifest:
        adapter_blob = save_safetensors({k: v.contiguous() for k, v in adapter.items()})
        return self._commit_blobs(name, m, adapter_blob, cache.to_bytes())

    def _commit_blobs(
        self, name: str, m: fleet_pb2.StateManifest, adapter_blob: bytes, cache_blob: bytes
    ) -> fleet_pb2.StateManifest:
        out = self._dir(name)
        write_bytes_atomic(out / self._file("adapter", m.version), adapter_blob)
        write_bytes_atomic(out / self._file("cache", m.version), cache_blob)
        m.adapter_sha256, m.adapter_bytes = sha256(adapter_blob), len(adapter_blob)
        m.cache_sha256, m.cache_bytes = sha256(cache_blob), len(cache_blob)
        m.spec_sha256 = spec_digest(self.spec_of(out.name))
        blob = m.SerializeToString()
        write_bytes_atomic(out / self._file("manifest", m.version), blob)
        write_bytes_atomic(out / self._file("signature", m.version), self.signing_key().sign(blob))
        write_bytes_atomic(out / MANIFEST_FILE, blob)  # the commit point: everything it names exists
        for path in [
            *out.glob("adapter-v*.safetensors"),
            *out.glob("cache-v*.pb"),
            *out.glob("server-opt-v*.safetensors"),
            *out.glob("privacy-v*.json"),
            *out.glob("manifest-v*.sig"),
            *out.glob("manifest-v*.pb"),
        ]:
            version = int(path.name.split("-v", 1)[1].split(".", 1)[0])
            if version <= m.version - KEEP_VERSIONS or version > m.version:
                path.unlink(missing_ok=True)
        return m

    def versions(self, name: str) -> list[int]:
        """The versions of ``name`` still on disk (the last ``KEEP_VERSIONS``), oldest first."""
        self._require(name)
        return sorted(int(p.name[len("manifest-v") : -len(".pb")]) for p in self._dir(name).glob("manifest-v*.pb"))

    def rollback(self, name: str, to: int | None = None, *, before_round: int | None = None) -> fleet_pb2.StateManifest:
        """Publish version N+1 with the adapter and cache of version ``to`` (default N-1): devices
        see a newer version (no replay), whose ``restored_from`` says what it restores. Holds the
        target's writer lock (a round committing at the same time waits).

        ``before_round``: a rollback scheduled before that round (a scenario's). It is recorded
        in the manifest, and asking again for the same round returns the version already
        published instead of rolling back twice (a coordinator resuming an unfinished round
        replays its scheduled actions)."""
        with self._lock(name):
            if before_round is not None:
                for version in reversed(self.versions(name)):
                    m = self._manifest_at(name, version)
                    if m.HasField("scheduled_before_round") and m.scheduled_before_round == before_round:
                        return m
            return self._rollback(name, to, before_round)

    def _manifest_at(self, name: str, version: int) -> fleet_pb2.StateManifest:
        m = fleet_pb2.StateManifest()
        m.ParseFromString((self._dir(name) / self._file("manifest", version)).read_bytes())
        return m

    def _rollback(self, name: str, to: int | None, before_round: int | None = None) -> fleet_pb2.StateManifest:
        current = self.manifest(name)
        to = current.version - 1 if to is None else to
        if not 0 <= to < current.version:
            raise RegistryError(
                f"target {name!r} is at version {current.version}: roll back to 0..{current.version - 1}"
            )
        if to not in self.versions(name):
            raise RegistryError(
                f"target {name!r}: version {to} is no longer kept (kept: {', '.join(map(str, self.versions(name)))})"
            )
        old = self._manifest_at(name, to)
        blobs = [(self._dir(name) / self._file(kind, to)).read_bytes() for kind in ("adapter", "cache")]
        if sha256(blobs[0]) != old.adapter_sha256 or sha256(blobs[1]) != old.cache_sha256:
            raise RegistryError(f"target {name!r}: the files of version {to} do not match its manifest")
        m = fleet_pb2.StateManifest(
            target=name,
            version=current.version + 1,
            round=current.round,
            parent_version=current.version,
            restored_from=to,
            devices_total=old.devices_total,
            tokens_total=old.tokens_total,
            scheduled_before_round=before_round,
        )
        self._write_ledger(name, m.version, self.privacy_ledger(name))  # privacy spent stays spent
        return self._commit_blobs(name, m, *blobs)

    # -- staged rollout ---------------------------------------------------------------------------
    def rollout(self, name: str, fraction: float) -> None:
        """Move ``fraction`` of the devices that can serve ``name`` (they offer it in their
        status) to it, from the next round on; the devices are chosen by ``rollout_rank``, so
        raising the fraction adds devices and keeps the ones already moved. Devices already
        moved stay when the fraction is lowered."""
        self._require(name)
        if not 0 <= fraction <= 1:
            raise RegistryError(f"rollout fraction {fraction} must be in [0, 1]")
        write_bytes_atomic(
            self._dir(name) / ROLLOUT_FILE, json.dumps({"fraction": fraction, "time": time.time()}).encode()
        )

    def rollouts(self) -> dict[str, float]:
        """{target: fraction} of the targets being rolled out."""
        out = {}
        for name in self.names():
            try:
                out[name] = float(json.loads((self._dir(name) / ROLLOUT_FILE).read_text())["fraction"])
            except (OSError, ValueError, KeyError):
                continue
        return out

    @staticmethod
    def _file(kind: str, version: int) -> str:
        return {
            "adapter": f"adapter-v{version}.safetensors",
            "cache": f"cache-v{version}.pb",
            "signature": f"manifest-v{version}.sig",
            "manifest": f"manifest-v{version}.pb",
            "server-opt": f"server-opt-v{version}.safetensors",
            "privacy": f"privacy-v{version}.json",
        }[kind]

    def _require(self, name: str) -> None:
        if name not in self:
            known = ", ".join(self.names()) or "none"
            raise RegistryError(f"unknown target {name!r} (registered: {known})")


def rollout_rank(target: str, device_id: str) -> str:
    """A device's place in ``target``'s rollout order (lowest first): a hash, so the order is
    fixed, unrelated across targets, and needs no coordination."""
    return hashlib.sha256(f"{target}\n{device_id}".encode()).hexdigest()
