"""What a device keeps per (drafter, target) pair, on disk, so learning survives restarts.

One directory per pair, ``<root>/<drafter>--<target>/``:

* ``adapter.safetensors``: the target's LoRA adapter (peft tensor names, adapter name removed);
* ``head.safetensors``: the acceptance head;
* ``ngram_cache.pb``: the n-gram cache (``omnidraft.v1.NgramCache``);
* ``lookup_history.safetensors``: the device's recent prompts and outputs as target ids, which
  model-free drafts are looked up in (``omnidraft.shared.engine.lookup_drafts``; never sent);
* ``state.json``: versions, LoRA settings, counters, the throughput rule's calibration, and the sha256
  and size of each file above. It is written last, so it names a consistent set of files.

Every file is written atomically (temporary file, fsync, rename), and only when its contents
changed since this process last wrote it and the manifest on disk is still the one it wrote
(a service saves after every sample; its adapter changes at updates). On load, a file that is
missing from the manifest's record, fails its checksum, or does not parse is moved aside as
``<name>.corrupt-<unix time>`` and that part starts fresh, with a warning; loading never raises
on bad state. Bad input *paths* (a state directory that is a file) are the caller's error.

Several processes may share the directory (``device serve`` and a SuperNode's ClientApp):
saves hold an exclusive lock on ``<root>/.<drafter>--<target>.lock`` and loads a shared one, so a reader never sees a
half-written set; ``changed_on_disk`` tells a process that another one saved since it last
loaded or saved (``save(if_unchanged=True)`` then refuses to overwrite that state).
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

import omnidraft
from omnidraft.shared.util.atomic_io import file_lock, write_bytes_atomic
from omnidraft.shared.vocab.ngram_cache import NgramCache, NgramCacheError

FORMAT_VERSION = 1
ADAPTER_FILE = "adapter.safetensors"
HEAD_FILE = "head.safetensors"
CACHE_FILE = "ngram_cache.pb"
LOOKUP_FILE = "lookup_history.safetensors"
MANIFEST_FILE = "state.json"


def slug(name: str) -> str:
    """A directory-safe form of a model name or path (its last component)."""
    base = Path(name.rstrip("/")).name or name
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in base)


def _holds(path: Path, size: int) -> bool:
    """Whether ``path`` is a file of ``size`` bytes (a part this process wrote, still there)."""
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class LoadedState:
    """The parts found valid on disk (None: start that part fresh) and the manifest's counters."""

    adapter: dict[str, torch.Tensor] | None = None
    head: dict[str, torch.Tensor] | None = None
    cache: NgramCache | None = None
    lookup: torch.Tensor | None = None  # the lookup history's ids
    meta: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


class DeviceState:
    """The state directory of one (drafter, target) pair under ``root``."""

    def __init__(self, root: str | Path, drafter: str, target: str, cipher=None) -> None:
        """``cipher``: a ``state_key.StateCipher`` to keep every file encrypted (its key file
        must live outside ``root``)."""
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise ValueError(f"state directory {root} is not a directory")
        if cipher is not None and cipher.path.resolve().is_relative_to(root.resolve()):
            raise ValueError(f"the state key {cipher.path} must live outside the state directory {root}")
        self.drafter, self.target = drafter, target
        self.dir = root / f"{slug(drafter)}--{slug(target)}"
        self.lock = root / f".{self.dir.name}.lock"  # beside the directory: it holds state files only
        self.cipher = cipher
        self.seen: str | None = None  # sha256 of the manifest last loaded or saved by this process
        # per part this process wrote: (sha256 of its plaintext, its manifest entry), for skipping
        # an unchanged part at the next save (an adapter changes at updates, not with every sample)
        self._written: dict[str, tuple[str, dict]] = {}

    def _manifest_digest(self) -> str | None:
        try:
            return sha256((self.dir / MANIFEST_FILE).read_bytes())
        except FileNotFoundError:
            return None

    def changed_on_disk(self) -> bool:
        """True when another process saved this state since this one last loaded or saved it."""
        if not self.dir.exists():
            return False
        with file_lock(self.lock, exclusive=False):
            return self._manifest_digest() != self.seen

    def _seal(self, name: str, data: bytes) -> bytes:
        return self.cipher.encrypt(name, data) if self.cipher is not None else data

    def _open(self, name: str, stored: bytes) -> bytes:
        """The plaintext of a stored file; StateKeyError when it is encrypted and there is no
        key or the key is wrong, or when it is plaintext and the key existed before this process
        (a keyed state is encrypted: plaintext there was put by someone else). A plaintext state
        met with a key file this process just created is read and encrypted at the next save
        (the migration)."""
        from omnidraft.client.state_key import StateKeyError, is_encrypted

        if not is_encrypted(stored):
            if self.cipher is not None and not self.cipher.created:
                raise StateKeyError(
                    f"{self.dir / name} is not encrypted but its key {self.cipher.path} already "
                    f"exists: a keyed state is refused in plaintext (to encrypt a plaintext "
                    f"state, give a key file that does not exist yet)"
                )
            return stored
        if self.cipher is None:
            raise StateKeyError(f"the device state in {self.dir} is encrypted: give its key (--state-key)")
        return self.cipher.decrypt(name, stored)

    # -- writing -----------------------------------------------------------------------------
    def save(
        self,
        adapter: dict[str, torch.Tensor],
        head: dict[str, torch.Tensor] | None,
        cache: NgramCache,
        meta: dict,
        *,
        lookup: torch.Tensor | None = None,
        if_unchanged: bool = False,
    ) -> bool:
        """Write every part atomically, then the manifest naming their checksums; with
        ``if_unchanged``, write nothing and return False when another process saved since this
        one last loaded or saved (``changed_on_disk``)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with file_lock(self.lock):
            on_disk = self._manifest_digest()
            if if_unchanged and on_disk != self.seen:
                return False
            if on_disk is None or on_disk != self.seen:  # not what this process wrote last: write every part
                self._written.clear()
            self._write(adapter, head, cache, meta, lookup)
            self.seen = self._manifest_digest()
        return True

    def _write(
        self,
        adapter: dict[str, torch.Tensor],
        head: dict[str, torch.Tensor] | None,
        cache: NgramCache,
        meta: dict,
        lookup: torch.Tensor | None,
    ) -> None:
        blobs = {ADAPTER_FILE: save_safetensors(adapter), CACHE_FILE: cache.to_bytes()}
        if head is not None:
            blobs[HEAD_FILE] = save_safetensors(head)
        if lookup is not None:
            blobs[LOOKUP_FILE] = save_safetensors({"ids": lookup})
        files = {}
        for name, data in blobs.items():
            plain = sha256(data)
            kept = self._written.get(name)
            if kept is not None and kept[0] == plain and _holds(self.dir / name, kept[1]["bytes"]):
                files[name] = kept[1]  # the part on disk is this one, as this process wrote it
                continue
            sealed = self._seal(name, data)
            write_bytes_atomic(self.dir / name, sealed)
            # of the bytes on disk: the plaintext's digest, unless they were encrypted
            files[name] = {"sha256": plain if sealed is data else sha256(sealed), "bytes": len(sealed)}
            self._written[name] = (plain, files[name])
        manifest = {
            "format": FORMAT_VERSION,
            "omnidraft": omnidraft.__version__,
            "drafter": self.drafter,
            "target": self.target,
            "saved_at": time.time(),
            **meta,
            "files": files,
        }
        write_bytes_atomic(self.dir / MANIFEST_FILE, self._seal(MANIFEST_FILE, json.dumps(manifest, indent=1).encode()))

    # -- reading -----------------------------------------------------------------------------
    def load(self, **cache_kwargs) -> LoadedState:
        """Read what is valid; set aside and report (warning + ``problems``) what is not."""
        if not self.dir.exists():
            self.seen = None
            return LoadedState()
        with file_lock(self.lock, exclusive=False):
            self.seen = self._manifest_digest()
            return self._load(**cache_kwargs)

    def _load(self, **cache_kwargs) -> LoadedState:
        out = LoadedState()
        manifest_path = self.dir / MANIFEST_FILE
        try:
            raw = manifest_path.read_bytes()
        except FileNotFoundError:
            raw = None
        if raw is not None:
            raw = self._open(MANIFEST_FILE, raw)  # a wrong or missing key raises: nothing is set aside
        try:
            if raw is None:
                raise FileNotFoundError(manifest_path)
            meta = json.loads(raw)
            if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
                raise ValueError(f"unknown format {meta.get('format') if isinstance(meta, dict) else meta!r}")
            files = meta.get("files")
            if not isinstance(files, dict):
                raise ValueError("no file list")
        except FileNotFoundError:
            if any(self.dir.iterdir()):
                self._problem(out, MANIFEST_FILE, "missing (the parts cannot be checked)")
                for name in (ADAPTER_FILE, HEAD_FILE, CACHE_FILE, LOOKUP_FILE):
                    self._set_aside(self.dir / name)
            return out
        except (OSError, ValueError) as exc:
            self._problem(out, MANIFEST_FILE, f"unreadable ({exc})")
            for name in (MANIFEST_FILE, ADAPTER_FILE, HEAD_FILE, CACHE_FILE, LOOKUP_FILE):
                self._set_aside(self.dir / name)
            return out
        out.meta = meta
        out.adapter = self._read(out, files, ADAPTER_FILE, load_safetensors)
        out.head = self._read(out, files, HEAD_FILE, load_safetensors)
        out.cache = self._read(out, files, CACHE_FILE, lambda b: NgramCache.from_bytes(b, **cache_kwargs))
        out.lookup = self._read(out, files, LOOKUP_FILE, _lookup_ids)
        return out

    def _read(self, out: LoadedState, files: dict, name: str, parse):
        path = self.dir / name
        record = files.get(name)
        if record is None:
            if path.exists():
                self._problem(out, name, "not in the manifest")
                self._set_aside(path)
            return None
        try:
            data = path.read_bytes()
        except OSError as exc:
            self._problem(out, name, f"unreadable ({exc.strerror or exc})")
            return None
        if len(data) != record.get("bytes") or sha256(data) != record.get("sha256"):
            self._problem(out, name, f"checksum mismatch ({len(data)} bytes, manifest says {record.get('bytes')})")
            self._set_aside(path)
            return None
        data = self._open(name, data)
        try:
            return parse(data)
        except (NgramCacheError, ValueError, RuntimeError, OSError) as exc:
            self._problem(out, name, f"does not parse ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")
            self._set_aside(path)
            return None

    def _problem(self, out: LoadedState, name: str, what: str) -> None:
        msg = f"device state {self.dir / name}: {what}; set aside, that part starts fresh"
        out.problems.append(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    @staticmethod
    def _set_aside(path: Path) -> None:
        if path.exists():
            path.rename(path.with_name(f"{path.name}.corrupt-{int(time.time() * 1000)}"))


def _lookup_ids(data: bytes) -> torch.Tensor:
    """The lookup history's ids from its safetensors bytes (ValueError when malformed)."""
    tensors = load_safetensors(data)
    ids = tensors.get("ids")
    if ids is None or set(tensors) != {"ids"}:
        raise ValueError("expected exactly one tensor 'ids'")
    return ids
