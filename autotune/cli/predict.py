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
@click.option("--config", type=click.Path(), help="Take micro, GAS, bucket and checkpointing from a ds_config.json.")
@_FORMAT
def predict_command(study: str, micro: int | None, gas: int | None, bucket: float | None, parts: str | None,
                    checkpoint_interval: int | None, stages: int | None, dp: int | None, config: str | None,
                    fmt: str) -> None:
    """Predict samples/s, the step by term, the bubble and each stage's peak memory of a
    configuration STUDY has not run, from the model calibrated on STUDY's trials (docs/model.md)."""
    from autotune.model.render import leave_one_out, prediction_dict, prediction_text, to_json
    from autotune.model.step_model import predict
    from autotune.model.study_model import layout_from, model_of_study

    model = model_of_study(study)
    layout = layout_from(model, micro=micro, gas=gas, bucket=bucket, parts=parts,
                         checkpoint_interval=checkpoint_interval, stages=stages, dp=dp, config=config)
    p = predict(model.calibration, layout)
    loo = leave_one_out(model)
    click.echo(to_json(prediction_dict(model, p, loo)) if fmt == "json" else prediction_text(model, p, loo))
