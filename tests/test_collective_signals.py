"""A plain engine's communication per kind: the CSV's `zero_stage`, `collective_calls` and
`gather_seconds`, the signals they give (calls per micro-batch, the gathers' share), the
rank endpoint's gauges, and the ZeRO rules that read them (autotune/rank/collectives.py,
core/summary.py, advisor/signals.py, rules `zero-chatty-reductions` and `zero3-gathers-dominate`).

The rows written by real ranks are the zero study's (tests/shared_studies.py); the rules'
thresholds are checked on summaries built to sit either side of them."""

from __future__ import annotations

import csv
import json

from builders import csv_text, healthy_summary, record

from autotune.advisor.engine import evaluate
from autotune.advisor.signals import OLD_CSV, PER_CALL_NOT_AVAILABLE, from_summary
from autotune.core.summary import summarize
from autotune.loaders.metrics import load_summaries
from autotune.rank.collectives import collective_calls, gathers


def test_calls_and_gathers_come_from_the_steps_collective_intervals():
    intervals = {"collective:reduce_scatter_tensor:4096": [0.01, 0.02], "collective:all_gather_into_tensor:512": [0.03],
                 "collective:all_reduce:10": [0.001], "p2p:SendActivation": [0.5], "forward": [1.0]}
    assert collective_calls(intervals) == 4
    assert gathers(intervals) == {"collective:all_gather_into_tensor:512": [0.03]}


def _plain(**kw):
    """Two plain-engine ranks (one "stage"), GAS 4, 6 measured steps."""
    rows = []
    for step in range(7):
        for rank in range(2):
            rows.append(record(rank=rank, stage=0, step=step, warmup=int(step == 0), pipeline_stages=1,
                               gradient_accumulation_steps=4, comm_seconds=0.2, zero_stage=3,
                               **{k: (v(rank) if callable(v) else v) for k, v in kw.items()}))
    return rows


def test_the_summary_reads_the_worst_ranks_calls_per_micro_batch_and_gather_share(tmp_path):
    rows = _plain(collective_calls=lambda r: 40 + 8 * r, gather_seconds=lambda r: 0.05 + 0.1 * r)
    path = tmp_path / "metrics-rank0.csv"
    path.write_text(csv_text(rows))
    (s,) = load_summaries(path)  # through the CSV, as advise reads it
    assert s.zero_stage == 3
    assert s.collective_calls_per_micro_batch == 48 / 4  # rank 1's 48 calls over GAS 4
    assert abs(s.gather_comm_fraction - 0.15 / 0.2) < 1e-9  # rank 1: 0.15 s of its 0.2 s
    sig = from_summary(s)
    assert sig.get("collective_calls_per_micro_batch") == 12.0 and sig.get("zero_stage") == 3.0


def test_absent_on_a_pipeline_and_in_an_older_csv_never_zero():
    pipe = summarize(_pipeline_rows())[0]
    assert pipe.collective_calls_per_micro_batch is None and pipe.gather_comm_fraction is None
    assert from_summary(pipe).why_missing("collective_calls_per_micro_batch") == PER_CALL_NOT_AVAILABLE
    old = summarize(_plain())[0]  # a plain engine's CSV from before the columns
    assert old.collective_calls_per_micro_batch is None
    assert from_summary(old).why_missing("gather_comm_fraction") == OLD_CSV


def _pipeline_rows():
    return [record(rank=r, stage=r // 2, step=s, warmup=int(s == 0)) for s in range(4) for r in range(4)]


def _fired(summary) -> set[str]:
    return {f.rule_id for f in evaluate([summary]) if f.fired}


def _zero(stage: int, calls: float, ratio: float, gather: float | None = None):
    return healthy_summary(pipeline_stages=1, gradient_accumulation_steps=4, bubble_fraction_measured=None,
                           bubble_fraction_ideal=None, stage_compute_imbalance=None, comm_compute_ratio=ratio,
                           zero_stage=stage, collective_calls_per_micro_batch=calls, gather_comm_fraction=gather)


def test_chatty_reductions_fire_at_zero_1_and_2_only_where_calls_and_communication_are_high():
    assert "zero-chatty-reductions" in _fired(_zero(2, calls=53, ratio=1.5))
    assert "zero-chatty-reductions" in _fired(_zero(1, calls=20, ratio=0.4))
    assert "zero-chatty-reductions" not in _fired(_zero(2, calls=3, ratio=1.5))  # a few calls: not chatty
    assert "zero-chatty-reductions" not in _fired(_zero(2, calls=53, ratio=0.05))  # cheap communication
    assert "zero-chatty-reductions" not in _fired(_zero(3, calls=53, ratio=1.5, gather=0.2))  # ZeRO-3: gathers


def test_stage3_gathers_fire_where_the_gathers_dominate_costly_communication():
    assert "zero3-gathers-dominate" in _fired(_zero(3, calls=60, ratio=1.0, gather=0.7))
    assert "zero3-gathers-dominate" not in _fired(_zero(3, calls=60, ratio=1.0, gather=0.3))
    assert "zero3-gathers-dominate" not in _fired(_zero(2, calls=60, ratio=1.0, gather=0.7))
    assert "zero3-gathers-dominate" not in _fired(_zero(3, calls=60, ratio=0.05, gather=0.7))


def test_real_zero_ranks_write_the_columns_and_serve_the_gauges(zero_study):
    """The zero study's ranks (ZeRO-2 baseline, the stage sweep's other stages): every row holds
    the stage it ran, its collective calls (> 0: dp 2 reduces every step) and its gathers."""
    summary = json.loads((zero_study.study / "summary.json").read_text())
    seen = {}
    for t in summary["trials"]:
        if t["status"] != "ok":
            continue
        ran = json.loads((zero_study.study / f"trial-{t['trial']:03d}" / "ds_config.json").read_text())
        for path in sorted((zero_study.study / f"trial-{t['trial']:03d}").glob("metrics-rank*.csv")):
            with path.open() as fh:
                rows = list(csv.DictReader(fh))
            assert rows and all(int(r["zero_stage"]) == ran["zero_optimization"]["stage"] for r in rows)
            assert all(int(r["collective_calls"]) > 0 for r in rows)
            assert all(0.0 <= float(r["gather_seconds"]) <= float(r["comm_seconds"]) + 1e-9 for r in rows)
            seen[int(rows[0]["zero_stage"])] = max(float(r["gather_seconds"]) for r in rows)
    assert seen.get(3, 0.0) > 0.0  # ZeRO-3 gathers its parameters every forward and backward
