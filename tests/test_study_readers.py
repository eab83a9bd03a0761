"""Reading a study: the one read-only opener (while a live controller holds it) and the one
derivation of its results (`autotune.study.results`), against summary.json, report.md and the page."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
import time
from statistics import fmean

import pytest
from html_study import CFGS, failed_trial, full_study, new_study, ok_trial

from autotune.core.errors import StudyError
from autotune.study.job_record import META_KEY
from autotune.study.outputs import render_markdown, write_outputs
from autotune.study.results import read_results
from autotune.study.store import Study, open_study_readonly, stored_budget, stored_meta
from autotune.usercmd.prepare import stored_job

JOB = {"argv": ["deepspeed", "train.py", "--deepspeed_config", "ds.json"], "cwd": "/work", "parameters": 1234}

# A controller's side, in its own process: the study opened for writing and locked, trial 0
# committed, then a write transaction left open (trial 0's reason changed, not committed)
# until the test says "commit"; the process exits (closing the study) at the end of its input.
WRITER = textwrap.dedent("""
    import sys
    from autotune.core.space import TrialConfig
    from autotune.study.store import Study

    s = Study.open(sys.argv[1], create=True, meta={"budget": 3, "user_command": %r})
    t = s.start_trial(0, TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4), "baseline", "")
    s.finish_trial(t, status="ok", samples_per_second=10.0, failure_reason=None, failure_detail=None,
                   summary=None, rules_fired=[], wall_seconds=1.0)
    s._db.execute("BEGIN IMMEDIATE")
    s._db.execute("UPDATE trials SET reason = 'changed' WHERE number = 0")
    print("holding", flush=True)
    sys.stdin.readline()
    s._db.commit()
    print("committed", flush=True)
    sys.stdin.readline()
    s.close()
""") % (JOB,)


def test_a_study_is_read_read_only_while_a_live_controller_holds_it(tmp_path):
    root = tmp_path / "st"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "holding"
        with pytest.raises(StudyError, match="in use by another autotune run"):
            Study.open(root, create=False)  # the controller's lock is real
        started = time.monotonic()
        ro = open_study_readonly(root)
        try:
            # the committed trial is there; the open transaction's change is not, and nothing waited for it
            assert [(t.number, t.status, t.reason) for t in ro.trials()] == [(0, "ok", "")]
            assert time.monotonic() - started < 10  # far below the 30 s lock timeout
            results = read_results(ro)
            assert results.best.number == 0 and results.speedup == 1.0 and len(results.counted) == 1
            with pytest.raises(sqlite3.OperationalError, match="readonly"):
                ro._db.execute("DELETE FROM trials")
            # what a new run reads before it opens the study: the same opener, the held study
            assert stored_budget(root) == 3 and json.loads(stored_meta(root, META_KEY)) == JOB
            assert stored_job(root).argv == JOB["argv"]
            writer.stdin.write("commit\n")
            writer.stdin.flush()
            assert writer.stdout.readline().strip() == "committed"
            assert [t.reason for t in ro.trials()] == ["changed"]  # the WAL's commit is seen at once
        finally:
            ro.close()
    finally:
        writer.stdin.close()
        assert writer.wait(timeout=60) == 0
    ro = open_study_readonly(root)
    assert ro.trials()[0].reason == "changed"  # and after the controller closed it
    ro.close()


def test_stored_meta_reads_an_older_study_that_the_full_reader_refuses(tmp_path):
    # a study written before `master_port` existed: a resume still finds its budget and command
    # (Study.open then adds the column); the report's reader refuses it, as it did before
    s = Study.open(tmp_path / "st", create=True, meta={"budget": 5, META_KEY: JOB})
    s.close()
    db = sqlite3.connect(tmp_path / "st" / "study.db")
    db.execute("ALTER TABLE trials DROP COLUMN master_port")
    db.commit()
    db.close()
    assert stored_budget(tmp_path / "st") == 5 and stored_job(tmp_path / "st").argv == JOB["argv"]
    with pytest.raises(StudyError, match="master_port"):
        open_study_readonly(tmp_path / "st")
    assert stored_meta(tmp_path / "nothing", "budget") is None


def test_the_typed_results_are_summary_json_report_md_and_the_page(tmp_path):
    pytest.importorskip("numpy")
    from autotune.report_html.gather import gather_study

    root = full_study(tmp_path / "st")
    with _writer(root) as s:
        written = read_results(s)
        write_outputs(s, written, None)
    ro = open_study_readonly(root)
    try:
        results = read_results(ro)
        page = gather_study(ro)
    finally:
        ro.close()
    assert results == written and page.results == results
    assert results.to_dict() == json.loads((root / "summary.json").read_text())
    assert (root / "report.md").read_text() == render_markdown(results)
    rows = {t.number: t for t in results.trials}
    # the best: trials 3 and 4 ran one configuration; it is judged by their mean
    assert results.best.number == 4 and results.best.repeats == 2
    assert results.best.samples_per_second == fmean([rows[3].samples_per_second, rows[4].samples_per_second])
    assert results.speedup == results.best.samples_per_second / rows[0].samples_per_second
    assert [t.number for t in results.failed] == [2] and results.to_dict()["failed_trials"] == 1


def _results(root):
    ro = open_study_readonly(root)
    try:
        return read_results(ro)
    finally:
        ro.close()


class _writer:
    def __init__(self, root):
        self.study = Study.open(root, create=False)

    def __enter__(self):
        return self.study

    def __exit__(self, *exc):
        self.study.close()


def test_an_empty_study_has_no_baseline_best_or_speedup(tmp_path):
    new_study(tmp_path / "st").close()
    r = _results(tmp_path / "st")
    assert (r.trials, r.counted, r.baseline, r.best, r.speedup) == ((), (), None, None, None)
    d = r.to_dict()
    assert (d["counted_trials"], d["failed_trials"], d["baseline"], d["best"]) == (0, 0, None, None)
    assert "Best:" not in render_markdown(r) and "Baseline" not in render_markdown(r)


def test_no_successful_trial_has_no_best_and_no_speedup(tmp_path):
    s = new_study(tmp_path / "st")
    failed_trial(s, 0, CFGS[0], "oom")
    failed_trial(s, 1, CFGS[1], "hang")
    s.close()
    r = _results(tmp_path / "st")
    assert r.best is None and r.speedup is None and r.ok == []
    assert r.baseline.number == 0 and r.baseline.status == "failed"
    assert [t.failure_reason for t in r.failed] == ["oom", "hang"] and r.to_dict()["failed_trials"] == 2
    text = render_markdown(r)
    assert "Best:" not in text and "Speed-up" not in text and "| 1 | bayes |" in text


def test_a_failed_baseline_gives_a_best_but_no_speedup(tmp_path):
    s = new_study(tmp_path / "st")
    failed_trial(s, 0, CFGS[0], "oom")
    ok_trial(s, 1, CFGS[1], 30.0, csvs=False)
    s.close()
    r = _results(tmp_path / "st")
    assert r.baseline.status == "failed" and r.best.number == 1 and r.speedup is None
    assert r.to_dict()["speedup_over_baseline"] is None and r.to_dict()["baseline"]["failure_reason"] == "oom"
    text = render_markdown(r)
    assert "Best: trial 1" in text and "Baseline (trial 0)" not in text and "Speed-up" not in text


def test_an_interrupted_baseline_is_no_baseline_until_it_ran_again(tmp_path):
    s = new_study(tmp_path / "st")
    s.start_trial(0, CFGS[0], "baseline", "")
    s.interrupt_running()
    ok_trial(s, 1, CFGS[1], 30.0, csvs=False)
    s.close()
    r = _results(tmp_path / "st")
    assert r.baseline is None and r.best.number == 1 and r.speedup is None
    assert [t.number for t in r.counted] == [1] and len(r.trials) == 2
    with _writer(tmp_path / "st") as s:
        ok_trial(s, 0, CFGS[0], 20.0, csvs=False)  # the resume runs it again: it counts once
    r = _results(tmp_path / "st")
    assert r.baseline.status == "ok" and sorted(t.number for t in r.counted) == [0, 1]
    assert r.speedup == r.best.samples_per_second / r.baseline.samples_per_second
