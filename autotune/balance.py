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
layers moved, what to write in the user's own code) and rebuilt from the study's trial
folders on resume, so a resumed study takes the same decision without re-measuring.

The partition trial runs the baseline's TrialConfig, so the study's history key
(micro-batch, GAS, bucket) cannot tell the two apart. Left alone, `Study.best()` averaged
them as two runs of one configuration (a rejected partition dragged the baseline's mean
down and was named the best trial; a kept one was averaged with the partition it
replaced), and the proposer was told a failed partition trial as a failure of the
baseline configuration (which drops it from the proposer's means and teaches the
memory model a false failure). `superseded()` names the trials whose measurement does
not hold for the partition the study runs from then on; `Study.best()`, the report and
the tuner's proposer leave them out, and the tuner tells the proposer the baseline's key
once, with the measurement that holds, after the decision (`deciding`).
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


def superseded(trials: list[Any]) -> set[int]:
    """Numbers of the trials whose measurement does not hold for the study's partition.

    From the trial rows alone (number, source, status, samples_per_second), with the rule
    `_decide` applies: a partition trial is kept when it succeeds faster than the
    measurement it would replace (the baseline's, or an earlier kept round's). Superseded:
    every partition trial not kept (failed ones too: the failure belongs to the parts, not
    to the configuration) and, once one is kept, the measurement it replaced. Only the
    baseline and partition trials can be; every other trial runs the partition in force.

    A knob trial of a user's script (`--knob`, usercmd/knobs.py: source `knob:NAME=VALUE`)
    is the same case, another model setting at the baseline's key, and `KnobSweep` keeps a
    value by the same rule (faster than the measurement in force), so it is judged here too.
    """
    from autotune.usercmd.knobs import SOURCE_PREFIX as KNOB

    def at_baseline_key(source: str) -> bool:
        return source in ("baseline", SOURCE) or source.startswith(KNOB)

    out: set[int] = set()
    current: Any = None
    for t in sorted((t for t in trials if at_baseline_key(t.source) and t.status in ("ok", "failed")),
                    key=lambda t: t.number):
        if t.source == "baseline":
            current = t if t.status == "ok" else None
            continue
        best = float(current.samples_per_second or 0.0) if current is not None else None
        if best is not None and t.status == "ok" and t.samples_per_second is not None and t.samples_per_second > best:
            out.add(current.number)
            current = t
        else:
            out.add(t.number)
    return out


def builtin_equivalent(parts: list[int], costs: list[float], parameters: list[int],
                       stage_fixed: list[float] | None = None, *, tolerance: float = 0.02) -> dict[str, Any]:
    """What a user writes to keep `parts`: a built-in partition_method when its parts are
    predicted as good (slowest stage within `tolerance`), else the parts list itself.

    The built-in parts are DeepSpeed's own rules on the measured layers (`uniform`: the
    layer count; `parameters`: each layer's parameter count, as `_count_layer_params`).
    `type:REGEX` balances a count of matching layers and is not tried."""
    from autotune.partition import imbalance, stage_times

    stages = len(parts) - 1
    best = max(stage_times(costs, parts, stage_fixed))
    builtin = {"uniform": [int(p) for p in partition_uniform(num_items=len(costs), num_parts=stages)],
               "parameters": [int(p) for p in partition_balanced(weights=parameters, num_parts=stages)]}
    predicted = {m: imbalance(stage_times(costs, p, stage_fixed)) for m, p in builtin.items()}
    same = [m for m, p in builtin.items()
            if max(stage_times(costs, p, stage_fixed)) <= best * (1 + tolerance)]
    if same:
        m = same[0]
        text = (f"partition_method='{m}' builds {builtin[m]}, predicted as good as {list(parts)}: "
                f"use PipelineModule(..., partition_method='{m}')")
    else:
        nearest = min(predicted, key=predicted.__getitem__)
        text = (f"no built-in method builds it (nearest: '{nearest}' {builtin[nearest]}, predicted imbalance "
                f"{predicted[nearest]:.2f}): set PARTS = {list(parts)} in the PipelineModule subclass of "
                "docs/partition.md (\"Keeping the result in your own code\")")
    return {"method": same[0] if same else None, "parts": list(parts), "builtin_parts": builtin,
            "builtin_predicted_imbalance": predicted, "text": text}


def read_result(study_root: str | Path) -> dict[str, Any] | None:
    """partition.json of a study (None: no partition step ran, or the file is unreadable)."""
    try:
        info = json.loads((Path(study_root) / RESULT_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def describe_result(info: dict[str, Any] | None) -> str | None:
    """One line for the end of a run and report.md: the decision and what to write in the code."""
    if not info or not info.get("rounds"):
        return None
    if info.get("parts") is not None:
        last = next(r for r in reversed(info["rounds"]) if r.get("kept"))
        code = (info.get("in_your_code") or {}).get("text") or f"PARTS = {info['parts']} (docs/partition.md)"
        return (f"partition: parts {info['parts']} kept (trial {last.get('trial')}, work imbalance "
                f"{info.get('measured_imbalance', 0):.2f} -> {last.get('measured_imbalance') or 0:.2f}, "
                f"{info.get('baseline_samples_per_second') or 0:.1f} -> {info.get('kept_samples_per_second') or 0:.1f}"
                f" samples/s); the best configuration needs it: {code}")
    tried = info["rounds"][-1]
    if tried.get("trial") is None:
        return None
    return (f"partition: parts {tried['parts']} measured {tried.get('samples_per_second') or 0:.1f} against "
            f"{info.get('baseline_samples_per_second') or 0:.1f} samples/s (work imbalance "
            f"{info.get('measured_imbalance', 0):.2f} -> {tried.get('measured_imbalance') or 0:.2f}); not kept: "
            f"{info.get('method', 'the script')} partition stays, nothing to change in the code")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed 0.19.8's `runtime.utils.partition_uniform` (the `uniform` method), ported so
    that the controller needs neither torch nor DeepSpeed (tests compare it with DeepSpeed's)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        parts[i + 1:] = [x + 1 for x in parts[i + 1:]]
    return parts


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """DeepSpeed 0.19.8's `runtime.utils.partition_balanced` (the `parameters` method on the
    layers' parameter counts), ported step for step, ties included."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    dp_max[0][0] = dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                max_sum, min_sum = max(dp_max[k][j - 1], run), min(dp_min[k][j - 1], run)
                if dp_cost[i][j] >= max_sum - min_sum:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j] = max_sum - min_sum, max_sum, min_sum
                    position[i][j] = k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


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
        self.layers: tuple[list[float], list[int], list[float]] | None = None
        """(costs, parameters, stage fixed seconds) the last plan was made from: what `builtin_equivalent` compares."""

    @property
    def deciding(self) -> bool:
        """A partition trial is planned or running: the baseline's key has no final measurement yet."""
        return self.pending is not None or self.candidate is not None

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
        self.layers = (lc.costs, lc.parameters, lc.stage_fixed_seconds)
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
        current_best = self.best
        faster = bool(ok and samples_per_second is not None and sps > self.best)  # as superseded() judges
        current = self.info["rounds"][-1]
        current.update(trial=number, samples_per_second=samples_per_second, kept=faster,
                       measured_imbalance=work_imbalance(summary) if summary is not None else None)
        if faster:
            self.kept, self.best = parts, sps
            code = self._in_your_code(parts)
            self.note(f"      partition: parts {parts} kept for the later trials ({sps:.1f} against "
                      f"{current_best:.1f} samples/s); in your own code: {code}")
        else:
            keep = self.kept if self.kept is not None else self.method
            self.note(f"      partition: parts {parts} measured {sps:.1f} samples/s against {self.best:.1f}; "
                      f"later trials keep {keep}")
        self.info.update(parts=self.kept, kept_samples_per_second=self.best)
        self._write(decision="kept" if self.kept is not None else "rejected")
        if (faster and summary is not None and work_imbalance(summary) > THRESHOLD
                and self.rounds < MAX_ROUNDS):
            self._plan(number, config, summary)  # still unbalanced: one more round from its own costs

    def _in_your_code(self, parts: list[int]) -> str:
        if self.layers is None:
            return f"PARTS = {parts} (docs/partition.md)"
        costs, parameters, fixed = self.layers
        advice = builtin_equivalent(parts, costs, parameters, fixed)
        self.info["in_your_code"] = advice
        return advice["text"]

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
