"""A model's weights read from its files one module at a time, in either format it is kept in.

An int8 target packed by the native kernels needs its float32 weights only while it packs
them. Loaded whole, a 1.5B target is 6 GB of float32 (7.1 GB of safetensors mapped, or a GGUF
dequantized) beside the packed 1.7 GB. A ``Checkpoint`` instead leaves the model's decoder
layers, embeddings and LM head on the meta device (``fill_model``) and gives a runner one
layer's weights at a time (``materialized``) and embedding rows on demand (``rows``).

Two formats implement it: ``gguf_weights.GgufCheckpoint`` (a model kept as the GGUF it ships
as) and ``safetensors_weights.SafetensorsCheckpoint`` (the default float32 conversion). Both
give exactly the values a whole load gives, so a runner packed from either is bit-identical to
one packed from the loaded model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM

from omnidraft.shared.runtime.heap import release_freed_memory


def skeleton(model_dir: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers model of ``model_dir/config.json`` with its parameters on the meta
    device (no memory) and its computed buffers (RoPE frequencies) real, on the CPU."""
    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):  # buffers are computed at construction
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # meta parameters are created apart: tied ones become one again
    return model


class Rows(Protocol):
    """Rows of a ``[rows, cols]`` tensor read on demand (a checkpoint's token embeddings)."""

    shape: tuple[int, int]

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor: ...

    def clone(self) -> Rows: ...


class ReleasedRows:
    """The release rule of a row reader over a mapped file: the file's pages a read touched
    count in this process's resident memory until released (they stay in the page cache). They
    are released once ``RELEASE_AFTER_ROWS`` rows were read since the last release, so at most
    that many rows' pages stay resident, and a read of the whole table (an LM head packed from
    it) releases it at once. Releasing after every read cost a decode step a page fault on its
    next read (73 us against 21 us for one row of SmolLM2-135M's Q8_0 table, AMD EPYC)."""

    RELEASE_AFTER_ROWS = 256

    _unreleased = 0  # rows read since the last release

    def _read(self, n: int) -> None:
        """``n`` rows were just read: release the pages when the rule says so."""
        self._unreleased += n
        if self._unreleased >= self.RELEASE_AFTER_ROWS:
            self._release()
            self._unreleased = 0

    def _release(self) -> None:
        raise NotImplementedError

    def clone(self) -> ReleasedRows:
        """Itself: it holds nothing of the checkpoint in memory."""
        return self


class FileEmbedding(torch.nn.Module):
    """A model's input embedding whose table stays in the model's file (``Checkpoint.rows``): a
    lookup reads the rows it needs (the values a float32 load holds, bit for bit) and casts them
    to ``dtype``. 0.11 GB of float32 not resident for SmolLM2-135M; about 20 us for one row
    (a GGUF's Q8_0, AMD EPYC)."""

    def __init__(self, rows: Rows, dtype: torch.dtype) -> None:
        super().__init__()
        self.rows, self.dtype = rows, dtype
        self.num_embeddings, self.embedding_dim = rows.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        found = self.rows.index_select(0, input_ids.reshape(-1).cpu()).to(self.dtype)
        return found.view(*input_ids.shape, self.embedding_dim)


class MissingTensors(ValueError):
    """A model's files hold no tensor under some of its parameter names."""


class Checkpoint:
    """The tensors of a model's files under the parameter names of ``model`` (built by
    ``skeleton`` from the same model's config). A format gives ``path``, ``names`` (the
    parameter names its files hold), ``tensor`` and ``rows``."""

    path: Path
    names: set[str]

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Parameter ``name`` in memory of its own (float32 values, then cast to ``dtype``)."""
        raise NotImplementedError

    def rows(self, name: str) -> Rows:
        """Parameter ``name`` (token embeddings) as rows read on demand."""
        raise NotImplementedError

    def _check_names(self, model: torch.nn.Module) -> None:
        """Refuse files that lack a parameter of ``model`` (tied ones are filled through the
        parameter they are tied to): ``MissingTensors``."""
        expected = {name for name, _ in model.named_parameters()}
        tied = set(getattr(model, "all_tied_weights_keys", None) or ())
        missing = sorted(expected - self.names - tied)
        if missing:
            raise MissingTensors(
                f"{self.path.name}: no tensor for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
            )

    def fill(self, model: torch.nn.Module, module: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
        """Give ``module`` of ``model`` (``model`` itself included) its weights from the files,
        in ``dtype`` (None: each parameter's own). Tied parameters are left to ``tie_weights``."""
        prefix = prefix_of(model, module)
        for name, param in list(module.named_parameters()):
            full = prefix + name
            if full not in self.names:
                continue  # a tied parameter: filled through the one it is tied to
            owner, _, attr = name.rpartition(".")
            value = self.tensor(full, dtype or param.dtype)
            if value.shape != param.shape:
                raise ValueError(
                    f"{full} is {tuple(value.shape)} in {self.path.name}, {tuple(param.shape)} in config.json"
                )
            module.get_submodule(owner).register_parameter(attr, torch.nn.Parameter(value, requires_grad=False))

    def load(self, model: torch.nn.Module) -> torch.nn.Module:
        """Fill every parameter of ``model`` (one tensor in float32 at a time, then in the
        parameter's dtype) and re-tie tied weights; returns ``model``."""
        self.fill(model, model)
        model.tie_weights()
        return model

    @contextlib.contextmanager
    def materialized(self, model: torch.nn.Module, module: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """``module`` of ``model`` filled in float32 inside the block, on the meta device after
        (and the freed memory handed back to the system)."""
        self.fill(model, module, torch.float32)
        try:
            yield module
        finally:
            module.to("meta")
            release_freed_memory()


def fill_model(
    model: torch.nn.Module, checkpoint: Checkpoint, dtype: torch.dtype, *, stream: bool, embeddings_in_file: bool
) -> None:
    """Fill ``model`` (built by ``skeleton``) from ``checkpoint``: every weight in ``dtype``,
    the file closed after each (with ``embeddings_in_file``, the input embeddings read from the
    file, ``FileEmbedding``, and a tied LM head keeping the matrix as its own weight), or, with
    ``stream``, only what lies outside the decoder layers, the input embeddings and the LM head
    (the final norm), for a runner that packs the rest layer by layer through
    ``checkpoint.materialized`` and reads embedding rows through ``checkpoint.rows``."""
    if stream:
        base = model.get_decoder()
        skip = {id(base.layers), id(model.get_input_embeddings()), id(model.get_output_embeddings())}
        for module in base.children():
            if id(module) not in skip:
                checkpoint.fill(model, module, torch.float32)
        return
    checkpoint.load(model)
    embed = model.get_input_embeddings()
    if embeddings_in_file and type(embed) is torch.nn.Embedding:  # a subclass may scale (Gemma)
        model.set_input_embeddings(FileEmbedding(checkpoint.rows(prefix_of(model, embed) + "weight"), dtype))
        model.config.tie_word_embeddings = False  # a tied head keeps the table as its own weight


def prefix_of(model: torch.nn.Module, module: torch.nn.Module) -> str:
    """The name prefix (``"model.layers.3."``) of ``module``'s parameters in ``model``."""
    if module is model:
        return ""
    for name, candidate in model.named_modules():
        if candidate is module:
            return name + "."
    raise ValueError("module is not part of model")
