"""A trial's kind (autotune/core/trial_kind.py): typed from the proposal to the study's row and
back, stored and shown as its label."""

from __future__ import annotations

import json

from autotune.core.space import TrialConfig
from autotune.core.trial_kind import (
    BASELINE,
    CHECKPOINT,
    PARTITION_RECHECK,
    REMEASURE,
    Step,
    TrialKind,
)
from autotune.study.store import Study
from autotune.tuning.proposers.base import Proposal


def test_every_kind_says_its_step_and_reads_as_its_label():
    assert [TrialKind.of(x).step for x in ("baseline", "partition-recheck", "checkpoint", "knob:layers=4", "bayes",
                                           "rule:a+rule:b")] == \
        [Step.BASELINE, Step.PARTITION, Step.CHECKPOINT, Step.KNOB, Step.SEARCH, Step.SEARCH]
    assert TrialKind.knob("layers", "4").knob_setting == ("layers", "4") and BASELINE.knob_setting is None
    assert BASELINE.measured_in_full and REMEASURE.measured_in_full and not TrialKind.of("bayes").measured_in_full
    assert PARTITION_RECHECK.hooked and not CHECKPOINT.hooked
    assert BASELINE == "baseline" and json.dumps({"source": BASELINE}) == '{"source": "baseline"}'
    assert type(BASELINE.label) is str and f"{TrialKind.rule('x')}" == "rule:x"


def test_a_proposals_kind_is_the_studys_rows_kind(tmp_path):
    """Text given as a source is made a kind; the store keeps the label and reads a kind back."""
    proposal = Proposal(config=TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4), source="knob:layers=4")
    assert isinstance(proposal.source, TrialKind) and proposal.kind.step is Step.KNOB
    study = Study.open(tmp_path / "st", create=True)
    try:
        study.start_trial(0, proposal.config, proposal.source, proposal.reason)
        [row] = study.trials()
    finally:
        study.close()
    assert isinstance(row.source, TrialKind) and row.source == "knob:layers=4" and row.source.step is Step.KNOB
