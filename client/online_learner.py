"""Online distillation of the drafter on the device (OmniDraft paper, Algorithm 2 + 4).

``OnlineLearner.observe(sample)`` is called after each generation with what it taught
(``TrainingSample``). Every ``interval`` prompts (``I``, default 8) the buffered samples drive
AdamW steps on the active target's LoRA adapter with the configured loss (sequence-level
NLL by default, or the paper's hybrid loss); the buffer is then
cleared (one pass over the stream, on-policy: each sample was decoded with the current
drafter). The training forwards of the update's last pass also label the acceptance head's
replay buffer (each sample's hidden states with the acceptance its drafter logits would get, a
consistent pair from the drafter state of that step), and the head takes one step; on every
other prompt the head takes one step on a replayed batch (interleaved training). The caller
runs ``observe`` between requests, so an update never blocks a generation in progress;
``UpdateReport.seconds`` is the time it took.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from dataclasses import asdict, dataclass, field

import torch

from omnidraft.shared.learning.acceptance_head import AcceptanceHead, ReplayBuffer, soft_labels
from omnidraft.shared.learning.adapters import DrafterAdapters
from omnidraft.shared.learning.distill import SEQ_ROWS, LossConfig, hybrid_loss, sequence_nll_rows
from omnidraft.shared.learning.training_signal import Intersection, TrainingSample
from omnidraft.shared.runtime.heap import release_freed_memory, small_machine
from omnidraft.shared.runtime.native_kernels import cpu_has_native_bf16
from omnidraft.shared.util.steps import run_to_end

OPTIMIZERS = ("adamw", "sgd")


def default_training_autocast() -> torch.dtype | None:
    """The dtype the learner's forwards autocast to unless ``OnlineConfig.bf16_autocast`` says
    otherwise: bf16 where the CPU has native bf16 (AMX, AVX512-BF16), else None (float32)."""
    return torch.bfloat16 if cpu_has_native_bf16() else None


def default_recompute_layers() -> int:
    """``OnlineConfig.recompute_layers`` when unset: 1 (every layer) where this process may use
    at most ``heap.SMALL_MACHINE_BYTES`` of memory (``heap.small_machine``), 0 elsewhere (a
    checkpointed update takes about half as long again: each layer's forward runs again in
    the backward pass)."""
    return 1 if small_machine() else 0


@dataclass
class OnlineConfig:
    """Schedule and optimizer settings (paper Table 10 defaults where it gives them)."""

    interval: int = 8  # prompts per drafter update (I)
    lr: float = 1e-4  # constant AdamW learning rate for the adapter
    weight_decay: float = 0.0
    steps_per_update: int = 8  # optimizer steps per pass (the buffer split into this many batches)
    epochs: int = 1  # passes over the buffer per update (the paper: 1; a federated round may take more)
    optimizer: str = "adamw"  # adamw | sgd (plain SGD: its updates average like gradients in FedAvg)
    loss: LossConfig = field(default_factory=LossConfig)
    head: bool = True  # train the acceptance head
    head_lr: float = 1e-3
    head_batch: int = 256  # replayed rows per head step
    replay_rows: int = 8192  # replay buffer capacity (rows)
    bf16_autocast: bool | None = None  # None: where the CPU has native bf16 (AMX / AVX512-BF16)
    # recompute every n-th drafter layer's activations in the backward pass instead of holding
    # them (transformers' activation checkpointing; the same gradients, bit for bit); 0 holds
    # them all. None: 1 where the process may use at most SMALL_MACHINE_BYTES of memory, else 0
    recompute_layers: int | None = None
    # drafter tokens of a sample's prompt a training forward reads before the response
    # (``TrainingSample.windowed``; 0: all of them)
    max_context: int = 256

    def validate(self) -> None:
        if self.interval < 1:
            raise ValueError("the update interval must be >= 1 prompt")
        if self.lr <= 0:
            raise ValueError("the learning rate must be > 0")
        if self.steps_per_update < 1:
            raise ValueError("steps per update must be >= 1")
        if self.epochs < 1:
            raise ValueError("epochs per update must be >= 1")
        if self.max_context < 0:
            raise ValueError("max_context must be >= 0 drafter tokens (0: the whole prompt)")
        if self.recompute_layers is not None and self.recompute_layers < 0:
            raise ValueError("recompute_layers must be >= 0 (0: hold every layer's activations)")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        self.loss.validate()


@dataclass
class UpdateReport:
    """One drafter update: when, how long, on what, and the loss before the step."""

    update: int
    prompts_seen: int
    seconds: float
    loss: float
    dm_terms: int
    ngram_terms: int
    head_rows: int
    parts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class OnlineLearner:
    """Adapter (and acceptance head) training for one target (see the module docstring)."""

    def __init__(
        self,
        adapters: DrafterAdapters,
        target: str,
        intersection: Intersection,
        head: AcceptanceHead | None = None,
        config: OnlineConfig | None = None,
    ) -> None:
        self.config = config or OnlineConfig()
        self.config.validate()
        self.adapters = adapters
        self.target = target
        self.inter = intersection
        self.head = head if self.config.head else None
        self.new_optimizer()
        self.head_optimizer = (
            torch.optim.AdamW(self.head.parameters(), lr=self.config.head_lr) if self.head is not None else None
        )
        self.replay = ReplayBuffer(self.config.replay_rows)
        self.buffer: list[TrainingSample] = []
        self.prompts_seen = 0
        self.updates = 0
        self.reports: list[UpdateReport] = []
        autocast = self.config.bf16_autocast
        self.autocast = default_training_autocast() is not None if autocast is None else autocast
        recompute = self.config.recompute_layers
        self.recompute_layers = default_recompute_layers() if recompute is None else recompute
        if self.recompute_layers:  # only in training mode: drafting and scoring forwards keep theirs
            adapters.peft.get_base_model().activation_checkpointing_enable(every_n_layers=self.recompute_layers)

    def new_optimizer(self) -> None:
        """A fresh optimizer (``config.optimizer``) over the target adapter's trainable
        parameters (also after the adapter was rebuilt with other LoRA settings)."""
        self.adapters.activate(self.target)
        params, c = self.adapters.trainable_parameters(), self.config
        if c.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=c.lr, weight_decay=c.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=c.lr, betas=(0.9, 0.999), weight_decay=c.weight_decay)

    # -- the stream ----------------------------------------------------------------------------
    def observe(self, sample: TrainingSample) -> UpdateReport | None:
        """Take one generation's sample (cut to ``max_context`` tokens of prompt); update when
        the buffer holds ``interval`` prompts."""
        return run_to_end(self.observe_steps(sample))

    def observe_steps(self, sample: TrainingSample) -> Generator[None, None, UpdateReport | None]:
        """``observe``, pausing after each optimizer step of an update (``update_steps``)."""
        self.prompts_seen += 1
        self.buffer.append(sample.windowed(self.config.max_context) if self.config.max_context else sample)
        if len(self.buffer) >= self.config.interval:
            return (yield from self.update_steps())
        if self.head is not None and self.replay.size:
            self.head_step()
        return None

    def update(self) -> UpdateReport:
        """``epochs`` passes over the buffer, each ``steps_per_update`` optimizer steps on the
        loss; the report's loss is the first pass's (before most steps). The last pass's
        forwards label the acceptance head's replay buffer (no forward of its own)."""
        return run_to_end(self.update_steps())

    def update_steps(self) -> Generator[None, None, UpdateReport]:
        """``update``, pausing after each optimizer step, so that a caller can run other work
        on the models between steps (a service's requests: ``client.service``). Drafting in
        the pauses uses the adapter as it was before the update (its merged runner is
        invalidated at the end); the update's report is the generator's return value."""
        t0 = time.perf_counter()
        self.adapters.activate(self.target)
        board = small_machine()
        if board:  # its drafting weights go now (re-packed after the update anyway), not
            self.adapters.release(self.target)  # kept for the next device loading the same global adapter
        kind = self.config.loss.kind
        samples = [s for s in self.buffer if s.positions(kind)]
        self.buffer = []
        steps = max(1, min(self.config.steps_per_update, len(samples)))
        batches = [samples[i::steps] for i in range(steps)]
        totals = {"loss": 0.0, "dm_terms": 0, "ngram_terms": 0, "terms": 0}
        head_rows = 0
        model = self.adapters.peft
        model.train()
        try:
            for epoch in range(self.config.epochs):
                last = epoch == self.config.epochs - 1
                for batch in batches:
                    terms = sum(s.positions(kind) for s in batch)
                    self.optimizer.zero_grad(set_to_none=True)
                    for s in batch:
                        n = s.positions(kind)
                        loss, parts, hidden, dm_logits = self._sample_loss(s, grad=True)
                        if board:  # what the forward freed goes back before the backward's transients
                            release_freed_memory()
                        (loss * (n / terms)).backward()
                        if epoch == 0:
                            totals["loss"] += float(loss.detach()) * n
                            totals["terms"] += n
                            totals["dm_terms"] += parts.get("dm_terms", 0)
                            totals["ngram_terms"] += parts.get("ngram_terms", 0)
                        if last and self.head is not None:
                            head_rows += self._label_for_head(
                                s, hidden.detach(), None if dm_logits is None else dm_logits.detach()
                            )
                    if terms:
                        self.optimizer.step()
                    yield
        finally:
            model.eval()
            # the gradients are zeroed before every step: between updates they would only hold
            # one float per adapter weight (39 MB at rank 32) on a device that may have no room
            self.optimizer.zero_grad(set_to_none=True)
        self.adapters.invalidate(self.target)
        if self.head is not None and self.replay.size:
            self.head_step()
        self.updates += 1
        n_terms = totals["terms"]
        report = UpdateReport(
            self.updates,
            self.prompts_seen,
            time.perf_counter() - t0,
            totals["loss"] / n_terms if n_terms else 0.0,
            totals["dm_terms"],
            totals["ngram_terms"],
            head_rows,
        )
        self.reports.append(report)
        return report

    # -- losses ----------------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _sample_loss(self, s: TrainingSample, grad: bool):
        """``(loss, parts, hidden, dm_logits)`` of one sample: the teacher-forced drafter over
        its ids, logits only at the rows that predict a loss position (``hidden`` and
        ``dm_logits`` at the DM positions, for the acceptance head's labels; ``dm_logits`` is None
        under the sequence loss, which computes its logits in slices)."""
        decoder, lm_head = self.adapters.decoder_and_head(torch.bfloat16 if self.autocast else None)
        ids = torch.tensor([s.draft_ids], dtype=torch.long)
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with ctx, self._autocast():
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
            dm_hidden = hidden.index_select(0, s.dm_pos - 1)
            if self.config.loss.kind == "seq":  # logits a slice of positions at a time
                loss, parts = sequence_nll_rows(lm_head, hidden[s.seq_start - 1 : -1], ids[0, s.seq_start :])
                return loss, parts, dm_hidden.float(), None  # the head's labels compute their logits
            dm_logits = lm_head(dm_hidden).float()
            ng_logits = lm_head(hidden.index_select(0, s.ng_pos - 1)).float()
        loss, parts = hybrid_loss(
            dm_logits,
            self.inter.draft_ids,
            s.dm_top_idx,
            s.dm_top_logp,
            s.dm_inter_logmass,
            ng_logits,
            s.ng_ids,
            s.ng_logp_t,
            self.config.loss,
        )
        return loss, parts, dm_hidden.float(), dm_logits

    def loss_on(self, samples: list[TrainingSample]) -> float:
        """The loss averaged over the terms of ``samples`` with the current adapter."""
        total, terms = 0.0, 0
        kind = self.config.loss.kind
        for s in samples:
            n = s.positions(kind)
            if n:
                loss, _, _, _ = self._sample_loss(s, grad=False)
                total += float(loss) * n
                terms += n
        return total / terms if terms else 0.0

    # -- the acceptance head ---------------------------------------------------------------------
    def _label_for_head(self, s: TrainingSample, hidden: torch.Tensor, logits: torch.Tensor | None) -> int:
        """Push sample ``s``'s (hidden state, soft label) rows at its DM positions into the
        replay buffer, from the drafter ``hidden`` states and ``logits`` there (a training
        forward's); returns the rows added."""
        if not s.dm_pos.numel():
            return 0
        if logits is None:  # the sequence loss kept none: the DM positions' logits, without autograd,
            # ``SEQ_ROWS`` rows at a time (a label reads its own row): all of them at once, with their
            # log-softmax, were the peak of a float32 update (0.1 GB for 256 positions of SmolLM2's vocabulary)
            _, lm_head = self.adapters.decoder_and_head(torch.bfloat16 if self.autocast else None)
            with torch.no_grad(), self._autocast():
                rows = [
                    soft_labels(
                        lm_head(hidden[lo : lo + SEQ_ROWS]).float(),
                        self.inter.index_of_draft,
                        s.dm_top_idx[lo : lo + SEQ_ROWS],
                        s.dm_top_logp[lo : lo + SEQ_ROWS],
                    )
                    for lo in range(0, hidden.shape[0], SEQ_ROWS)
                ]
            labels, keep = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        else:
            labels, keep = soft_labels(logits, self.inter.index_of_draft, s.dm_top_idx, s.dm_top_logp)
        self.replay.push(hidden[keep], labels[keep])
        return int(keep.sum())

    def head_step(self) -> float:
        """One weighted-BCE step of the head on a replayed batch; returns the loss."""
        hidden, labels = self.replay.sample(self.config.head_batch)
        self.head.train()
        logits = self.head(hidden)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        self.head_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.head_optimizer.step()
        self.head.eval()
        self.head.trained_steps += 1
        return float(loss.detach())
