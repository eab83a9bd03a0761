"""Input loaders for `autotune advise`: the format is detected from the header.

Each loader returns subjects the rule engine understands: named SignalSets (our
metrics CSV through its TrialSummaries, which are kept for the HTML page; device
logs and Prometheus exports carry fewer signals, and the missing ones are
reported, not invented). `autotune.loaders.inputs` turns files, globs and folders
into jobs; each trial of a job is one subject.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from autotune.advisor.signals import SignalSet, from_summary
from autotune.core.errors import InputFileError
from autotune.core.summary import TrialSummary
from autotune.loaders.detect import METRICS, NVIDIA_SMI, PROMETHEUS, TRACE, detect_format
from autotune.loaders.inputs import InputGroup, resolve_inputs


@dataclass(kw_only=True, slots=True)
class LoadedInput:
    format: str
    subjects: list[TrialSummary | SignalSet]
    """What the rule engine evaluates, one per trial of each job (or per device log)."""
    notes: list[str] = field(default_factory=list)
    """Things the user should know about this input (e.g. which signals it cannot carry)."""
    summaries: list[TrialSummary] = field(default_factory=list)
    """Our metrics CSV's trial summaries (the HTML page's headline figures)."""
    groups: list[InputGroup] = field(default_factory=list)
    """The jobs the inputs were grouped into (files, their name)."""
    layout: tuple[int, int] | None = None
    """(stages, world size) where the input knows them but not the batch (a trace): with
    `--config`, the config's micro-batch and GAS get their layout from it."""

    @property
    def sources(self) -> list[Path]:
        return [p for g in self.groups for p in g.paths]


def load_input(path: str | Path) -> LoadedInput:
    """One file (kept for callers that have one)."""
    return load_inputs([str(path)])


def load_inputs(args: Sequence[str], *, stages: int | None = None) -> LoadedInput:
    """Files, globs and folders as one input of one format; `stages` maps a device log's devices."""
    groups = resolve_inputs(args)
    fmt = groups[0].format
    if fmt == METRICS:
        groups, notes = _split_overlapping(groups)
        subjects, summaries = [], []
        for g in groups:
            for s in _summaries(g):
                summaries.append(s)
                subjects.append(replace(from_summary(s, subject=_subject_name(g, s.trial)),
                                        partition_method=g.partition_method,
                                        sources=tuple(str(p) for p in g.paths)))
        notes += [n for s in summaries if (n := _missing_ranks(s))]
        notes += [n for s in summaries if (n := _old_schema(s))]
        return LoadedInput(format=fmt, subjects=_unique(subjects, groups), notes=list(dict.fromkeys(notes)),
                           summaries=summaries, groups=groups)
    if fmt == TRACE:
        return _load_traces(groups)
    if fmt == NVIDIA_SMI:
        from autotune.loaders.nvidia_smi import NOTE, load_nvidia_smi

        sets = [replace(load_nvidia_smi(g.paths[0], stages=stages), sources=(str(g.paths[0]),)) for g in groups]
        return LoadedInput(format=fmt, subjects=list(sets), notes=[NOTE], groups=groups)
    assert fmt == PROMETHEUS
    from autotune.loaders.prometheus import NOTE as PROM_NOTE
    from autotune.loaders.prometheus import load_prometheus

    subjects = []
    for g in groups:
        for s in load_prometheus(g.paths[0]):
            subjects.append(replace(s, subject=f"{s.subject} ({g.name})") if len(groups) > 1 else s)
    return LoadedInput(format=fmt, subjects=subjects, notes=[PROM_NOTE], groups=groups)


def _load_traces(groups: list[InputGroup]) -> LoadedInput:
    """Each job's traces as one subject (autotune/loaders/trace.py); a study trial's traces
    read its micro-batch, GAS and bucket from the trial's ds_config.json."""
    from autotune.core.dsconfig import load_ds_config
    from autotune.loaders.trace import read_job_traces, trace_signals, trial_config_beside

    subjects: list[TrialSummary | SignalSet] = []
    notes: list[str] = []
    layout = None
    for g in groups:
        traces = read_job_traces(g.paths)
        micro = gas = bucket = None
        if (cfg_path := trial_config_beside(g.paths)) is not None:
            cfg = load_ds_config(cfg_path)
            micro, gas, bucket = cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.reduce_bucket_size
        s, n = trace_signals(traces, name=g.name, micro=micro, gas=gas, bucket=bucket, trial=g.study_trial)
        subjects.append(s)
        notes += n
        stages, world = s.get("pipeline_stages"), traces[0].world_size
        if stages and world:
            layout = (int(stages), world)
    return LoadedInput(format=TRACE, subjects=subjects, notes=list(dict.fromkeys(notes)), groups=groups,
                       layout=layout)


def _summaries(g: InputGroup) -> list[TrialSummary]:
    from autotune.core.summary import summarize_columns
    from autotune.loaders.metrics import read_columns, read_trial_columns

    source = str(g.paths[0]) if len(g.paths) == 1 else g.name
    cols = read_columns(g.paths[0]) if len(g.paths) == 1 else read_trial_columns(list(g.paths))  # no copy for one
    out = summarize_columns(cols, source=source)
    if not out:
        raise InputFileError(f"{source}: no measured (non-warm-up) step in the file"
                             + ("s" if len(g.paths) > 1 else ""))
    return out


def _split_overlapping(groups: list[InputGroup]) -> tuple[list[InputGroup], list[str]]:
    """A folder's files that hold the same rank of the same trial are not one job's: split them."""
    from autotune.loaders.metrics import read_columns

    out, notes = [], []
    for g in groups:
        if len(g.paths) == 1:
            out.append(g)
            continue
        keys = []
        for p in g.paths:
            c = read_columns(p)
            keys.append(set(zip(c["trial"].astype(np.int64).tolist(), c["rank"].astype(np.int64).tolist(),
                                strict=True)))
        clash = next(((a, b) for i, a in enumerate(keys) for b in keys[i + 1:] if a & b), None)
        if clash is None:
            out.append(g)
            continue
        i, j = keys.index(clash[0]), keys.index(clash[1])
        trial, rank = sorted(clash[0] & clash[1])[0]
        notes.append(f"{g.paths[i].name} and {g.paths[j].name} both hold rank {rank}"
                     f"{'' if trial < 0 else f' of trial {trial}'}: not one job's per-rank files, "
                     "so each file of that folder is advised on its own")
        out.extend(replace(g, name=p.name, paths=(p,)) for p in g.paths)
    return out, notes


OLD_SCHEMA_NOTE = ("written with metrics schema 1 (before autotune split waiting from transfer): "
                   "comm_seconds holds every send's whole time, its wait for the peer stage included, "
                   "and wait_seconds every receive's, so comm/compute over-states the transfer; "
                   "re-measure for schema 2")


def _old_schema(s: TrialSummary) -> str:
    """Say which definitions an older CSV was written with (docs/metrics.md, schema versions)."""
    if s.metrics_schema is None or s.metrics_schema >= 2:
        return ""
    return f"trial {s.trial}: {OLD_SCHEMA_NOTE}" if s.trial >= 0 else OLD_SCHEMA_NOTE


def _missing_ranks(s: TrialSummary) -> str:
    """Say so when a job's files hold fewer ranks than its layout has (imbalance is then unseen)."""
    world = s.pipeline_stages * s.data_parallel_size
    if len(s.ranks) >= world:
        return ""
    stages = {r.stage for r in s.ranks}
    seen = f"{len(s.ranks)} of {world} ranks ({s.pipeline_stages} stages x dp {s.data_parallel_size})"
    of_trial = f" of trial {s.trial}" if s.trial >= 0 else ""
    unseen = "; stage imbalance needs every stage" if len(stages) < s.pipeline_stages else ""
    return (f"the input holds {seen}{of_trial}{unseen}: give every rank's file (several files, "
            "a quoted glob such as 'run/metrics-rank*.csv', or their folder)")


def _subject_name(g: InputGroup, trial: int) -> str:
    """A study's trial is "trial N"; a run outside a study (trial -1) is named by its files."""
    if trial >= 0 and trial == g.study_trial:
        return f"trial {trial}"
    if trial < 0:
        return g.name
    return f"trial {trial} ({g.name})"


def _unique(subjects: list[SignalSet], groups: list[InputGroup]) -> list[TrialSummary | SignalSet]:
    """Subjects of different jobs that would read the same ("trial 3" of two studies) name their folder."""
    names = [s.subject for s in subjects]
    out: list[TrialSummary | SignalSet] = []
    by_source = {p: g for g in groups for p in g.paths}
    for s, subj in zip(subjects, names, strict=True):
        g = next((by_source[Path(p)] for p in s.sources if Path(p) in by_source), None)
        if names.count(subj) > 1 and g is not None:
            subj = f"{subj} ({g.paths[0].parent})"
        out.append(replace(s, subject=subj))
    return out


__all__ = ["LoadedInput", "detect_format", "load_input", "load_inputs"]
