"""The engine seam (autotune/engines/): every registered engine answers the same questions, and
what differs between engines reaches a trial only through what its engine hands the runner.

The real trials under each engine are the shared studies' and tests/test_torch_pipelining.py's;
these are the seam's own promises, checked without a launch."""

from __future__ import annotations

import pytest

from autotune.core.dsconfig import DsConfig
from autotune.core.errors import UserError
from autotune.core.options import RunOptions, WorkloadOptions
from autotune.core.space import TrialConfig
from autotune.engines.registry import DEFAULT, ENGINES, engine_named
from autotune.rank.collectives import COLLECTIVES
from autotune.rank.engine_face import COLLECTIVE, DEEPSPEED_CATEGORY, PLAIN_ENGINE_PHASES
from autotune.trials.builtin import BuiltinRunner, WarmRunner, builtin_runner
from autotune.trials.contract import TrialRequest
from autotune.trials.launcher import DEEPSPEED_STYLE, TORCHRUN_STYLE, LaunchSpec, build_command
from autotune.tuning.builtin_job import BuiltinJob

BASE = DsConfig.from_dict({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1,
                           "gradient_accumulation_steps": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                           "zero_optimization": {"stage": 1}})


def _opts(engine: str, **workload) -> RunOptions:
    return RunOptions(workload=WorkloadOptions(engine=engine, preset="tiny", **workload))


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_answers_the_jobs_questions(name):
    engine = ENGINES[name]
    assert engine.name == name and engine.title
    assert engine.launch.script.is_file(), engine.launch.script  # the rank entry it names ships
    opts = _opts(name)
    engine.validate(opts)  # its own defaults are honoured
    engine.check_config(opts, BASE)
    job = BuiltinJob()
    space = job.space(opts, BASE)
    described = job.describe(opts)
    assert described.startswith("workload: tiny") and (name == DEFAULT) == (described.count("engine:") == 0)
    assert all(hasattr(step, "next_proposal") for step in job.steps(opts, BASE, space, root=_tmp(),
                                                                   note=lambda _t: None, noise=0.1, cluster=None))
    assert engine.workload_knobs <= {"schedule"}


def _tmp():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp())


def test_an_unknown_engine_is_one_line_naming_the_engines():
    with pytest.raises(UserError, match="--engine 'jax': use deepspeed or zero or torch"):
        engine_named("jax")


def test_the_bucket_is_searched_only_where_the_engine_has_one():
    job = BuiltinJob()
    assert job.space(_opts("deepspeed"), BASE).bucket_range is not None  # ZeRO-1, dp 2
    torch_space = job.space(_opts("torch"), BASE)
    assert torch_space.bucket_range is None and "no ZeRO bucket" in torch_space.bucket_note


def test_the_performance_models_tuner_is_refused_for_an_engine_it_does_not_model():
    opts = _opts("torch")
    opts.tuner = "model"
    with pytest.raises(UserError, match="--tuner model: not available under --engine torch yet"):
        BuiltinJob().validate(opts)
    for modelled in ("deepspeed", "zero"):  # the pipeline replay; a plain engine's step by ZeRO stage
        ok = _opts(modelled)
        ok.tuner = "model"
        BuiltinJob().validate(ok)


def test_the_launch_is_the_engines_and_so_are_warm_workers():
    torch = engine_named("torch")
    said: list[str] = []
    runner = builtin_runner(WorkloadOptions(engine="torch", workers="warm"), BASE, note=said.append,
                            launch=torch.launch, workload_knobs=torch.workload_knobs)
    assert type(runner) is BuiltinRunner and said and torch.launch.warm_refusal in said[0]
    warm = builtin_runner(WorkloadOptions(workers="warm"), BASE, note=said.append)
    try:
        assert isinstance(warm, WarmRunner)
    finally:
        warm.close()


def test_each_launch_spells_its_own_command_line():
    ds = LaunchSpec(num_ranks=4, script_args=["--x"], log_path=_tmp() / "l", timeout=1.0)
    assert ds.style == DEEPSPEED_STYLE and "--num_gpus" in build_command(ds, 29500)
    tr = LaunchSpec(num_ranks=4, script_args=["--x"], log_path=_tmp() / "l", timeout=1.0, style=TORCHRUN_STYLE)
    cmd = build_command(tr, 29500)
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4" and "--num_gpus" not in cmd


def test_only_the_options_an_engine_sweeps_reach_the_workload():
    """A knob value sets a workload option only where the engine declared it (the torch engine's
    schedule); a user's knob of the same name as another option (partition_method) is its command's."""
    request = TrialRequest(number=1, config=TrialConfig(micro_batch_size=1, gradient_accumulation_steps=8),
                           trial_dir=_tmp(), timeout=1.0)
    request.knob_values = {"schedule": "GPipe", "partition_method": "uniform"}
    wl = WorkloadOptions(engine="torch")
    swept = BuiltinRunner(wl, BASE, workload_knobs=frozenset({"schedule"})).workload_for(request)
    assert (swept.schedule, swept.partition_method) == ("GPipe", wl.partition_method)
    assert wl.schedule == "1F1B"  # the runner's own workload is left as it was
    assert BuiltinRunner(wl, BASE).workload_for(request).schedule == "1F1B"
    with pytest.raises(ValueError, match="not text options"):
        BuiltinRunner(wl, BASE, workload_knobs=frozenset({"pipeline_stages"}))


def test_one_ds_config_for_every_runner_and_what_the_rank_reads_of_deepspeeds_engines(tmp_path):
    """`trial_ds_config` is every runner's: the user's own config is kept as written where the
    trial is its own, and a checkpoint interval is written where DeepSpeed reads it. A real
    PipelineEngine (one gloo rank) shows that `pipeline.activation_checkpoint_interval` in the
    config sets the module's interval, so a user's script runs the checkpointed trial too."""
    import json
    import os
    import subprocess
    import sys

    from autotune.core.space import TrialConfig
    from autotune.trials.contract import trial_ds_config

    own = DsConfig.from_dict({"train_batch_size": 8, "gradient_accumulation_steps": 4,
                              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    same = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4)
    assert trial_ds_config(own, same, 1, own_when_unchanged=True) == own.to_dict()  # byte for byte the user's
    checkpointed = TrialConfig(micro_batch_size=2, gradient_accumulation_steps=4, activation_checkpoint_interval=1)
    cfg = trial_ds_config(own, checkpointed, 1, own_when_unchanged=True)
    assert cfg["pipeline"] == {"activation_checkpoint_interval": 1} and cfg["train_micro_batch_size_per_gpu"] == 2
    assert trial_ds_config(own, checkpointed, 1) == cfg  # the built-in runner's is the same

    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    script = (
        "import json, sys, torch, deepspeed\n"
        "from deepspeed.pipe import PipelineModule\n"
        "deepspeed.init_distributed('gloo')\n"
        "m = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=1,"
        " loss_fn=torch.nn.MSELoss(), activation_checkpoint_interval=0)\n"
        "pipe, *_ = deepspeed.initialize(model=m, config=json.load(open(sys.argv[1])), model_parameters=m.parameters())\n"
        "print('interval', m.activation_checkpoint_interval)\n"
        "from autotune.rank.engine_face import layout_of\n"
        "print('pipeline', layout_of(pipe))\n"
        "lin = torch.nn.Linear(4, 4)\n"
        "plain, *_ = deepspeed.initialize(model=lin, config=json.load(open(sys.argv[1])), model_parameters=lin.parameters())\n"
        "print('plain', layout_of(plain))\n"
        "from autotune.rank.engine_face import instructions_of\n"
        "seen, none = [], []\n"
        "undo = instructions_of(pipe).wrap(lambda i, fn: seen.append(i) or fn)\n"
        "print('wrapped', ','.join(sorted(f'{i.name}={i.category}' for i in seen)), '_INSTRUCTION_MAP' in vars(pipe))\n"
        "undo()\n"
        "print('undone', '_INSTRUCTION_MAP' in vars(pipe))\n"
        "from deepspeed.comm import comm\n"
        "undo = instructions_of(plain).wrap(lambda i, fn: none.append(i) or fn)\n"
        "print('plainwrapped', ','.join(sorted(f'{i.name}={i.category}' for i in none)), "
        "'forward' in vars(plain), 'all_reduce' in vars(comm.cdb))\n"
        "undo()\n"
        "print('plainundone', 'forward' in vars(plain), 'all_reduce' in vars(comm.cdb))\n")
    from autotune.trials.launcher import free_port, remove_shm_buffers

    port = free_port()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    try:
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ds.json")], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=240)
    finally:
        remove_shm_buffers(port)  # DeepSpeed's CPU comm op leaves them (autotune/trials/launcher.py)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "interval 1" in out.stdout.splitlines(), out.stdout[-500:]
    # the rank side's one reader of an engine's layout (autotune/rank/engine_face.py), on both of
    # DeepSpeed's engines: a plain DeepSpeedEngine (ZeRO, HF Trainer, Lightning) has no stages
    lines = {line.split(" ", 1)[0]: line for line in out.stdout.splitlines()}
    same = "micro_batch_size=2, accumulation_steps=4, data_parallel_size=1, data_parallel_rank=0"
    assert f"{same}, topology=Topology(stages=1, stage=0)" in lines["pipeline"], out.stdout
    assert f"{same}, topology=None" in lines["plain"], out.stdout
    # what the probe times, read of DeepSpeed's instruction map there and nowhere else: every
    # instruction in its category, wrapped on the instance (the class's map untouched) and undone
    wrapped = dict(pair.split("=") for pair in lines["wrapped"].split()[1].split(","))
    assert wrapped == DEEPSPEED_CATEGORY and lines["wrapped"].endswith("True"), lines["wrapped"]
    assert lines["undone"] == "undone False"
    # a plain engine's: its phases and the ZeRO collectives of DeepSpeed's backend, on the
    # instances (the engine's, the backend object's), and undone
    plain = dict(pair.split("=") for pair in lines["plainwrapped"].split()[1].split(","))
    assert {k: plain[k] for k in PLAIN_ENGINE_PHASES} == PLAIN_ENGINE_PHASES, plain
    assert {k for k, v in plain.items() if v == COLLECTIVE} == set(COLLECTIVES), plain
    assert lines["plainwrapped"].endswith("True True") and lines["plainundone"] == "plainundone False False"


def test_the_torch_engine_declares_its_instructions_in_the_probes_categories():
    """No DeepSpeed classes impersonated: the torch engine names its instructions and their
    categories, which agree with DeepSpeed's where the names are the same (so a CSV or a trace
    reads the same whichever engine ran)."""
    from autotune.rank.torch_pp.engine import INSTRUCTION_CATEGORY

    assert INSTRUCTION_CATEGORY.items() <= DEEPSPEED_CATEGORY.items()
    assert {"ForwardPass", "BackwardPass", "OptimizerStep", "RecvActivation"} <= set(INSTRUCTION_CATEGORY)

