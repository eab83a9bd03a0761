"""What the run and `advise` print is text, not Rich markup.

A gloo error's detail carries its source path in brackets ("[/__w/pytorch/pytorch/third_party/
gloo/gloo/transport/tcp/pair.cc:553]"); printed as markup it raised MarkupError as a closing
tag and ended `autotune run` with a traceback. A partition proposal holds a regular
expression (`type:[Dd]ecoder`) that markup would have swallowed."""

from __future__ import annotations

import io

from rich.console import Console

from autotune.advisor.findings import Change, Evidence, Finding
from autotune.advisor.render import print_table
from autotune.core.space import TrialConfig
from autotune.tuning.display import ProgressDisplay

GLOO = "Connection closed by peer [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"


def test_a_note_with_a_closing_tag_prints_as_it_is():
    out = io.StringIO()
    display = ProgressDisplay(console=Console(file=out, width=200), budget=3)
    display.note(f"      failed (crash): {GLOO}; log kept in trial-001/launcher.log :smile:")
    display.trial_row(1, TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4), "explore[/x]",
                      "failed", None, "crash", False)
    text = out.getvalue()
    assert GLOO in text and ":smile:" in text and "explore[/x]" in text


def test_the_advice_table_prints_brackets_as_they_are(capsys):
    finding = Finding(rule_id="stage-imbalance", title="stage 1 [bold]slowest[/bold]", severity="warning",
                      status="fired", subject="trial 0 [stage 1]", trial=0,
                      evidence=[Evidence(signal="stage_work_imbalance", measured=1.4, op=">", threshold=1.1)],
                      changes=[Change(kind="advice", target="partition_method", current="parameters",
                                      new="type:[Dd]ecoder")],
                      expected_impact=0.2, explanation="")
    print_table([finding], title="advice", notes=[GLOO])
    text = capsys.readouterr().out
    assert "type:[Dd]ecoder" in text and "[bold]slowest[/bold]" in text and "pair.cc:553]" in text
