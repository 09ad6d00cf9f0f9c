"""A lean incremental decoder for Llama-architecture drafters on small CPUs.

``FastLlamaRunner`` has the interface of :class:`omnidraft.shared.engine.model_runner.ModelRunner`
(``forward`` / ``crop`` / ``reset`` / ``length`` / ``forward_calls``) but runs the decoder
itself, reusing the weights of a loaded HF ``LlamaForCausalLM`` (nothing is re-loaded):

* one fused QKV matrix and one fused gate/up matrix per layer, with the RMSNorm gains, the
  attention scale and a RoPE-pairing row order folded in (``layer_folding``; the final norm's
  gain goes into the LM head);
* a static, preallocated KV cache (keys ``[layers, kv_heads, max_positions / 16, head_dim, 16]``
  so that one query scores 16 keys with plain FMAs, values ``[layers, kv_heads, max_positions,
  head_dim]``) written in place, resident only in the pages its positions reached
  (``heap.zeros_on_demand``); ``held`` lists the ids whose keys and values it holds (``length``
  is its size; ``crop`` only shortens it) and ``prefilled`` the first forward into the empty
  cache while it holds it (``model_runner.Prefill``), for a decoder to reuse;
* the kernels picked per call by the number of new tokens ``M`` (see ``weights``).

``weights`` chooses the kernels: ``"fp32"`` (torch, MKL; HF's fp32 forward to ~1e-6), ``"bf16"``
(oneDNN prepacked bf16 weights, AMX where present; norms, RoPE and attention in float32) or
``"int8"``: one native C call per step (``shared/runtime/native/``, built by ``pip install`` per
instruction set or at first use: ``native_kernels``) with int8 weights scaled per (output row, 64
inputs), exact int32 group sums, float16 KV cache and fused norms/RoPE/softmax/SiLU, on the best
ISA present (``amx``, ``avx512`` VNNI, ``avx2``; ``OMNIDRAFT_NATIVE_ISA`` or ``native_isa`` force
one); without them, fbgemm dynamic quantization (fast, less accurate). Calls of more than
``prefill_min_tokens`` tokens run the ``prefill_weights`` kernels (bf16, a second copy, where
VNNI would run 16-bit prefill activations; else the int8 ones). The native kernel runs on
``threads`` OpenMP threads (default ``torch.get_num_threads()``). ``vocab_rows`` prunes the LM
head to the given drafter ids (logits stay full-size, ``-inf`` there).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import time
from collections.abc import Callable
from functools import partial

import torch

from omnidraft.shared.runtime.cached_positions import CachedPositions
from omnidraft.shared.runtime.checkpoints import FileEmbedding
from omnidraft.shared.runtime.heap import release_freed_memory, small_machine, zeros_on_demand
from omnidraft.shared.runtime.layer_folding import fold_layer, linear_of, lora_deltas, rope_pair_perms
from omnidraft.shared.runtime.native_kernels import (
    FdModel,
    cpu_has_native_bf16,
    default_native_isa,
    native_error,
    native_library,
    onednn_bf16_linear,
    warn_no_kernels,
)
from omnidraft.shared.runtime.torch_decoder import torch_forward
from omnidraft.shared.runtime.weight_packing import (
    WEIGHT_KINDS,
    Packing,
    make_linear,
    pack_native,
    pack_native_slices,
    param_name,
)

# Llama and Qwen2 share the decoder (Qwen2 adds biases to q/k/v, which the runner folds in)
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


class FastLlamaRunner(CachedPositions):
    """Incremental forward passes over one sequence for a Llama-architecture causal LM.

    Same interface as ``ModelRunner``: ``forward(ids, logits_to_keep)`` appends ``ids`` and returns
    float32 logits ``[len(ids), vocab]`` (of the last ``logits_to_keep`` positions when > 0); ``crop(n)``
    keeps the first ``n`` positions; ``reset()`` empties the cache; ``length`` is the number
    of cached positions and ``forward_calls`` counts ``forward`` calls.

    Arguments (see the module docstring): ``weights`` ("fp32" | "bf16" | "int8");
    ``max_positions`` (size of the static KV cache); ``vocab_rows`` (LM-head pruning; -inf
    logits elsewhere); ``prefill_weights`` ("auto" | None | a kind: kernels for calls with more
    than ``prefill_min_tokens`` tokens); ``native`` (int8 only: None = native kernels where
    available, True = require them, False = fbgemm); ``threads`` (native kernels; None = torch's
    setting at each call); ``activation_bits`` (native kernels: 16 = per-token 16-bit activations,
    two VPDPBUSD passes; 8 = 8-bit activations with a scale per token and 64 inputs, one pass:
    about half the arithmetic for multi-token calls); ``prefill_activation_bits`` (native
    kernels, calls with more than ``prefill_min_tokens`` tokens on the int8 kernels; None = as
    ``activation_bits``; drafters use 8: ~1.6x faster prefill); ``native_isa`` (a key of ``NATIVE_ISAS``;
    None = ``default_native_isa()``); ``checkpoint`` (a ``checkpoints.Checkpoint`` with the
    weights ``model`` left on the meta device: one decoder layer in float32 at a time, input
    embeddings read from the file row by row). ``backend`` names the kernels in use."""

    def __init__(
        self,
        model,
        *,
        weights: str = "int8",
        max_positions: int = 4096,
        vocab_rows: torch.Tensor | None = None,
        prefill_weights: str | None = "auto",
        prefill_min_tokens: int = 16,
        native: bool | None = None,
        threads: int | None = None,
        activation_bits: int = 16,
        native_isa: str | None = None,
        prefill_activation_bits: int | None = None,
        checkpoint=None,
    ) -> None:
        if weights not in WEIGHT_KINDS:
            raise ValueError(f"unknown weights kind {weights!r}: choose one of {', '.join(WEIGHT_KINDS)}")
        config = model.config
        if (kind := getattr(config, "model_type", "llama")) not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"FastLlamaRunner supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not {kind!r}")
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
            raise ValueError("FastLlamaRunner supports full attention only (no sliding-window layers)")
        decoder = model.model
        self.config = config
        self.weights = weights
        self.max_positions = int(max_positions)
        self.num_layers = len(decoder.layers)
        self.hidden = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.n_heads
        self.intermediate = config.intermediate_size
        self.eps = float(decoder.norm.variance_epsilon)
        self._final_norm = decoder.norm.weight.detach().float().clone()
        self._last_residual: torch.Tensor | None = None
        if (act := getattr(config, "hidden_act", "silu")) not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {act!r}")

        if prefill_weights not in (None, "auto") and prefill_weights not in WEIGHT_KINDS:
            raise ValueError(f"unknown prefill_weights {prefill_weights!r}")
        self.prefill_min_tokens = int(prefill_min_tokens)
        self.threads = threads

        # int8 through the native kernels where possible (K dims multiples of 64, head_dim of 16)
        lib = None
        if weights == "int8" and native is not False:
            dims_ok = (
                self.head_dim % 16 == 0
                and self.n_heads % self.n_kv == 0
                and all(d % 64 == 0 for d in (self.hidden, self.intermediate, self.n_heads * self.head_dim))
            )
            native_isa = native_isa or default_native_isa()
            lib = native_library(native_isa) if dims_ok else None
            if lib is None and native:
                reason = native_error(native_isa) if dims_ok else "hidden/intermediate sizes must be multiples of 64"
                raise RuntimeError(f"native int8 kernels unavailable: {reason}")
            if lib is None and dims_ok:
                warn_no_kernels(native_error(native_isa))
        prefill_activation_bits = prefill_activation_bits or activation_bits
        if activation_bits not in (8, 16) or prefill_activation_bits not in (8, 16):
            raise ValueError("activation_bits must be 8 or 16")
        self._lib = lib
        if prefill_weights == "auto":
            # the native kernels prefill faster than oneDNN's bf16, and need no second copy of the
            # weights, on AMX tiles and with 8-bit prefill activations (SmolLM2-135M on an AMD EPYC
            # with AVX-512 VNNI and BF16, 2 threads: 160 tokens in 72 instead of 136 ms); only
            # 16-bit activations on VNNI (two passes) leave long blocks to bf16 where it is native
            fast_int8 = lib is not None and (native_isa == "amx" or prefill_activation_bits == 8)
            prefill_weights = "bf16" if weights == "int8" and cpu_has_native_bf16() and not fast_int8 else None
        self.prefill_weights = None if prefill_weights == weights else prefill_weights
        self.activation_bits = activation_bits if lib else None
        self._prefill_act8 = int(prefill_activation_bits == 8)
        self.native_isa = native_isa if lib else None
        self.backend = {
            "fp32": "torch-fp32",
            "bf16": "onednn-bf16" if onednn_bf16_linear() else "torch-bf16",
            "int8": (
                "native-int8"
                + ("" if native_isa == "avx512" else f"-{native_isa}")
                + ("-a8" if activation_bits == 8 else "")
                + ("-p8" if prefill_activation_bits == 8 and activation_bits != 8 else "")
            )
            if lib
            else "fbgemm-int8",
        }[weights]
        torch_kinds = [k for k in [weights, prefill_weights] if k is not None and not (k == "int8" and lib)]

        # --- RoPE table: exp(i * pos * inv_freq) * attention_scaling ------------------------
        rotary = decoder.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"rope type {rope_type!r} depends on the sequence length; not supported")
        inv_freq = rotary.inv_freq.detach().float().cpu()
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        angles = pos[:, None] * inv_freq[None, :]
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._cos = (angles.cos() * scaling).contiguous()  # [P, hd/2]
        self._sin = (angles.sin() * scaling).contiguous()
        self._cis = torch.complex(self._cos, self._sin)

        # --- per-layer fused, folded weights ------------------------------------------------
        hd = self.head_dim
        self._q_perm, self._k_perm = rope_pair_perms(self.n_heads, self.n_kv, hd)
        self._torch_kinds = torch_kinds
        self._source_layers = decoder.layers  # the model's float weights (a reference): adapters merge into them
        self._layer_weights = (
            partial(checkpoint.materialized, model)
            if checkpoint is not None
            else lambda layer: contextlib.nullcontext(layer)
        )
        self.lora_rank = 0
        self._base_packing = self._pack_layers()
        self._packing = self._base_packing

        # --- embeddings and (optionally pruned) LM head -------------------------------------
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if checkpoint is not None:  # the names the GGUF's tensors go by
            embed_name, head_name = param_name(model, embed.weight), param_name(model, head.weight)
        if getattr(head, "bias", None) is not None:
            raise ValueError("FastLlamaRunner supports LM heads without a bias")
        gain = decoder.norm.weight.detach().float()[None, :]
        if checkpoint is not None:
            self._embed = checkpoint.rows(embed_name)
        else:  # rows kept in the model's file stay there (``FileEmbedding``)
            self._embed = embed.rows if isinstance(embed, FileEmbedding) else embed.weight.detach()
        self.vocab = head.weight.shape[0]
        self.vocab_rows = None
        head_slices = lib is not None and not torch_kinds and vocab_rows is None  # packed in row slices
        w_head = None
        if not head_slices:
            w_head = (head.weight.detach().float() if checkpoint is None else checkpoint.tensor(head_name)) * gain
        if vocab_rows is not None:
            rows = torch.as_tensor(vocab_rows, dtype=torch.long).flatten().unique(sorted=True)
            if rows.numel() == 0 or rows[0] < 0 or rows[-1] >= self.vocab:
                raise ValueError("vocab_rows must hold ids in [0, vocab)")
            self.vocab_rows = rows
            w_head = w_head[rows]
        self.head_rows = self.vocab if w_head is None else w_head.shape[0]
        self._head = {k: make_linear(k, w_head, None) for k in torch_kinds}

        # --- static KV cache -----------------------------------------------------------------
        # keys as [layers, kv_heads, blocks of 16 positions, head_dim, 16]: a query scores 16 keys
        # with head_dim broadcast-FMAs (no horizontal sums); values as [layers, kv_heads, pos, head_dim]
        # (float16 for the native int8 path: halves the cache traffic of long contexts)
        pos_pad = -(-self.max_positions // 16) * 16
        cache_dtype = torch.float16 if lib is not None else torch.float32
        self._cache_shapes = (
            (self.num_layers, self.n_kv, pos_pad // 16, hd, 16),
            (self.num_layers, self.n_kv, pos_pad, hd),
        )
        self._kcache, self._vcache = (zeros_on_demand(shape, cache_dtype) for shape in self._cache_shapes)
        self._pos_pad = pos_pad
        self._template = False  # ``as_template``: no KV cache, forks only
        self._origin: FastLlamaRunner | None = None  # the runner this one was forked from

        if lib is not None:
            if w_head is None:  # PACK_SLICE_ROWS rows at a time (no float32 copy of the whole head)
                rows = head.weight.detach() if checkpoint is None else checkpoint.rows(head_name)
                bufs = pack_native_slices(
                    lambda lo, hi: rows.index_select(0, torch.arange(lo, hi)).float() * gain, self.vocab, lib
                )
                release_freed_memory()
            else:
                bufs = pack_native(w_head, None, lib)
            head_ptrs = torch.tensor([0 if t is None else t.data_ptr() for t in bufs], dtype=torch.int64)
            self._head_tensors = [t for t in bufs if t is not None] + [head_ptrs]
            self._head_pad = bufs[0].shape[0] * 16
            n_qkv = (self.n_heads + 2 * self.n_kv) * hd
            self._fd = FdModel(
                D=self.hidden,
                H=self.n_heads,
                KV=self.n_kv,
                HD=hd,
                I=self.intermediate,
                L=self.num_layers,
                maxpos=self._pos_pad,
                n_qkv=n_qkv + (-n_qkv % 16),
                n_head=self._head_pad,
                eps=self.eps,
                layer_ptrs=self._packing.layer_ptrs.data_ptr(),
                head_ptrs=head_ptrs.data_ptr(),
                kcache=self._kcache.data_ptr(),
                vcache=self._vcache.data_ptr(),
                cos_t=self._cos.data_ptr(),
                sin_t=self._sin.data_ptr(),
                act8=int(activation_bits == 8),
            )
            self._fd_ref = ctypes.addressof(self._fd)
        self.forward_calls = 0
        self._empty_positions()

    def _pack_layers(
        self, layer_deltas: list[dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]]] | None = None
    ) -> Packing:
        """Pack every decoder layer's weights (plus ``layer_deltas[i]``, see ``fold_layer``)
        for the kernels in use; ``layer_deltas`` may hold callables producing the deltas
        (one layer's full-size deltas exist at a time)."""
        torch_layers = {k: [] for k in self._torch_kinds}
        native_tensors: list[torch.Tensor] = []
        ptrs: list[int] = []
        hand_back = small_machine()  # a board: each layer's temporaries go back before the next
        for i, layer in enumerate(self._source_layers):
            deltas = {} if layer_deltas is None else layer_deltas[i]
            linears = {k: [] for k in self._torch_kinds}
            with self._layer_weights(layer):
                deltas = deltas() if callable(deltas) else deltas
                for w, b in fold_layer(layer, deltas, self._q_perm, self._k_perm, self.head_dim):
                    for k in self._torch_kinds:
                        linears[k].append(make_linear(k, w, b))
                    if self._lib is not None:
                        bufs = pack_native(w, b, self._lib)
                        native_tensors += [t for t in bufs if t is not None]
                        ptrs += [0 if t is None else t.data_ptr() for t in bufs]
            for k in self._torch_kinds:
                torch_layers[k].append(tuple(linears[k]))
            if hand_back:  # among packed buffers that stay, glibc kept 0.38 GB over a re-pack
                release_freed_memory()
        layer_ptrs = torch.tensor(ptrs, dtype=torch.int64) if self._lib is not None else None
        return Packing(torch_layers, native_tensors, layer_ptrs)

    def _use_packing(self, packing: Packing) -> None:
        self._packing = packing
        self.prefilled = None  # cached keys and values of other weights
        if self._lib is not None:
            self._fd.layer_ptrs = packing.layer_ptrs.data_ptr()

    def set_lora(self, layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] | None) -> None:
        """Merge a LoRA adapter into this runner's own weights, re-packed (``W + B A`` as peft's
        ``merge_adapter`` computes it, quantized like the base): drafting costs what the base costs at
        any rank; ~0.4 s for SmolLM2-135M on 2 cores per adapter change, never per token. ``layers[i]``:
        layer ``i``'s {Linear name: (A [r, in], B [out, r]), the LoRA scaling in ``B``}; ``None``
        returns to the shared base packing. Resets the cache."""
        if layers is None:
            self.reset()
            self._use_packing(self._base())
            self.lora_rank = 0
            return
        if len(layers) != self.num_layers:
            raise ValueError(f"LoRA for {len(layers)} layers, the model has {self.num_layers}")
        if self._source_layers is None:
            raise RuntimeError("no float weights held (own_weights): an adapter cannot be merged")
        if len(ranks := {a.shape[0] for mods in layers for a, _ in mods.values()}) != 1:
            raise ValueError("LoRA matrices must share one rank")
        r = ranks.pop()
        for mods, layer in zip(layers, self._source_layers):  # shapes checked before anything is packed
            for name, (a, b) in mods.items():
                out_dim, in_dim = linear_of(layer, name).weight.shape
                if tuple(a.shape) != (r, in_dim) or tuple(b.shape) != (out_dim, r):
                    raise ValueError(f"LoRA {name} has shapes {tuple(a.shape)}, {tuple(b.shape)}")
        self.release_packing()  # freed (where nothing else holds it) before the next is packed
        self._use_packing(self._pack_layers([partial(lora_deltas, mods) for mods in layers]))
        self.lora_rank = r

    def release_packing(self) -> None:
        """Drop the weights this runner drafts on (0.13 GB for SmolLM2-135M; freed where nothing else
        holds them) until ``set_lora`` packs them again; a forward before then raises. Resets the cache."""
        self.reset()
        self._packing = None
        self.release_base()
        if self._lib is not None:
            self._fd.layer_ptrs = 0

    def _base(self) -> Packing:
        """The base packing, packed again from the model's weights as they are held now if
        ``release_base`` dropped it (bf16 once training began: what adapters merge from)."""
        if self._base_packing is None:  # a fork shares its template's
            self._base_packing = self._origin._base() if self._origin is not None else self._pack_layers()
        return self._base_packing

    def release_base(self) -> None:
        """Drop this runner's reference to the base packing unless it drafts on it (a template never
        does): once none holds it, its 0.1 GB (SmolLM2-135M) is freed."""
        if self._template:
            self._packing = None
        if self._packing is not self._base_packing and self._source_layers is not None:
            self._base_packing = None

    def own_weights(self) -> None:
        """Copy the input embeddings in so the model's tensors can be freed (no adapters then)."""
        self._embed = self._embed.clone()
        self._source_layers = None

    def fork(self, current: bool = False) -> FastLlamaRunner:
        """A runner with its own empty KV cache on this one's base packing (shared, no copy) and no
        adapter, until an adapter is merged into it. ``current``: on this one's weights as they
        are now instead (its merged adapter included), to decode another sequence beside this
        one's (``batched_steps``); valid while this runner's adapter does not change."""
        if current:
            return self._with_empty_cache(self._packing)
        base = self._base()
        new = self._with_empty_cache(base)
        new._base_packing, new._origin, new.lora_rank = base, self, 0
        return new

    def _with_empty_cache(self, packing: Packing) -> FastLlamaRunner:
        new = copy.copy(self)
        dtype = self._kcache.dtype
        new._kcache, new._vcache = (zeros_on_demand(shape, dtype) for shape in self._cache_shapes)
        new._template, new._packing, new._last_residual = False, packing, None
        new.forward_calls = 0
        new._empty_positions()
        if self._lib is not None:
            new._fd = FdModel.from_buffer_copy(self._fd)
            new._fd.kcache, new._fd.vcache = new._kcache.data_ptr(), new._vcache.data_ptr()
            new._fd.layer_ptrs = packing.layer_ptrs.data_ptr()
            new._fd_ref = ctypes.addressof(new._fd)
        return new

    def copy_positions(self, source: FastLlamaRunner, ids: list[int]) -> None:
        """Give this runner's empty cache ``source``'s first ``len(ids)`` positions (holding
        ``ids``; ``exact_prefix`` says how many hold the bits this runner's prefill writes)."""
        n, blocks = len(ids), -(-len(ids) // 16)  # keys are stored 16 positions to a block
        self._kcache[:, :, :blocks].copy_(source._kcache[:, :, :blocks])
        self._vcache[:, :, :n].copy_(source._vcache[:, :, :n])
        self._took(source, ids)

    def as_template(self) -> None:
        """Keep this runner only as the source of ``fork``s (a device's adapters draft on forks): its KV
        cache (~94 MB for SmolLM2-135M at 4,096 positions) is freed, and ``forward`` refuses to run."""
        dtype = self._kcache.dtype
        self._kcache = self._vcache = torch.empty(0, dtype=dtype)
        self._template = True
        if self._lib is not None:
            self._fd.kcache = self._fd.vcache = 0

    def _weights_for(self, m: int) -> str:
        """The packed weights a forward of ``m`` tokens uses (``prefill_weights``: long ones)."""
        return self.prefill_weights if self.prefill_weights and m > self.prefill_min_tokens else self.weights

    def row_kind(self, m: int) -> int | None:
        """A forward of ``m`` tokens on the native int8 kernels (rows never mix): its activation
        width (1: 8-bit, 0: 16-bit); None on the other kernels."""
        if self._lib is None or self._weights_for(m) != self.weights:
            return None
        return self._prefill_act8 if m > self.prefill_min_tokens else int(self.activation_bits == 8)

    @torch.inference_mode()
    def forward(self, ids: list[int], logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``ids``; return float32 logits of the last ``logits_to_keep`` positions
        ``[min(logits_to_keep, len(ids)), vocab]`` (0: every position, ``[len(ids), vocab]``)."""
        m = len(ids)
        if m == 0:
            raise ValueError("forward needs at least one token id")
        p = self.length
        t = p + m
        if t > self.max_positions:
            raise ValueError(f"sequence of {t} positions exceeds max_positions={self.max_positions}")
        if self._template or self._packing is None:
            raise RuntimeError("no weights to run: a template (forward on a fork) or released (release_packing)")
        rows = self.row_kind(m)
        t0 = time.perf_counter() if p == 0 else 0.0
        h = self._embed.index_select(0, torch.tensor(ids, dtype=torch.long))
        if h.dtype != torch.float32:
            h = h.float()
        if rows is not None:
            out = torch.empty(min(logits_to_keep, m) or m, self._head_pad)
            self._fd.act8 = rows
            rc = self._lib.fd_forward(
                self._fd_ref,
                m,
                h.data_ptr(),
                p,
                logits_to_keep,
                out.data_ptr(),
                self.threads or torch.get_num_threads(),
            )
            if rc != 0:
                raise MemoryError("native forward failed to allocate its work buffers")
            logits = out[:, : self.head_rows] if self._head_pad != self.head_rows else out
        else:
            kind = self._weights_for(m)
            logits = torch_forward(
                self._packing.torch_layers[kind],
                self._head[kind],
                self._kcache,
                self._vcache,
                self._cis,
                h,
                p,
                logits_to_keep,
                self.n_heads,
                self.hidden,
                self.intermediate,
                self.eps,
            )
        return self._appended(ids, rows, logits, h[-1], t0)  # both kernel paths leave the final residual in h

    def _appended(self, ids: list[int], rows, logits: torch.Tensor, residual: torch.Tensor, t0: float) -> torch.Tensor:
        """What a forward of ``ids`` (rows computed as ``rows``: ``row_kind``) leaves: the cache
        holds them, the last ``residual`` is kept (``last_hidden``), a prefill (``t0``: when it
        began) is remembered; returns the logits, widened to the whole vocabulary where the head
        is pruned."""
        self._last_residual = residual
        if self.vocab_rows is not None:
            full = torch.full((logits.shape[0], self.vocab), float("-inf"))
            full.index_copy_(1, self.vocab_rows, logits)
            logits = full
        self._wrote(ids, rows, time.perf_counter() - t0)
        self.forward_calls += 1
        return logits

    def track_hidden(self) -> None:
        """Nothing to set up: every forward keeps the final residual (``last_hidden``)."""

    def last_hidden(self) -> torch.Tensor:
        """The last forwarded position's hidden state after the final norm ``[hidden]`` (what
        HF's ``last_hidden_state`` holds): the acceptance head's input."""
        h = self._last_residual
        return torch.rms_norm(h, (self.hidden,), self._final_norm, self.eps)
