"""Models kept as safetensors (the catalog's default float32 conversion), read one tensor at a time.

transformers' ``from_pretrained`` gives a whole model: for Qwen2.5-Coder-1.5B 6.2 GB of float32
weights, all of them resident while the native int8 kernels pack them (mapped from the 7.1 GB
file), although the packing reads one decoder layer at a time and keeps only its 1.7 GB.
``SafetensorsCheckpoint`` gives the runner what ``gguf_weights.GgufCheckpoint`` gives it for a
GGUF: one layer's tensors at a time (``materialized``) and embedding rows on demand
(``SafetensorsRows``), read through safetensors' own ``safe_open`` (the file opened for each
read and closed after it, so no page of it stays mapped). The tensors are the file's float32
values as stored, the ones ``from_pretrained`` gives, so a runner packed this way is bit-identical
to one packed from the loaded model (``tests/test_safetensors_weights.py``).

Only Llama and Qwen2 models are read this way (the architectures the native kernels run), whose
tensor names in the file are the model's parameter names; a directory split into shards is read
through its ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from omnidraft.shared.runtime.checkpoints import Checkpoint, MissingTensors, ReleasedRows, fill_model, skeleton
from omnidraft.shared.runtime.fast_drafter import SUPPORTED_MODEL_TYPES

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def tensor_files(model_dir: str | Path) -> dict[str, Path] | None:
    """Each tensor's file in a safetensors model directory (one file, or shards listed by their
    index), or None when the directory holds no safetensors weights."""
    model_dir = Path(model_dir)
    index = model_dir / SHARD_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        return None
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def supported(model_dir: str | Path) -> bool:
    """Whether the model in ``model_dir`` is read one tensor at a time (``load_model``):
    safetensors weights of an architecture the native kernels run."""
    return AutoConfig.from_pretrained(model_dir).model_type in SUPPORTED_MODEL_TYPES and (
        (Path(model_dir) / SINGLE_FILE).is_file() or (Path(model_dir) / SHARD_INDEX).is_file()
    )


class SafetensorsRows(ReleasedRows):
    """Rows of one tensor of a safetensors file (token embeddings), copied into memory of their
    own when read. Has the ``index_select(0, ids)`` of a ``[rows, cols]`` tensor; the file stays
    open between reads, and is closed (its pages unmapped) as ``ReleasedRows`` says."""

    def __init__(self, path: Path, name: str) -> None:
        self._path, self._name = path, name
        self._slice = None
        self.shape = tuple(self._open().get_shape())

    def _open(self):
        if self._slice is None:
            self._slice = safe_open(self._path, "pt").get_slice(self._name)
        return self._slice

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise ValueError("SafetensorsRows selects rows only (dim 0)")
        ids = index.tolist()
        data = self._open()
        parts, start = [], 0
        for i in range(1, len(ids) + 1):  # runs of consecutive ids are read as one slice
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                parts.append(data[ids[start] : ids[i - 1] + 1])
                start = i
        rows = torch.cat(parts) if len(parts) != 1 else parts[0].clone()  # never a view of the map
        self._read(len(ids))
        return rows

    def _release(self) -> None:
        self._slice = None  # the file closes with its last slice

    def __getstate__(self) -> dict:
        """Copied or pickled without the open file (a copy opens it again when it reads)."""
        return {**self.__dict__, "_slice": None}


class SafetensorsCheckpoint(Checkpoint):
    """The tensors of a safetensors model directory under the parameter names of ``model``
    (built by ``skeleton`` from the same directory's config)."""

    def __init__(self, model_dir: str | Path, model: torch.nn.Module) -> None:
        files = tensor_files(model_dir)
        if files is None:
            raise FileNotFoundError(f"{model_dir}: no {SINGLE_FILE} or {SHARD_INDEX}")
        self._files = files
        self.path = next(iter(files.values()), Path(model_dir) / SINGLE_FILE)
        self.names = set(files)
        self._check_names(model)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Parameter ``name`` in memory of its own, in ``dtype``."""
        with safe_open(self._files[name], "pt") as f:
            return f.get_tensor(name).to(dtype, copy=True)  # a copy: the file closes after

    def rows(self, name: str) -> SafetensorsRows:
        return SafetensorsRows(self._files[name], name)


def load_model(
    model_dir: str | Path, dtype: torch.dtype, *, stream: bool = False, embeddings_in_file: bool = False
) -> tuple[torch.nn.Module, SafetensorsCheckpoint] | None:
    """The model of a safetensors directory (``supported``) and its checkpoint, filled as
    ``checkpoints.fill_model`` says (``stream``: for a runner that packs it layer by layer;
    ``embeddings_in_file``: the input embeddings read from the file row by row). Unlike
    ``from_pretrained``'s, the model's tensors are copies: no page of the file stays mapped.
    None where the files' tensor names are not the model's parameter names (what
    ``save_pretrained`` writes; a checkpoint saved from the base model lacks the prefix, which
    transformers' own load adds): such a directory is for ``from_pretrained``."""
    model = skeleton(model_dir, dtype)
    try:
        checkpoint = SafetensorsCheckpoint(model_dir, model)
    except MissingTensors:
        return None
    fill_model(model, checkpoint, dtype, stream=stream, embeddings_in_file=embeddings_in_file)
    return model, checkpoint
