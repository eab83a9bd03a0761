"""A run's live metrics, on by default: the controller endpoint, the ranks' ports and the
Prometheus targets file that lists them all (`autotune run` and `autotune watch`).

    endpoints = start_run_endpoints(job="autotune", addr="127.0.0.1", controller_port=9700,
                                    rank_port=9710, world_size=2, folder=study.root,
                                    trial_dir=study.trial_dir, note=print)
    endpoints.trial_started(3, config)    # the tuning loop's exporter hooks, forwarded
    endpoints.trial_finished(3, config, "ok", 41.2)
    endpoints.close()

`trial_started` also starts listing trial 3's rank endpoints in FOLDER/prometheus_targets.json
as the ranks record them (exporters/file_sd.py); `trial_finished` drops them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from autotune.core.space import TrialConfig
from exporters.file_sd import (
    RANK_ENDPOINT,
    TARGETS_FILE,
    LiveTargets,
    ScrapeTarget,
    scrape_config,
    target_host,
)
from exporters.prometheus_controller import DEFAULT_CONTROLLER_PORT, ControllerExporter
from exporters.prometheus_rank import DEFAULT_RANK_BASE_PORT

__all__ = ["DEFAULT_CONTROLLER_PORT", "DEFAULT_RANK_BASE_PORT", "RunEndpoints", "start_run_endpoints"]


class RunEndpoints:
    """The tuning loop's `exporter` (trial_started, trial_finished), plus the targets file."""

    def __init__(self, controller: Any | None, targets: LiveTargets,
                 trial_dir: Callable[[int], Path] | None = None) -> None:
        self.controller, self.targets, self.trial_dir = controller, targets, trial_dir

    @property
    def url(self) -> str | None:
        endpoint = getattr(self.controller, "endpoint", None)
        return endpoint.url if endpoint is not None else None

    def trial_started(self, trial: int, config: TrialConfig) -> None:
        if self.controller is not None:
            self.controller.trial_started(trial, config)
        if self.trial_dir is not None:
            self.watch_folder(self.trial_dir(trial))

    def watch_folder(self, folder: Path) -> None:
        """List the rank endpoints recorded in `folder` from now on; an earlier attempt's go first."""
        folder = Path(folder).resolve()
        for old in folder.glob(RANK_ENDPOINT.replace("{rank}", "*")):
            old.unlink(missing_ok=True)
        self.targets.watch(folder, since=time.time() - 1.0)

    def trial_finished(self, trial: int, config: TrialConfig, status: str, samples_per_second: float,
                       summary: Any = None, rules_fired: Iterable[str] = ()) -> None:
        if self.controller is not None:
            self.controller.trial_finished(trial, config, status, samples_per_second, summary, rules_fired)
        if self.trial_dir is not None:
            self.targets.unwatch(Path(self.trial_dir(trial)).resolve())

    def close(self) -> None:
        self.targets.close()
        close = getattr(self.controller, "close", None)
        if close is not None:
            close()


def start_run_endpoints(*, job: str, addr: str, controller_port: int | None, rank_port: int | None,
                        world_size: int | None, folder: Path, trial_dir: Callable[[int], Path] | None = None,
                        note: Callable[[str], None] = print, controller: Any | None = None) -> RunEndpoints:
    """Serve the controller (ControllerExporter unless `controller` is given: any collector with
    `serve(addr=, port=)` and `endpoint`), start the targets file in `folder`, say where all is."""
    fixed = []
    if controller_port is not None:
        controller = controller if controller is not None else ControllerExporter(job=job)
        controller.serve(addr=addr, port=controller_port)  # prints its URL, or warns and goes on
        if controller.endpoint is not None:
            fixed.append(ScrapeTarget(host=target_host(addr), port=controller.endpoint.port,
                                      labels={"job": job}))
    else:
        controller = None
    path = Path(folder) / TARGETS_FILE
    targets = LiveTargets(path, fixed)
    if rank_port is not None:
        if world_size is None:  # not known before the job starts (autotune watch)
            span = f"({rank_port} + local rank)"
        else:
            span = f"{rank_port}..{rank_port + world_size - 1}" if world_size > 1 else str(rank_port)
        note(f"rank metrics: http://{addr}:{span}/metrics while the ranks run (a taken port falls back; "
             f"the ports each rank bound are listed in {path})")
    note("Prometheus: scrape them all through the targets file, e.g. in prometheus.yml:\n"
         + scrape_config([path]).rstrip())
    return RunEndpoints(controller, targets, trial_dir)
