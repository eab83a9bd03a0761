"""The partition step of a tuning run (`autotune run --balance-stages`).

The partition is a model setting, not a ds_config key, so it is not a dimension of the
Bayesian space. It is decided in rounds, each at one configuration (its micro-batch, GAS
and bucket), each from layer costs measured at that configuration:

1. the baseline trial runs with the layer-cost hooks on (autotune/rank/layer_costs.py);
2. when its measured stage work imbalance is above `THRESHOLD`, the next trial runs the
   baseline's configuration with the parts autotune/core/partition.py computes from those
   costs (`parts:` method, autotune/rank/pipeline_parts.py; for a user's command the bootstrap
   forces the parts on the script's PipelineModule), hooks on again so the two trials cost
   the same to measure;
3. when that trial is faster, every later trial keeps the parts; otherwise the partition
   in force stays. When the kept trial is still above `THRESHOLD` (layer costs measured on
   one partition do not carry exactly to another: a stage's neighbours and its share of
   the cores change), its own layer costs give one more candidate;
4. imbalance grows with the micro-batch (the per-stage fixed work, the optimizer step and
   the transfers, weighs less against the layers' work), so a baseline balanced at a small
   micro-batch says little about the configuration the search ends at. When a search trial
   becomes the best so far above `THRESHOLD`, its configuration runs once more with the
   hooks on (`COSTS`), and a round as in 2-3 follows at that configuration, judged against
   that hooked run.

A round is judged on one pair of trials, unless the pair lies within the noise margin:
then both run once more, in the order A B B A (the partition in force, the candidate, the
candidate again `RECHECK`, the partition in force again `REFERENCE`), which cancels a
steady drift of the machine's speed, and the means decide. At most `MAX_ROUNDS` rounds.

The decision is written to `STUDY/partition.json` (each round: its configuration, the
parts, the throughputs, which layers moved; what to write in the user's own code) and
rebuilt from the study's trials on resume, so a resumed study takes the same decision
without re-measuring.

A round's trials run one configuration with other parts, so the study's history key
(micro-batch, GAS, bucket) cannot tell them apart. Left alone, `Study.best()` averaged
them as runs of one configuration (a rejected partition dragged the baseline's mean down
and was named the best trial; a kept one was averaged with the partition it replaced),
and the proposer was told a failed partition trial as a failure of the configuration
(which drops it from the proposer's means and teaches the memory model a false failure).
`superseded()` (autotune/core/measurements.py) names the trials whose measurement does not
hold for the partition the study runs from then on; `Study.best()`, the report and the
tuner's proposer leave them out, and the tuner tells the proposer the round's
configuration once, with the measurement that holds, after the decision (`deciding`).
Trials of other configurations measured before a later round was kept keep their
measurement (they ran with the parts then in force); partition.json names the round each
kept parts came from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING

from autotune.core.errors import UserError
from autotune.core.fileio import write_atomic
from autotune.core.measurements import COSTS, RECHECK, REFERENCE, SOURCE
from autotune.core.noise import NOISE_MARGIN, ties
from autotune.core.partition import (
    bounding_layer,
    no_gain_text,
    partition_balanced,
    partition_uniform,
)
from autotune.core.space import TrialConfig
from autotune.core.trial_kind import Step, TrialKind
from autotune.study.partition_record import RESULT_NAME, at_config
from autotune.trials.contract import TrialRequest
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.steps import TrialEnd

if TYPE_CHECKING:
    from autotune.core.summary import TrialSummary
    from autotune.rank.layer_costs import LayerCosts
    from autotune.study.store import TrialRow

THRESHOLD = 1.10
"""Stage work imbalance (max / mean, `work_imbalance`) above which the partition trial runs (the goal of issue 13)."""
MAX_ROUNDS = 3
"""Rounds (candidate partitions measured) at most in one study."""
GAIN_OF_NOISE = 0.5
"""A round runs only where the layer costs predict its slowest stage faster than the one in force
by more than this share of the noise margin (5 % at the default 10 %). Below it even the A B B A
recheck reads a tie (two warm runs of identical parts read 0.95-1.07 of each other at 2 stages,
docs/partition.md), and the round spends 2-4 trials to keep or drop parts on a coin toss. The
whole margin would be too much: a round starts above `THRESHOLD` (1.10), so at 1.10-1.15 a
perfect partition gains only 5-10 %, and such rounds measured +8-11 % (docs/partition.md)."""


def work_imbalance(summary: TrialSummary) -> float:
    """The stage imbalance a partition decides: of the stages' work (thread CPU time on a CPU,
    where wall time also holds each rank's wait for a core; CUDA events on a GPU)."""
    work = getattr(summary, "stage_work_imbalance", None)
    if work is None:
        work = summary.stage_compute_imbalance
    return float(work) if work is not None else 1.0  # no stages (not a pipeline): nothing to balance


def builtin_equivalent(parts: list[int], costs: list[float], parameters: list[int],
                       stage_fixed: list[float] | None = None, *, tolerance: float = 0.02,
                       names: list[str] | None = None, own: list[int] | None = None,
                       own_method: str = "the script's own partition_method") -> dict[str, object]:
    """What a user writes to keep `parts`: nothing, when the partition the job builds by itself
    (`own`, measured at its baseline) is predicted as good (slowest stage within `tolerance`);
    else a built-in partition_method predicted as good; else a `type:REGEX` over the model's
    own layer classes (`names`) predicted as good; else the parts list itself.

    The built-in parts are DeepSpeed's own rules on the measured layers (`uniform`: the
    layer count; `parameters`: each layer's parameter count, as `_count_layer_params`;
    `type:`: the count of layers whose class the regex finds, `partition.type_parts`)."""
    from autotune.core.partition import best_type_method, imbalance, stage_times

    stages = len(parts) - 1
    best = max(stage_times(costs, parts, stage_fixed))
    builtin = {"uniform": [int(p) for p in partition_uniform(num_items=len(costs), num_parts=stages)],
               "parameters": [int(p) for p in partition_balanced(weights=parameters, num_parts=stages)]}
    predicted = {m: imbalance(stage_times(costs, p, stage_fixed)) for m, p in builtin.items()}

    def as_good(p: list[int]) -> bool:
        return max(stage_times(costs, p, stage_fixed)) <= best * (1 + tolerance)

    same = [m for m, p in builtin.items() if as_good(p)]
    typed = best_type_method(names, costs, stages, stage_fixed) if names and len(names) == len(costs) else None
    if own is not None and len(own) == len(parts) and as_good(own):
        same = ["own"]
        text = (f"keep what you have: {own_method} builds {list(own)}, predicted as good as {list(parts)} "
                f"(imbalance {imbalance(stage_times(costs, own, stage_fixed)):.2f}); nothing to change in the code")
    elif same:
        m = same[0]
        text = (f"partition_method='{m}' builds {builtin[m]}, predicted as good as {list(parts)}: "
                f"use PipelineModule(..., partition_method='{m}')")
    elif typed is not None and as_good(typed[1]):
        m, p = typed
        same = [m]
        builtin[m] = p
        predicted[m] = imbalance(stage_times(costs, p, stage_fixed))
        text = (f"partition_method='{m}' (the model's own layer classes) builds {p}, predicted as good as "
                f"{list(parts)}: use PipelineModule(..., partition_method='{m}')")
    else:
        none = "no built-in method builds it"
        if typed is not None:  # the nearest may be a type: regex over the model's own classes
            builtin[typed[0]] = typed[1]
            predicted[typed[0]] = imbalance(stage_times(costs, typed[1], stage_fixed))
            none = "neither a built-in method nor a type: regex over the model's layer classes builds it"
        nearest = min(predicted, key=predicted.__getitem__)
        text = (f"{none} (nearest: '{nearest}' {builtin[nearest]}, predicted imbalance "
                f"{predicted[nearest]:.2f}): set PARTS = {list(parts)} in the PipelineModule subclass of "
                "docs/partition.md (\"Keeping the result in your own code\")")
    return {"method": same[0] if same else None, "parts": list(parts), "builtin_parts": builtin,
            "builtin_predicted_imbalance": predicted, "text": text}


def _config_fields(config: TrialConfig) -> dict[str, int | None]:
    return {"micro_batch_size": config.micro_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "reduce_bucket_size": config.reduce_bucket_size}


def _slowest(summary: TrialSummary) -> int:
    work = getattr(summary, "stage_work_seconds", None)
    return int(max(range(len(work)), key=work.__getitem__)) if work else int(summary.slowest_stage)


class StageBalancer:
    """Decides and carries the partition of a study's trials (through the runner's workload)."""

    def __init__(self, study_root: Path, note: Callable[[str], None] = print, *, method: str | None,
                 multi_node: bool = False, noise: float = NOISE_MARGIN) -> None:
        self.root = Path(study_root)
        self.note = note
        self.noise = noise
        self.multi_node = multi_node
        """The ranks run on several nodes: they do not share this machine's cores."""
        self.user_command = method is None
        """A user's command (usercmd/runner.py): its own code picks the method; parts are forced."""
        self.method = "the script's own" if method is None else method
        """The study's own partition method (what trials run without a kept partition)."""
        self.pending: list[Proposal] = []
        """The step's next trials, in order (each follows from the trial just finished)."""
        self.candidate: list[int] | None = None
        """The parts the open round measures (None: no round open)."""
        self.kept: list[int] | None = None
        """The parts later trials run with (None: the study's own method)."""
        self.reference: list[float] = []
        """samples/s of the runs in force at the open (or next) round's configuration."""
        self.runs: list[tuple[int, float | None, TrialSummary | None]] = []
        """(trial, samples/s or None: failed, summary) of the open round's candidate runs."""
        self.rounds = 0
        self.bounded = False
        """A plan found one layer setting the pace of every partition at this stage count: no more rounds."""
        self.planned: set[tuple] = set()
        """Configurations a round was planned at (one plan each, refinements aside)."""
        self.info: dict[str, object] = {}
        """partition.json's fields besides its rounds and plans (`_write` joins them)."""
        self.round_records: list[dict[str, object]] = []
        """partition.json's `rounds`: each round's plan, then its measurement and decision."""
        self.plan_records: list[dict[str, object]] = []
        """partition.json's `plans`: each plan's trial, imbalance and outcome."""
        self.measured_parts: list[int] | None = None
        """The first plan's parts: measured with the job's own partition."""
        self.outcome = "measuring"
        """What the last plan found (`plans` in partition.json: each plan's trial, imbalance and outcome)."""
        self.layers: tuple[list[float], list[int], list[float]] | None = None
        """(costs, parameters, stage fixed seconds) the last plan was made from: what `builtin_equivalent` compares."""
        self.names: list[str] | None = None
        """The layers' classes of the last plan (the `type:` regexes `builtin_equivalent` tries)."""
        self._room = 1 << 30
        """Trials the budget has left after the trial `after` is handling."""
        self._followed: str | None = None
        """In a replay, the source of the trial that followed the one being replayed (None: none yet)."""

    @property
    def deciding(self) -> bool:
        """A round is planned or open: its configuration has no final measurement yet."""
        return bool(self.pending) or self.candidate is not None

    # -- around each trial ------------------------------------------------------------------
    def prepare(self, request: TrialRequest, kind: TrialKind) -> None:
        """This trial's part of the request: hooks on the step's own trials, and the parts."""
        source = kind.label
        request.layer_costs = kind.hooked
        parts = (None if kind.is_baseline else
                 self.candidate if source in (SOURCE, RECHECK) and self.candidate is not None else self.kept)
        request.parts = list(parts) if parts is not None else None

    def after(self, end: TrialEnd) -> None:
        """Learn from a trial's end (see `_after`)."""
        self._after(end.number, end.proposal, end.ok, end.samples_per_second, end.summary,
                    is_best=end.is_best, room=end.room)

    def _after(self, number: int, proposal: Proposal, ok: bool, samples_per_second: float | None,
               summary: TrialSummary | None, *, is_best: bool = False, room: int | None = None) -> None:
        """After trial `number`. `is_best`: it made its configuration the study's best so far;
        `room`: trials the budget has left (None: no limit), so that a round is started only
        where its trials fit."""
        source, config = proposal.source, proposal.config
        self._room = 1 << 30 if room is None else room
        sps = float(samples_per_second) if ok and samples_per_second is not None else None
        if proposal.kind.is_baseline or source == COSTS:
            self.planned.add(config.key())
            if sps is not None and summary is not None:
                self.reference = [sps]
                if proposal.kind.is_baseline:
                    self.info["baseline_samples_per_second"] = sps
                self._plan(number, config, summary)
            elif source == COSTS:
                self.note(f"      partition: trial {number} did not finish; the partition stays as it is")
        elif source in (SOURCE, RECHECK) and self.candidate is not None:
            self.runs.append((number, sps, summary))
            if source == SOURCE and sps is not None and self._close(sps) and self._room_for(RECHECK, 2):
                self.pending = [
                    Proposal(config=config, source=RECHECK,
                             reason=f"the candidate parts {self.candidate} measured within the {self.noise:.0%} noise "
                                    f"margin of the partition in force: measured again (A B B A) before deciding"),
                    Proposal(config=config, source=REFERENCE,
                             reason="the partition in force again, the pair's last run (A B B A)")]
            elif source == SOURCE or sps is None:  # one pair decides; a failed candidate is rejected
                self.pending = [p for p in self.pending if p.source != REFERENCE]
                self._decide(config)
        elif source == REFERENCE and self.candidate is not None:
            if sps is not None:
                self.reference.append(sps)
            self._decide(config)
        elif (sps is not None and is_best and summary is not None and not self.deciding
              and self.rounds < MAX_ROUNDS and not self.bounded and config.key() not in self.planned
              and work_imbalance(summary) > THRESHOLD and self._room_for(COSTS, 2)):
            self.planned.add(config.key())
            self.pending = [Proposal(
                config=config, source=COSTS,
                reason=f"trial {number} is the best so far and its stage {_slowest(summary)} does "
                       f"{work_imbalance(summary):.2f}x the mean stage's work: its configuration again with the "
                       "layer-cost hooks, to partition at it")]

    def before_end(self, best: TrialRow | None, room: int) -> Proposal | None:
        return None

    def next_proposal(self) -> Proposal | None:
        """The step's next trial: each follows from the trial just finished."""
        return self.pending.pop(0) if self.pending else None

    def _room_for(self, source: str, trials: int) -> bool:
        """May the step start `trials` more trials, the first of `source`? While a resume replays
        a trial that others followed, what followed it says (`replay`: the budget may differ
        from the one the run had then); otherwise the budget's room does."""
        if self._followed is not None:
            return self._followed == source
        return self._room >= trials

    def _close(self, sps: float) -> bool:
        """Is the candidate's first run within the noise margin of the reference?"""
        ref = fmean(self.reference) if self.reference else 0.0
        return ref > 0 and ties(sps, ref, self.noise)

    # -- the decision ------------------------------------------------------------------------
    def _plan(self, number: int, config: TrialConfig, summary: TrialSummary) -> None:
        from autotune.core.partition import balanced_parts, describe_moves, imbalance, stage_times
        from autotune.rank.layer_costs import memory_model, read_trial_layer_costs

        measured = work_imbalance(summary)
        self.plan_records.append({"trial": number, "work_imbalance": measured})
        if measured <= THRESHOLD or self.rounds >= MAX_ROUNDS:
            self._write(outcome="balanced" if measured <= THRESHOLD else "rounds spent")
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
            self._write(outcome="no partition fits the device's memory")
            return
        after = stage_times(lc.costs, parts, lc.stage_fixed_seconds)
        moved = describe_moves(lc.parts, parts, lc.names)
        if self.measured_parts is None:
            self.measured_parts = list(lc.parts)
            self.info.update(measured_parts=lc.parts, measured_imbalance=measured,
                             slowest_stage=_slowest(summary))
            self._say_if_cores_are_shared(lc, summary)
        self.layers = (lc.costs, lc.parameters, lc.stage_fixed_seconds)
        self.names = list(lc.names)
        gain = max(stage_times(lc.costs, lc.parts, lc.stage_fixed_seconds)) / max(after) - 1.0
        if parts == lc.parts or gain <= self.noise * GAIN_OF_NOISE:
            text = no_gain_text(lc.names, lc.costs, lc.parts, parts, lc.stage_fixed_seconds,
                                margin=self.noise * GAIN_OF_NOISE, lead=f"no round{at_config({'config': _config_fields(config)})}",
                                keep="keep what you have" if self.kept is None else
                                f"the parts kept earlier, {self.kept}, stay")
            self.note(f"      partition: {text}")
            if bounding_layer(lc.costs, parts, lc.stage_fixed_seconds) is not None:
                self.bounded = True  # no later round: the layer bounds every partition at any micro-batch
            self._write(outcome="no better contiguous partition" if parts == lc.parts
                        else "predicted gain within the noise", no_round=text)
            return
        if not self._room_for(SOURCE, 1):
            self._write(outcome="no trial left in the budget")
            return
        self.candidate, self.runs = parts, []
        self.round_records.append({
            "from_trial": number, "config": _config_fields(config),
            "from_imbalance": measured, "reference_samples_per_second": fmean(self.reference),
            "parts": parts, "moves": moved, "predicted_imbalance": imbalance(after), "predicted_gain": gain})
        self._write(outcome="round planned")
        self.pending = [Proposal(
            config=config, source=SOURCE,
            reason=f"stage {_slowest(summary)} does {measured:.2f}x the mean stage's work; the layer costs of trial "
                   f"{number} balance as parts {parts} (predicted imbalance {imbalance(after):.2f}, the slowest "
                   f"stage {gain:.1%} faster): {moved}")]

    def _decide(self, config: TrialConfig) -> None:
        """Close the open round by the rule `superseded` replays: kept when no candidate run
        failed and their mean beats the mean of the reference's runs."""
        self.rounds += 1
        parts, self.candidate = self.candidate, None
        runs = [s for _, s, _ in self.runs]
        measured = [s for s in runs if s is not None]
        sps = fmean(measured) if runs and len(measured) == len(runs) else None
        ref = fmean(self.reference) if self.reference else None
        faster = sps is not None and ref is not None and sps > ref
        work = [work_imbalance(m) for _, _, m in self.runs if m is not None]
        measured_imbalance = fmean(work) if work else None
        self.round_records[-1].update(trial=self.runs[0][0], trials=[n for n, _, _ in self.runs], samples_per_second=sps,
                                      reference_samples_per_second=ref, kept=faster,
                                      measured_imbalance=measured_imbalance)
        shown = f"{sps:.1f}" if sps is not None else "a failure"
        abba = len(self.runs) > 1
        if faster:
            assert parts is not None  # a round was open
            self.kept = parts
            self.reference = measured
            code = self._in_your_code(parts)
            self.note(f"      partition: parts {parts} kept for the later trials ({shown} against "
                      f"{ref:.1f} samples/s{', means of the A B B A runs' if abba else ''}); in your own code: {code}")
        else:
            keep = self.kept if self.kept is not None else self.method
            self.note(f"      partition: parts {parts} measured {shown} against {ref or 0:.1f} samples/s"
                      f"{' (means of the A B B A runs)' if abba else ''}; later trials keep {keep}")
        self.info.update(parts=self.kept, kept_samples_per_second=fmean(self.reference) if self.kept else None)
        self._write()
        last, _, summary = self.runs[-1]
        if (faster and summary is not None and measured_imbalance is not None and measured_imbalance > THRESHOLD
                and self.rounds < MAX_ROUNDS):
            self._plan(last, config, summary)  # still unbalanced: one more round from its own costs

    def _say_if_cores_are_shared(self, lc: LayerCosts, summary: TrialSummary) -> None:
        """On a CPU with fewer cores than ranks, every core is busy all the time and a step takes
        about the stages' summed work over the cores, whatever the slowest stage does: a round
        can then read only a tie, and saying so up front beats a verdict that reads like noise.
        (4 stages of `wide-vocab` on 2 cores: docs/partition.md, "Why 4 stages do not win here".)"""
        ranks = lc.stages * int(getattr(summary, "data_parallel_size", 1) or 1)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if lc.peak_memory_kind == "cuda_max_allocated" or ranks <= cores or self.multi_node:
            return
        self.info["cores_shared"] = {"ranks": ranks, "cores": cores}
        self.note(f"      partition: {ranks} ranks share {cores} cores here, so a step takes about the stages' "
                  "summed work over the cores, not the slowest stage's time: a balanced partition can read no "
                  "faster on this machine than the one it replaces (with a core or a device per rank it would)")

    def _in_your_code(self, parts: list[int]) -> str:
        if self.layers is None:
            return f"PARTS = {parts} (docs/partition.md)"
        costs, parameters, fixed = self.layers
        advice = builtin_equivalent(parts, costs, parameters, fixed, names=self.names, own=self.measured_parts,
                                    own_method="the script's own partition_method" if self.user_command
                                    else f"partition_method='{self.method}'")
        self.info["in_your_code"] = advice
        return str(advice["text"])

    def _write(self, outcome: str | None = None, **fields: object) -> None:
        if outcome is not None:
            self.outcome = outcome
        self.info.update(fields)
        decided = any("kept" in r for r in self.round_records)
        self.info["decision"] = ("kept" if self.kept is not None else "rejected" if decided else
                                 "measuring" if self.candidate is not None else self.outcome)
        if self.plan_records:
            self.plan_records[-1]["outcome"] = self.outcome
        self.info["method"] = self.method
        record = {"rounds": self.round_records, **self.info}
        if self.plan_records:
            record["plans"] = self.plan_records
        write_atomic(self.root / RESULT_NAME, json.dumps(record, indent=2) + "\n")

    # -- resume ------------------------------------------------------------------------------
    def replay(self, finished: Sequence[TrialRow], redo: Sequence[TrialRow], budget: int | None = None) -> None:
        """Rebuild the decision from the study's finished trials (a resume), in trial order: each
        step reads the same layer-cost files and the same best-so-far it read when it ran, and
        where the budget's room decided (a recheck, a round), what followed the trial says what
        was decided (a resume may bring another budget); after the last trial, the budget left.
        A step's trial interrupted (in `redo`) runs again as itself, not a second time."""
        from autotune.core.measurements import best_of
        from autotune.core.summary import TrialSummary

        saved = self.note
        self.note = lambda _text: None  # said when it happened
        rows = sorted(finished, key=lambda t: t.number)
        try:
            for i, t in enumerate(rows):
                self._drop_pending(t.source)
                summary = TrialSummary.from_dict(t.summary) if t.summary else None
                ok = t.status == "ok"
                best = best_of(rows[:i + 1]) if ok and not TrialKind.of(t.source).hooked else None
                # the other steps' trials come between this step's: look past them
                self._followed = next((r.source for r in [*rows[i + 1:], *redo]
                                       if TrialKind.of(r.source).step in (Step.SEARCH, Step.PARTITION)), None)
                self._after(t.number, Proposal(config=t.config, source=t.source), ok, t.samples_per_second,
                           summary, is_best=best is not None and best.number == t.number,
                           room=None if budget is None else budget - (i + 1))
        finally:
            self.note = saved
            self._followed = None
        for t in redo:
            self._drop_pending(t.source)

    def _drop_pending(self, source: str) -> None:
        """The step's proposal that trial of `source` ran (it is not proposed again)."""
        if TrialKind.of(source).step is Step.PARTITION:
            i = next((i for i, p in enumerate(self.pending) if p.source == source), None)
            if i is not None:
                del self.pending[i]
