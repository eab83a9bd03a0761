"""What to do about an unbalanced pipeline: the changes of `stage-imbalance` and `bottleneck-device`.

The partition is a model-level setting (`PipelineModule(partition_method=...)` in the
user's code), not a ds_config key, so these changes are advice: they name the method
to try, how much work to move off the bottleneck stage and, where per-layer cost files
lie beside the metrics, the parts `autotune.core.partition` proposes, or the `type:` regex over
the model's own layer classes that builds them. Where the layers are not known, they say
what to run to learn them, never a placeholder.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from autotune.advisor.findings import Change
from autotune.advisor.rulebook import Move
from autotune.advisor.signals import SignalSet

BUILTIN_METHODS = ("parameters", "uniform")
DEEPSPEED_DEFAULT_METHOD = "parameters"
NOT_A_CONFIG_KEY = "a PipelineModule(partition_method=...) argument in your model code, not a ds_config key"
LAYER_COST_GLOB = "layer-costs-rank*.csv"  # autotune.rank.layer_costs.FILE_GLOB (that module imports the probe's timer)
"""Per-layer forward/backward times, one file per rank, beside the metrics CSVs."""
ENGINE_MARKER_GLOB = "engine-rank*.json"  # autotune.rank.hook.marker_path(trial_dir, "engine", rank)
"""What the bootstrap read from a user's engine, beside a trial's metrics: `layers` holds the class
of every layer of the PipelineModule, as DeepSpeed's `type:` method reads it."""
MEASURE = "autotune run --balance-stages -- deepspeed ... (the job's own command)"
"""What measures the layers' classes and costs of a job and computes its partition."""


SPLIT_BY_SCRIPT = ("a torch.distributed.pipelining script splits its model itself (the submodule of each "
                   "PipelineStage it builds, or pipeline()'s split points): move layers there; it has no "
                   "PipelineModule partition_method")


def bottleneck_change(move: Move, s: SignalSet, raw: dict[str, Any] | None) -> Change | None:
    if split_by_script(s):  # no PipelineModule: only the move of work between its stages applies
        change = rebalance_stage(s) if move.compute == "rebalance_stage" else None
        return dataclasses.replace(change, note=f"{change.note}; {SPLIT_BY_SCRIPT}") if change else None
    if move.compute == "other_partition_method":
        return other_partition_method(s, raw)
    if move.compute == "rebalance_stage":
        return rebalance_stage(s)
    if move.compute == "type_partition":
        return type_partition(s, raw)
    return measured_parts(s)


def current_method(s: SignalSet, raw: dict[str, Any] | None) -> tuple[str | None, str]:
    """The method the run used and where that is known from (trial.json, or the config's
    ignored `pipeline.partition_method`, which says what the user meant)."""
    if s.partition_method:
        return s.partition_method, "as the trial's model was built"
    pipe = raw.get("pipeline") if isinstance(raw, dict) else None
    if isinstance(pipe, dict) and isinstance(pipe.get("partition_method"), str):
        return pipe["partition_method"], "the config's pipeline.partition_method, which DeepSpeed ignores"
    return None, ""


def other_partition_method(s: SignalSet, raw: dict[str, Any] | None) -> Change | None:
    """DeepSpeed's other built-in method; where the layers' measured costs are beside the
    metrics, the method they say balances the stages instead of a guess (a `type:` regex, or
    "keep"), or nothing where only a parts list does (the measured-parts move names it)."""
    if _layers(s)[0] is not None:
        typed = type_partition(s, raw)
        return typed if typed is not None and typed.target == "PipelineModule:partition_method" else None
    cur, where = current_method(s, raw)
    stale = ""
    if cur == "parameters" or cur is None:
        new = "uniform"
    elif cur.startswith("parts:"):  # explicit boundaries (autotune's own partition) still unbalanced
        new = "uniform"
        stale = "; the explicit parts were computed from costs this run no longer matches: measure the layer costs again"
    else:
        new = "parameters"  # from uniform or type:REGEX, the other built-in balance
    known = f"now {cur} ({where})" if cur else f"the run's method is not recorded (DeepSpeed's default: {DEEPSPEED_DEFAULT_METHOD})"
    note = f"{NOT_A_CONFIG_KEY}; {known}; {type_note(s)}; re-measure after the change{stale}"
    return Change(kind="advice", target="PipelineModule:partition_method", current=cur, new=new, note=note)


def bottleneck(s: SignalSet) -> tuple[int | None, str, float] | None:
    """(stage, device, compute ratio vs. the mean stage) of the subject's bottleneck, if it has one.
    The device is set where the ratio is inferred from utilization, not timed."""
    imb = s.get("stage_compute_imbalance")
    if imb is not None and imb > 1:
        rv = next(iter(s.per_rank.get("stage_compute_imbalance", [])), None)
        return (rv.stage if rv else None), "", imb
    lead = s.get("device_utilization_lead")
    hits = s.per_rank.get("device_utilization_lead", [])
    if lead is None or lead <= 1 or not hits:
        return None
    n = int(s.get("pipeline_stages") or len(s.per_rank.get("device_utilization_mean", [])) or 2)
    # busiest = lead x the others' mean; the mean stage = (lead + n - 1) / n x the others' mean
    return hits[0].stage, hits[0].device, n * lead / (lead + n - 1)


def rebalance_stage(s: SignalSet) -> Change | None:
    found = bottleneck(s)
    if found is None:
        return None
    stage, device, ratio = found
    share = 1 - 1 / ratio
    p = s.get("pipeline_stages")
    if stage is not None:
        target = f"pipeline stage {stage}"
        nbrs = [x for x in (stage - 1, stage + 1) if x >= 0 and (p is None or x < p)]
        to = f" to stage {' or '.join(map(str, nbrs))}" if nbrs else ""
    else:
        target = f"the stage on {device}"
        to = " to its neighbour stages"
    if not device:
        note = f"it computes {ratio:.2f}x the mean stage; moving that much brings it to the mean"
    else:
        per = "" if stage is not None else "; assuming one device per stage, pass --stages N to name the stage"
        note = (f"its utilization suggests about {ratio:.2f}x the mean stage's work{per}; "
                "a metrics CSV (instrument()) measures it")
    return Change(kind="advice", target=target, current=None,
                  new=f"move about {share:.0%} of its layers' forward+backward time{to}", note=note)


def layer_cost_files(s: SignalSet) -> list[Path]:
    folders = dict.fromkeys(Path(p).parent for p in s.sources)
    return sorted(f for d in folders for f in d.glob(LAYER_COST_GLOB))


def measured_parts(s: SignalSet) -> Change | None:
    """The parts `autotune.core.partition` computes from the per-layer cost files beside the metrics.

    None where there are no such files, or where the measured partition is already the best.
    No memory limit applies here (advise does not know the device's size): `autotune run`
    checks the parts against memory when it tries them.
    """
    lc = _layers(s)[0]
    if lc is None:
        return None
    files = layer_cost_files(s)
    from autotune.core.errors import InputFileError, UserError
    from autotune.core.partition import balanced_parts, describe_moves, imbalance, stage_times

    try:
        new = balanced_parts(lc.costs, lc.stages, stage_fixed=lc.stage_fixed_seconds)
    except (UserError, ValueError) as exc:
        raise InputFileError(f"layer costs beside the metrics ({files[0].parent}): {exc}; "
                             "move them away to advise without them") from None
    if new == lc.parts:
        return None
    old_t = stage_times(lc.costs, lc.parts, lc.stage_fixed_seconds)
    new_t = stage_times(lc.costs, new, lc.stage_fixed_seconds)
    moved = describe_moves(lc.parts, new, lc.names)
    note = (f"from measured layer costs ({len(files)} layer-costs file(s)): slowest stage "
            f"{max(old_t):.3g} s -> {max(new_t):.3g} s, imbalance {imbalance(old_t):.2f} -> "
            f"{imbalance(new_t):.2f}; {moved}; DeepSpeed's methods cannot take a parts list: "
            "autotune run tries it, or use the nearest type:/uniform setting")
    return Change(kind="advice", target="PipelineModule parts", current=list(lc.parts), new=new, note=note)


def split_by_script(s: SignalSet) -> bool:
    """The metrics are a torch.distributed.pipelining script's: the bootstrap's engine marker beside
    them says so (autotune/rank/hook.py `schedule_built`)."""
    folders = dict.fromkeys(Path(p).parent for p in s.sources)
    markers = sorted(f for d in folders for f in d.glob(ENGINE_MARKER_GLOB))
    return _torch_markers(tuple((str(f), _mtime(f)) for f in markers))


@functools.lru_cache(maxsize=16)
def _torch_markers(files: tuple[tuple[str, int], ...]) -> bool:
    import json

    for f, _ in files:
        try:
            if json.loads(Path(f).read_text(encoding="utf-8")).get("torch_pipelining") is True:
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


# -- type:REGEX over the model's own layer classes -------------------------------------------------

def _layers(s: SignalSet) -> tuple[Any, list[str] | None]:
    """(the layer costs beside the metrics or None, the layers' classes or None): the costs name
    the classes too; without them the bootstrap's engine markers may (a user's command). Read
    once per set of files: every partition move of every finding asks."""
    folders = dict.fromkeys(Path(p).parent for p in s.sources)
    files = sorted(f for d in folders for f in (*d.glob(LAYER_COST_GLOB), *d.glob(ENGINE_MARKER_GLOB)))
    return _read_layers(tuple((str(f), _mtime(f)) for f in files))


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return -1


@functools.lru_cache(maxsize=16)
def _read_layers(files: tuple[tuple[str, int], ...]) -> tuple[Any, list[str] | None]:
    costs = [Path(f) for f, _ in files if Path(f).match(LAYER_COST_GLOB)]
    if costs:
        return _read_costs(costs), None
    import json

    for f in (Path(f) for f, _ in files if Path(f).match(ENGINE_MARKER_GLOB)):
        try:
            layers = json.loads(f.read_text(encoding="utf-8")).get("layers")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(layers, list) and layers and all(isinstance(x, str) for x in layers):
            return None, layers
    return None, None


def _read_costs(files: list[Path]) -> Any:
    from autotune.core.errors import InputFileError, UserError
    from autotune.rank.layer_costs import read_layer_costs

    try:
        return read_layer_costs(files)
    except (UserError, OSError, ValueError, KeyError) as exc:
        raise InputFileError(f"layer costs beside the metrics ({files[0].parent}): {exc}; "
                             "move them away to advise without them") from None


def _classes(names: list[str]) -> str:
    return ", ".join(dict.fromkeys(names))


def _typed(lc: Any) -> tuple[list[int], tuple[str, list[int]] | None, bool]:
    """(the balanced parts, the best type: method over the layers' classes, whether it is
    predicted within 2 % of the balanced parts' slowest stage)."""
    from autotune.core.partition import balanced_parts, best_type_method, stage_times

    fixed = lc.stage_fixed_seconds
    best = balanced_parts(lc.costs, lc.stages, stage_fixed=fixed)
    typed = best_type_method(lc.names, lc.costs, lc.stages, fixed)
    good = typed is not None and (max(stage_times(lc.costs, typed[1], fixed))
                                  <= max(stage_times(lc.costs, best, fixed)) * (1 + TYPE_TOLERANCE))
    return best, typed, good


TYPE_TOLERANCE = 0.02
"""A type: method is named when its parts are predicted within this of the balanced parts'
slowest stage (autotune.tuning.balance.builtin_equivalent's tolerance)."""
NO_GAIN = 0.05
"""Where the balanced parts are predicted no more than this faster than the measured partition,
no partition is proposed (autotune.core.noise.NOISE_MARGIN x autotune.tuning.balance.GAIN_OF_NOISE, the gain a
round needs)."""


def _no_gain(lc: Any, best: list[int], lead: str) -> str | None:
    """The no-gain line where the measured partition is about as good as any (else None)."""
    from autotune.core.partition import no_gain_text, stage_times

    fixed = lc.stage_fixed_seconds
    if max(stage_times(lc.costs, lc.parts, fixed)) > max(stage_times(lc.costs, best, fixed)) * (1 + NO_GAIN):
        return None
    return no_gain_text(lc.names, lc.costs, lc.parts, best, fixed, margin=NO_GAIN, lead=lead,
                        keep="keep the partition you have")


def type_note(s: SignalSet) -> str:
    """What a `type:REGEX` method would do for this job, from what the input knows of its layers."""
    names = _layers(s)[1]  # with layer costs, other_partition_method names the partition itself
    if names is not None:
        return (f"type:REGEX balances the count of layers of the classes it finds (this model's: "
                f"{_classes(names)}); which regex balances the work needs the layers' costs: "
                "autotune run measures them in its baseline (--layer-costs: in every trial)")
    return f"a type:REGEX method balances the count of layers of the classes it finds: {MEASURE} measures the layers' classes and costs and names the partition"


def type_partition(s: SignalSet, raw: dict[str, Any] | None) -> Change | None:
    """The partition to balance the stages by, where `partition_method` is named by layer type:
    the `type:` regex over the model's own classes that the measured layer costs say balances
    it, else the balanced parts; without layer costs, what to run to learn them. None where the
    measured costs say the stages are already balanced (the bubble comes from elsewhere)."""
    from autotune.core.partition import imbalance, stage_times

    cur, where = current_method(s, raw)
    lc, names = _layers(s)
    if lc is not None:
        best, typed, good = _typed(lc)
        fixed = lc.stage_fixed_seconds
        now = imbalance(stage_times(lc.costs, lc.parts, fixed))
        stuck = _no_gain(lc, best, "no partition helps")
        if stuck:
            return Change(kind="advice", target="PipelineModule:partition_method", current=cur,
                          new="keep the partition you have", note=stuck)
        if typed is not None and good:
            pred = imbalance(stage_times(lc.costs, typed[1], fixed))
            return Change(kind="advice", target="PipelineModule:partition_method", current=cur, new=typed[0],
                          note=f"{NOT_A_CONFIG_KEY}; over the model's own layer classes ({_classes(lc.names)}): "
                               f"builds {typed[1]}, predicted work imbalance {now:.2f} -> {pred:.2f} "
                               "(from the measured layer costs)")
        pred = imbalance(stage_times(lc.costs, best, fixed))
        near = f" (the best, '{typed[0]}', builds {typed[1]})" if typed is not None else ""
        return Change(kind="advice", target="PipelineModule parts", current=list(lc.parts), new=best,
                      note=f"no type: regex over the model's layer classes ({_classes(lc.names)}) balances it"
                           f"{near}; the measured layer costs balance as these parts, predicted work imbalance "
                           f"{now:.2f} -> {pred:.2f}: PARTS in the PipelineModule subclass of docs/partition.md; "
                           "autotune run --balance-stages measures them against the job's own partition")
    if names is not None:
        return Change(kind="advice", target="PipelineModule:partition_method", current=cur,
                      new="autotune run on this job first (it measures them in its baseline; --layer-costs: in every trial)",
                      note=f"{NOT_A_CONFIG_KEY}; type:REGEX balances the count of layers of the classes it "
                           f"finds (this model's: {_classes(names)}); the layers' measured costs say which "
                           "regex, if any, balances the work")
    known = f"now {cur} ({where}); " if cur else ""
    return Change(kind="advice", target="PipelineModule:partition_method", current=cur,
                  new=f"measure the layers first: {MEASURE}",
                  note=f"{NOT_A_CONFIG_KEY}; {known}it learns the model's layer classes and costs and names a "
                       "type:REGEX over those classes where one balances the stages, else the balanced parts")
