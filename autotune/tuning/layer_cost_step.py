"""The layer costs of every pipeline study, measured once: in the baseline, outside its figures.

`plan`, the partition advice and the model's other partitions and stage counts need each
layer's cost (autotune/rank/layer_costs.py). Measured only on request (`--layer-costs`,
`--balance-stages`), a user who had just tuned a job had to tune it again before planning
a cluster. So a pipeline study's baseline asks for them by default: its ranks run a short
block of hooked steps after the measured ones (autotune/rank/wiring.py `LAYER_COST_STEPS`),
which no CSV row, live gauge or step budget sees, so the baseline's samples/s is the
same as without it. `--no-layer-costs` turns it off.

A setting step with no trials of its own: it only fills in the baseline's request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from autotune.core.trial_kind import TrialKind
from autotune.tuning.proposers.base import Proposal

if TYPE_CHECKING:
    from autotune.core.options import WorkloadOptions
    from autotune.study.store import TrialRow
    from autotune.trials.contract import TrialRequest
    from autotune.tuning.steps import SettingStep, TrialEnd


class BaselineLayerCosts:
    """The baseline's request asks for the layer-cost block; every other trial's is left as it is."""

    deciding = False

    def replay(self, finished: Sequence[TrialRow], redo: Sequence[TrialRow], budget: int | None) -> None:
        """Nothing to rebuild: a resumed study's baseline already wrote its costs."""

    def next_proposal(self) -> Proposal | None:
        return None

    def before_end(self, best: TrialRow | None, room: int) -> Proposal | None:
        return None

    def prepare(self, request: TrialRequest, kind: TrialKind) -> None:
        if kind.is_baseline and request.layer_costs is None:
            request.layer_costs = True

    def after(self, end: TrialEnd) -> None:
        """Nothing to learn: the costs are read from the trial's folder by whoever needs them."""


def layer_cost_steps(wl: WorkloadOptions) -> list[SettingStep]:
    """The step where the study needs it: asked for (the default) and not already measured by
    `--layer-costs` (every trial) or the partition step (its baseline is hooked)."""
    if not wl.layer_costs_once or wl.layer_costs or wl.balance_stages:
        return []
    return [BaselineLayerCosts()]
