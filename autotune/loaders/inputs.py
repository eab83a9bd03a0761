"""What `autotune advise` was pointed at: files, globs and folders, grouped into jobs.

- A file is read as it is. A glob (quoted, for shells that do not expand it) is expanded
  here, sorted; one that matches nothing is an error.
- A folder holding `metrics-rank*.csv` is one job (a study's `trial-NNN/` folder, or the
  folder `instrument(csv_path="out/metrics-rank{rank}.csv")` wrote into).
- A study folder (its `trial-*/` folders hold `metrics-rank*.csv`) is one job per trial folder.
- A folder of torch.profiler traces (`*.json`, `*.json.gz`, as `tensorboard_trace_handler`
  writes them, a study trial's `traces/`) is one job: its traces are the job's ranks.
- Any other folder: every CSV in it (per-node nvidia-smi logs, say), each on its own.

Our metrics CSVs of one folder are one job's per-rank files: they are merged, and each
trial in them is one subject, so stage imbalance across ranks is seen. Files of different
folders are different jobs, even with the same trial number. Two files of one folder that
hold the same rank of the same trial are not one job: each is then a subject of its own.
Device logs and Prometheus exports are a subject per file. Formats do not mix.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autotune.core.errors import InputFileError, UserError
from autotune.loaders.detect import METRICS, NVIDIA_SMI, TRACE, detect_format
from autotune.traces.reader import is_trace_path

RANK_CSV = "metrics-rank*.csv"
TRIAL_DIR = re.compile(r"^trial-(\d+)$")
NOT_INPUTS = re.compile(r"^layer-costs-rank\d+\.csv$")
"""CSV files beside the metrics that are read by the advice itself, not as inputs."""
FORMAT_NAMES = {METRICS: "an autotune metrics CSV", NVIDIA_SMI: "an nvidia-smi log",
                "prometheus": "a Prometheus export", TRACE: "a torch.profiler trace"}
GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True, slots=True)
class InputGroup:
    """Files advised together as one job (one subject per trial they hold)."""

    name: str
    """How the job is named: its file, "FIRST + N more", or its folder."""
    paths: tuple[Path, ...]
    format: str
    study_trial: int | None = None
    """The number of a study's `trial-NNN/` folder these files came from."""
    partition_method: str | None = None
    """What the trial's trial.json says the PipelineModule was partitioned with."""


@dataclass(frozen=True, slots=True)
class _Found:
    path: Path
    folder: Path | None
    """The folder argument (or study trial folder) the file was found in, if any."""
    study_trial: int | None = None


def resolve_inputs(args: Sequence[str]) -> list[InputGroup]:
    """The arguments as jobs; one-line UserError for anything that cannot be advised."""
    if not args:
        raise UserError("give a metrics file, several files, a glob or a folder to advise")
    found: list[_Found] = []
    for arg in args:
        found.extend(_expand(arg))
    _refuse_duplicates(found)
    formats = {f.path: detect_format(f.path) for f in found}
    kinds = dict.fromkeys(formats.values())
    if len(kinds) > 1:
        a, b = (next(p for p, k in formats.items() if k == kind) for kind in list(kinds)[:2])
        raise UserError(f"mixed inputs: {a} is {FORMAT_NAMES[formats[a]]}, {b} is {FORMAT_NAMES[formats[b]]}; "
                        "advise each format on its own")
    fmt = next(iter(kinds))
    if fmt == TRACE:
        return _trace_jobs(found)
    if fmt != METRICS:
        return [InputGroup(name=f.path.name, paths=(f.path,), format=fmt) for f in found]
    return _metrics_jobs(found)


def _expand(arg: str) -> list[_Found]:
    p = Path(arg)
    if p.is_dir():
        return _folder(p)
    if p.exists():
        return [_file(p)]
    if GLOB_CHARS.search(arg):
        matches = sorted(glob.glob(arg), key=_natural)
        if not matches:
            raise UserError(f"{arg}: the pattern matches no file")
        out: list[_Found] = []
        for m in matches:
            out.extend(_folder(Path(m)) if Path(m).is_dir() else [_file(Path(m))])
        return out
    raise InputFileError(f"{arg}: no such file or folder")


def _file(p: Path) -> _Found:
    """A file named on its own; inside a study's trial-NNN/ folder it is still that trial's."""
    m = TRIAL_DIR.match(p.resolve().parent.name)
    return _Found(p, None, int(m.group(1)) if m else None)


def _folder(d: Path) -> list[_Found]:
    try:
        entries = sorted(d.iterdir(), key=lambda e: _natural(e.name))
    except OSError as exc:
        raise InputFileError(f"{d}: cannot list the folder ({exc.strerror or exc})") from None
    ranks = [e for e in entries if e.is_file() and e.match(RANK_CSV)]
    if ranks:
        m = TRIAL_DIR.match(d.resolve().name)
        return [_Found(e, d, int(m.group(1)) if m else None) for e in ranks]
    trials = [e for e in entries if e.is_dir() and TRIAL_DIR.match(e.name)]
    study = [_Found(f, t, int(TRIAL_DIR.match(t.name).group(1)))  # type: ignore[union-attr]
             for t in trials for f in sorted(t.glob(RANK_CSV), key=lambda e: _natural(e.name))]
    if study:
        return study
    if trials:
        raise InputFileError(f"{d}: a study folder without trial metrics yet (no trial-*/{RANK_CSV})")
    traces = [e for e in entries if e.is_file() and is_trace_path(e.name)]
    if traces:  # torch.profiler's tensorboard_trace_handler folder: one job's per-rank traces
        return [_Found(e, d) for e in traces]
    csvs = [e for e in entries if e.is_file() and e.suffix.lower() == ".csv" and not NOT_INPUTS.match(e.name)]
    if csvs:
        return [_Found(e, None) for e in csvs]
    raise InputFileError(f"{d}: an empty folder" if not entries else
                         f"{d}: no {RANK_CSV}, no study trial folders, no trace and no CSV file in the folder")


def _refuse_duplicates(found: list[_Found]) -> None:
    seen: dict[str, Path] = {}
    for f in found:
        key = os.path.realpath(f.path)
        if key in seen:
            same = "" if str(seen[key]) == str(f.path) else f" (also as {seen[key]})"
            raise UserError(f"{f.path} is given twice{same}; name each file once")
        seen[key] = f.path


def _metrics_jobs(found: list[_Found]) -> list[InputGroup]:
    """Metrics files grouped by folder (see the module docstring)."""
    by_folder: dict[Path, list[_Found]] = {}
    for f in found:
        by_folder.setdefault(f.folder or f.path.parent, []).append(f)
    groups = []
    for folder, files in by_folder.items():
        paths = tuple(f.path for f in files)
        trial = files[0].study_trial if all(f.study_trial == files[0].study_trial for f in files) else None
        if files[0].folder is not None:
            name = str(folder).rstrip("/") if trial is None else f"trial-{trial:03d}"
        else:
            name = paths[0].name if len(paths) == 1 else f"{paths[0].name} + {len(paths) - 1} more"
        groups.append(InputGroup(name=name, paths=paths, format=METRICS, study_trial=trial,
                                 partition_method=_partition_method(folder) if trial is not None else None))
    return groups


def _trace_jobs(found: list[_Found]) -> list[InputGroup]:
    """Traces grouped by folder: the per-rank traces of one job lie in one folder (what
    tensorboard_trace_handler writes); files of different folders are different jobs."""
    by_folder: dict[Path, list[Path]] = {}
    for f in found:
        by_folder.setdefault(f.folder or f.path.parent, []).append(f.path)
    groups = []
    for folder, paths in by_folder.items():
        trial = TRIAL_DIR.match(folder.resolve().parent.name) if folder.name == "traces" else None
        name = (f"trial-{int(trial.group(1)):03d}" if trial else paths[0].name if len(paths) == 1
                else str(folder).rstrip("/"))
        groups.append(InputGroup(name=name, paths=tuple(paths), format=TRACE,
                                 study_trial=int(trial.group(1)) if trial else None))
    return groups


def _partition_method(trial_dir: Path) -> str | None:
    """The partition method of a trial: the built-in workload's from trial.json, a user script's
    from what its PipelineModule was built with (the hook's engine marker); None where neither says."""
    try:
        spec = json.loads((trial_dir / "trial.json").read_text(encoding="utf-8"))
        method = spec["workload"]["partition_method"]
    except (OSError, ValueError, KeyError, TypeError):
        try:
            method = json.loads((trial_dir / "engine-rank0.json").read_text(encoding="utf-8"))["partition_method"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return method if isinstance(method, str) else None


def _natural(name: str) -> list[object]:
    """metrics-rank2 before metrics-rank10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
