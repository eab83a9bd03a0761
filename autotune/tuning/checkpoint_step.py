"""The checkpoint step of a tuning run: a micro-batch that ran out of memory, run again with
activation checkpointing (`autotune run`, on by default; `--no-checkpoint-on-oom` turns it off).

Activation checkpointing keeps only each checkpointed layer's input in the forward pass and
recomputes the rest in the backward pass: about one more forward of compute for much less
activation memory. At a micro-batch that fits without it, it only costs time. Its use is the
micro-batch that does not fit: the largest micro-batches are often the fastest, and they are
the ones that run out of memory first. So the interval is not a dimension of the Bayesian
space (the proposers search micro-batch, GAS and bucket as before); it is set here, after the
fact:

1. a trial without checkpointing fails with `oom` (autotune/trials/judge.py);
2. the next trial runs the same micro-batch, GAS and bucket with
   `pipeline.activation_checkpoint_interval` = `INTERVAL` (DeepSpeed's PipelineEngine reads it
   from the ds_config and sets it on the module; deepspeed-facts.md);
3. when that trial fits and is the best so far, the next larger micro-batch of the space is
   tried with checkpointing too; at most `MAX_TRIALS` checkpointed trials in one study.

The interval is part of the trial's configuration (`TrialConfig.activation_checkpoint_interval`),
so the study's history keeps the checkpointed run apart from the run that ran out of memory,
`Study.best()` can name it, and `best_ds_config.json` carries the interval when it wins. The
proposers are not told checkpointed trials: their encoding has no such dimension, and a
success at the key of an out-of-memory failure would teach the memory model a false wall.

Where the model allows it: the built-in workload, whose PipelineModule checkpoints its decoder
layers only (autotune/rank/workload/model.py). Not a user's `--model` or command: DeepSpeed's default
rule checkpoints every layer with parameters, and its reentrant checkpoint of an embedding fed
integer token ids fails (the built-in model's trial crashed that way before it named its
checkpointable layers). A user's script has `--knob`
(docs/user-script.md). Nor a study whose config or `--activation-checkpoint-interval` already
checkpoints.

Checkpointed trials run in fresh processes (autotune/trials/warm_pool.py `fresh_reason`); the trials
after them start a new pool of warm workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_kind import CHECKPOINT as SOURCE
from autotune.core.trial_kind import TrialKind
from autotune.trials.contract import TrialRequest
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.proposers.feasibility import OOM_REASONS
from autotune.tuning.steps import TrialEnd

INTERVAL = 1
"""Checkpoint every decoder layer: the most memory saved, one recomputed forward per layer."""
MAX_TRIALS = 3
"""Checkpointed trials at most in one study."""


class CheckpointStep:
    """Plans the checkpointed trials of a study from the outcomes of the trials before them."""

    def __init__(self, space: SearchSpace, note: Callable[[str], None] = print) -> None:
        self.space = space
        self.note = note
        self.pending: Proposal | None = None
        self.tried: set[tuple] = set()
        """Keys of the checkpointed configurations planned so far (never one twice)."""

    def before_end(self, best: Any, room: int) -> Proposal | None:
        return None

    def next_proposal(self) -> Proposal | None:
        p, self.pending = self.pending, None
        return p

    @property
    def deciding(self) -> bool:
        """Checkpointed trials are never told to the proposer (its encoding has no interval), so
        nothing is held while one is planned."""
        return False

    def prepare(self, request: TrialRequest, kind: TrialKind) -> None:
        """The interval is a TrialConfig field: the request carries it already."""

    def after(self, end: TrialEnd) -> None:
        self._after(end.number, end.proposal.config, end.proposal.source, end.ok, end.failure_reason,
                    end.samples_per_second, end.earlier_best)

    def _after(self, number: int, config: TrialConfig, source: str, ok: bool, failure_reason: str | None,
               samples_per_second: float | None, earlier_best: float | None) -> None:
        """Plan the next checkpointed trial, if trial `number`'s outcome calls for one;
        `earlier_best`: the fastest successful trial before it (samples/s; None: none)."""
        if config.activation_checkpoint_interval == 0:
            if not ok and failure_reason in OOM_REASONS:
                self._plan(config, f"trial {number} ran out of memory at micro-batch {config.micro_batch_size}; "
                                   "activation checkpointing keeps only each decoder layer's input and "
                                   "recomputes the rest in the backward pass")
            return
        if source != SOURCE:
            return
        if not ok:
            why = failure_reason or "failed"
            self.note(f"      checkpoint: micro-batch {config.micro_batch_size} with activation checkpointing "
                      f"{'ran out of memory too' if why in OOM_REASONS else f'failed ({why})'}; "
                      "later trials run without it")
            return
        sps = float(samples_per_second or 0.0)
        if earlier_best is not None and sps <= earlier_best:
            self.note(f"      checkpoint: micro-batch {config.micro_batch_size} fits with activation checkpointing "
                      f"({sps:.1f} samples/s) but is not faster than the best trial ({earlier_best:.1f}); "
                      "later trials run without it")
            return
        self.note(f"      checkpoint: micro-batch {config.micro_batch_size} fits with activation checkpointing "
                  f"and is the fastest so far ({sps:.1f} samples/s): keep "
                  f"pipeline.activation_checkpoint_interval {config.activation_checkpoint_interval} with it")
        larger = self._larger(config)
        if larger is not None:
            self._plan(larger, f"trial {number} (micro-batch {config.micro_batch_size}, activation checkpointing) "
                               "is the best so far; the next larger micro-batch may fit with it too")

    def _larger(self, config: TrialConfig) -> TrialConfig | None:
        """The next micro-batch of the space above `config`'s, GAS as the space implies."""
        for m in self.space.micro_batch_sizes:
            if m <= config.micro_batch_size:
                continue
            gas = self.space.gas_for(m) if self.space.global_batch is not None else config.gradient_accumulation_steps
            plain = dataclasses.replace(config, micro_batch_size=m, gradient_accumulation_steps=gas,
                                        activation_checkpoint_interval=0)
            if self.space.contains(plain):
                return plain
        return None

    def _plan(self, config: TrialConfig, reason: str) -> None:
        cfg = dataclasses.replace(config, activation_checkpoint_interval=INTERVAL)
        if cfg.key() in self.tried or len(self.tried) >= MAX_TRIALS:
            return
        self.tried.add(cfg.key())
        self.pending = Proposal(config=cfg, source=SOURCE, reason=reason)

    def replay(self, finished: Sequence[Any], redo: Sequence[Any], budget: int | None = None) -> None:
        """Rebuild the plan from a resumed study's finished trials, in trial order. A checkpointed
        trial that was interrupted (in `redo`) runs again as itself, not a second time."""
        saved, self.note = self.note, (lambda _text: None)  # said when it happened
        try:
            best: float | None = None
            for t in sorted(finished, key=lambda t: t.number):
                if t.source == SOURCE:
                    self.tried.add(t.config.key())
                    self.pending = None
                ok = t.status == "ok"
                self._after(t.number, t.config, t.source, ok, t.failure_reason, t.samples_per_second, best)
                if ok and t.samples_per_second:
                    best = max(best or 0.0, float(t.samples_per_second))
        finally:
            self.note = saved
        for t in redo:
            if t.source == SOURCE:
                self.tried.add(t.config.key())
                self.pending = None
