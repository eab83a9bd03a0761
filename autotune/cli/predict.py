"""`autotune predict STUDY` and `autotune plan STUDY`: the calibrated model of a study. Parse and call."""

from __future__ import annotations

import click

_FORMAT = click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
                       help="Output format.")


@click.command("predict")
@click.argument("study", type=click.Path())
@click.option("--micro", type=click.IntRange(min=1), help="Micro-batch size [default: the study's best trial's].")
@click.option("--gas", type=click.IntRange(min=1),
              help="Gradient accumulation steps [default: the study's global batch over micro x dp].")
@click.option("--bucket", type=float, help="reduce_bucket_size in elements [default: the best trial's].")
@click.option("--parts", help="Layer boundaries, e.g. 0,3,6 (or parts:0,3,6) [default: the study's partition].")
@click.option("--checkpoint-interval", type=click.IntRange(min=0),
              help="pipeline.activation_checkpoint_interval (0: off) [default: 0].")
@click.option("--stages", type=click.IntRange(min=1), help="Pipeline stages [default: the study's].")
@click.option("--dp", type=click.IntRange(min=1), help="Data-parallel degree [default: the study's].")
@click.option("--zero-stage", type=click.IntRange(0, 3),
              help="zero_optimization.stage, for a plain-engine (ZeRO) study [default: the best trial's].")
@click.option("--config", type=click.Path(),
              help="Take micro, GAS, bucket, checkpointing (and a plain engine's ZeRO stage) from a ds_config.json.")
@_FORMAT
def predict_command(study: str, micro: int | None, gas: int | None, bucket: float | None, parts: str | None,
                    checkpoint_interval: int | None, stages: int | None, dp: int | None, zero_stage: int | None,
                    config: str | None, fmt: str) -> None:
    """Predict samples/s, the step by term, the bubble and each stage's peak memory of a
    configuration STUDY has not run, from the model calibrated on STUDY's trials (docs/model.md)."""
    from autotune.model.render import leave_one_out, prediction_dict, prediction_text, to_json
    from autotune.model.step_model import predict
    from autotune.model.study_model import layout_from, model_of_study

    model = model_of_study(study)
    layout = layout_from(model, micro=micro, gas=gas, bucket=bucket, parts=parts,
                         checkpoint_interval=checkpoint_interval, stages=stages, dp=dp, config=config,
                         zero_stage=zero_stage)
    p = predict(model.calibration, layout)
    loo = leave_one_out(model)
    click.echo(to_json(prediction_dict(model, p, loo)) if fmt == "json" else prediction_text(model, p, loo))


@click.command("plan")
@click.argument("study", type=click.Path())
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="GPUs of the cluster to plan for.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True,
              help="GPUs per node (stages crossing a node go over the network).")
@click.option("--hardware", default=None,
              help="Device and network: a preset (a100, h100, h200) or a TOML file in their format "
                   "[default: the study's own device; a CPU study needs one].")
@click.option("--device-memory", type=float, default=None, help="Bytes per GPU, instead of the preset's.")
@click.option("--global-batch", type=click.IntRange(min=1), default=None,
              help="Global batch to keep [default: the study's best trial's].")
@click.option("--stages", type=click.IntRange(min=1), default=None, help="Only layouts with this many stages.")
@click.option("--dp", type=click.IntRange(min=1), default=None, help="Only layouts with this data-parallel degree.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Layouts listed.")
@_FORMAT
def plan_command(study: str, gpus: int, gpus_per_node: int, hardware: str | None, device_memory: float | None,
                 global_batch: int | None, stages: int | None, dp: int | None, top: int, fmt: str) -> None:
    """Rank the layouts of STUDY's model on GPUS GPUs: stages x dp, micro-batch and GAS at the
    global batch, partition, checkpointing; each with predicted throughput and memory per stage,
    and the layouts that do not fit with the stage that overflows (docs/model.md)."""
    from autotune.model.hardware import load_hardware
    from autotune.model.plan import Cluster, plan
    from autotune.model.render import leave_one_out, plan_dict, plan_text, to_json
    from autotune.model.study_model import model_of_study

    hw = load_hardware(hardware, device_memory=device_memory) if hardware else None
    if hw is None and device_memory is not None and device_memory <= 0:
        from autotune.core.errors import UserError

        raise UserError(f"--device-memory {device_memory:g}: must be a positive number of bytes")
    model = model_of_study(study)
    batch = global_batch or max(model.observations, key=lambda o: o.samples_per_second).global_batch
    result = plan(model, Cluster(gpus=gpus, gpus_per_node=gpus_per_node, hardware=hw, global_batch=batch,
                                 device_memory=device_memory), stages=stages, dp=dp)
    loo = leave_one_out(model)  # an interval on the study's own device; onto a preset, why none
    click.echo(to_json(plan_dict(result, loo)) if fmt == "json" else plan_text(result, top, loo))
