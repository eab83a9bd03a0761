"""End to end: `autotune run --budget 3` on the tiny workload, real DeepSpeed processes."""

from __future__ import annotations

import csv
import json
import sqlite3

import pytest
from launch_helpers import run_ranks
from shared_studies import TRACE_STEPS

from autotune.core.schema import CSV_COLUMNS, REQUIRED_COLUMNS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def study(builtin_study):
    """The session's built-in study (tests/shared_studies.py): budget 3, default config, 4 ranks."""
    assert builtin_study.returncode == 0, builtin_study.stdout[-3000:] + builtin_study.stderr[-3000:]
    return builtin_study.study, builtin_study, builtin_study.shm_leaked


def test_study_database_holds_every_trial(study):
    root, *_ = study
    db = sqlite3.connect(root / "study.db")
    rows = db.execute("SELECT number, status, source, micro_batch_size, gradient_accumulation_steps,"
                      " reduce_bucket_size, samples_per_second, summary_json FROM trials ORDER BY number").fetchall()
    assert [r[0] for r in rows] == [0, 1, 2]
    assert rows[0][2] == "baseline"
    assert all(r[1] == "ok" for r in rows)
    for r in rows:
        assert r[3] * r[4] * 2 == 64  # fixed global batch of the default config, dp 2
        assert r[5] is not None  # ZeRO-1 with dp 2: the bucket knob is real
        assert r[6] > 0
        summary = json.loads(r[7])
        assert summary["samples_per_second"] == pytest.approx(r[6])


def test_trial_folders_and_csv_schema(study):
    root, *_ = study
    for n in range(3):
        d = root / f"trial-{n:03d}"
        cfg = json.loads((d / "ds_config.json").read_text())
        assert cfg["train_batch_size"] == 64
        assert (d / "launcher.log").stat().st_size > 0
        csvs = sorted(d.glob("metrics-rank*.csv"))
        assert len(csvs) == 4
        with open(csvs[0], newline="") as fh:
            rows = list(csv.DictReader(fh))
        assert tuple(rows[0].keys()) == CSV_COLUMNS
        assert set(REQUIRED_COLUMNS) <= set(rows[0])
        # the warm-up step, then (traced trials: tests/test_traces.py) the profiler's warm-up,
        # the traced steps and the settling step, all unmeasured; then the 2 measured steps
        traced = (d / "traces").is_dir()
        unmeasured = 1 + (TRACE_STEPS + 2 if traced else 0)
        assert [r["warmup"] for r in rows] == ["1"] * unmeasured + ["0", "0"]
        assert rows[0]["memory_fragmentation_ratio"] == ""  # not available on CPU, never 0
        assert int(rows[0]["micro_batch_size"]) == cfg["train_micro_batch_size_per_gpu"]


def test_summary_json_and_best(study):
    root, proc, _ = study
    summary = json.loads((root / "summary.json").read_text())
    assert len(summary["trials"]) == 3
    best = summary["best"]
    by_config: dict = {}
    for t in summary["trials"]:
        key = (t["micro_batch_size"], t["gradient_accumulation_steps"], t["reduce_bucket_size"])
        by_config.setdefault(key, []).append(t["samples_per_second"])
    means = {k: sum(v) / len(v) for k, v in by_config.items()}
    assert best["samples_per_second"] == pytest.approx(max(means.values()))
    assert best["measurements"] == len(by_config[max(means, key=means.get)])
    assert summary["baseline"]["trial"] == 0
    assert summary["speedup_over_baseline"] == pytest.approx(
        best["samples_per_second"] / summary["baseline"]["samples_per_second"])
    assert "best: trial" in proc.stdout and "speed-up" in proc.stdout
    assert (root / "report.md").read_text().count("\n| ") >= 4


def test_the_typed_results_are_summary_json_report_md_and_the_printed_lines(study):
    from autotune.study.outputs import render_markdown
    from autotune.study.results import read_results
    from autotune.study.store import open_study_readonly

    root, proc, _ = study
    st = open_study_readonly(root)
    try:
        results = read_results(st)
    finally:
        st.close()
    assert results.to_dict() == json.loads((root / "summary.json").read_text())
    assert (root / "report.md").read_text() == render_markdown(results)
    best = results.best
    assert (f"best: trial {best.number}: micro {best.config.micro_batch_size}, "
            f"GAS {best.config.gradient_accumulation_steps}, ") in proc.stdout
    assert f"{best.samples_per_second:.1f} samples/s" in proc.stdout
    assert f"speed-up {results.speedup:.2f}x" in proc.stdout


def test_best_config_initializes_a_deepspeed_engine(study, tmp_path):
    root, *_ = study
    best = json.loads((root / "best_ds_config.json").read_text())
    records, summary, rc = run_ranks(tmp_path, best, ranks=4, steps=1, warmup=0, preset="tiny")
    assert rc == 0
    assert summary is not None and summary.micro_batch_size == best["train_micro_batch_size_per_gpu"]
    assert summary.data_parallel_size == 2


def test_no_shared_memory_left_behind(study):
    """DeepSpeed's CPU comm op never unlinks its /dev/shm buffers; the launcher removes them."""
    *_, leaked = study
    assert leaked == set()
