"""The rank endpoint renders once per content version, not once per scrape (real HTTP)."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from exporters.endpoint import serve_registry


class Counting:
    """A collector that counts how often it is rendered and exports `value`."""

    def __init__(self) -> None:
        self.renders = 0
        self.value = 0.0
        self.version = 0

    def collect(self):
        self.renders += 1
        yield GaugeMetricFamily("autotune_test_value", "test", value=self.value)

    def set(self, value: float) -> None:
        self.value = value
        self.version += 1


def serve(interval: float, *, versioned: bool = True):
    reg, c = CollectorRegistry(), Counting()
    reg.register(c)
    c.renders = 0  # register() may collect once to check names
    ep = serve_registry(reg, addr="127.0.0.1", port=0, version=(lambda: c.version) if versioned else None,
                        min_render_interval=interval)
    return ep, c


def get(url: str, accept: str | None = None) -> tuple[str, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.headers["Content-Type"], r.read().decode()


def test_unchanged_content_is_rendered_once_however_many_scrapes():
    ep, c = serve(0.0)
    try:
        bodies = {get(ep.url)[1] for _ in range(20)}
        assert c.renders == 1 and len(bodies) == 1
        c.set(7)
        assert "autotune_test_value 7.0" in get(ep.url)[1]  # a new version renders at once
        assert c.renders == 2
    finally:
        ep.close()


def test_fast_changes_are_rendered_at_most_once_per_interval():
    ep, c = serve(0.5)
    try:
        c.set(1)
        assert "autotune_test_value 1.0" in get(ep.url)[1]
        c.set(2)
        assert "autotune_test_value 1.0" in get(ep.url)[1]  # within the interval: the last rendering
        assert c.renders == 1
        time.sleep(0.55)
        assert "autotune_test_value 2.0" in get(ep.url)[1]
        assert c.renders == 2
    finally:
        ep.close()


def test_openmetrics_and_text_are_kept_apart():
    ep, c = serve(10.0)
    try:
        text_type, text = get(ep.url)
        om_type, om = get(ep.url, accept="application/openmetrics-text; version=1.0.0")
        assert text_type.startswith("text/plain") and om_type.startswith("application/openmetrics-text")
        assert om.rstrip().endswith("# EOF") and "# EOF" not in text
        assert c.renders == 2
    finally:
        ep.close()


def test_without_a_version_every_scrape_renders():
    ep, c = serve(10.0, versioned=False)
    try:
        for _ in range(3):
            get(ep.url)
        assert c.renders == 3
    finally:
        ep.close()
