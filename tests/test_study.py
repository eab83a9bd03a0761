import sqlite3

import pytest

from autotune.core.errors import StudyError
from autotune.core.fileio import write_atomic
from autotune.core.space import TrialConfig
from autotune.study.store import Study

CFG = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4, reduce_bucket_size=10**5)


def test_trials_roundtrip_and_best(tmp_path):
    s = Study.open(tmp_path / "st", create=True, meta={"budget": 3})
    a = s.start_trial(0, CFG, "baseline", "")
    s.finish_trial(a, status="ok", samples_per_second=10.0, failure_reason=None, failure_detail=None,
                   summary={"x": 1}, rules_fired=["r1"], wall_seconds=2.0)
    b = s.start_trial(1, CFG, "bayes", "why")
    s.finish_trial(b, status="failed", samples_per_second=None, failure_reason="oom",
                   failure_detail="boom", summary=None, rules_fired=[], wall_seconds=1.0)
    rows = s.trials()
    assert [(r.number, r.status, r.failure_reason) for r in rows] == [(0, "ok", None), (1, "failed", "oom")]
    assert rows[0].config == CFG and rows[0].rules_fired == ["r1"]
    assert s.best().number == 0 and len(s.counted()) == 2
    assert s.get_meta_json("budget") == 3
    s.close()
    # WAL mode: the database stays consistent for a second reader
    assert sqlite3.connect(tmp_path / "st" / "study.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_running_trials_become_interrupted(tmp_path):
    s = Study.open(tmp_path / "st", create=True)
    s.start_trial(0, CFG, "baseline", "")
    left = s.interrupt_running()
    assert [t.number for t in left] == [0]
    assert s.trials()[0].status == "interrupted" and s.counted() == []


def test_refuses_folders_that_are_not_studies(tmp_path):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "precious.txt").write_text("keep")
    with pytest.raises(StudyError, match="not an autotune study"):
        Study.open(tmp_path / "stuff", create=True)
    assert (tmp_path / "stuff" / "precious.txt").read_text() == "keep"
    (tmp_path / "f").write_text("x")
    with pytest.raises(StudyError, match="not a folder"):
        Study.open(tmp_path / "f", create=True)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "study.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StudyError, match="SQLite"):
        Study.open(bad, create=False)


def test_other_format_version_refused(tmp_path):
    s = Study.open(tmp_path / "st", create=True)
    with s._db:
        s._db.execute("UPDATE meta SET value='99' WHERE key='format'")
    s.close()
    with pytest.raises(StudyError, match="format 99"):
        Study.open(tmp_path / "st", create=False)


def test_write_atomic_replaces_whole_file(tmp_path):
    p = tmp_path / "a.json"
    write_atomic(p, "old")
    write_atomic(p, "new")
    assert p.read_text() == "new"
    assert [x.name for x in tmp_path.iterdir()] == ["a.json"]


def test_best_is_judged_by_the_mean_of_repeated_measurements(tmp_path):
    s = Study.open(tmp_path / "st", create=True)
    other = TrialConfig(micro_batch_size=4, gradient_accumulation_steps=2, reduce_bucket_size=10**5)
    for n, (cfg, sps) in enumerate([(CFG, 12.0), (other, 10.0), (CFG, 6.0)]):
        i = s.start_trial(n, cfg, "bayes", "")
        s.finish_trial(i, status="ok", samples_per_second=sps, failure_reason=None, failure_detail=None,
                       summary=None, rules_fired=[], wall_seconds=1.0)
    best = s.best()
    # CFG's lucky 12.0 averages to 9.0 with its re-measurement: `other` (10.0) is the better config
    assert best.config == other and best.samples_per_second == 10.0 and best.repeats == 1
    i = s.start_trial(3, other, "remeasure", "")
    s.finish_trial(i, status="ok", samples_per_second=6.0, failure_reason=None, failure_detail=None,
                   summary=None, rules_fired=[], wall_seconds=1.0)
    best = s.best()
    assert best.config == CFG and best.samples_per_second == 9.0 and best.repeats == 2 and best.number == 2


def test_launch_facts_survive_and_older_studies_gain_the_column(tmp_path):
    s = Study.open(tmp_path / "st", create=True)
    t = s.start_trial(0, CFG, "baseline", "")
    s.set_launch(t, 4321, 29517)
    s.close()
    # a study written before master_port existed: drop the column as an older autotune had it
    db = sqlite3.connect(tmp_path / "st" / "study.db")
    db.execute("ALTER TABLE trials DROP COLUMN master_port")
    db.commit()
    db.close()
    s = Study.open(tmp_path / "st", create=False)
    row = s.trials()[0]
    assert (row.pgid, row.master_port) == (4321, None)
    s.set_launch(row.id, 4321, 29518)
    assert s.trials()[0].master_port == 29518
    s.close()
