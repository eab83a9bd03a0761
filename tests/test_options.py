"""One option tree from the command line to the rank (autotune/core/options.py)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from click.testing import CliRunner

from autotune.cli.main import cli
from autotune.core.errors import UserError
from autotune.core.options import RunOptions, WorkloadOptions, check_fields, from_cli
from autotune.rank.workload.train import parse_args
from autotune.rank.workload.trial_spec import describe_workload


def _cli_fields(cls):
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli")]


def test_every_cli_field_is_an_option_with_its_help_and_default():
    out = CliRunner().invoke(cli, ["run", "--help"], terminal_width=200).output
    for f in [*_cli_fields(RunOptions), *_cli_fields(WorkloadOptions)]:
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        if f.metadata["hidden"]:
            assert flag not in out, flag
            continue
        assert flag in out, flag
        # its lines, up to the next option (a flag too long for the column has its help on the next line)
        entry = re.split(rf"  {re.escape(flag)}[ \n]", out, maxsplit=1)[1].split("\n  --", 1)[0]
        assert f.metadata["help"].split()[0] in entry, (flag, entry)
    assert "[default: 6]" in out.split("--steps", 1)[1].split("--warmup-steps", 1)[0]  # the tree's default


def test_the_command_line_builds_the_tree_and_the_study_reads_it_back():
    kw = {f.name: f.default for f in [*_cli_fields(RunOptions), *_cli_fields(WorkloadOptions)]}
    kw.update(bucket_min=2e4, bucket_max=5e8, steps=9, preset="small", faults=None)
    opts = from_cli(kw, budget=7)
    assert opts.budget == 7 and opts.bucket_min == 20_000 and isinstance(opts.bucket_min, int)
    assert opts.workload.steps == 9 and opts.workload.preset == "small" and opts.workload.faults == ""
    stored = json.loads(json.dumps(opts.to_dict()))  # as the study keeps it
    assert RunOptions.from_dict(stored) == opts
    check_fields(opts)


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("budget", 0, "--budget must be >= 1"),
    ("micro_max", 10**6, "--micro-max must be <= 65536"),
    ("seed", True, "--seed must be an integer"),
    ("trial_timeout", float("nan"), "--trial-timeout must be a finite number"),
    ("trial_timeout", 0.0, "--trial-timeout must be > 0"),
    ("metrics_port", 0, "--metrics-port must be a port 1-65535"),
])
def test_ranges_come_from_the_tree(field, value, needle):
    opts = RunOptions(**{field: value})
    with pytest.raises(UserError, match=needle):
        check_fields(opts)


def test_a_rank_reads_the_same_workload_the_controller_wrote(tmp_path):
    wl = WorkloadOptions(preset="small", pipeline_stages=3, steps=11, slow_stage=1, slow_factor=2)
    spec = describe_workload(wl, trial=4, trial_dir="/x", ds_config="/x/ds.json", fault="nan")
    path = spec.write(tmp_path / "trial.json")
    assert parse_args(["--trial-spec", str(path)]) == spec


def test_the_presets_layer_limit_binds_the_built_in_workload_only():
    from autotune.tuning.validation import validate

    opts = RunOptions(workload=WorkloadOptions(pipeline_stages=8))  # tiny has 4 blocks + 2 ends
    with pytest.raises(UserError, match="exceeds the 6 layers of preset tiny"):
        validate(opts)
    validate(opts, built_in=False)  # the user's own model: their stages, not the preset's


def test_watch_takes_the_endpoint_options_of_run_from_the_one_declaration():
    from autotune.core.options import endpoint_fields
    from autotune.usercmd.watch import WatchOptions

    def params(command: str) -> dict[str, object]:
        return {p.name: p for p in cli.commands[command].params}

    run, watch = params("run"), params("watch")
    names = [f.name for f in endpoint_fields()]
    assert names == ["metrics_port", "rank_metrics_port", "metrics_addr", "no_metrics"]
    for name in names:
        a, b = run[name], watch[name]
        assert (a.opts, a.default, a.help, a.is_flag, a.type.name) == (b.opts, b.default, b.help, b.is_flag, b.type.name)
        assert getattr(WatchOptions(), name) == a.default  # watch's own defaults are the declaration's
    for command in ("run", "watch"):
        out = CliRunner().invoke(cli, [command, "--help"], terminal_width=200).output
        for f in endpoint_fields():
            flag = "--" + f.name.replace("_", "-")
            entry = re.split(rf"  {re.escape(flag)}[ \n]", out, maxsplit=1)[1].split("\n  --", 1)[0]
            assert " ".join(f.metadata["help"].split()[:4]) in " ".join(entry.split()), (command, flag)
