"""The layer costs of every pipeline study, once (autotune/tuning/layer_cost_step.py, issue 44).

What a real study does with it is asserted on the shared default study (tests/test_model.py:
its baseline alone wrote layer costs, and `plan` works from it); the block itself, outside
every figure, on real ranks in tests/test_layer_costs.py. Here: which trials ask, and when
the step is there at all."""

from __future__ import annotations

from pathlib import Path

from autotune.core.options import RunOptions, WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.core.trial_kind import BASELINE, TrialKind
from autotune.trials.contract import TrialRequest
from autotune.tuning.layer_cost_step import BaselineLayerCosts, layer_cost_steps


def _request() -> TrialRequest:
    config = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4, reduce_bucket_size=None)
    return TrialRequest(number=0, config=config, trial_dir=Path("/nowhere"), timeout=60.0)


def test_only_the_baseline_asks_and_an_explicit_request_stands():
    step = BaselineLayerCosts()
    base, search, told = _request(), _request(), _request()
    step.prepare(base, TrialKind.of(BASELINE))
    step.prepare(search, TrialKind.of("bayes"))
    told.layer_costs = False  # a step before it decided (none does today): not overridden
    step.prepare(told, TrialKind.of(BASELINE))
    assert (base.layer_costs, search.layer_costs, told.layer_costs) == (True, None, False)
    assert step.next_proposal() is None and not step.deciding


def test_the_step_is_there_unless_turned_off_or_already_measured():
    assert len(layer_cost_steps(WorkloadOptions(layer_costs_once=True))) == 1
    assert layer_cost_steps(WorkloadOptions(layer_costs_once=False)) == []  # --no-layer-costs
    assert layer_cost_steps(WorkloadOptions(layer_costs_once=True, layer_costs=True)) == []  # every trial
    assert layer_cost_steps(WorkloadOptions(layer_costs_once=True, balance_stages=True)) == []  # its own hooks


def test_a_study_stored_before_the_option_resumes_without_it():
    stored = RunOptions().to_dict()
    del stored["workload"]["layer_costs_once"]
    assert RunOptions.from_dict(stored).workload.layer_costs_once is False


def test_the_command_line_turns_it_on_and_no_layer_costs_off():
    from click.testing import CliRunner

    from autotune.cli.main import cli

    out = CliRunner().invoke(cli, ["run", "--help"], terminal_width=400).output
    entry = out.split("--layer-costs-once / --no-layer-costs", 1)[1].split("\n  --", 1)[0]
    assert "[default: layer-costs-once]" in entry, entry
