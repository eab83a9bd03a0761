"""`autotune advise` on several files, quoted globs and folders: jobs, subject names, refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
import pytest
from builders import csv_text, record
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.cli.advise import advise_command

FIX = Path(__file__).parent / "fixtures" / "advise"


@click.group()
def cli() -> None:
    """Local group: the lead registers the commands in autotune.cli.main."""


cli.add_command(advise_command)


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def advise_json(*args) -> dict:
    r = run("advise", "--format", "json", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def write_job(folder: Path, *, trial: int = -1, slow_stage: int = 1, slow: float = 0.9,
              name: str = "metrics-rank{r}.csv", ranks: int = 4) -> list[Path]:
    """One job's per-rank CSVs (2 stages x 2 dp) with stage `slow_stage` computing `slow` s, the other 0.45 s."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for r in range(ranks):
        st = r // 2
        recs = [record(trial=trial, rank=r, stage=st, step=s, warmup=int(s == 0), step_seconds=1.2,
                       compute_seconds=slow if st == slow_stage else 0.45, gradient_accumulation_steps=8,
                       wait_seconds=0.05 if st == slow_stage else 0.4) for s in range(6)]
        p = folder / name.format(r=r)
        p.write_text(csv_text(recs))
        out.append(p)
    return out


def fired(data: dict, rule_id: str) -> list[dict]:
    return [f for f in data["findings"] if f["rule_id"] == rule_id and f["status"] == "fired"]


def test_per_rank_files_of_one_job_are_one_subject_and_show_the_imbalance(tmp_path):
    files = write_job(tmp_path / "run")
    data = advise_json(*files)
    imb = fired(data, "stage-imbalance")
    assert len(imb) == 1, data
    assert imb[0]["subject"] == "metrics-rank0.csv + 3 more" and imb[0]["trial"] is None
    assert imb[0]["evidence"][0]["stages"] == [1] and imb[0]["evidence"][0]["ranks"] == [2, 3]
    assert data["sources"] == [str(f) for f in files]
    assert "trial -1" not in json.dumps(data)


def test_one_rank_alone_hides_the_imbalance_and_says_so(tmp_path):
    files = write_job(tmp_path / "run")
    data = advise_json(files[0])
    assert not fired(data, "stage-imbalance")
    assert any("1 of 4 ranks" in n and "needs every stage" in n for n in data["notes"])
    assert {f["subject"] for f in data["findings"] if f["subject"] != "ds_config"} == {"metrics-rank0.csv"}


def test_a_quoted_glob_and_the_folder_give_the_same_advice(tmp_path):
    write_job(tmp_path / "run")
    by_glob = advise_json(str(tmp_path / "run" / "metrics-rank*.csv"))
    by_folder = advise_json(tmp_path / "run")
    strip = lambda d: [(f["rule_id"], f["status"], f["evidence"]) for f in d["findings"]]  # noqa: E731
    assert strip(by_glob) == strip(by_folder)
    assert fired(by_folder, "stage-imbalance")[0]["subject"] == str(tmp_path / "run")
    assert fired(by_glob, "stage-imbalance")[0]["subject"] == "metrics-rank0.csv + 3 more"


def test_ranks_sort_by_number_not_text(tmp_path):
    for r in range(12):  # 2 stages x dp 6: metrics-rank10 comes after metrics-rank9
        recs = [record(trial=-1, rank=r, stage=r // 6, step=s, warmup=int(s == 0), data_parallel_size=6)
                for s in range(3)]
        (tmp_path / f"metrics-rank{r}.csv").write_text(csv_text(recs))
    data = advise_json(tmp_path)
    assert [Path(s).name for s in data["sources"]][-3:] == ["metrics-rank9.csv", "metrics-rank10.csv",
                                                            "metrics-rank11.csv"]
    assert not data["notes"]  # every rank of the job: one subject, nothing missing


def study(tmp_path: Path) -> Path:
    root = tmp_path / "study"
    write_job(root / "trial-000", trial=0)
    write_job(root / "trial-001", trial=1, slow_stage=0)
    (root / "trial-001" / "trial.json").write_text(json.dumps({"workload": {"partition_method": "uniform"}}))
    (root / "trial-002").mkdir()  # a trial that failed before writing metrics
    return root


def test_a_study_folder_is_one_subject_per_trial_named_trial_n(tmp_path):
    data = advise_json(study(tmp_path))
    got = {f["subject"]: f for f in fired(data, "stage-imbalance")}
    assert set(got) == {"trial 0", "trial 1"}
    assert got["trial 0"]["evidence"][0]["stages"] == [1] and got["trial 1"]["evidence"][0]["stages"] == [0]
    method = {s: next(c for c in f["changes"] if c["target"] == "PipelineModule:partition_method")
              for s, f in got.items()}
    assert method["trial 1"]["current"] == "uniform" and method["trial 1"]["new"] == "parameters"
    assert method["trial 0"]["current"] is None and method["trial 0"]["new"] == "uniform"


def test_a_trial_folder_of_a_study_is_trial_n(tmp_path):
    data = advise_json(study(tmp_path) / "trial-001")
    assert {f["subject"] for f in fired(data, "stage-imbalance")} == {"trial 1"}


def test_a_file_of_a_trial_folder_is_that_trial(tmp_path):
    trial = study(tmp_path) / "trial-001"
    data = advise_json(trial / "metrics-rank0.csv", trial / "metrics-rank1.csv")
    assert {f["subject"] for f in data["findings"] if f["subject"] != "ds_config"} == {"trial 1"}


def test_two_studies_name_their_folder_when_trial_numbers_meet(tmp_path):
    a, b = study(tmp_path / "a"), study(tmp_path / "b")
    data = advise_json(a, b)
    subjects = {f["subject"] for f in fired(data, "stage-imbalance")}
    assert len(subjects) == 4 and all(str(tmp_path) in s for s in subjects), subjects


def test_two_jobs_outside_a_study_stay_two_subjects(tmp_path):
    write_job(tmp_path / "job-a", slow_stage=1)
    write_job(tmp_path / "job-b", slow_stage=0)
    data = advise_json(tmp_path / "job-a", tmp_path / "job-b")
    got = {Path(f["subject"]).name: f["evidence"][0]["stages"] for f in fired(data, "stage-imbalance")}
    assert got == {"job-a": [1], "job-b": [0]}


def test_files_holding_the_same_rank_are_not_merged(tmp_path):
    write_job(tmp_path / "run", ranks=2)
    (tmp_path / "run" / "metrics-copy.csv").write_text((tmp_path / "run" / "metrics-rank0.csv").read_text())
    data = advise_json(tmp_path / "run" / "metrics-rank0.csv", tmp_path / "run" / "metrics-copy.csv")
    assert any("both hold rank 0" in n for n in data["notes"])
    assert {"metrics-rank0.csv", "metrics-copy.csv"} <= {f["subject"] for f in data["findings"]}


def test_a_single_file_outside_a_study_is_named_by_its_file():
    data = advise_json(FIX / "h200-small-1stage.csv")
    subjects = {f["subject"] for f in data["findings"] if f["subject"] != "ds_config"}
    assert subjects == {"h200-small-1stage.csv"}
    assert all(f["trial"] is None for f in data["findings"])
    r = run("advise", FIX / "h200-small-1stage.csv")
    assert "trial -1" not in r.output and "h200-small-1stage.csv" in r.output


def test_several_nvidia_smi_logs_are_a_subject_each(tmp_path):
    a, b = tmp_path / "node0.csv", tmp_path / "node1.csv"
    a.write_bytes((FIX / "nvidia_smi_2gpu.csv").read_bytes())
    b.write_bytes((FIX / "nvidia_smi_2gpu.csv").read_bytes())
    data = advise_json(tmp_path)
    assert {f["subject"] for f in fired(data, "utilization-fluctuation")} == {
        "nvidia-smi log node0.csv", "nvidia-smi log node1.csv"}


def test_write_config_and_html_with_several_inputs(tmp_path):
    pytest.importorskip("matplotlib")
    files = write_job(tmp_path / "run")
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
                               "pipeline": {"partition_method": "parameters"}}))
    out, page = tmp_path / "new.json", tmp_path / "advice.html"
    r = run("advise", *files, "--config", cfg, "--write-config", out, "--html", page)
    assert r.exit_code == 0, r.output
    new = json.loads(out.read_text())
    assert "partition_method" not in new.get("pipeline", {})  # ignored-pipeline-keys removed it
    html = page.read_text()
    assert "metrics-rank0.csv + 3 more: micro 4" in html and "stage-imbalance" in html
    assert "outside a study" not in html  # the job is named by its files
    assert (tmp_path / "advice_figures" / "split-run.svg").is_file()


def test_html_of_a_study_folder_draws_every_trial(tmp_path):
    pytest.importorskip("matplotlib")
    page = tmp_path / "s.html"
    r = run("advise", study(tmp_path), "--html", page)
    assert r.exit_code == 0, r.output
    assert {p.name for p in (tmp_path / "s_figures").glob("split-*.svg")} == {
        "split-trial-000.svg", "split-trial-001.svg"}
    html = page.read_text()
    assert "trial 0: micro 4" in html and "trial 1: micro 4" in html


def test_stages_on_a_metrics_csv_is_a_note(tmp_path):
    data = advise_json(*write_job(tmp_path / "run"), "--stages", "2")
    assert any("--stages 2 is for device logs" in n for n in data["notes"])


def one_line_error(r, *needles: str) -> None:
    assert r.exit_code == 2, r.output
    assert r.output.startswith("autotune: error: ") and r.output.count("\n") == 1, r.output
    for n in needles:
        assert n in r.output, r.output


def test_refusals_are_one_line(tmp_path):
    files = write_job(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bin.csv").write_bytes(b"\x00\x01" * 100)
    smi = tmp_path / "smi.csv"
    smi.write_bytes((FIX / "nvidia_smi_2gpu.csv").read_bytes())
    one_line_error(run("advise", files[0], files[1], files[0]), "given twice")
    one_line_error(run("advise", tmp_path / "run", files[2]), "given twice")
    one_line_error(run("advise", tmp_path / "empty"), "an empty folder")
    one_line_error(run("advise", str(tmp_path / "run" / "nothing-*.csv")), "matches no file")
    one_line_error(run("advise", tmp_path / "bin.csv"), "binary")
    (tmp_path / "latin.csv").write_bytes("tr\xe9s,x\n".encode("latin-1") * 10)
    one_line_error(run("advise", files[0], tmp_path / "latin.csv"), "not a UTF-8 text file")
    one_line_error(run("advise", tmp_path / "missing.csv"), "no such file or folder")
    one_line_error(run("advise", files[0], smi), "mixed inputs", "nvidia-smi log", "metrics CSV")
    (tmp_path / "study" / "trial-000").mkdir(parents=True)
    one_line_error(run("advise", tmp_path / "study"), "without trial metrics")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    one_line_error(run("advise", tmp_path / "other"), "no metrics-rank*.csv")
    r = run("advise")
    assert r.exit_code == 2 and "Missing argument" in r.output


def test_write_config_never_overwrites_an_input(tmp_path):
    files = write_job(tmp_path / "run")
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    before = files[1].read_bytes()
    one_line_error(run("advise", *files, "--config", cfg, "--write-config", files[1]), "would overwrite")
    assert files[1].read_bytes() == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_one_line(tmp_path):
    files = write_job(tmp_path / "run")
    files[1].chmod(0)
    one_line_error(run("advise", tmp_path / "run"), "cannot open")


KINDS = ["rank0", "rank1", "smi", "prom", "bin", "empty", "folder", "emptydir", "glob", "noglob", "missing"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(KINDS), min_size=1, max_size=4))
def test_any_mix_of_inputs_is_advice_or_one_line(tmp_path, kinds):
    """Whatever mix of files, folders and globs: findings (exit 0) or one clean line (exit 2)."""
    root = tmp_path / "in"
    if not root.exists():
        files = write_job(root / "run", ranks=2)
        (root / "smi.csv").write_bytes((FIX / "nvidia_smi_2gpu.csv").read_bytes())
        (root / "prom.csv").write_bytes((FIX / "prometheus_export.csv").read_bytes())
        (root / "bin.csv").write_bytes(b"\x00" * 64)
        (root / "empty.csv").write_text("")
        (root / "emptydir").mkdir()
        assert files
    paths = {"rank0": root / "run" / "metrics-rank0.csv", "rank1": root / "run" / "metrics-rank1.csv",
             "smi": root / "smi.csv", "prom": root / "prom.csv", "bin": root / "bin.csv",
             "empty": root / "empty.csv", "folder": root / "run", "emptydir": root / "emptydir",
             "glob": str(root / "run" / "metrics-rank*.csv"), "noglob": str(root / "none-*.csv"),
             "missing": root / "missing.csv"}
    r = run("advise", "--format", "json", *(paths[k] for k in kinds))
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    if r.exit_code == 0:
        assert json.loads(r.output)["findings"]
    else:
        assert r.exit_code == 2 and r.output.startswith("autotune: error: ") and r.output.count("\n") == 1, r.output


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), ranks=st.sampled_from([2, 4, 8]))
def test_per_rank_files_summarise_as_their_concatenation(tmp_path_factory, seed, ranks):
    """Merging a job's per-rank files loses nothing: the same summary as all rows in one file."""
    import random

    from autotune.loaders import load_inputs

    rng = random.Random(seed)
    folder = tmp_path_factory.mktemp("job")
    recs = [record(trial=-1, rank=r, stage=r * 2 // ranks, step=s, warmup=int(s == 0),
                   data_parallel_size=ranks // 2, step_seconds=rng.uniform(0.5, 2),
                   compute_seconds=rng.uniform(0.1, 0.5), wait_seconds=rng.uniform(0, 0.3),
                   device_utilization=rng.random()) for s in range(rng.randint(2, 6)) for r in range(ranks)]
    (folder / "all.csv").write_text(csv_text(recs))
    (folder / "split").mkdir()
    for r in range(ranks):
        (folder / "split" / f"metrics-rank{r}.csv").write_text(csv_text([x for x in recs if x.rank == r]))
    whole = load_inputs([str(folder / "all.csv")]).summaries
    merged = load_inputs([str(folder / "split")]).summaries
    assert [s.to_dict() for s in merged] == [s.to_dict() for s in whole]
