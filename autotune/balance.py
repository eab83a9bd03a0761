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
   own partition method comes back.

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
"""Stage compute imbalance (max / mean) above which the partition trial runs (the goal of issue 13)."""
SOURCE = "partition"
RESULT_NAME = "partition.json"


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
        self.parts: list[int] | None = None
        self.baseline: tuple[int, float] | None = None
        self.decided = False
        self.kept = False
        self.info: dict[str, Any] = {}

    # -- around each trial ------------------------------------------------------------------
    def before(self, number: int, proposal: Proposal) -> None:
        """Set the runner's workload for this trial: hooks on the baseline and the partition trial."""
        if self.user_command:
            measuring = proposal.source in ("baseline", SOURCE)
            self.runner.layer_costs = measuring
            use = self.parts if proposal.source == SOURCE or (self.decided and self.kept) else None
            self.runner.parts = list(use) if use is not None and proposal.source != "baseline" else None
            return
        wl = self.runner.workload
        if proposal.source == "baseline":
            wl = dataclasses.replace(wl, layer_costs=True, partition_method=self.method)
        elif proposal.source == SOURCE and self.parts is not None:
            from autotune.pipeline_parts import method_for

            wl = dataclasses.replace(wl, layer_costs=True, partition_method=method_for(self.parts))
        else:
            wl = dataclasses.replace(wl, layer_costs=False, partition_method=self._kept_method())
        self.runner.workload = wl

    def after(self, number: int, proposal: Proposal, ok: bool, samples_per_second: float | None,
              summary: Any) -> None:
        if proposal.source == "baseline" and ok and summary is not None:
            self.baseline = (number, float(samples_per_second or 0.0))
            self._plan(number, proposal.config, summary.stage_compute_imbalance, summary.slowest_stage)
        elif proposal.source == SOURCE and self.parts is not None:
            self._decide(ok, samples_per_second)

    def next_proposal(self) -> Proposal | None:
        """The partition trial, once, right after an unbalanced baseline."""
        p, self.pending = self.pending, None
        return p

    # -- the decision ------------------------------------------------------------------------
    def _plan(self, number: int, config: TrialConfig, measured_imbalance: float, slowest: int) -> None:
        from autotune.layer_costs import read_trial_layer_costs
        from autotune.partition import balanced_parts, describe_moves, imbalance, stage_times

        if measured_imbalance <= THRESHOLD:
            self._write(decision="balanced already", measured_imbalance=measured_imbalance)
            self.decided = True
            return
        try:
            lc = read_trial_layer_costs(self.root / f"trial-{number:03d}")
        except UserError as exc:
            self.note(f"      partition: the layer costs of trial {number} cannot be read ({exc})")
            return
        if lc is None:
            self.note(f"      partition: trial {number} wrote no layer costs; the partition stays {self.method}")
            return
        parts = balanced_parts(lc.costs, lc.stages, stage_fixed=lc.stage_fixed_seconds)
        before = stage_times(lc.costs, lc.parts, lc.stage_fixed_seconds)
        after = stage_times(lc.costs, parts, lc.stage_fixed_seconds)
        moved = describe_moves(lc.parts, parts, lc.names)
        self.info = {"measured_parts": lc.parts, "parts": parts, "measured_imbalance": measured_imbalance,
                     "slowest_stage": slowest, "predicted_imbalance_before": imbalance(before),
                     "predicted_imbalance_after": imbalance(after), "moves": moved}
        if parts == lc.parts:
            self._write(decision="no better contiguous partition")
            self.decided = True
            return
        self.parts = parts
        self.pending = Proposal(
            config=config, source=SOURCE,
            reason=f"stage {slowest} is {measured_imbalance:.2f}x the mean stage; measured layer costs "
                   f"balance as parts {parts} (predicted imbalance {imbalance(after):.2f}): {moved}")

    def _decide(self, ok: bool, samples_per_second: float | None) -> None:
        base = self.baseline[1] if self.baseline else 0.0
        kept = bool(ok and samples_per_second is not None and samples_per_second > base)
        self.decided = True
        if not kept:
            self.note(f"      partition: parts {self.parts} measured {samples_per_second or 0:.1f} samples/s "
                      f"against {base:.1f}; later trials keep {self.method}")
        else:
            self.note(f"      partition: parts {self.parts} kept for the later trials "
                      f"({samples_per_second:.1f} against {base:.1f} samples/s)")
        self.kept = kept
        self._write(decision="kept" if kept else "rejected", baseline_samples_per_second=base,
                    partition_samples_per_second=samples_per_second)

    def _kept_method(self) -> str:
        if self.decided and self.kept and self.parts is not None:
            from autotune.pipeline_parts import method_for

            return method_for(self.parts)
        return self.method

    def _write(self, **fields: Any) -> None:
        self.info.update(fields)
        self.info["method"] = self.method
        write_atomic(self.root / RESULT_NAME, json.dumps(self.info, indent=2) + "\n")

    # -- resume ------------------------------------------------------------------------------
    def replay(self, finished: list[Any], redo: list[Any]) -> None:
        """Rebuild the decision from the study's finished trials (a resume); an interrupted
        partition trial in `redo` runs again as itself, not a second time."""
        by_number = {t.number: t for t in finished}
        base = by_number.get(0)
        if base is None or base.status != "ok" or not base.summary:
            return
        from autotune.summary import TrialSummary

        summary = TrialSummary.from_dict(base.summary)
        self.after(0, Proposal(config=base.config, source="baseline"), True, base.samples_per_second, summary)
        done = [t for t in finished if t.source == SOURCE]
        if done and self.parts is not None:
            self.pending = None
            t = done[-1]
            self._decide(t.status == "ok", t.samples_per_second)
        elif any(t.source == SOURCE for t in redo):
            self.pending = None
