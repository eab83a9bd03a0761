"""The partition trial shares the baseline's history key (autotune/tuning/balance.py `superseded`).

It runs the baseline's micro-batch, GAS and bucket with other parts, so the study and the
proposer must not take it for a second run of the baseline's configuration: the best
configuration, its mean, the report and what the proposer is told count only the
measurement that holds for the partition the study runs from then on. The tuning loop,
the study (SQLite), the balancer and the hybrid proposer are the real ones; the trials are
answered at once by a runner that writes the layer costs a real baseline would (the
loop's bookkeeping, not DeepSpeed, is under test).
"""

from __future__ import annotations

import json

from builders import RecordingDisplay, ScriptedRunner, healthy_summary

from autotune.core.dsconfig import DsConfig
from autotune.core.measurements import superseded
from autotune.core.options import WorkloadOptions
from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_result import STATUS_OK, TrialResult
from autotune.rank.layer_costs import rows_to_csv
from autotune.study.partition_record import describe_result
from autotune.study.store import Study
from autotune.trials.builtin import BuiltinRunner
from autotune.trials.judge import TrialOutcome, failed
from autotune.tuning.balance import COSTS, SOURCE, StageBalancer
from autotune.tuning.proposers.hybrid import HybridProposer
from autotune.tuning.tuner import Tuner

BASE = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)
OTHER = TrialConfig(micro_batch_size=4, gradient_accumulation_steps=2)


def _space() -> SearchSpace:
    return SearchSpace.build(pipeline_stages=2, data_parallel_size=1, zero_stage=0, global_batch=8)


def _layer_costs(folder) -> None:
    """Stage 1 of [0, 3, 6] holds the heavy layer 5 (a head after five blocks): balanced as [0, 4, 6]."""
    folder.mkdir(parents=True, exist_ok=True)
    costs = [1, 1, 1, 1, 1, 4]
    for s, (lo, hi) in enumerate([(0, 3), (3, 6)]):
        rows = [{"rank": s, "stage": s, "stages": 2, "layer": i, "name": "Head" if i == 5 else "Block", "forward_seconds": costs[i] / 2,
                 "backward_seconds": costs[i] / 2, "parameters": 100, "activation_bytes": 1,
                 "stage_overhead_seconds": 0.0, "stage_peak_memory_bytes": 1.0, "peak_memory_kind": "process_max_rss",
                 "micro_batch_size": 2, "gradient_accumulation_steps": 4, "steps": 2} for i in range(lo, hi)]
        (folder / f"layer-costs-rank{s}.csv").write_text(rows_to_csv(rows))


class AnsweringRunner(ScriptedRunner):
    """Trial N answers `answers[N]` (samples/s, or None: failed out of memory)."""

    def __init__(self, answers: dict[int, float | None], imbalances: dict[int, float] | None = None) -> None:
        self.answers = answers
        self.imbalances = imbalances if imbalances is not None else {0: 1.4}
        """Trial N's stage imbalance (1.05 where not named)."""
        self.workload = WorkloadOptions(preset="tiny", pipeline_stages=2, partition_method="uniform",
                                        workers="fresh")
        self.methods: dict[int, str] = {}

    def answer(self, request) -> TrialOutcome:
        number, trial_dir = request.number, request.trial_dir
        workload = BuiltinRunner(self.workload, DsConfig()).workload_for(request)
        self.methods[number] = workload.partition_method
        if workload.layer_costs:  # a hooked trial writes its layer costs, as a real one does
            _layer_costs(trial_dir)
        sps = self.answers[number]
        if sps == "stop":  # Ctrl-C during this trial
            raise KeyboardInterrupt
        if sps is None:
            return failed("oom", "out of memory on stage 0", 0.1)
        imbalance = self.imbalances.get(number, 1.05)
        return TrialOutcome(result=TrialResult(status=STATUS_OK, samples_per_second=sps),
                            summary=healthy_summary(stage_compute_imbalance=imbalance, slowest_stage=1,
                                                    samples_per_second=sps),
                            failure_detail=None, wall_seconds=0.1)

    def ds_config_for(self, config: TrialConfig) -> dict:
        return {"train_micro_batch_size_per_gpu": config.micro_batch_size}


class RecordingProposer(HybridProposer):
    """The hybrid proposer; records what it is told and proposes OTHER first after the baseline."""

    def __init__(self, space: SearchSpace) -> None:
        super().__init__(space, seed=0, moves=None, budget=4)
        self.told: list[tuple[TrialConfig, str, float]] = []

    def tell(self, config, result) -> None:
        self.told.append((config, result.status, result.samples_per_second))
        super().tell(config, result)

    def ask(self):
        from autotune.tuning.proposers.base import Proposal

        if not any(c == OTHER for c, _, _ in self.told):
            self.history.pending.add(OTHER.key())
            return Proposal(config=OTHER, source="explore", reason="the other configuration")
        return super().ask()


def _tune(root, answers: dict[int, float | None], budget: int = 3, knobs: list[str] | None = None,
          imbalances: dict[int, float] | None = None, balance: bool | None = None):
    """A study run by the real loop: the partition step, or with `knobs` the knob sweep (and with
    `balance` as well the partition step before it, as one study runs both)."""
    from autotune.tuning.knob_sweep import KnobSweep
    from autotune.usercmd.knobs import own_values, parse_knobs

    study = Study.open(root, create=not (root / "study.db").exists())
    runner = KnobRunner(answers) if knobs else AnsweringRunner(answers, imbalances)
    if imbalances is not None:
        runner.imbalances = imbalances
    proposer = RecordingProposer(_space())
    steps = []
    if balance or (balance is None and not knobs):
        steps.append(StageBalancer(study.root, lambda _: None, method=runner.workload.partition_method))
    if knobs:
        parsed = parse_knobs(knobs)
        steps.append(KnobSweep(parsed, own_values(parsed, runner.command.script_args), study.root, lambda _: None))
    try:
        result = Tuner(study=study, runner=runner, space=_space(), proposer=proposer, baseline=BASE,
                       note=RecordingDisplay().note, budget=budget, steps=steps, stop_early=False).run()
        best = study.best()
    finally:
        study.close()
    return result.results.to_dict(), best, proposer, runner  # summary.json's content


def test_a_rejected_partition_is_no_second_run_of_the_baseline(tmp_path):
    # baseline 10, partition trial 8 (slower: rejected), the other configuration 9.5
    summary, best, proposer, runner = _tune(tmp_path / "st", {0: 10.0, 1: 8.0, 2: 9.5})
    assert runner.methods == {0: "uniform", 1: "parts:0,4,6", 2: "uniform"}
    # averaged with the rejected partition the baseline read 9.0 and lost to the other one
    assert best.number == 0 and best.samples_per_second == 10.0 and best.repeats == 1
    assert summary["best"]["trial"] == 0 and summary["speedup_over_baseline"] == 1.0
    assert [(c, s) for c, _, s in proposer.told] == [(BASE, 10.0), (OTHER, 9.5)]
    line = describe_result(summary["partition"])
    assert "not kept" in line and "[0, 4, 6]" in line and "Partition: parts" in (tmp_path / "st" / "report.md").read_text()


def test_a_kept_partition_replaces_the_baseline_run_it_beat(tmp_path):
    # baseline 10, partition trial 14 (kept), the other configuration (with the kept parts) 13
    summary, best, proposer, runner = _tune(tmp_path / "st", {0: 10.0, 1: 14.0, 2: 13.0})
    assert runner.methods[2] == "parts:0,4,6"
    # averaged with the baseline's own partition the configuration read 12.0 and lost to 13
    assert best.number == 1 and best.samples_per_second == 14.0 and best.repeats == 1
    assert summary["best"]["trial"] == 1 and abs(summary["speedup_over_baseline"] - 1.4) < 1e-9
    assert [(c, s) for c, _, s in proposer.told] == [(BASE, 14.0), (OTHER, 13.0)]
    assert summary["partition"]["in_your_code"]["parts"] == [0, 4, 6]
    line = describe_result(summary["partition"])
    assert "kept (trial 1" in line and "PARTS = [0, 4, 6]" in line  # no built-in method builds [0, 4, 6]


def test_a_failed_partition_trial_is_no_failure_of_the_baseline_configuration(tmp_path):
    summary, best, proposer, _ = _tune(tmp_path / "st", {0: 10.0, 1: None, 2: 9.5})
    assert best.number == 0 and best.samples_per_second == 10.0
    assert [(c, st) for c, st, _ in proposer.told] == [(BASE, STATUS_OK), (OTHER, STATUS_OK)]
    assert BASE.key() in proposer.history.means()  # a told failure would have dropped it


def test_a_resumed_study_tells_the_proposer_what_the_run_told_it(tmp_path):
    _, _, first, _ = _tune(tmp_path / "st", {0: 10.0, 1: 14.0}, budget=2)
    assert [(c, s) for c, _, s in first.told] == [(BASE, 14.0)]
    _, best, again, _ = _tune(tmp_path / "st", {2: 13.0}, budget=3)  # resume: trials 0 and 1 replayed
    assert again.told == [(BASE, "ok", 14.0), (OTHER, "ok", 13.0)]
    assert best.number == 1


def test_superseded_follows_the_rounds():
    from types import SimpleNamespace

    def row(n, source, sps, status="ok", config=BASE):
        return SimpleNamespace(number=n, source=source, status=status, samples_per_second=sps, config=config)

    assert superseded([row(0, "baseline", 10.0), row(1, SOURCE, 12.0), row(2, SOURCE, 11.0),
                       row(3, "bayes", 20.0)]) == {0, 2}
    assert superseded([row(0, "baseline", 10.0), row(1, SOURCE, 12.0), row(2, SOURCE, 13.0)]) == {0, 1}
    assert superseded([row(0, "baseline", 10.0), row(1, SOURCE, None, "failed")]) == {1}
    assert superseded([row(0, "baseline", 10.0), row(1, SOURCE, 12.0, "interrupted")]) == set()
    assert superseded([row(0, "baseline", None, "failed"), row(1, "bayes", 5.0)]) == set()
    assert json.dumps(sorted(superseded([]))) == "[]"


# -- a round at the best trial (the baseline was balanced at its small micro-batch) --------------

def test_a_round_at_the_best_trial_replaces_its_runs_and_tells_the_proposer_once(tmp_path):
    # baseline 10 balanced; OTHER 12 unbalanced and the best: its configuration again with the
    # hooks (11, the round's reference), then the parts (15: kept); then one more trial
    summary, best, proposer, runner = _tune(tmp_path / "st", {0: 10.0, 1: 12.0, 2: 11.0, 3: 15.0, 4: 9.0},
                                            budget=5, imbalances={0: 1.05, 1: 1.4, 2: 1.4})
    sources = [t["source"] for t in summary["trials"]]
    assert sources[:4] == ["baseline", "explore", COSTS, SOURCE], sources
    assert runner.methods == {0: "uniform", 1: "uniform", 2: "uniform", 3: "parts:0,4,6", 4: "parts:0,4,6"}
    # trials 1 and 2 ran the parts the round replaced: OTHER's measurement is trial 3's alone
    assert best.number == 3 and best.samples_per_second == 15.0 and best.repeats == 1
    told = [(c, s) for c, _, s in proposer.told]
    assert told[:2] == [(BASE, 10.0), (OTHER, 15.0)] and len(told) == 3  # trial 1 held until the round decided
    assert summary["partition"]["rounds"][0]["config"]["micro_batch_size"] == OTHER.micro_batch_size
    assert "at micro 4 GAS 2" in describe_result(summary["partition"])


def test_a_resume_between_the_rounds_trials_runs_the_partition_trial_next(tmp_path):
    imbalances = {0: 1.05, 1: 1.4, 2: 1.4}
    first, _, _, _ = _tune(tmp_path / "st", {0: 10.0, 1: 12.0, 2: 11.0, 3: "stop"}, budget=4, imbalances=imbalances)
    assert [t["status"] for t in first["trials"]][-1] == "interrupted"
    summary, best, proposer, runner = _tune(tmp_path / "st", {3: 15.0}, budget=4, imbalances=imbalances)
    assert [t["source"] for t in summary["trials"] if t["status"] != "interrupted"] == [
        "baseline", "explore", COSTS, SOURCE]
    assert runner.methods == {3: "parts:0,4,6"} and best.number == 3  # the interrupted partition trial, as itself
    assert [(c, s) for c, _, s in proposer.told] == [(BASE, 10.0), (OTHER, 15.0)]


def test_the_built_in_parts_are_deepspeeds_own():
    """The controller computes `uniform` and `parameters` without torch; DeepSpeed agrees."""
    import random

    from deepspeed.runtime import utils as ds

    from autotune.tuning.balance import partition_balanced, partition_uniform

    rng = random.Random(0)
    for _ in range(60):
        n, m = rng.randint(1, 14), rng.randint(1, 5)
        weights = [rng.choice([0, 1, 5, 100, 526080, rng.randint(0, 10**6)]) for _ in range(n)]
        assert partition_uniform(n, m) == [int(x) for x in ds.partition_uniform(n, m)], (n, m)
        assert partition_balanced(weights, m) == [int(x) for x in ds.partition_balanced(weights, m)], (weights, m)


# -- knob trials (`--knob`, autotune/usercmd/knobs.py) share the baseline's key the same way ------

class KnobRunner(AnsweringRunner):
    """A user's command with one flag per knob; trial N answers `answers[N]`."""

    def __init__(self, answers: dict[int, float | None]) -> None:
        super().__init__(answers)
        from types import SimpleNamespace

        self.command = SimpleNamespace(script_args=("--partition", "parameters", "--ckpt", "0"))
        self.knob_values: dict[str, str] = {}
        self.seen: dict[int, dict[str, str]] = {}

    def answer(self, request) -> TrialOutcome:
        self.seen[request.number] = dict(request.knob_values)
        return super().answer(request)


KNOBS = ["partition_method:parameters,uniform=--partition {value}",
         "activation_checkpoint_interval:0,1=--ckpt {value}"]


def test_knob_trials_are_no_second_runs_of_the_baseline_and_a_later_knob_beats_the_kept_value(tmp_path):
    # baseline 10; uniform 14 (kept); checkpointing 12 with uniform: slower than the 14 in force,
    # so not kept (compared with the baseline's 10 it would have been); then the other configuration
    summary, best, proposer, runner = _tune(tmp_path / "st", {0: 10.0, 1: 14.0, 2: 12.0, 3: 13.0}, budget=4, knobs=KNOBS)
    assert runner.seen[2] == {"partition_method": "uniform", "activation_checkpoint_interval": "1"}
    assert runner.seen[3] == {"partition_method": "uniform", "activation_checkpoint_interval": "0"}
    # averaged as three runs of one configuration, the baseline's key read 12.0 and lost to 13
    assert best.number == 1 and best.samples_per_second == 14.0 and best.repeats == 1
    assert [(c, s) for c, _, s in proposer.told] == [(BASE, 14.0), (OTHER, 13.0)]
    info = json.loads((tmp_path / "st" / "knobs.json").read_text())
    assert info["kept"] == {"partition_method": "uniform", "activation_checkpoint_interval": "0"}


def test_a_knob_value_within_the_noise_of_the_one_in_force_is_a_tie_and_leaves_it(tmp_path):
    # baseline 10; uniform 10.8 (+8 %: within the 10 % noise between launches) ties, so the
    # script's own value stays; checkpointing 12 (+20 % over the 10 in force) beats it
    summary, best, proposer, runner = _tune(tmp_path / "st", {0: 10.0, 1: 10.8, 2: 12.0, 3: 9.0}, budget=4, knobs=KNOBS)
    own = runner.seen[0]["partition_method"]
    assert own != "uniform" and runner.seen[2] == {"partition_method": own, "activation_checkpoint_interval": "1"}
    info = json.loads((tmp_path / "st" / "knobs.json").read_text())
    assert info["kept"] == {"partition_method": own, "activation_checkpoint_interval": "1"}
    # the rows' replay agrees: the tied run does not stand for the baseline's key, the kept one does
    assert best.number == 2 and best.samples_per_second == 12.0 and best.repeats == 1


def test_failed_or_slower_knob_trials_leave_the_baseline_alone(tmp_path):
    summary, best, proposer, _ = _tune(tmp_path / "st", {0: 10.0, 1: None, 2: 8.0, 3: 9.5}, budget=4, knobs=KNOBS)
    assert best.number == 0 and best.samples_per_second == 10.0 and best.repeats == 1
    assert [(c, st, s) for c, st, s in proposer.told] == [(BASE, STATUS_OK, 10.0), (OTHER, STATUS_OK, 9.5)]


def test_the_partition_step_and_the_knob_sweep_run_in_one_study(tmp_path):
    """Both setting steps in the tuner's one list: the partition round first (from the baseline's
    layer costs), then the knob trials at the baseline's layout with the kept parts, and only
    then the proposer, which is told the baseline's key once, with the measurement that holds."""
    answers = {0: 10.0, 1: 12.0, 2: 14.0, 3: 11.0, 4: 9.0, 5: 9.5}
    summary, best, proposer, runner = _tune(tmp_path / "st", answers, budget=6, knobs=KNOBS, balance=True,
                                            imbalances={0: 1.4})
    rows = {t["trial"]: t for t in summary["trials"]}
    kinds = [rows[n]["source"] for n in sorted(rows)]
    assert kinds[:5] == ["baseline", "partition", "knob:partition_method=uniform",
                         "knob:activation_checkpoint_interval=1", "explore"], kinds
    assert runner.methods[1] == "parts:0,4,6" and runner.methods[2] == "parts:0,4,6"  # the kept parts
    assert runner.seen[3] == {"partition_method": "uniform", "activation_checkpoint_interval": "1"}
    assert json.loads((tmp_path / "st" / "partition.json").read_text())["decision"] == "kept"
    assert json.loads((tmp_path / "st" / "knobs.json").read_text())["kept"]["partition_method"] == "uniform"
    assert best.number == 2 and best.samples_per_second == 14.0
    assert [c for c, _, _ in proposer.told][:1] == [BASE] and len([c for c, _, _ in proposer.told if c == BASE]) == 1
