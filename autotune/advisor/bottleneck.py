"""What to do about an unbalanced pipeline: the changes of `stage-imbalance` and `bottleneck-device`.

The partition is a model-level setting (`PipelineModule(partition_method=...)` in the
user's code), not a ds_config key, so these changes are advice: they name the method
to try, how much work to move off the bottleneck stage and, where per-layer cost files
lie beside the metrics, the parts `autotune.partition` proposes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.advisor.findings import Change
from autotune.advisor.rulebook import Move
from autotune.advisor.signals import SignalSet

BUILTIN_METHODS = ("parameters", "uniform")
DEEPSPEED_DEFAULT_METHOD = "parameters"
NOT_A_CONFIG_KEY = "a PipelineModule(partition_method=...) argument in your model code, not a ds_config key"
LAYER_COST_GLOB = "layer-costs-rank*.csv"  # autotune.layer_costs.FILE_GLOB (that module imports the probe's timer)
"""Per-layer forward/backward times, one file per rank, beside the metrics CSVs."""


def bottleneck_change(move: Move, s: SignalSet, raw: dict[str, Any] | None) -> Change | None:
    if move.compute == "other_partition_method":
        return other_partition_method(s, raw)
    if move.compute == "rebalance_stage":
        return rebalance_stage(s)
    return measured_parts(s)


def current_method(s: SignalSet, raw: dict[str, Any] | None) -> tuple[str | None, str]:
    """The method the run used and where that is known from (trial.json, or the config's
    ignored `pipeline.partition_method`, which says what the user meant)."""
    if s.partition_method:
        return s.partition_method, "the trial's trial.json"
    pipe = raw.get("pipeline") if isinstance(raw, dict) else None
    if isinstance(pipe, dict) and isinstance(pipe.get("partition_method"), str):
        return pipe["partition_method"], "the config's pipeline.partition_method, which DeepSpeed ignores"
    return None, ""


def other_partition_method(s: SignalSet, raw: dict[str, Any] | None) -> Change:
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
    note = f"{NOT_A_CONFIG_KEY}; {known}; or type:<your block class>; re-measure after the change{stale}"
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
    """The parts `autotune.partition` computes from the per-layer cost files beside the metrics.

    None where there are no such files, or where the measured partition is already the best.
    No memory limit applies here (advise does not know the device's size): `autotune run`
    checks the parts against memory when it tries them.
    """
    files = layer_cost_files(s)
    if not files:
        return None
    from autotune.errors import InputFileError, UserError
    from autotune.layer_costs import read_layer_costs
    from autotune.partition import balanced_parts, describe_moves, imbalance, stage_times

    try:
        lc = read_layer_costs(files)
        new = balanced_parts(lc.costs, lc.stages, stage_fixed=lc.stage_fixed_seconds)
    except (UserError, OSError, ValueError, KeyError) as exc:
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
