"""Loading a causal LM and running it incrementally with a croppable KV cache.

Both the drafter and the target go through a ``Runner``: it feeds new token ids, returns the
logits of the new positions, and rolls the KV cache back to any earlier length (the speculative
decoder drops rejected draft positions this way). ``ModelRunner`` runs any transformers model;
``fast_drafter.FastLlamaRunner`` (Llama/Qwen2 on the native kernels) and
``recorded_target.RecordedTarget`` (a recorded greedy output) are the others.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from omnidraft.shared.engine import catalog
from omnidraft.shared.runtime import gguf_weights, safetensors_weights
from omnidraft.shared.runtime.cached_positions import Prefill, exact_prefix
from omnidraft.shared.runtime.checkpoints import Checkpoint


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and the directory it came from."""

    model: torch.nn.Module
    tokenizer: object
    path: Path
    # where the weights not loaded yet are read from (``load(..., stream=True)``): its decoder
    # layers and embeddings stay on the meta device until a runner packs them
    checkpoint: Checkpoint | None = None

    @property
    def logit_rows(self) -> int:
        """Number of logits columns the LM head produces (may exceed the tokenizer's size)."""
        head = self.model.get_output_embeddings()
        return getattr(head, "out_features", None) or head.weight.shape[0]  # a held weight is not read whole


def load(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    *,
    progress: bool = True,
    stream: bool = False,
    embeddings_in_file: bool = False,
) -> LoadedModel:
    """Load a catalog model (pulled on first use) or a local HF directory, in eval mode.

    With ``stream`` the decoder layers and embeddings are left in the model's files for a runner
    that packs them one layer at a time (``LoadedModel.checkpoint``: a model kept as GGUF, or as
    safetensors of an architecture the native kernels run under the model's own parameter
    names; any other loads whole). A model kept as GGUF (``catalog.pull(..., fmt="gguf")``) is
    dequantized into ``dtype`` at load. With ``embeddings_in_file`` (a drafter's) the input
    embeddings of either are read from the file row by row (``checkpoints.FileEmbedding``), a
    tied LM head keeping the matrix as its own weight, and no page of the file stays mapped
    (transformers' own load maps the file)."""
    path = catalog.resolve(name_or_path, progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(path)
    checkpoint = None
    if gguf_weights.gguf_file(path) is not None:
        model, checkpoint = gguf_weights.load_model(path, dtype, stream=stream, embeddings_in_file=embeddings_in_file)
    else:
        read = None
        if (stream or embeddings_in_file) and safetensors_weights.supported(path):
            read = safetensors_weights.load_model(path, dtype, stream=stream, embeddings_in_file=embeddings_in_file)
        model, checkpoint = read or (AutoModelForCausalLM.from_pretrained(path, dtype=dtype), None)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, path, checkpoint if stream else None)


def set_threads(n: int | None = None) -> None:
    """Use ``n`` intra-op threads (default: ``$OMNIDRAFT_THREADS`` or every available core)."""
    n = n or int(os.environ.get("OMNIDRAFT_THREADS", "0")) or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)


def prefill(runner: Runner, ids: list[int]) -> Prefill:
    """Make ``runner``'s cache hold exactly ``ids``, as one forward of them into an empty cache
    would write it, and return that prefill (``runner.prefilled`` where the runner keeps one).

    The leading positions ``ids`` shares with what the runner holds (``held``: the previous
    prompt and its output) are kept where they hold the bits that forward would write
    (``cached_positions.exact_prefix``: the native int8 kernels, whose rows never mix, with the
    rows written alike; the target's runner uses one activation width for prefill and steps)
    and only the rest is forwarded: a prompt that begins like the one before (a file's imports,
    the code above the cursor) is read in part. Any other runner starts from an empty cache.
    The seconds are this call's, so a prefill that kept positions is cheaper by what it did
    not read."""
    keep = exact_prefix(runner, runner, ids, same_weights=True)
    if not keep:
        runner.reset()
        t0 = time.perf_counter()
        runner.forward(ids, logits_to_keep=1)  # its logits are not used: one row, not [n, vocab]
        # timed by the runner; one that keeps no prefill (a sliding-window model) is timed here
        return runner.prefilled or Prefill(tuple(ids), time.perf_counter() - t0)
    t0 = time.perf_counter()
    runner.crop(keep)
    if keep < len(ids):
        runner.forward(ids[keep:], logits_to_keep=1)
    runner.prefilled = Prefill(tuple(ids), time.perf_counter() - t0, keep)
    return runner.prefilled


@runtime_checkable
class Runner(Protocol):
    """What the decoders use of a runner: incremental forwards over one sequence."""

    length: int  # token positions held in the cache
    forward_calls: int  # forward calls so far (cost accounting)
    prefilled: Prefill | None  # the first forward into the empty cache, while the cache holds it

    def forward(self, ids: list[int], logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``ids``; float32 logits ``[len(ids), vocab]`` (the last ``logits_to_keep`` rows when > 0)."""
        ...

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` positions."""
        ...

    def reset(self) -> None:
        """Start a new, empty sequence."""
        ...


class ModelRunner:
    """Incremental forward passes over one sequence with a croppable KV cache.

    ``length`` is the number of token positions held in the cache.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache: DynamicCache | None = None
        self.length = 0
        self.forward_calls = 0
        self.prefilled: Prefill | None = None
        self._last_hidden: torch.Tensor | None = None
        self._hidden_hook = None

    def track_hidden(self) -> None:
        """Keep the final norm's output at the last position of every later ``forward``."""
        if self._hidden_hook is None:
            norm = getattr(self.model.get_decoder(), "norm", None)
            if norm is None:
                raise ValueError("this model has no final norm to read the hidden state from")
            self._hidden_hook = norm.register_forward_hook(self._keep_hidden)

    def _keep_hidden(self, module, inputs, output) -> None:
        self._last_hidden = output[0, -1]

    def last_hidden(self) -> torch.Tensor:
        """Hidden state after the final norm at the last forwarded position ``[hidden]``
        (needs ``track_hidden`` before that forward)."""
        if self._last_hidden is None:
            raise RuntimeError("no hidden state recorded: call track_hidden() before forward")
        return self._last_hidden.float()

    def reset(self) -> None:
        cache = DynamicCache(config=self.model.config)
        # Sliding-window layers (e.g. Gemma-3) can be rolled back only if they record past states.
        cache.activate_past_recording()
        self.cache = cache
        self.length = 0
        self.prefilled = None

    @torch.inference_mode()
    def forward(self, ids: list[int], logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``ids`` to the sequence; return float32 logits ``[len(ids), vocab]``, or of
        the last ``logits_to_keep`` positions only when it is > 0 (as in transformers)."""
        if self.cache is None:
            self.reset()
        t0 = time.perf_counter() if self.length == 0 else 0.0
        input_ids = torch.tensor([ids], dtype=torch.long)
        out = self.model(
            input_ids=input_ids,
            cache=self.cache,  # transformers 5.24 renamed past_key_values
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        if self.length == 0 and not any(self.cache.is_sliding):
            # (a sliding-window layer rolls back only the few positions it records: never kept)
            self.prefilled = Prefill(tuple(ids), time.perf_counter() - t0)
        self.length += len(ids)
        self.forward_calls += 1
        return out.logits[0].float()

    def crop(self, length: int) -> None:
        """Roll the cache back so that it holds only the first ``length`` positions."""
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length
        if self.prefilled is not None and length < len(self.prefilled.ids):
            self.prefilled = None
