"""The partition step of a tuning run (`autotune run --balance-stages`).

The partition is a model setting, not a ds_config key, and one good partition serves
every micro-batch and GAS, so it is not a dimension of the Bayesian space. It is one
decision, taken once:

1. the baseline trial runs with the layer-cost hooks on (autotune/layer_costs.py);
2. when its measured stage compute imbalance is above `THRESHOLD`, the next trial runs
   the baseline's configuration with the parts autotune/partition.py computes from
   those costs (`parts:` method, autotune/pipeline_parts.py; for a user's command the
   bootstrap forces the parts on the script's PipelineModule), hooks on again so the two
   trials cost the same to measure;
3. when that trial is faster, every later trial keeps the parts; otherwise the study's
   own partition method comes back. When the kept trial is still above `THRESHOLD`
   (layer costs measured on one partition do not carry exactly to another: a stage's
   neighbours and its share of the cores change), its own layer costs give one more
   candidate, up to `MAX_ROUNDS` partition trials.

The decision is written to `STUDY/partition.json` (the parts, both throughputs, which
layers moved) and rebuilt from the study's trial folders on resume, so a resumed study
takes the same decision without re-measuring.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.errors import UserError
from autotune.fileio import write_atomic
from autotune.proposers.base import Proposal
from autotune.space import TrialConfig

THRESHOLD = 1.10
"""Stage work imbalance (max / mean, `work_imbalance`) above which the partition trial runs (the goal of issue 13)."""
MAX_ROUNDS = 2
"""Partition trials at most in one study."""
SOURCE = "partition"
RESULT_NAME = "partition.json"


def work_imbalance(summary: Any) -> float:
    """The stage imbalance a partition decides: of the stages' work (thread CPU time on a CPU,
    where wall time also holds each rank's wait for a core; CUDA events on a GPU)."""
    work = getattr(summary, "stage_work_imbalance", None)
    return float(work if work is not None else summary.stage_compute_imbalance)


def _slowest(summary: Any) -> int:
    work = getattr(summary, "stage_work_seconds", None)
    return int(max(range(len(work)), key=work.__getitem__)) if work else int(summary.slowest_stage)


class StageBalancer:
    """Decides and carries the partition of a study's trials (through the runner's workload)."""

    def __init__(self, runner: Any, study_root: Path, note: Callable[[str], None] = print) -> None:
        self.runner = runner
        self.root = Path(study_root)
        self.note = note
        self.user_command = not hasattr(runner, "workload")
        """A user's command (usercmd/runner.py): its own code picks the method; parts are forced."""
        self.method = "the script's own" if self.user_command else runner.workload.partition_method
        """The study's own partition method (what trials run without a kept partition)."""
        self.pending: Proposal | None = None
        self.candidate: list[int] | None = None
        """The parts the next (or running) partition trial measures."""
        self.kept: list[int] | None = None
        """The parts later trials run with (None: the study's own method)."""
        self.best = 0.0
        """samples/s of the trial whose partition is kept (the baseline's at first)."""
        self.rounds = 0
        self.info: dict[str, Any] = {"rounds": []}

    # -- around each trial ------------------------------------------------------------------
    def before(self, number: int, proposal: Proposal) -> None:
        """Set the runner for this trial: hooks on the baseline and partition trials, the parts."""
        measuring = proposal.source in ("baseline", SOURCE)
        parts = (None if proposal.source == "baseline" else
                 self.candidate if proposal.source == SOURCE and self.candidate is not None else self.kept)
        if self.user_command:
            self.runner.layer_costs = measuring
            self.runner.parts = list(parts) if parts is not None else None
            return
        from autotune.pipeline_parts import method_for

        method = method_for(parts) if parts is not None else self.method
        self.runner.workload = dataclasses.replace(self.runner.workload, layer_costs=measuring,
                                                   partition_method=method)

    def after(self, number: int, proposal: Proposal, ok: bool, samples_per_second: float | None,
              summary: Any) -> None:
        if proposal.source == "baseline" and ok and summary is not None:
            self.best = float(samples_per_second or 0.0)
            self.info["baseline_samples_per_second"] = self.best
            self._plan(number, proposal.config, summary)
        elif proposal.source == SOURCE and self.candidate is not None:
            self._decide(number, proposal.config, ok, samples_per_second, summary)

    def next_proposal(self) -> Proposal | None:
        """The partition trial, once per round, right after the trial that measured its costs."""
        p, self.pending = self.pending, None
        return p

    # -- the decision ------------------------------------------------------------------------
    def _plan(self, number: int, config: TrialConfig, summary: Any) -> None:
        from autotune.layer_costs import memory_model, read_trial_layer_costs
        from autotune.partition import balanced_parts, describe_moves, imbalance, stage_times

        measured = work_imbalance(summary)
        if measured <= THRESHOLD or self.rounds >= MAX_ROUNDS:
            self._write(decision="balanced" if measured <= THRESHOLD else "rounds spent",
                        measured_imbalance=measured)
            return
        try:
            lc = read_trial_layer_costs(self.root / f"trial-{number:03d}")
        except UserError as exc:
            self.note(f"      partition: the layer costs of trial {number} cannot be read ({exc})")
            return
        if lc is None:
            self.note(f"      partition: trial {number} wrote no layer costs; the partition stays as it is")
            return
        memory = memory_model(lc, getattr(summary, "memory_capacity_bytes", None))
        try:  # on a GPU each stage must also fit the device (1F1B's activations in flight included)
            parts = balanced_parts(lc.costs, lc.stages, stage_fixed=lc.stage_fixed_seconds, memory=memory)
        except UserError as exc:
            self.note(f"      partition: {exc}; the partition stays as it is")
            self._write(decision="no partition fits the device's memory")
            return
        after = stage_times(lc.costs, parts, lc.stage_fixed_seconds)
        moved = describe_moves(lc.parts, parts, lc.names)
        if "measured_parts" not in self.info:
            self.info.update(measured_parts=lc.parts, measured_imbalance=measured,
                             slowest_stage=_slowest(summary))
        if parts == lc.parts:
            if not self.rounds:
                self._write(decision="no better contiguous partition")
            return
        self.candidate = parts
        self.info["rounds"].append({"from_trial": number, "parts": parts, "moves": moved,
                                    "predicted_imbalance": imbalance(after)})
        if not self.rounds:
            self._write(decision="measuring")
        self.pending = Proposal(
            config=config, source=SOURCE,
            reason=f"stage {_slowest(summary)} does {measured:.2f}x the mean stage's work; the layer costs of trial "
                   f"{number} balance as parts {parts} (predicted imbalance {imbalance(after):.2f}): {moved}")

    def _decide(self, number: int, config: TrialConfig, ok: bool, samples_per_second: float | None,
                summary: Any) -> None:
        self.rounds += 1
        parts, self.candidate = self.candidate, None
        sps = float(samples_per_second or 0.0)
        faster = bool(ok and samples_per_second is not None and sps > self.best)
        current = self.info["rounds"][-1]
        current.update(trial=number, samples_per_second=samples_per_second, kept=faster,
                       measured_imbalance=work_imbalance(summary) if summary is not None else None)
        if faster:
            self.note(f"      partition: parts {parts} kept for the later trials ({sps:.1f} against "
                      f"{self.best:.1f} samples/s)")
            self.kept, self.best = parts, sps
        else:
            keep = self.kept if self.kept is not None else self.method
            self.note(f"      partition: parts {parts} measured {sps:.1f} samples/s against {self.best:.1f}; "
                      f"later trials keep {keep}")
        self.info.update(parts=self.kept, kept_samples_per_second=self.best)
        self._write(decision="kept" if self.kept is not None else "rejected")
        if (faster and summary is not None and work_imbalance(summary) > THRESHOLD
                and self.rounds < MAX_ROUNDS):
            self._plan(number, config, summary)  # still unbalanced: one more round from its own costs

    def _write(self, **fields: Any) -> None:
        self.info.update(fields)
        self.info["method"] = self.method
        write_atomic(self.root / RESULT_NAME, json.dumps(self.info, indent=2) + "\n")

    # -- resume ------------------------------------------------------------------------------
    def replay(self, finished: list[Any], redo: list[Any]) -> None:
        """Rebuild the decision from the study's finished trials (a resume), in trial order: each
        step reads the same layer-cost files it read when it ran. An interrupted partition trial
        in `redo` runs again as itself, not a second time."""
        from autotune.summary import TrialSummary

        saved = self.note
        self.note = lambda _text: None  # said when it happened
        try:
            for t in sorted(finished, key=lambda t: t.number):
                if t.source not in ("baseline", SOURCE):
                    continue
                summary = TrialSummary.from_dict(t.summary) if t.summary else None
                if t.source == SOURCE:
                    self.pending = None
                self.after(t.number, Proposal(config=t.config, source=t.source), t.status == "ok",
                           t.samples_per_second, summary)
        finally:
            self.note = saved
        if any(t.source == SOURCE for t in redo):
            self.pending = None
