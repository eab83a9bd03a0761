"""A signal that is not known is absent, never 0 (issue 24, "Unknown is written as 0").

Every column of the metrics CSV is swept: on a job that cannot know a value (tokens and
sequence length of an image model, fragmentation and allocator memory on a CPU, the loss
scale without fp16, ...), its cell is empty, `StepRecord` reads None, and the rank's
Prometheus exposition has no series for it. A cheap sweep over StepRecord -> CSV ->
Prometheus text, then the real thing: an image pipeline script through `autotune run --`.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from builders import grid_records
from click.testing import CliRunner
from launch_helpers import autotune_cli
from prometheus_client import CollectorRegistry, generate_latest

from autotune.cli.main import cli
from autotune.core.schema import CSV_COLUMNS, StepRecord
from autotune.core.summary import summarize_trial
from autotune.loaders.metrics import load_summaries, read_records
from autotune.rank.metrics_csv import CsvSink
from autotune.rank.token_input import token_seq_length
from autotune.study.store import Study
from exporters.prometheus_rank import RankExporter

REPO = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "advise" / "h200-small-1stage.csv"

UNKNOWN_ON_A_CPU_IMAGE_JOB = {
    "tokens_per_second": "an image model has no tokens",
    "seq_length": "an image model has no tokens",
    "memory_allocated_bytes": "no CUDA allocator on a CPU",
    "memory_reserved_bytes": "no CUDA allocator on a CPU",
    "memory_fragmentation_ratio": "no CUDA allocator on a CPU",
    "memory_inactive_split_bytes": "no CUDA allocator on a CPU",
    "memory_capacity_bytes": "the ranks share the host's memory: no per-device limit",
    "loss_scale": "no fp16",
    "reduce_bucket_size": "acts only with ZeRO-1 and dp > 1 (dp is 1)",
    "collective_calls": "a pipeline's reduction is one timed instruction, not one call each",
    "gather_seconds": "a pipeline's reduction is one timed instruction, not one call each",
}
"""Every column that the image job below cannot know, and why. Every other column must hold a value."""
LAST_STAGE_ONLY = {"loss"}


def _series(text: str, column: str) -> list[str]:
    name = f"autotune_{column}"
    return [line for line in text.splitlines() if line.startswith((name + "{", name + " "))]


def _exposition(record: StepRecord) -> str:
    reg = CollectorRegistry()
    RankExporter(labels={"job": "t"}, registry=reg).write(record)
    return generate_latest(reg).decode()


def _cpu_image_record(**known: object) -> StepRecord:
    """What the probe knows on a CPU rank of an image model: the rest left to the defaults."""
    base = dict(time=1.7e9, trial=0, rank=0, stage=0, step=1, warmup=0, step_seconds=0.5,
                samples_per_second=32.0, compute_seconds=0.3, comm_seconds=0.02, wait_seconds=0.1,
                data_seconds=0.01, device_utilization=0.6, micro_batch_size=2,
                gradient_accumulation_steps=8, pipeline_stages=2, data_parallel_size=1,
                memory_peak_bytes=2e8, device="cpu", host="h", optimizer_seconds=0.01,
                utilization_from_device=0, compute_cpu_seconds=0.25)
    base.update(known)
    return StepRecord(**base)  # type: ignore[arg-type]


def test_a_record_with_unknowns_is_empty_in_the_csv_and_absent_in_prometheus(tmp_path):
    record = _cpu_image_record()
    path = tmp_path / "m.csv"
    sink = CsvSink(path)
    sink.write(record)
    sink.close()
    with open(path, newline="", encoding="utf-8") as fh:
        (row,) = list(csv.DictReader(fh))
    unknown = {c for c in CSV_COLUMNS if getattr(record, c) is None}
    assert {"tokens_per_second", "seq_length", "loss"} | set(UNKNOWN_ON_A_CPU_IMAGE_JOB) <= unknown
    for column in CSV_COLUMNS:
        if column in unknown:
            assert row[column] == "", (column, row[column])
        else:
            assert row[column] != "", column
    (back,) = read_records(path)  # the one reader takes the empty cells, as None
    assert all(getattr(back, c) is None for c in unknown)
    text = _exposition(back)
    for column in unknown:
        assert _series(text, column) == [], column
    assert _series(text, "samples_per_second")  # the known ones are served
    (summary,) = load_summaries(path)
    assert summary.tokens_per_second is None and summary.samples_per_second > 0


def test_only_the_first_stage_knows_the_length_and_the_summary_takes_it_from_there(tmp_path):
    """A user script's later stages never see the input: their rows leave it empty."""
    rows = grid_records(ranks=4, steps=4)
    rows = [StepRecord(**{**{c: getattr(r, c) for c in CSV_COLUMNS},
                          "seq_length": 64 if r.stage == 0 else None,
                          "tokens_per_second": r.samples_per_second * 64 if r.stage == 0 else None})
            for r in rows]
    path = tmp_path / "m.csv"
    sink = CsvSink(path)
    for r in reversed(rows):  # a later stage's row first
        sink.write(r)
    sink.close()
    (summary,) = load_summaries(path)
    assert summary.tokens_per_second == pytest.approx(summary.samples_per_second * 64)
    first, later = (next(r for r in read_records(path) if r.stage == s) for s in (0, 1))
    (line,) = _series(_exposition(first), "tokens_per_second")
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(first.samples_per_second * 64)
    assert _series(_exposition(later), "tokens_per_second") == []


def _rewrite(tmp_path: Path, name: str, cells: dict[str, str]) -> Path:
    with open(FIXTURE, newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    header, body = rows[0], rows[1:]
    idx = {c: header.index(c) for c in cells}
    for r in body:
        for c, v in cells.items():
            r[idx[c]] = v
    path = tmp_path / name
    with open(path, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([header, *body])
    return path


@pytest.mark.parametrize("tokens, seq", [("0.0", "0"), ("", "")], ids=["old-zeros", "new-empty"])
def test_old_zeros_and_new_empty_cells_both_read_and_advise(tmp_path, tokens, seq):
    """A CSV written before the change (0.0 / 0) reads as written; its 0 was "not known" all along,
    so the summary says so too. The new form (empty cells) reads, and `advise` runs, on both."""
    path = _rewrite(tmp_path, "m.csv", {"tokens_per_second": tokens, "seq_length": seq})
    records = read_records(path)
    expected = (0.0, 0) if tokens else (None, None)
    assert {(r.tokens_per_second, r.seq_length) for r in records} == {expected}
    summaries = load_summaries(path)
    assert summaries and all(s.tokens_per_second is None for s in summaries)
    result = CliRunner().invoke(cli, ["advise", str(path), "--format", "json"])
    assert result.exit_code == 0, result.output[-2000:]
    assert '"findings"' in result.output and "tokens" not in result.output
    text = CliRunner().invoke(cli, ["advise", str(path)])
    assert text.exit_code == 0 and "tokens" not in text.output.lower()


@pytest.mark.parametrize("inputs, micro, expected", [
    (torch.randint(0, 256, (4, 32)), 4, 32),  # token ids: batch x seq
    ((torch.randint(0, 256, (4, 32), dtype=torch.int32), torch.ones(4, 1, 32, 32, dtype=torch.bool)), 4, 32),
    (torch.randn(4, 3, 16, 16), 4, None),  # images
    (torch.randn(4, 32), 4, None),  # float features
    (torch.ones(4, 32, dtype=torch.bool), 4, None),  # a mask is not tokens
    (torch.randint(0, 256, (32, 4)), 4, None),  # sequence first: not batch x seq, not guessed
    (torch.randint(0, 10, (4,)), 4, None),
    ((), 4, None),
], ids=["ids", "ids-and-mask", "images", "floats", "bool", "seq-first", "1d", "empty"])
def test_sequence_length_is_read_only_from_batch_by_seq_integer_ids(inputs, micro, expected):
    assert token_seq_length(inputs, micro) == expected


MEASURED_STEPS = 6


@pytest.fixture(scope="module")
def cnn_trial(tmp_path_factory) -> Path:
    """examples/cnn_pipeline.py, unmodified, through `autotune run --layer-costs --`: the reported
    job's shape (an image pipeline, dp 1, its first stage computing about twice its second)."""
    tmp_path = tmp_path_factory.mktemp("cnn")
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = autotune_cli("run", "--budget", "1", "--study", "st", "--steps", str(MEASURED_STEPS),
                        "--warmup-steps", "1", "--fixed-steps", "--trial-timeout", "600", "--no-metrics",
                        "--layer-costs", "--",
                        "deepspeed", "--num_gpus", "2", str(REPO / "examples" / "cnn_pipeline.py"),
                        "--deepspeed_config", str(REPO / "examples" / "ds_config.json"), "--steps", "100000",
                        cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / "st" / "trial-000"


@pytest.fixture(scope="module")
def cnn_advice(cnn_trial) -> str:
    """`autotune advise TRIAL --format json` on that trial, once for the tests that read it."""
    result = CliRunner().invoke(cli, ["advise", str(cnn_trial), "--format", "json"])
    assert result.exit_code == 0, result.output[-2000:]
    return result.output


@pytest.mark.slow
def test_an_image_script_through_autotune_run_writes_no_zero_for_what_it_cannot_know(cnn_trial, cnn_advice):
    """Every CSV column, the Prometheus exposition of every row, the stored summary and `advise`."""
    trial = cnn_trial
    tmp_path = trial.parent.parent
    for rank in (0, 1):
        path = trial / f"metrics-rank{rank}.csv"
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
        assert len(rows) == MEASURED_STEPS + 1 and list(rows[0]) == list(CSV_COLUMNS)
        for row in rows:
            last = row["stage"] == "1"
            for column in CSV_COLUMNS:
                unknown = column in UNKNOWN_ON_A_CPU_IMAGE_JOB or (column in LAST_STAGE_ONLY and not last)
                if unknown:
                    assert row[column] == "", (rank, column, row[column])
                else:
                    assert row[column] != "", (rank, column)
        for record in read_records(path):
            text = _exposition(record)
            for column in UNKNOWN_ON_A_CPU_IMAGE_JOB:
                assert _series(text, column) == [], (rank, column)
            for gauge in ("collective_calls_per_micro_batch", "gather_comm_ratio"):  # their gauges: absent
                assert _series(text, gauge) == [], (rank, gauge)
            assert _series(text, "samples_per_second")
            assert bool(_series(text, "loss")) == (rank == 1)  # the loss lives on the last stage
    study = Study.open(tmp_path / "st", create=False)
    (row,) = study.trials()
    assert row.status == "ok" and row.summary is not None
    assert row.summary["tokens_per_second"] is None and row.summary["samples_per_second"] > 0
    assert row.summary["memory_fragmentation_ratio"] is None
    summary_json = (tmp_path / "st" / "summary.json").read_text()
    assert "tokens_per_second" not in summary_json and "seq_length" not in summary_json
    assert "tokens" not in (tmp_path / "st" / "report.md").read_text().lower()
    assert "tokens" not in cnn_advice


@pytest.mark.slow
def test_an_unbalanced_dp1_job_reads_as_unbalanced_not_chatty(cnn_trial, cnn_advice):
    """Issue 24's first finding, on the job's shape: the stage imbalance comes first, with the
    partition the measured layer costs say balances it; communication is transfer only (the
    second stage's sends wait for the first: that is waiting), so it is not the top finding,
    and no data-parallel remedy (GAS to amortize a reduction) is proposed where dp is 1."""
    fired = [f for f in json.loads(cnn_advice)["findings"] if f["status"] == "fired"]
    assert fired and fired[0]["rule_id"] == "stage-imbalance", [(f["rule_id"], f.get("impact")) for f in fired]
    concrete = [c for c in fired[0]["changes"] if c["target"] in ("PipelineModule:partition_method",
                                                                  "PipelineModule parts")]
    assert concrete and all("<" not in json.dumps(c) and c["new"] != c["current"] for c in concrete)
    assert any(c["target"] == "PipelineModule parts" and c["new"][1] < 6 for c in concrete)  # layers off stage 0
    summary = summarize_trial([r for f in sorted(cnn_trial.glob("metrics-rank*.csv")) for r in read_records(f)])
    assert summary.data_parallel_size == 1 and summary.stage_compute_seconds[0] > summary.stage_compute_seconds[1]
    last = next(r for r in summary.ranks if r.stage == 1)
    assert last.wait_seconds_mean > last.comm_seconds_mean  # it mostly waits for stage 0
    # Transfer only: counted with its waits, as before issue 24, the job read as chatty. (Whether the
    # transfer alone crosses comm-compute-high's 1:4 depends on the machine: 0.251 on one CI run, so
    # that rule may fire, below the imbalance; the claim is the ratio without the waits.)
    with_waits = max((r.comm_seconds_mean + r.wait_seconds_mean) / r.compute_seconds_mean for r in summary.ranks)
    assert summary.comm_compute_ratio < 0.5 * with_waits
    for f in fired:  # the data-parallel remedy: more GAS to amortize a reduction there is none of
        if f["rule_id"].startswith("comm-compute"):
            assert "gradient_accumulation_steps" not in [c["target"] for c in f["changes"]]
