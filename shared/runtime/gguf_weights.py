"""Catalog models kept as the GGUF files they ship as, read one tensor at a time.

A device keeps no float32 copy of a model on disk: ``omnidraft models pull NAME --format gguf``
stores the pinned GGUF itself (Q4_K_M: 1.1 GB for Qwen2.5-Coder-1.5B, against 7.1 GB of float32
safetensors) beside its ``config.json`` and tokenizer. Loading builds the transformers model
on the meta device (shapes only) and fills it from the memory-mapped GGUF with the functions
transformers' own GGUF loader uses: gguf-py's ``dequantize``, transformers' GGUF-to-HF name map
and its per-architecture tensor processors (the Llama query/key row order, Gemma's norm offset).
The values are therefore exactly those of a float32 conversion, bit for bit.

Two ways to fill a model:

* ``GgufCheckpoint.load(model)``: every tensor, in the requested dtype (a drafter that trains,
  a float target); ``load_model(..., embeddings_in_file=True)`` (a drafter's) then gives the
  model a ``checkpoints.FileEmbedding`` that reads the rows a lookup needs from the GGUF, and a tied LM
  head keeps the matrix as its own weight (which the engine then holds in bf16:
  ``held_weights``), so no float32 table stays resident for lookups;
* ``GgufCheckpoint.materialized(module)``: one module's tensors for the duration of a ``with``
  block, then back to the meta device. The native int8 kernels pack the target layer by layer
  this way, so the float32 weights of one decoder layer exist at a time; the token embeddings
  stay in the GGUF and ``rows`` dequantizes the few rows a forward needs (``GgufRows``).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize
from transformers.integrations.gguf.reader import GgufHeader
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from omnidraft.shared.engine.catalog import GGUF_FILE
from omnidraft.shared.runtime.checkpoints import Checkpoint, ReleasedRows, fill_model, skeleton


def gguf_file(model_dir: str | Path) -> Path | None:
    """The GGUF weights of a model directory kept in the GGUF format, else None."""
    path = Path(model_dir) / GGUF_FILE
    return path if path.is_file() else None


@dataclass(frozen=True)
class _TensorAt:
    """Where one tensor's bytes lie in a GGUF file."""

    gguf_name: str
    qtype: GGMLQuantizationType
    offset: int  # bytes from the start of the file
    shape: tuple[int, ...]  # of the stored array (rows, bytes per row for quantized types)
    dtype: np.dtype

    def map(self, path: Path) -> np.memmap:
        """A read-only map of this tensor's bytes alone (only the pages read become resident)."""
        return np.memmap(path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)

    def read(self, data: np.memmap, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """The tensor mapped as ``data`` (or ``rows`` of it) dequantized to float32, in memory of
        its own. Dequantizing selected rows gives exactly those rows of the whole (GGUF blocks
        never span rows)."""
        # a plain view: each slice of a memmap would pay numpy's memmap bookkeeping
        out = _dequantize(np.asarray(data)[rows], self.qtype)
        # a float32 tensor comes back as a view of the map: copied, so the map can close
        return np.array(out, dtype=np.float32) if np.may_share_memory(out, data) else out.astype(np.float32, copy=False)


# rows of a quantized matrix dequantized per numpy pass (``_dequantize``): the fastest of 16-4,096
# for Qwen2.5-Coder-1.5B (6.0 s against 9.5 s at 16, 8.4 s at 1,024: temporaries that stay in
# cache), at most 4.6 MB of float32 per pass for its widest rows (8,960 inputs)
DEQUANTIZE_ROWS = 128


def _dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf-py's ``dequantize`` of ``raw`` (a quantized matrix: rows x bytes per row) with its
    block type's own ``dequantize_rows`` over ``DEQUANTIZE_ROWS`` rows at a time. gguf-py's
    ``dequantize`` makes a numpy pass per 16 rows and joins their results in one more copy: 9.0
    s against 6.0 s for Qwen2.5-Coder-1.5B's tensors on a 2-core AMD EPYC. Blocks dequantize
    independently of one another, so the values are the same, bit for bit. Other types (float
    ones, a 1-D tensor): ``dequantize`` itself."""
    quant = getattr(gguf.quants, qtype.name, None)  # gguf-py's class of this block type (Q4_K, ...)
    if raw.ndim != 2 or getattr(quant, "qtype", None) != qtype:  # not one of gguf-py's block types
        return dequantize(raw, qtype)
    quant.init_grid()
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    out = np.empty((raw.shape[0], raw.shape[1] // type_size * block_size), dtype=np.float32)
    for lo in range(0, raw.shape[0], DEQUANTIZE_ROWS):
        out[lo : lo + DEQUANTIZE_ROWS] = quant.dequantize_rows(raw[lo : lo + DEQUANTIZE_ROWS])
    return out


# the numpy types gguf-py maps a tensor of these value types to; every other (block) type is
# mapped as bytes: rows x bytes per row
_VALUE_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


def tensor_table(path: Path) -> tuple[str, list[_TensorAt]]:
    """The architecture and the tensor table of the GGUF at ``path``, each tensor stored as
    gguf-py's reader maps it. Read with transformers' header reader, which walks the metadata's
    string arrays without decoding them: 0.04 s for Qwen2.5-Coder-1.5B, where gguf-py's
    ``GGUFReader`` decodes its whole vocabulary and merges first (9-10 s on one core of a Zen 4
    EPYC). A file cut short raises ``ValueError`` (the reader's ``struct.error`` says only where
    its buffer ended)."""
    try:
        header = GgufHeader.from_file(str(path))
    except struct.error:
        raise ValueError(f"{path} ends inside its header: the GGUF file is cut short") from None
    table = []
    for info in header.tensors:
        qtype = GGMLQuantizationType(info.ggml_type)
        dtype = _VALUE_TYPES.get(qtype)
        shape = info.shape if dtype is not None else gguf.quant_shape_to_byte_shape(info.shape, qtype)
        table.append(_TensorAt(info.name, qtype, header.data_start + info.offset, shape, np.dtype(dtype or np.uint8)))
    return header.architecture, table


@contextlib.contextmanager
def _one_tensor_name_map():
    """While open, gguf-py's ``get_tensor_name_map(arch, blocks)`` builds each map once.
    transformers' ``get_gguf_hf_weights_map`` calls it again for every submodule of the model
    (768 times for Qwen2.5-Coder-1.5B, each formatting every tensor name of every block: 13 s of
    a 46 s load); the map depends on its two arguments only."""
    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(build)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = build


class GgufRows(ReleasedRows):
    """Rows of one GGUF tensor (token embeddings), dequantized to float32 when read: only the
    rows read are ever in memory. Has the ``index_select(0, ids)`` of a ``[rows, cols]`` tensor;
    the file's pages it touched are released as ``ReleasedRows`` says."""

    def __init__(self, path: Path, at: _TensorAt) -> None:
        self._at, self._data = at, at.map(path)  # mapped once: a forward reads a few rows
        self._rows = np.asarray(self._data)  # a plain view: indexing a memmap costs more
        self.shape = (at.shape[0], at.read(self._rows, slice(0, 1)).shape[-1])

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise ValueError("GgufRows selects rows only (dim 0)")
        rows = self._at.read(self._rows, index.numpy())
        self._read(len(rows))
        return torch.from_numpy(rows)

    def _release(self) -> None:
        self._data._mmap.madvise(mmap.MADV_DONTNEED)  # numpy's memmap keeps its mmap there


class GgufCheckpoint(Checkpoint):
    """The tensors of a GGUF file under the parameter names of ``model`` (built by ``skeleton``
    from the same model's config)."""

    def __init__(self, path: str | Path, model: torch.nn.Module) -> None:
        self.path = Path(path)
        arch, tensors = tensor_table(self.path)
        self._processor: TensorProcessor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
        with _one_tensor_name_map():
            self._hf_names = get_gguf_hf_weights_map(model, self._processor)
        self._tensors = {self._hf_names[t.gguf_name]: t for t in tensors if t.gguf_name in self._hf_names}
        self.names = set(self._tensors)
        self._check_names(model)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Parameter ``name`` dequantized (float32 values, then cast to ``dtype``)."""
        at = self._tensors[name]
        result = self._processor.process(
            weights=at.read(at.map(self.path)),
            name=at.gguf_name,
            tensor_key_mapping=self._hf_names,
            parsed_parameters={"tensors": {}},
        )
        return torch.from_numpy(np.ascontiguousarray(result.weights)).to(dtype)

    def rows(self, name: str) -> GgufRows:
        """Parameter ``name`` (token embeddings) as rows read on demand. Only for tensors no
        tensor processor rewrites (embeddings are stored as they are)."""
        return GgufRows(self.path, self._tensors[name])


def load_model(
    model_dir: str | Path, dtype: torch.dtype, *, stream: bool = False, embeddings_in_file: bool = False
) -> tuple[torch.nn.Module, GgufCheckpoint]:
    """The model of a GGUF-format directory and its checkpoint, filled as
    ``checkpoints.fill_model`` says (``stream``: for a runner that packs it layer by layer;
    ``embeddings_in_file``: the input embeddings read from the GGUF row by row)."""
    path = gguf_file(model_dir)
    if path is None:
        raise FileNotFoundError(f"{model_dir}: no {GGUF_FILE}")
    model = skeleton(model_dir, dtype)
    checkpoint = GgufCheckpoint(path, model)
    fill_model(model, checkpoint, dtype, stream=stream, embeddings_in_file=embeddings_in_file)
    return model, checkpoint
