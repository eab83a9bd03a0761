"""The user's own torch.distributed.pipelining script, unchanged (issue 43).

examples/torch_pipeline_train.py through `autotune run -- torchrun ...` (the shared study,
tests/shared_studies.py) and `autotune watch -- torchrun ...`: the bootstrap reads the schedule
object the script builds (autotune/rank/torch_schedule_probe.py), builds each trial's schedule in
its place, and times it behind the engine face (autotune/rank/torch_pp/user_schedule.py)."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
from launch_helpers import autotune_cli
from shared_studies import TORCH_BUDGET, TORCH_OWN

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "torch_pipeline_train.py"


@pytest.mark.slow
def test_a_torch_pipelining_script_is_tuned_unchanged(torch_script_study):
    """The shared study: the start-up check read the script's schedule; the schedule sweep ran each
    class that fits one stage per rank, each built in place of the script's (its marker says so),
    the step's batch fixed (micro x n_microbatches = 16 in every trial); the result is
    best_schedule.json, no ds_config; nothing left running."""
    st = torch_script_study
    assert st.returncode == 0, st.output[-3000:]
    schedule, n, batch = TORCH_OWN
    parameters = 4 * (64 * 64 + 64)  # the script's four Linear(64, 64) layers, over both stages
    assert (f"the job: a torch.distributed.pipelining script; 2 stages (1 per rank), schedule Schedule{schedule}, "
            f"n_microbatches {n}, micro-batch {batch // n} (the step's batch {batch} over {n}), data-parallel 1, "
            f"{parameters:,} parameters") in st.stdout
    summary = json.loads((st.study / "summary.json").read_text())
    trials = summary["trials"]
    assert len(trials) == TORCH_BUDGET and all(t["status"] == "ok" for t in trials), trials
    assert all(t["micro_batch_size"] * t["gradient_accumulation_steps"] == batch for t in trials)
    swept, kept = {}, json.loads((st.study / "knobs.json").read_text())["kept"]
    for t in trials:
        folder = st.study / f"trial-{t['trial']:03d}"
        ran = json.loads((folder / "engine-rank0.json").read_text())
        assert ran["script_schedule"] == f"Schedule{schedule}" and ran["deepspeed"] is False
        assert ran["micro_batches"] == t["gradient_accumulation_steps"]  # the trial's count, not the script's
        if t["source"].startswith("knob:schedule="):
            swept[t["source"].split("=", 1)[1]] = ran["engine"]
        if t["source"] == "knob:activation_checkpoint=1":  # the script's own flag, after the schedule's sweep
            assert ran["engine"] == f"Schedule{kept['schedule']}"
            assert json.loads((folder / "knobs.json").read_text()) == {"schedule": kept["schedule"],
                                                                        "activation_checkpoint": "1"}
    assert trials[0]["source"] == "baseline" and trials[0]["gradient_accumulation_steps"] == n
    assert swept == {name: f"Schedule{name}" for name in ("1F1B", "Interleaved1F1B", "LoopedBFS",
                                                          "InterleavedZeroBubble")}
    assert [t["source"] for t in trials].count("knob:activation_checkpoint=1") == 1
    assert not (st.study / "best_ds_config.json").exists()
    result = json.loads((st.study / "best_schedule.json").read_text())
    best = summary["best"]
    assert result["n_microbatches"] == best["gradient_accumulation_steps"] and result["trial"] == best["trial"]
    ran = json.loads((st.study / f"trial-{best['trial']:03d}" / "engine-rank0.json").read_text())
    assert ran["engine"] == result["schedule_class"].rsplit(".", 1)[1]  # the file names what the best ran
    assert result["script_own"] == {"schedule": schedule, "n_microbatches": n}
    assert result["command"].startswith("torchrun --nproc-per-node 2 ")
    checkpoint = result["knobs"]["activation_checkpoint"]  # the best's value, in the command to run
    assert checkpoint in ("0", "1") and result["command"].endswith(f"--activation-checkpoint {checkpoint}")
    assert "wrote " in st.stdout and "best_schedule.json" in st.stdout and "in the script: " in st.stdout
    report = (st.study / "report.md").read_text()
    assert "As the script's schedule: `" in report and f"schedule {schedule}, n_microbatches {n}" in report
    for t in trials:  # the probe's columns, as for the built-in torch engine (the bubble is derived from them)
        rows = list(csv.DictReader((st.study / f"trial-{t['trial']:03d}" / "metrics-rank0.csv").open()))
        assert rows and all(float(r["step_seconds"]) > float(r["compute_seconds"]) > 0 for r in rows)
        assert all(float(r["p2p_seconds"]) > 0 and r["gradient_accumulation_steps"] ==
                   str(t["gradient_accumulation_steps"]) for r in rows)
    assert st.alive_after == []


ALONE_STEPS = 5
"""Steps of the shared study's command run alone: its profiler (--profile-dir) records steps 2-3."""


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "OMP_NUM_THREADS": "1"}


def _alone(argv: list[str], cwd: Path) -> str:
    """The script run by torchrun alone, no autotune: its stdout."""
    import subprocess

    from autotune.trials.launcher import free_port

    proc = subprocess.run([argv[0], "--master-port", str(free_port()), *argv[1:]], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def script_alone(torch_script_study, tmp_path_factory) -> tuple[str, Path]:
    """The shared study's command run alone once, ALONE_STEPS steps with its own profiler on: the
    parity reference and a GPipe trace in one launch (the profiler only observes)."""
    folder = tmp_path_factory.mktemp("alone")
    argv = list(torch_script_study.command)
    argv[argv.index("--steps") + 1] = str(ALONE_STEPS)
    return _alone([*argv, "--profile-dir", str(folder / "prof")], folder), folder / "prof"


@pytest.mark.slow
def test_the_baseline_trial_trains_as_the_script_alone(torch_script_study, script_alone):
    """Parity in a trial: the baseline runs the script's own schedule object (nothing substituted);
    its losses (fp32, same seed) are the script's alone, to 1e-6 relative."""
    logged = _losses((torch_script_study.study / "trial-000" / "launcher.log").read_text())
    assert len(logged) >= 2  # warm-up + measured steps; the last one's print never runs (the rank stops in it)
    alone = _losses(script_alone[0])
    assert len(alone) == ALONE_STEPS and logged == pytest.approx(alone[:len(logged)], rel=1e-6)


def _losses(text: str) -> list[float]:
    """The script's own `step N loss X` lines."""
    import re

    return [float(x) for x in re.findall(r"^step \d+ loss ([\d.]+)$", text, flags=re.M)]


@pytest.mark.slow
def test_watch_instruments_the_users_schedule_and_leaves_its_training_unchanged(tmp_path):
    """`autotune watch -- torchrun ...` on the unmodified script, 3 ranks: every step of its own loop is
    a CSV row with the pipeline's layout read from its objects (the middle stage, whose `step()`
    gets no batch, too), the point-to-point time split out, and the loss the last stage computed. Parity: fp32, the same seed: the losses it prints under watch
    are the losses it prints alone (the instrumentation only times; tolerance 1e-6 relative)."""
    import csv
    import subprocess

    from autotune.trials.launcher import free_port

    env = _env()
    script = [str(SCRIPT), "--schedule", "1F1B", "--n-microbatches", "4", "--batch", "16", "--steps", "8",
              "--layers", "6"]
    alone = subprocess.run(["torchrun", "--nproc-per-node", "3", "--master-port", str(free_port()), *script], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300, env=env)
    assert alone.returncode == 0, alone.stderr[-2000:]
    proc = autotune_cli("watch", "--out", str(tmp_path / "w"), "--no-metrics", "--warmup-steps", "1", "--",
                        "torchrun", "--nproc-per-node", "3", *script, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("the job: a torch.distributed.pipelining schedule, Schedule1F1B: 3 pipeline ranks x 1 data-parallel, "
            "n_microbatches 4") in proc.stdout
    run = tmp_path / "w" / "run-001"
    own, watched = _losses(alone.stdout), _losses((run / "launcher.log").read_text())
    assert len(own) == len(watched) == 8
    assert watched == pytest.approx(own, rel=1e-6)
    for rank in (0, 1, 2):
        rows = list(csv.DictReader((run / f"metrics-rank{rank}.csv").open()))
        assert [int(r["step"]) for r in rows] == list(range(8)) and [r["warmup"] for r in rows].count("1") == 1
        assert {(r["stage"], r["pipeline_stages"], r["micro_batch_size"], r["gradient_accumulation_steps"],
                 r["data_parallel_size"]) for r in rows} == {(str(rank), "3", "4", "4", "1")}
        assert all(float(r["step_seconds"]) > float(r["compute_seconds"]) > 0 for r in rows)
        assert all(float(r["p2p_seconds"]) > 0 for r in rows)  # the stages' sends and receives, timed
        logged = [float(r["loss"]) for r in rows if r["loss"]]
        if rank == 2:  # the last stage computes the loss
            assert logged == pytest.approx(own, rel=1e-4)
        else:
            assert logged == []
    assert (run / "findings.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "n"), [(TORCH_OWN[0], TORCH_OWN[1]), ("Interleaved1F1B", 4)])
def test_advise_reads_a_torch_scripts_own_trace_by_its_schedule_labels(script_alone, tmp_path, schedule, n):
    """The script's own torch.profiler trace (its --profile-dir): GPipe labels `Forward i` and
    `Backward i` (the shared study's command run alone), the runtime schedules
    `PP:<stage><action><micro>`; both read as the pipeline's instructions, so the micro-batches per
    step (distinct micro-batches: Interleaved1F1B's rank runs two stages' forwards of each), and
    with them the ideal bubble, come from the trace alone."""
    from autotune.loaders import load_inputs
    from autotune.traces.breakdown import breakdown
    from autotune.traces.rank_trace import read_rank_trace

    prof = script_alone[1]
    if schedule != TORCH_OWN[0]:
        prof = tmp_path / "prof"
        _alone(["torchrun", "--nproc-per-node", "2", str(SCRIPT), "--schedule", schedule, "--n-microbatches",
                str(n), "--batch", "16", "--steps", str(ALONE_STEPS), "--profile-dir", str(prof)], tmp_path)
    traces = [read_rank_trace(f) for f in sorted(prof.glob("*.json"))]
    assert len(traces) == 2
    for t in traces:
        assert {"ForwardPass", "BackwardPass"} <= {i.name for i in t.instructions}
        assert breakdown(t).micro_batches == n
    s = load_inputs([str(prof)]).subjects[0]
    assert s.get("pipeline_stages") == 2 and s.get("gradient_accumulation_steps") == n
    assert s.get("bubble_fraction_ideal") == pytest.approx(1 / (n + 1))
    assert s.get("stage_compute_imbalance") is not None
