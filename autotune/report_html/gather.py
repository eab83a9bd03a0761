"""Everything the HTML report shows, gathered from a study or a metrics file, read-only.

Nothing here draws or writes. A study folder is opened read-only by
`autotune.study.store.open_study_readonly` (a folder that is not a valid study, or a study
of another format, is refused with one line before anything is touched); its trials,
baseline, best and speed-up are `autotune.study.results`'s, as summary.json's are.
Per-step data comes from each trial's `metrics-rank*.csv` through the project's own
readers; what cannot be read becomes a sentence in `missing`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.core.errors import InputFileError
from autotune.core.space import TrialConfig
from autotune.core.summary import TrialSummary, ideal_bubble_fraction
from autotune.study.results import StudyResults, read_results
from autotune.study.store import STATUS_INTERRUPTED, STATUS_OK, STATUS_RUNNING, Study, TrialRow

KNOB_LABELS = {
    "micro_batch_size": "micro-batch size",
    "gradient_accumulation_steps": "gradient accumulation steps",
    "reduce_bucket_size": "reduce_bucket_size (elements)",
    "activation_checkpoint_interval": "activation checkpoint interval (layers)",
}


@dataclass(kw_only=True, slots=True)
class RankSteps:
    """One rank's measured steps (warm-up excluded), in step order."""

    rank: int
    stage: int
    device: str
    step: list[int]
    utilization: list[float]
    step_seconds: list[float]
    compute_seconds: list[float]
    comm_seconds: list[float]
    wait_seconds: list[float]
    data_seconds: list[float]
    from_device: bool = False
    """Utilization is the device's own counter (NVML), not the busy fraction."""


@dataclass(kw_only=True, slots=True)
class StageSplit:
    """Mean seconds per step of one pipeline stage (over its ranks and measured steps)."""

    stage: int
    step: float
    compute: float
    communication: float
    waiting: float
    data: float
    ideal_bubble: float
    """(p-1)/(m+p-1) of the stage's step time: the idle time 1F1B cannot avoid."""

    @property
    def other(self) -> float:
        return max(0.0, self.step - self.compute - self.communication - self.waiting - self.data)


@dataclass(kw_only=True, slots=True)
class StepData:
    """A trial's per-step data: what the split and utilization figures draw."""

    trial: int
    ranks: list[RankSteps]
    stages: list[StageSplit]


@dataclass(kw_only=True, slots=True)
class TrialTraces:
    """One trial's profiler traces (trial-NNN/traces/, one file per rank)."""

    number: int
    kind: str
    files: list[Path]


@dataclass
class StudyReport:
    root: Path
    settings: dict[str, Any]
    space: dict[str, Any]
    workload: dict[str, Any]
    results: StudyResults
    """The trials, the counted ones, the baseline, the best and the speed-up (autotune/study/results.py)."""
    measurements: dict[tuple, list[float]]
    """Configuration key -> samples/s of every successful trial of it."""
    knobs: list[str]
    """TrialConfig fields the study varied (or searched)."""
    steps: dict[int, StepData]
    """Per-step data of the baseline and the best trial, where their CSVs could be read."""
    findings: list[Any]
    """The advisor's fired findings on the best trial's summary."""
    config_diff: list[str]
    """Unified diff of the best trial's ds_config.json against the baseline's."""
    missing: list[str] = field(default_factory=list)
    """What the page cannot show, in words."""
    user_command: dict[str, Any] = field(default_factory=dict)
    """The user's command and what its start-up check read (autotune/usercmd/job.py); empty: built-in."""
    held_out: list[Any] = field(default_factory=list)
    """The performance model's prediction of each trial from the others (autotune/model/validation.py)."""
    traces: list[TrialTraces] = field(default_factory=list)
    """The torch.profiler traces the study's trials recorded (`--trace-steps`)."""

    @property
    def trials(self) -> tuple[TrialRow, ...]:
        """Every row, interrupted attempts included, in the order they started."""
        return self.results.trials

    @property
    def counted(self) -> tuple[TrialRow, ...]:
        """Finished trials (ok or failed), one per number: what the budget counts."""
        return self.results.counted

    @property
    def baseline(self) -> TrialRow | None:
        return self.results.baseline

    @property
    def best(self) -> TrialRow | None:
        """The best configuration's latest trial; samples_per_second is its mean, `repeats` its count."""
        return self.results.best

    @property
    def ok(self) -> list[TrialRow]:
        return self.results.ok

    @property
    def interrupted(self) -> list[TrialRow]:
        return [t for t in self.trials if t.status in (STATUS_INTERRUPTED, STATUS_RUNNING)]

    @property
    def speedup(self) -> float | None:
        return self.results.speedup


@dataclass(kw_only=True, slots=True)
class MetricsReport:
    """`advise --html`: the files `advise` read (one, or several jobs)."""

    source: Path
    format: str
    summaries: list[TrialSummary]
    steps: dict[int, StepData]
    findings: list[Any]
    insufficient: list[Any]
    notes: list[str]
    missing: list[str] = field(default_factory=list)
    device_utilization: dict[str, list[float]] = field(default_factory=dict)
    """An nvidia-smi log's per-GPU utilization samples (0-1), in file order."""
    label: str = ""
    """The name of several inputs ("FIRST + N more"); empty for one file (its name is used)."""
    names: list[str] = field(default_factory=list)
    """Each summary's subject name as `advise` prints it ("trial 3", "run"); empty: by trial number."""


# -- a study -----------------------------------------------------------------------
def gather_study(study: Study) -> StudyReport:
    """Read everything the page shows; never raises for missing trial files."""
    results = read_results(study, meta=lambda key: _meta_value(study, key))
    trials, baseline, best = list(results.trials), results.baseline, results.best
    measurements: dict[tuple, list[float]] = {}
    from autotune.core.measurements import superseded

    stale = superseded(trials)  # partition and knob trials share a measured key (autotune/core/measurements.py)
    for t in trials:
        if t.status == STATUS_OK and t.samples_per_second and t.number not in stale:
            measurements.setdefault(t.config.key(), []).append(t.samples_per_second)
    space = _meta(study, "space")
    from autotune.study.job_record import META_KEY

    report = StudyReport(
        root=study.root, settings=_meta(study, "settings"), space=space,
        workload=_meta(study, "workload"), results=results, measurements=measurements,
        knobs=_knobs(trials, space), steps={}, findings=[], config_diff=[], user_command=_meta(study, META_KEY),
    )
    _explain_missing(report)
    wanted = [t for t in (baseline, best) if t is not None and t.status == STATUS_OK]
    for t in wanted:
        if t.number in report.steps:
            continue
        data, problem = _trial_steps(study.trial_dir(t.number), t.number)
        if data is not None:
            report.steps[t.number] = data
        else:
            report.missing.append(problem)
    report.held_out, problem = _held_out(study.root)
    if problem:
        report.missing.append(problem)
    report.traces = _traces(study.root, trials)
    traced = {t.number for t in report.traces}
    traced_keys = {t.config.key() for t in trials if t.number in traced}
    if int(report.settings.get("trace_steps") or 0) and best is not None and best.config.key() not in traced_keys:
        report.missing.append("no trace of the best configuration: it was not run again after it became the "
                              "best (the trace step records the baseline and the best's re-measurement)")
    if best is not None:
        report.findings, problem = _findings(best)
        if problem:
            report.missing.append(problem)
        report.config_diff, problem = _config_diff(study, baseline, best)
        if problem:
            report.missing.append(problem)
    return report


def _traces(root: Path, trials: list[TrialRow]) -> list[TrialTraces]:
    from autotune.rank.trace_recorder import traces_dir
    from autotune.traces.reader import is_trace_path

    out = []
    for number in sorted({t.number for t in trials}):
        folder = traces_dir(root / f"trial-{number:03d}")
        files = sorted(p for p in folder.glob("*") if is_trace_path(p.name)) if folder.is_dir() else []
        if files:
            kind = next(t.source for t in trials if t.number == number)
            out.append(TrialTraces(number=number, kind=kind, files=files))
    return out


def _held_out(root: Path) -> tuple[list[Any], str]:
    """Each trial as the model calibrated on the others predicts it; a reason where it cannot."""
    from autotune.core.errors import AutotuneError
    from autotune.model.study_model import model_of_study
    from autotune.model.validation import MIN_TRIALS, held_out

    try:
        model = model_of_study(root)
    except AutotuneError:
        return [], ""
    if len(model.observations) < MIN_TRIALS:
        return [], (f"predicted against measured: the performance model needs {MIN_TRIALS} finished trials to "
                    f"predict each from the others ({len(model.observations)} here)")
    return held_out(model), ""


def _meta_value(study: Study, key: str) -> Any:
    """A stored value; None where it is damaged (the page says what it can, never a traceback)."""
    try:
        return study.get_meta_json(key)
    except ValueError:
        return None


def _meta(study: Study, key: str) -> dict[str, Any]:
    value = _meta_value(study, key)
    return value if isinstance(value, dict) else {}


def _knobs(trials: list[TrialRow], space: dict[str, Any]) -> list[str]:
    names = [f.name for f in dataclasses.fields(TrialConfig)]
    out = []
    for name in names:
        values = {getattr(t.config, name) for t in trials}
        # the checkpoint interval is set by the checkpoint step, not searched: shown once it varies
        searched = (name == "reduce_bucket_size" and space.get("bucket_range") is not None
                    or name in ("micro_batch_size", "gradient_accumulation_steps"))
        if len(values - {None}) > 1 or (searched and values - {None}):
            out.append(name)
    return out


def _explain_missing(r: StudyReport) -> None:
    if not r.trials:
        r.missing.append("No trial has started in this study yet: there is nothing to draw.")
        return
    if not r.counted:
        r.missing.append("No trial has finished yet (only interrupted or running ones): "
                         "there is no throughput to draw.")
    elif not r.ok:
        reasons = sorted({t.failure_reason or "unknown" for t in r.counted})
        r.missing.append(f"Every finished trial failed ({', '.join(reasons)}): there is no throughput, "
                         "time split or utilization to draw; the trial table gives each failure.")
    elif len(r.ok) == 1:
        r.missing.append("Only one trial succeeded: the convergence and knob figures need at least "
                         "two successful trials to compare.")
    if r.counted and (r.baseline is None or r.baseline.status != STATUS_OK):
        why = "did not finish" if r.baseline is None else f"failed ({r.baseline.failure_reason})"
        r.missing.append(f"The baseline (trial 0) {why}: there is no reference, so no gain is given.")
    if r.interrupted:
        nums = sorted({t.number for t in r.interrupted})
        rerun = [n for n in nums if any(c.number == n for c in r.counted)]
        open_ = [n for n in nums if n not in rerun]
        text = f"Resumed study: {len(r.interrupted)} interrupted attempt(s) of trial(s) {_nums(nums)}"
        if rerun:
            text += f"; {_nums(rerun)} ran again and count once"
        if open_:
            text += f"; {_nums(open_)} not run again yet (resume the study to finish them)"
        r.missing.append(text + ".")
    budget = r.settings.get("budget")
    if isinstance(budget, int) and r.counted and len(r.counted) < budget:
        r.missing.append(f"The study has {len(r.counted)} of its {budget} budgeted trials: "
                         "it was stopped early or is still running.")


def _nums(nums: list[int]) -> str:
    return ", ".join(str(n) for n in nums)


def _trial_steps(trial_dir: Path, number: int) -> tuple[StepData | None, str]:
    from autotune.loaders.metrics import read_text_columns, read_trial_columns

    files = sorted(trial_dir.glob("metrics-rank*.csv"))
    rel = f"{trial_dir.name}/metrics-rank*.csv"
    if not files:
        return None, (f"Trial {number}'s per-rank metrics ({rel}) are missing: its time split and "
                      "utilization over the steps cannot be drawn (its stored summary is still used).")
    try:  # the one reader, as the trial's judge and `advise` read these files
        cols = read_trial_columns(files)
        devices = read_text_columns(files[0], ["device"]).get("device") or [""]
    except (InputFileError, OSError) as exc:
        return None, f"Trial {number}'s per-rank metrics cannot be read ({exc}): no time split or utilization for it."
    data = steps_from_columns(cols, number, device=devices[0])
    if data is None:
        return None, f"Trial {number}'s per-rank metrics ({rel}) hold no measured step."
    return data, ""


def steps_from_columns(cols: dict[str, Any], trial: int, *, device: str = "") -> StepData | None:
    """One trial's per-rank steps from the columnar reader of `autotune.loaders.metrics`."""
    import numpy as np

    sel = (cols["trial"] == trial) & (cols["warmup"] == 0)
    if not sel.any():
        return None
    c = {k: v[sel] for k, v in cols.items()}
    ranks = []
    for rank in np.unique(c["rank"]):
        m = c["rank"] == rank
        order = np.argsort(c["step"][m], kind="stable")

        def col(name: str, m=m, order=order) -> list[float]:
            return [float(x) for x in np.nan_to_num(c[name][m][order])] if name in c else [0.0] * int(m.sum())

        ranks.append(RankSteps(
            rank=int(rank), stage=int(c["stage"][m][0]), device=device, step=[int(s) for s in col("step")],
            utilization=col("device_utilization"), step_seconds=col("step_seconds"),
            compute_seconds=col("compute_seconds"), comm_seconds=col("comm_seconds"),
            wait_seconds=col("wait_seconds"), data_seconds=col("data_seconds"),
            from_device=bool("utilization_from_device" in c and (c["utilization_from_device"][m] == 1).any())))
    return StepData(trial=trial, ranks=ranks, stages=_stage_split(
        ranks, int(c["pipeline_stages"][0]), int(c["gradient_accumulation_steps"][0])))


def _stage_split(ranks: list[RankSteps], stages: int, gas: int) -> list[StageSplit]:
    ideal = ideal_bubble_fraction(max(1, stages), max(1, gas))
    out = []
    for stage in sorted({r.stage for r in ranks}):
        rs = [r for r in ranks if r.stage == stage]

        def mean(name: str, rs: list[RankSteps] = rs) -> float:
            return statistics.fmean(v for r in rs for v in getattr(r, name))

        step = mean("step_seconds")
        out.append(StageSplit(stage=stage, step=step, compute=mean("compute_seconds"),
                              communication=mean("comm_seconds"), waiting=mean("wait_seconds"),
                              data=mean("data_seconds"), ideal_bubble=ideal * step))
    return out


def _findings(best: TrialRow) -> tuple[list[Any], str]:
    if not best.summary:
        return [], f"Trial {best.number} has no stored summary: the rules cannot be evaluated on it."
    try:
        from autotune.advisor import evaluate

        summary = TrialSummary.from_dict(best.summary)
        return [f for f in evaluate([summary]) if f.fired], ""
    except (TypeError, ValueError, KeyError, InputFileError) as exc:
        return [], f"The rules could not be evaluated on trial {best.number}'s summary ({exc})."


def _config_diff(study: Study, baseline: TrialRow | None, best: TrialRow) -> tuple[list[str], str]:
    if baseline is None:
        return [], "No baseline trial: the best configuration cannot be compared with the starting one."
    if baseline.number == best.number or baseline.config == best.config:
        return [], ""
    a, b = study.trial_dir(baseline.number) / "ds_config.json", study.trial_dir(best.number) / "ds_config.json"
    texts = []
    for p in (a, b):
        try:
            texts.append(json.dumps(json.loads(p.read_text(encoding="utf-8")), indent=2, sort_keys=True))
        except (OSError, ValueError):
            return [], (f"{p.parent.name}/ds_config.json is missing or unreadable: the configuration "
                        "diff is given as knob values only.")
    return list(difflib.unified_diff(texts[0].splitlines(), texts[1].splitlines(),
                                     fromfile=f"trial {baseline.number} (baseline) ds_config.json",
                                     tofile=f"trial {best.number} (best) ds_config.json", lineterm="", n=1)), ""


# -- a metrics file (advise --html) ----------------------------------------------------
def gather_metrics(path: str | Path, findings: list[Any], fmt: str, notes: list[str],
                   subjects: list[Any], groups: list[Any] | None = None,
                   names: list[str] | None = None) -> MetricsReport:
    """The page's data for input `advise` already loaded and evaluated: the file `path`, or the
    jobs of a multi-file `advise` (`groups`: `autotune.loaders.inputs.InputGroup`s)."""
    from autotune.loaders.detect import METRICS, NVIDIA_SMI

    path = Path(path)
    jobs = [(g.name, list(g.paths)) for g in groups] if groups else [(path.name, [path])]
    files = [p for _, ps in jobs for p in ps]
    summaries = [s for s in subjects if isinstance(s, TrialSummary)]
    report = MetricsReport(source=path, format=fmt, summaries=summaries, steps={},
                           findings=[f for f in findings if f.fired],
                           insufficient=[f for f in findings if not f.fired], notes=list(notes),
                           label="" if len(files) == 1 else f"{files[0].name} + {len(files) - 1} more",
                           names=list(names or []))
    if fmt == NVIDIA_SMI:
        from autotune.loaders.nvidia_smi import utilization_series

        for f in files:
            for gpu, series in utilization_series(f).items():
                report.device_utilization[gpu if len(files) == 1 else f"{f.name}:{gpu}"] = series
        report.missing.append("An nvidia-smi log carries no per-step timing: the step split is drawn for "
                              "autotune metrics CSVs only; utilization is drawn per device over its samples.")
        return report
    if fmt != METRICS:
        report.missing.append(f"A {fmt} file carries no per-step, per-rank timing: utilization over the "
                              "steps and the step split are drawn for autotune metrics CSVs only.")
        return report
    import numpy as np

    from autotune.loaders.metrics import read_trial_columns

    for name, paths in jobs:
        cols = read_trial_columns(paths)
        for trial in sorted({int(t) for t in np.unique(cols["trial"])}):
            if trial in report.steps:  # figures are keyed by trial: another job's trial of that number
                report.missing.append(f"Figures of {name} (trial {trial}) are not drawn: another input "
                                      "already holds that trial number; advise it on its own to see them.")
                continue
            data = steps_from_columns(cols, trial)
            if data is not None:
                report.steps[trial] = data
    return report
