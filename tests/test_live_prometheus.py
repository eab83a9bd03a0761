"""A real Prometheus scrapes real exporters; every dashboard query and rule must return data.

Feed: in-process exporters fed with synthetic StepRecords for two jobs, one shaped like
a GPU run (memory fields present) and one like a CPU run (memory "not available").
On the CPU job the memory panels and the fragmentation alert must return *no* data
(absent, never a made-up 0); everything else must return data with the expected labels.
The lead's DeepSpeed integration test can reuse `prom_helpers.prometheus_server` and
`check_dashboard_and_rules` with a real training job as the feed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dashboard_checks import check_dashboard_and_rules
from prom_helpers import ALERTS, Feed, Prom, prometheus_server, wait_for_history

pytestmark = pytest.mark.prometheus


@pytest.fixture(scope="module")
def live() -> Iterator[Prom]:
    feed = Feed()
    try:
        with prometheus_server(feed.targets, rule_files=[ALERTS]) as prom:
            wait_for_history(prom, seconds=6)
            yield prom
    finally:
        feed.close()


def test_gpu_like_job_every_query_and_rule_returns_data(live: Prom):
    check_dashboard_and_rules(live, "live-gpu", cpu=False)


def test_cpu_like_job_memory_is_absent_everything_else_present(live: Prom):
    check_dashboard_and_rules(live, "live-cpu", cpu=True)


def test_stage_imbalance_recording_rule_value(live: Prom):
    """Synthetic stage 1 computes 0.2 s, stage 0 0.1 s: max/mean = 0.2/0.15."""
    got = live.query('job_trial:autotune_stage_compute_imbalance:ratio{job="live-gpu"}')
    assert float(got[0]["value"][1]) == pytest.approx(0.2 / 0.15)
