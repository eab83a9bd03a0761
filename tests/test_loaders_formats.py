"""Loaders: format detection, nvidia-smi and Prometheus parsing, the columnar metrics path."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from builders import csv_text, grid_records, record
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.advisor import evaluate
from autotune.core.errors import InputFileError
from autotune.core.summary import summarize
from autotune.loaders import detect_format, load_input
from autotune.loaders.metrics import load_summaries
from autotune.loaders.nvidia_smi import load_nvidia_smi
from autotune.loaders.prometheus import load_prometheus

FIX = Path(__file__).parent / "fixtures" / "advise"


def test_detects_each_format(tmp_path):
    m = tmp_path / "m.csv"
    m.write_text(csv_text(grid_records()))
    assert detect_format(m) == "metrics"
    assert detect_format(FIX / "nvidia_smi_2gpu.csv") == "nvidia-smi"
    assert detect_format(FIX / "prometheus_export.csv") == "prometheus"


def test_nvidia_smi_interleaved_gpus():
    s = load_nvidia_smi(FIX / "nvidia_smi_2gpu.csv")
    gpu1 = [0.41, 0.88, 0.12, 0.79]
    mean = sum(gpu1) / 4
    std = (sum((x - mean) ** 2 for x in gpu1) / 4) ** 0.5
    assert s.get("device_utilization_fluctuation") == pytest.approx(std)
    assert s.get("memory_used_ratio") == pytest.approx(77310 / 81559)
    assert s.get("memory_peak_bytes") == 77310 * 2**20
    assert s.get("comm_compute_ratio") is None and "nvidia-smi" in s.why_missing("comm_compute_ratio")


def test_nvidia_smi_findings_name_the_gpu():
    findings = evaluate(load_input(FIX / "nvidia_smi_2gpu.csv").subjects)
    f = next(x for x in findings if x.rule_id == "utilization-fluctuation")
    assert f.fired and f.evidence[0].devices == ["gpu1"]
    assert next(x for x in findings if x.rule_id == "memory-near-limit").fired
    assert not next(x for x in findings if x.rule_id == "comm-compute-high").fired


def test_nvidia_smi_nounits_and_na(tmp_path):
    f = tmp_path / "n.csv"
    f.write_text("timestamp, index, utilization.gpu [%], memory.used [MiB], memory.total [MiB]\n"
                 "t, 0, 50, 100, 1000\nt, 0, [N/A], 100, 1000\nt, 0, 70, 200, 1000\n")
    s = load_nvidia_smi(f)
    assert s.get("device_utilization_fluctuation") == pytest.approx(0.1)
    assert s.get("memory_used_ratio") == pytest.approx(0.2)


@pytest.mark.parametrize("row,needle", [
    ("t, 0, 50 %, 100 Furlongs, 1000 MiB", "unknown memory unit"),
    ("t, 0, 50 degrees, 100 MiB, 1000 MiB", "unknown unit"),
    ("t, 0, lots %, 100 MiB, 1000 MiB", "non-numeric"),
    ("t, 0, 50 %", "cells"),
])
def test_nvidia_smi_bad_rows(tmp_path, row, needle):
    f = tmp_path / "n.csv"
    f.write_text("timestamp, index, utilization.gpu [%], memory.used [MiB], memory.total [MiB]\n" + row + "\n")
    with pytest.raises(InputFileError, match=needle):
        load_nvidia_smi(f)


def test_prometheus_export_signals():
    [s] = load_prometheus(FIX / "prometheus_export.csv")
    assert s.trial == 3 and s.get("pipeline_stages") == 2
    assert s.get("comm_compute_ratio") == pytest.approx(0.45)
    assert s.get("bubble_fraction_excess") == pytest.approx(0.35 - 0.11)
    findings = evaluate([s])
    cc = next(f for f in findings if f.rule_id == "comm-compute-high")
    assert cc.fired and cc.evidence[0].ranks == [1]
    assert next(f for f in findings if f.rule_id == "bubble-above-ideal").fired
    assert next(f for f in findings if f.rule_id == "utilization-fluctuation").fired


def test_prometheus_accepts_name_column(tmp_path):
    f = tmp_path / "p.csv"
    f.write_text("__name__,rank,value\nautotune_comm_compute_ratio,0,0.1\n")
    [s] = load_prometheus(f)
    assert s.get("comm_compute_ratio") == pytest.approx(0.1)
    assert "Prometheus" in s.why_missing("step_time_jitter")


def test_prometheus_rejects_bad_value(tmp_path):
    f = tmp_path / "p.csv"
    f.write_text("metric,rank,value\nautotune_comm_compute_ratio,0,high\n")
    with pytest.raises(InputFileError, match="line 2"):
        load_prometheus(f)


@pytest.mark.parametrize("content,needle", [
    (b"", "empty"), (b"\x00\x01\x02binary", "binary"), (b"a,b,c\n1,2,3\n", "unrecognised header"),
    (b"\xff\xfe\xfdabc,def\n", "UTF-8"),
])
def test_bad_files(tmp_path, content, needle):
    f = tmp_path / "x.csv"
    f.write_bytes(content)
    with pytest.raises(InputFileError, match=needle):
        load_input(f)


def test_metrics_missing_and_bad_cells(tmp_path):
    f = tmp_path / "m.csv"
    text = csv_text(grid_records())
    f.write_text(text.replace("step_seconds", "step_secs", 1))
    with pytest.raises(InputFileError, match="missing columns"):
        load_summaries(f)
    lines = text.splitlines()
    lines[3] = lines[3].replace("0.6", "zz", 1)
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputFileError, match="line 4"):
        load_summaries(f)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), trials=st.integers(1, 3), ranks=st.sampled_from([1, 2, 4]),
       with_frag=st.booleans())
def test_columnar_summary_matches_reference(tmp_path_factory, seed, trials, ranks, with_frag):
    """The file path (`advise`: CSV -> reader -> columns) gives the same TrialSummary as the
    records adapter (ranks and tests: StepRecords -> columns): the CSV round trip loses nothing."""
    rng = random.Random(seed)
    recs = []
    for t in range(trials):
        for s in range(rng.randint(1, 6)):
            for r in rng.sample(range(ranks), k=ranks):
                recs.append(record(trial=t, rank=r, stage=r * 2 // max(ranks, 2), step=s,
                                   warmup=int(s == 0 and rng.random() < 0.5),
                                   step_seconds=rng.uniform(0.5, 2), compute_seconds=rng.uniform(0, 1),
                                   comm_seconds=rng.uniform(0, 0.3), wait_seconds=rng.uniform(0, 0.3),
                                   device_utilization=rng.random(),
                                   memory_fragmentation_ratio=rng.random() / 10 if with_frag else None,
                                   loss=rng.random() if r == ranks - 1 else None,
                                   memory_peak_bytes=rng.uniform(1e8, 1e9),
                                   utilization_from_device=rng.choice([None, 0, 1] if with_frag else [None, 0])))
    f = tmp_path_factory.mktemp("m") / "m.csv"
    f.write_text(csv_text(recs))
    ref = summarize(recs)
    if not ref:
        with pytest.raises(InputFileError):
            load_summaries(f)
        return
    got = load_summaries(f)
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        _same(a.to_dict(), b.to_dict())


def _same(da: dict, db: dict) -> None:
    assert da.keys() == db.keys()
    for k in db:
        if k == "ranks":
            assert len(da[k]) == len(db[k])
            for ra, rb in zip(da[k], db[k], strict=True):
                _same(ra, rb)
        elif db[k] is None:
            assert da[k] is None, k
        else:
            assert da[k] == pytest.approx(db[k], rel=1e-9, abs=1e-12), k


def test_stdlib_path_reads_what_pandas_reads(tmp_path):
    """The csv-module path (taken for files pandas refuses, to name the bad line) agrees."""
    from autotune.loaders.detect import read_header
    from autotune.loaders.metrics import NUMERIC_COLUMNS, _read_pandas, _read_stdlib

    f = tmp_path / "m.csv"
    f.write_text(csv_text(grid_records(trials=2)))
    header = read_header(f)
    use = [c for c in NUMERIC_COLUMNS if c in header]
    fast, slow = _read_pandas(f, header, use), _read_stdlib(f, header, use)
    assert fast.keys() == slow.keys()
    for c in use:
        assert np.array_equal(fast[c], slow[c], equal_nan=True), c
    bad = tmp_path / "bad.csv"
    bad.write_text(csv_text(grid_records()).replace("0.6", "x", 1))
    with pytest.raises(InputFileError, match="line 2"):
        load_summaries(bad)


@pytest.mark.parametrize("word", ["TRUE", "false"])
def test_boolean_words_are_not_numbers(tmp_path, word):
    """pandas' C parser reads TRUE/false as 1.0/0.0 even with dtype float; we must refuse them."""
    f = tmp_path / "m.csv"
    lines = csv_text(grid_records()).splitlines()
    cells = lines[2].split(",")
    cells[0] = word
    lines[2] = ",".join(cells)
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputFileError, match="line 3"):
        load_summaries(f)
