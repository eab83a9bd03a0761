"""`--engine zero` (issue 42): the built-in decoder as a plain DeepSpeedEngine with ZeRO, on the
engine seam. The end-to-end checks read the shared ZeRO study (tests/shared_studies.py
`zero_study`: ZeRO-2, 2 data-parallel ranks, warm workers, budget 6); the probe's arithmetic, the
sweep's rules and the refusals run without a launch."""

from __future__ import annotations

import csv
import json

import pytest
from launch_helpers import autotune_cli
from shared_studies import ZERO_BUDGET, ZERO_STAGE
from step_driver import Driven

from autotune.core.dsconfig import DsConfig, reduce_bucket_acts, reduce_bucket_inert, with_settings
from autotune.core.space import TrialConfig
from autotune.core.summary import NOT_A_PIPELINE
from autotune.core.trial_kind import TrialKind
from autotune.engines.deepspeed_zero.engine import STAGE_KNOB, ZERO_KNOBS, zero_sweep
from autotune.rank.collectives import COLLECTIVE_PREFIX, collective_kind
from autotune.rank.engine_face import COLLECTIVE, COMPUTE, OPTIMIZER, EngineLayout, Instruction
from autotune.rank.instrument import PipelineProbe
from autotune.tuning.proposers.base import Proposal


def _rows(study, trial: int) -> list[dict[str, str]]:
    rows = []
    for path in sorted((study / f"trial-{trial:03d}").glob("metrics-rank*.csv")):
        with path.open(encoding="utf-8") as fh:
            rows += list(csv.DictReader(fh))
    return rows


# -- the shared study --------------------------------------------------------------------------
def test_every_trial_of_a_zero_study_runs_in_the_warm_workers(zero_study):
    """Every trial ok, the later ones in the same warm workers, across ZeRO stages: a plain
    engine's data-parallel group is DeepSpeed's cached clone of the world group, which the
    trial's clean-up destroyed (the second trial failed "Group ... is not registered" before
    groups.forget_in_deepspeed), and the stage is a setting a pool's next engine reads."""
    assert zero_study.returncode == 0, zero_study.output[-3000:]
    assert "2 data-parallel ranks; engine: DeepSpeed ZeRO" in zero_study.stdout
    assert "this trial starts fresh workers" not in zero_study.output  # one pool for every stage
    summary = json.loads((zero_study.study / "summary.json").read_text())
    assert summary["failed_trials"] == 0 and summary["counted_trials"] == ZERO_BUDGET, summary
    assert all(t["status"] == "ok" for t in summary["trials"]), summary["trials"]
    assert zero_study.alive_after == [] and not zero_study.shm_leaked


def test_a_zero_trials_records_have_collectives_as_communication_and_no_pipeline(zero_study):
    """The ZeRO reducer's collectives are the communication, out of the compute that runs them:
    compute + communication + waiting stay within the step; nothing of a pipeline is recorded."""
    rows = _rows(zero_study.study, 0)
    assert {r["rank"] for r in rows} == {"0", "1"}
    for r in rows:
        step = float(r["step_seconds"])
        comm, compute, wait = float(r["comm_seconds"]), float(r["compute_seconds"]), float(r["wait_seconds"])
        assert r["pipeline_stages"] == "1" and r["data_parallel_size"] == "2"
        assert r["p2p_seconds"] == ""  # absent, not 0: a plain engine has no point-to-point
        assert comm > 0, r  # ZeRO-2 with dp 2 reduce-scatters every step
        assert 0 < compute < step and compute + comm + wait <= step * 1.02, r
        assert r["reduce_bucket_size"] != ""  # the bucket acts at ZeRO-2 with dp 2


def test_the_table_and_the_signals_say_not_a_pipeline_job(zero_study, tmp_path):
    assert "n/a   n/a  ok" in zero_study.stdout  # the bubble and the imbalance, never 0
    assert f"ZeRO-{ZERO_STAGE}, dp > 1" in zero_study.stdout  # the bucket, searched where it acts
    csvs = [str(p) for p in sorted((zero_study.study / "trial-000").glob("metrics-rank*.csv"))]
    out = autotune_cli("advise", *csvs, "--format", "json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert any(NOT_A_PIPELINE in note and "bubble" in note for note in report["notes"]), report["notes"]
    assert not any(f["rule_id"].startswith(("bubble", "stage-imbalance")) and f["status"] == "fired"
                   for f in report["findings"])
    assert "not a pipeline job" in (zero_study.study / "report.md").read_text()


def test_the_stage_sweep_runs_each_other_stage_and_its_trials_carry_it(zero_study):
    knobs = json.loads((zero_study.study / "knobs.json").read_text())
    assert set(knobs["measured"][STAGE_KNOB]) == {"0", "1", "2", "3"} - {str(ZERO_STAGE)}
    summary = json.loads((zero_study.study / "summary.json").read_text())
    searched: dict[bool, set[int]] = {False: set(), True: set()}  # the search's stages, before/after a re-check
    again = next((t["trial"] for t in summary["trials"] if TrialKind.of(t["source"]).at_best), None)
    for t in summary["trials"]:
        ran = json.loads((zero_study.study / f"trial-{t['trial']:03d}" / "ds_config.json").read_text())
        setting = TrialKind.of(t["source"]).knob_setting  # a stage trial, at the baseline's layout or the best's
        if setting is not None and setting[0] == STAGE_KNOB:
            assert ran["zero_optimization"]["stage"] == int(setting[1]), t
        elif t["source"] != "baseline" and setting is None:
            searched[again is not None and t["trial"] > again].add(ran["zero_optimization"]["stage"])
    kept = int(knobs["kept"][STAGE_KNOB])
    if again is None:
        assert searched[False] <= {kept}  # the search runs the stage the sweep kept
    else:  # the stage kept at the baseline's layout, then the one kept at the best's
        assert len(searched[False]) <= 1 and searched[True] <= {kept}


def test_the_best_config_is_what_the_best_trial_ran_with_the_tuned_batch(zero_study):
    """best_ds_config.json carries the sweep's settings too (the stage), not only the batch."""
    best = json.loads((zero_study.study / "best_ds_config.json").read_text())
    summary = json.loads((zero_study.study / "summary.json").read_text())
    cfg = summary["best"]
    ran = json.loads((zero_study.study / f"trial-{cfg['trial']:03d}" / "ds_config.json").read_text())
    assert best == ran
    assert best["train_micro_batch_size_per_gpu"] == cfg["micro_batch_size"]
    assert best["gradient_accumulation_steps"] == cfg["gradient_accumulation_steps"]
    assert best["train_batch_size"] == cfg["micro_batch_size"] * cfg["gradient_accumulation_steps"] * 2 == 16


# -- without a launch -----------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--stages", "4"], "the ZeRO engine has no pipeline stages"),
    (["--layer-costs"], "--layer-costs: not available under --engine zero yet"),
    (["--schedule", "GPipe"], "not available under --engine zero yet"),
])
def test_what_the_zero_engine_cannot_do_is_one_line(args, words, tmp_path):
    out = autotune_cli("run", "--engine", "zero", "--budget", "1", *args, cwd=tmp_path)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "autotune_study").exists()


def test_a_pipeline_needs_two_stages_and_refuses_zero_2(tmp_path):
    out = autotune_cli("run", "--stages", "1", "--budget", "1", cwd=tmp_path)
    assert out.returncode == 2 and "a pipeline needs at least 2 stages" in out.stderr, out.stderr
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                               "optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2}}))
    out = autotune_cli("run", "--config", str(cfg), "--budget", "1", cwd=tmp_path)
    assert out.returncode == 2 and "refused by DeepSpeed with pipeline parallelism" in out.stderr, out.stderr


def test_where_reduce_bucket_size_acts_on_a_plain_engine():
    """ZeRO-1 to 3 bucket the reduction by it; ZeRO-0 all-reduces in fixed buffers; dp 1 has none."""
    assert [reduce_bucket_acts(s, 2, pipeline=False) for s in range(4)] == [False, True, True, True]
    assert [reduce_bucket_acts(s, 2) for s in range(4)] == [False, True, False, False]  # a pipeline's
    assert reduce_bucket_inert(2, 1, pipeline=False) == "dp = 1 has no gradient reduction"


class _Timer:
    """A host timer whose clock the test moves (the probe's arithmetic, not the machine's)."""

    def __init__(self):
        from autotune.rank.timing import HostTimer

        self.now = 0.0
        self.inner = HostTimer((COLLECTIVE_PREFIX,))

    def begin(self):
        return self.now

    def end(self, token, category, also=None):
        seconds = self.now - token
        self.inner._acc[category] += seconds
        if also is not None:
            self.inner._acc[also] += seconds
        self.inner.add(category, seconds)

    def collect(self):
        return self.inner.collect()

    def intervals(self):
        return self.inner.intervals()


class _PlainLike:
    """An engine with a plain engine's shape: a backward that runs a collective inside it."""

    device = type("D", (), {"type": "cpu"})()

    def __init__(self, timer, collective_seconds):
        self.timer, self.collective_seconds = timer, list(collective_seconds)

    def autotune_layout(self):
        return EngineLayout(rank=0, micro_batch_size=1, accumulation_steps=1, data_parallel_size=2,
                            data_parallel_rank=0, topology=None)

    def autotune_instructions(self):
        outer = self

        class Table:
            def wrap(self, wrapper):
                outer.backward = wrapper(Instruction("backward", COMPUTE), outer.backward)
                outer.step = wrapper(Instruction("step", OPTIMIZER), outer.step)
                outer.all_reduce = wrapper(Instruction("all_reduce", COLLECTIVE), outer.all_reduce)
                return lambda: None
        return Table()

    def all_reduce(self, tensor):
        self.timer.now += self.collective_seconds.pop(0)

    def backward(self):
        self.timer.now += 0.5
        self.all_reduce(_Tensor(1000))
        self.timer.now += 0.25

    def step(self):
        self.timer.now += 0.125

    def train_batch(self):
        self.backward()
        self.step()

    def is_last_stage(self):
        return True

    def fp16_enabled(self):
        return False

    def zero_optimization_stage(self):
        return 2

    def zero_reduce_bucket_size(self):
        return 1000


class _Tensor:
    def __init__(self, n):
        self.n = n

    def numel(self):
        return self.n


def test_a_collective_inside_the_backward_is_communication_not_compute():
    """The probe takes each collective out of the phase that runs it, and splits it as it splits
    a send: the fastest instance of its kind is the transfer, the rest the wait for a slower rank."""
    timer = _Timer()
    engine = _PlainLike(timer, [0.2, 0.5])  # the second step's reduction waits 0.3 s for the peer
    records = []
    probe = PipelineProbe(engine, timer=timer, warmup_steps=0, seq_length=8,
                          on_step=records.append).install()
    for _ in range(2):
        engine.train_batch()
    assert probe.collectives.fastest == {collective_kind("all_reduce", (_Tensor(1000),), {}): pytest.approx(0.2)}
    first, second = records
    assert first.compute_seconds == pytest.approx(0.875) and first.comm_seconds == pytest.approx(0.2)
    assert first.wait_seconds == pytest.approx(0.0) and first.optimizer_seconds == pytest.approx(0.125)
    assert second.compute_seconds == pytest.approx(0.875) and second.comm_seconds == pytest.approx(0.2)
    assert second.wait_seconds == pytest.approx(0.3)
    assert first.p2p_seconds is None and first.pipeline_stages == 1 and first.reduce_bucket_size == 1000


def test_a_knob_value_sets_its_dotted_key_as_json_and_leaves_the_base_alone():
    raw = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5}}
    out = with_settings(raw, {STAGE_KNOB: "3", "zero_optimization.overlap_comm": "true", "a.b": "1"})
    assert out == {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5, "overlap_comm": True}, "a": {"b": 1}}
    assert raw == {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5}}


def test_zero_0_kept_drops_the_reducers_knobs(tmp_path):
    """After the stage sweep keeps ZeRO-0, overlap_comm and contiguous_gradients cannot act:
    their trials are not run (the budget goes to the search)."""
    notes = []
    base = DsConfig.from_dict({"train_batch_size": 16, "zero_optimization": {"stage": 2}}, source="t")
    sweep = Driven(zero_sweep(base, tmp_path, notes.append))
    cfg = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)
    sweep.after(0, Proposal(config=cfg, source="baseline"), True, 100.0, None)
    speed = {"0": 150.0, "1": 105.0, "3": 40.0}
    n = 0
    while (p := sweep.next_proposal()) is not None:
        n += 1
        name, value = p.source.removeprefix("knob:").split("=")
        assert name == STAGE_KNOB, p.source  # nothing of the reducer is swept once ZeRO-0 is kept
        sweep.before(n, p)
        assert sweep.request.knob_values[STAGE_KNOB] == value
        sweep.after(n, p, True, speed[value], None)
    assert n == 3 and sweep.kept[STAGE_KNOB] == "0"
    assert sum("not swept: ZeRO-0 kept" in line for line in notes) == len(ZERO_KNOBS) - 1, notes


def _swept(tmp_path, stage: str, parameters: int | None, speed_of_stage: dict[str, float]) -> tuple[list[str], list[str]]:
    """Drive the ZeRO sweep from a ZeRO-1 baseline at 100 samples/s: (the knob trials it ran, its notes)."""
    notes: list[str] = []
    base = DsConfig.from_dict({"train_batch_size": 16, "zero_optimization": {"stage": 1}}, source="t")
    sweep = Driven(zero_sweep(base, tmp_path, notes.append, parameters=parameters))
    cfg = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)
    sweep.after(0, Proposal(config=cfg, source="baseline"), True, 100.0, None)
    ran, n = [], 0
    while (p := sweep.next_proposal()) is not None:
        n += 1
        name, value = p.source.removeprefix("knob:").split("=")
        ran.append(name)
        sweep.before(n, p)
        sweep.after(n, p, True, speed_of_stage.get(value, 100.0) if name == STAGE_KNOB else 100.0, None)
    assert sweep.kept[STAGE_KNOB] == stage
    return ran, notes


@pytest.mark.parametrize(("stage", "swept", "dropped"), [
    ("3", {"zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
           "zero_optimization.stage3_max_live_parameters"}, {"zero_optimization.allgather_bucket_size"}),
    ("1", {"zero_optimization.allgather_bucket_size"},
     {"zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_max_live_parameters"}),
])
def test_the_size_settings_are_swept_only_at_the_stage_they_act(tmp_path, stage, swept, dropped):
    """A 2e9-parameter model: ZeRO-3 kept sweeps the stage-3 sizes and not the ZeRO-1/2 gather's
    bucket; ZeRO-1 kept the other way round."""
    ran, notes = _swept(tmp_path, stage, 2_000_000_000, {"3": 300.0} if stage == "3" else {})
    assert swept <= set(ran) and not dropped & set(ran), ran
    assert all(any(f"{k.removeprefix('zero_optimization.')}" in line and "not swept" in line for line in notes)
               for k in dropped), notes


def test_a_model_within_every_size_tried_sweeps_none_of_them(tmp_path):
    """The tiny decoder's 234,048 parameters make one call at every bucket tried: no trial for them."""
    ran, notes = _swept(tmp_path, "1", 234_048, {})
    assert not any(k.startswith("zero_optimization.stage3_") or k.endswith("allgather_bucket_size") for k in ran), ran
    assert any("234,048 parameters are within every value tried" in line for line in notes), notes


def test_deepspeed_accepts_every_size_value_the_sweep_writes():
    """Each value the sweep may write, in the config section DeepSpeed 0.19.8 validates (its
    pydantic model, `extra="forbid"`), at the stage it is swept at."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from autotune.engines.deepspeed_zero.engine import SIZE_VALUES, STAGE3_ONLY

    for dotted, values in SIZE_VALUES.items():
        for v in values:
            section = with_settings({"zero_optimization": {"stage": 3 if dotted in STAGE3_ONLY else 2}},
                                    {dotted: v})["zero_optimization"]
            cfg = DeepSpeedZeroConfig(**section)
            field = dotted.removeprefix("zero_optimization.").removeprefix("stage3_")
            assert int(getattr(cfg, field)) == int(v), (dotted, v)


# -- the user's own plain-engine script (examples/zero_train.py), unchanged ----------------------
def test_the_users_own_zero_script_is_tuned_unchanged(usercmd_zero_study):
    """Its own loop of forward, backward and step: every trial ends after its steps at an
    optimizer-step boundary, before the script's checkpoint; the job is said as what it is."""
    s = usercmd_zero_study
    assert s.returncode == 0, s.output[-3000:]
    assert "2 data-parallel ranks of a plain DeepSpeedEngine (ZeRO-2; not a pipeline job)" in s.output
    summary = json.loads((s.study / "summary.json").read_text())
    assert summary["failed_trials"] == 0 and summary["counted_trials"] == 2, summary
    assert not (s.root / "ckpt").exists()  # autotune's stop came before the script's save
    assert s.alive_after == []


def test_a_users_zero_steps_are_its_optimizer_steps(usercmd_zero_study):
    """One record per optimizer step (not per micro-batch): warm-up + measured, each with the
    step's mean loss on every replica, its collectives as communication, no point-to-point."""
    study = usercmd_zero_study.study
    for trial in range(2):
        rows = _rows(study, trial)
        cfg = json.loads((study / f"trial-{trial:03d}" / "ds_config.json").read_text())
        for rank in ("0", "1"):
            mine = [r for r in rows if r["rank"] == rank]
            traced = (study / f"trial-{trial:03d}" / "traces").is_dir()  # + the profiler's warm-up, 2 traced, 1 after
            assert [r["step"] for r in mine] == [str(i) for i in range(3 + (4 if traced else 0))], mine
            for r in mine:
                gas = cfg.get("gradient_accumulation_steps") or cfg["train_batch_size"] // (
                    cfg["train_micro_batch_size_per_gpu"] * 2)  # DeepSpeed derives it where the config does not say
                assert r["gradient_accumulation_steps"] == str(gas)
                assert float(r["loss"]) > 0 and r["p2p_seconds"] == "" and float(r["comm_seconds"]) > 0
                step = float(r["step_seconds"])
                assert 0 < float(r["compute_seconds"]) < step
                assert float(r["compute_seconds"]) + float(r["comm_seconds"]) + float(r["wait_seconds"]) <= step * 1.02


def test_a_pipeline_only_option_for_a_plain_engines_script_is_one_line():
    """Checked once the start-up check has read a plain engine (the shared user ZeRO study shows
    that path runs); the refusal itself needs no launch."""
    from autotune.core.errors import UserError
    from autotune.core.options import RunOptions, WorkloadOptions
    from autotune.usercmd.job import refuse_pipeline_only

    refuse_pipeline_only(RunOptions(workload=WorkloadOptions()))  # the defaults: nothing refused
    with pytest.raises(UserError, match="--layer-costs: the script builds a plain DeepSpeedEngine"):
        refuse_pipeline_only(RunOptions(workload=WorkloadOptions(layer_costs=True)))



def test_a_config_built_in_code_is_the_baseline_and_the_best_is_it_tuned(usercmd_zero_study):
    """The script's dict, read at deepspeed.initialize by the start-up check, is the baseline;
    every trial is handed its own there; best_ds_config.json is the dict with the tuned values."""
    s = usercmd_zero_study
    assert "the config: the script's own config, built in code" in s.output
    best = json.loads((s.study / "best_ds_config.json").read_text())
    summary = json.loads((s.study / "summary.json").read_text())
    ran = json.loads((s.study / f"trial-{summary['best']['trial']:03d}" / "ds_config.json").read_text())
    assert best == ran and best["optimizer"]["type"] == "Adam" and best["steps_per_print"] == 10**6
    assert best["train_micro_batch_size_per_gpu"] == summary["best"]["micro_batch_size"]
    for t in summary["trials"]:  # each trial ran the config it was handed, not the script's own
        rows = _rows(s.study, t["trial"])
        assert {r["micro_batch_size"] for r in rows} == {str(t["micro_batch_size"])}, t
        engine = json.loads((s.study / f"trial-{t['trial']:03d}" / "engine-rank0.json").read_text())
        ran = json.loads((s.study / f"trial-{t['trial']:03d}" / "ds_config.json").read_text())
        assert engine["zero_stage"] == ran["zero_optimization"]["stage"], (t, engine, ran)
    # the ZeRO sweep runs on a user's plain engine too: its first trial, stage 0, in the dict handed over
    assert summary["trials"][1]["source"] == f"knob:{STAGE_KNOB}=0"
    baseline = json.loads((s.study / "trial-000" / "ds_config.json").read_text())
    assert "overlap_comm" not in baseline["zero_optimization"]  # the script's own values, as written


def test_the_bootstrap_reads_a_config_from_code_and_hands_the_trials_in_its_place(tmp_path):
    from types import SimpleNamespace

    from autotune.rank.hook import script_config, trial_config_in_place

    assert script_config((), {"config": {"a": 1}}) == {"source": "code", "config": {"a": 1}}
    assert script_config((), {"config": {"f": print}})["config"] is None  # not JSON: said, not guessed
    args = SimpleNamespace(deepspeed_config="ds.json")
    assert script_config((args,), {})["source"] == "args"
    assert script_config((), {}) == {"source": "none"}
    trial = tmp_path / "ds_config.json"
    trial.write_text('{"train_micro_batch_size_per_gpu": 4}')
    assert trial_config_in_place((), {"config": {"x": 1}, "model": "m"}, str(trial)) == {
        "config": {"train_micro_batch_size_per_gpu": 4}, "model": "m"}
    out = trial_config_in_place((), {"args": args}, str(trial))
    assert out["config"] == {"train_micro_batch_size_per_gpu": 4} and args.deepspeed_config is None


def test_a_swept_zero_setting_is_written_only_where_it_changes_what_runs():
    from autotune.core.dsconfig import with_swept

    raw = {"zero_optimization": {"stage": 2}}
    overlap, contiguous = "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients"
    assert with_swept(raw, {STAGE_KNOB: "2", overlap: "false", contiguous: "true"}) == raw  # its own values
    # at stage 3 DeepSpeed overlaps by default: "false" must be written, "true" need not
    assert with_swept(raw, {overlap: "false", STAGE_KNOB: "3"}) == {
        "zero_optimization": {"stage": 3, "overlap_comm": False}}
    assert with_swept(raw, {STAGE_KNOB: "3", overlap: "true"}) == {"zero_optimization": {"stage": 3}}
