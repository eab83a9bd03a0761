"""Inside each rank of the user's job: wrap `deepspeed.initialize`, instrument what it returns, stop.

Installed at interpreter start by bootstrap/sitecustomize.py, before the user's
script runs, and only where the controller set AUTOTUNE_USERCMD. Nothing of
the script is changed or copied: an import hook patches `deepspeed.initialize`
the moment the script imports deepspeed.

What a rank leaves in the trial folder (read by runner.py):
- `engine-rankR.json` when `deepspeed.initialize` returned: the engine's class
  and, for a PipelineEngine, stages, dp, micro-batch, GAS and its parameters;
- `metrics-rankR.csv` from the probe (autotune.rank.instrument, as the built-in workload);
- `done-rankR.json` when autotune ended the rank after the trial's steps;
- `exit-rankR.json` when the script ended by itself before that.

This module must import quickly and without torch: every rank imports it.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.core.rank_plan import JsonForm, RankPlan, plan_fields

ENV = "AUTOTUNE_USERCMD"
"""The controller's settings for the ranks, as JSON (BootstrapSettings)."""
FILE_ENV = "AUTOTUNE_USERCMD_FILE"
"""Or the path of a file holding them (multi-node: DeepSpeed's env file cannot carry JSON)."""
EXIT_NOT_PIPELINE = 45
"""A rank whose deepspeed.initialize returned no DeepSpeed engine exits with this."""
MODE_TRIAL, MODE_PROBE, MODE_WATCH = "trial", "probe", "watch"


@dataclass(kw_only=True, slots=True)
class BootstrapSettings(JsonForm):
    """What the controller tells every rank (one JSON environment variable, or a file): the
    rank plan (autotune/core/rank_plan.py) and what the bootstrap does with the script."""

    plan: RankPlan
    mode: str = MODE_TRIAL
    """`trial`: instrument and stop after warm-up + measured steps; `probe`: stop right
    after deepspeed.initialize (the start-up check that reads the pipeline's shape);
    `watch`: instrument and never stop (`autotune watch`: the job runs as long as it runs)."""
    ds_config: str | None = None
    """A script that builds its DeepSpeed config in code: the trial's ds_config.json, handed to
    `deepspeed.initialize` in place of the script's own (`config=`); None: the command names the
    file, and the trial's is in its place on the command line."""
    schedule: str | None = None
    n_microbatches: int | None = None
    """A trial of a torch.distributed.pipelining script: the schedule class (autotune's name, the
    torch class without `Schedule`) and micro-batch count it runs in place of the script's own
    (rank/torch_schedule_probe.py `substitute`); None: the script's."""

    @property
    def total_steps(self) -> int:
        return self.plan.total_steps

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "mode": self.mode, "ds_config": self.ds_config,
                "schedule": self.schedule, "n_microbatches": self.n_microbatches}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BootstrapSettings:
        plan, rest = plan_fields(d)
        return cls(plan=plan, **rest)

    def to_env(self) -> str:
        """The text of the environment variable (or of the file the nodes read)."""
        return self.to_json()

    @classmethod
    def from_env(cls, text: str) -> BootstrapSettings:
        return cls.from_json(text)


def marker_path(trial_dir: str | Path, kind: str, rank: int) -> Path:
    return Path(trial_dir) / f"{kind}-rank{rank}.json"


def install(settings: BootstrapSettings) -> None:
    """Patch deepspeed.initialize when the script imports deepspeed (or now, if it already has)."""
    state = _RankState(settings)
    if settings.mode != MODE_WATCH:
        from autotune.rank.wiring import rank_watchdog

        state.watchdog = rank_watchdog(settings.plan, state.rank)
    if state.watchdog is not None:
        state.watchdog.startup()  # from the interpreter's start: the script's imports, the op load, ...
    _patch_on_import("deepspeed", lambda module: _patch(module, state))
    from autotune.rank import torch_schedule_probe as tsp  # a torch.distributed.pipelining script

    if settings.mode == MODE_PROBE:  # its schedule read and reported, the rank ended before its first step
        _patch_on_import(tsp.MODULE, lambda module: tsp.patch(module, state.write_marker))
    else:  # its schedule instrumented (a trial's: the trial's class and count in its place)
        _patch_on_import(tsp.MODULE, lambda module: tsp.on_schedule_built(module, state.schedule_built))
    atexit.register(state.on_normal_exit)


def _patch_on_import(name: str, patch: Any) -> None:
    """`patch(module)` as soon as the script imports module `name` (or now, if it already has)."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PatchingFinder(name, patch))


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds one module the normal way, then patches it as soon as its code has run."""

    def __init__(self, name: str, patch: Any) -> None:
        self.name = name
        self.patch = patch
        self.busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != self.name or self.busy:
            return None
        self.busy = True  # find_spec below asks the meta path again, us included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader, patch = spec.loader, self.patch
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            patch(module)

        loader.exec_module = exec_module  # this loader instance loads only this one module
        return spec


def _patch(deepspeed: Any, state: _RankState) -> None:
    from autotune.rank.wiring import force_parts

    force_parts(state.settings.plan)  # before the script builds its PipelineModule
    if state.settings.mode != MODE_WATCH:  # a trial, not the user's own run: the op load asks py-cpuinfo once
        from autotune.rank import cpu_info

        cpu_info.install()
    original = getattr(deepspeed, "initialize", None)
    if original is None or getattr(original, "_autotune_wrapped", False):
        return

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        if state.settings.mode == MODE_PROBE:
            state.write_marker("config", {**script_config(args, kwargs), "built_by": engine_builder()})
        if state.settings.ds_config is not None:
            kwargs = trial_config_in_place(args, kwargs, state.settings.ds_config)
        result = original(*args, **kwargs)
        engine = result[0] if isinstance(result, tuple) else result
        state.engine_built(engine)
        return result

    initialize._autotune_wrapped = True  # type: ignore[attr-defined]
    deepspeed.initialize = initialize


class _RankState:
    """One rank's view: the engine autotune instruments, how many steps it has run."""

    def __init__(self, settings: BootstrapSettings) -> None:
        self.settings = settings
        self.rank = int(os.environ.get("RANK", "0"))
        self.engine: Any = None
        self.calls = 0
        self.stopping = False
        self.wiring: Any = None
        """The probe, records and step budget (autotune/rank/wiring.py); None until the engine is
        instrumented (its budget None in watch mode)."""
        self.watchdog: Any = None
        """This rank's stall watchdog (autotune/rank/watchdog.py); None in watch mode."""
        self.torch_schedule = False
        """The engine is a torch.distributed.pipelining schedule of the script's (no DeepSpeed)."""

    def write_marker(self, kind: str, payload: dict[str, Any]) -> None:
        path = marker_path(self.settings.plan.trial_dir, kind, self.rank)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": self.rank, **payload}) + "\n", encoding="utf-8")
        tmp.replace(path)  # the controller never reads half a marker

    def schedule_built(self, schedule: Any) -> None:
        """A torch.distributed.pipelining schedule object of the script's: the first is the one
        instrumented, behind the engine face (autotune/rank/torch_pp/user_schedule.py). A trial's
        schedule runs in its place: the script's object calls the trial's `step`."""
        if self.engine is not None:
            return
        from autotune.rank.torch_pp.user_schedule import UserSchedule
        from autotune.rank.torch_schedule_probe import substitute
        from autotune.rank.wiring import wire

        script_class = type(schedule).__name__
        run = substitute(schedule, self.settings.schedule, self.settings.n_microbatches)
        face = UserSchedule(run)
        if run is not schedule:
            schedule.step = run.step  # the face's timed step (an instance attribute of the script's object)
        self.engine, self.torch_schedule = face, True
        self.write_marker("engine", {
            "engine": face.schedule_name, "pipeline": True, "deepspeed": False, "torch_pipelining": True,
            "script_schedule": script_class, "stages": face.num_stages, "stage": face.stage_id,
            "dp": face.data_parallel_size, "dp_rank": face.replica, "micro_batches": face.m,
            "parameters": int(sum(p.numel() for p in face.module.parameters()))})
        watching = self.settings.mode == MODE_WATCH
        self.wiring = wire(face, self.settings.plan, budget=not watching)
        if not watching:
            self._stop_after_budget(face)

    def _stop_after_budget(self, engine: Any) -> None:
        """A plain engine's or a torch schedule's steps (the script's loop, one optimizer step at a
        time): the rank stops when the trial's budget ends."""
        from autotune.rank.step_boundary import plain_steps

        self.wiring.watch_steps(engine, self.watchdog)
        budget = self.wiring.budget

        def step_ended(loss: Any) -> None:  # after the probe's record (its listener came first)
            self.calls += 1
            if not budget.go_on():  # the same decision on every rank, at the same boundary
                self.stop()

        plain_steps(engine).ended.append(step_ended)

    def engine_built(self, engine: Any) -> None:
        if self.engine is not None:  # a second engine (e.g. a teacher model): the first is the one tuned
            return
        from deepspeed.runtime.engine import DeepSpeedEngine

        if not isinstance(engine, DeepSpeedEngine):  # a PipelineEngine is one too; anything else is not
            name = type(engine).__name__
            self.write_marker("engine", {"engine": name, "pipeline": False, "deepspeed": False})
            if self.settings.mode == MODE_WATCH:  # a watched job is never cut short: it runs unwatched
                print(f"autotune: deepspeed.initialize returned a {name}, not a DeepSpeed engine; "
                      "this rank runs on without metrics", file=sys.stderr, flush=True)
                return
            print(f"autotune: deepspeed.initialize returned a {name}, not a DeepSpeed engine; "
                  "this rank stops here", file=sys.stderr, flush=True)
            _flush_std()
            os._exit(EXIT_NOT_PIPELINE)  # nothing of the script may run on (it would train for days)
        self.engine = engine
        from autotune.rank.engine_face import layout_of

        layout = layout_of(engine)
        self.write_marker("engine", {
            "engine": type(engine).__name__, "pipeline": layout.topology is not None, "deepspeed": True,
            "zero_stage": int(engine.zero_optimization_stage()), "stages": layout.stages,
            "stage": layout.stage, "dp": layout.data_parallel_size,
            "dp_rank": layout.data_parallel_rank,
            "micro_batch_size": layout.micro_batch_size,
            "gradient_accumulation_steps": layout.accumulation_steps,
            # ZeRO-3 partitions each parameter: its full size is `ds_numel` (numel() is this rank's share)
            "parameters": int(sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())),
            "parts": [int(x) for x in getattr(engine.module, "parts", [])],  # the layers each stage got
            "layers": layer_classes(engine.module),  # what a type:REGEX partition method matches
            "partition_method": getattr(engine.module, "_autotune_partition_method", None),
        })
        if self.settings.mode == MODE_PROBE:
            self.stop()
        from autotune.rank.wiring import wire

        watching = self.settings.mode == MODE_WATCH  # no step limit: the script's own loop decides
        self.wiring = wire(engine, self.settings.plan, budget=not watching)
        if watching:
            return
        from autotune.rank.step_boundary import has_train_batch

        if not has_train_batch(engine):  # a plain engine: the script's loop, one optimizer step at a time
            self._stop_after_budget(engine)
            return
        measured = engine.train_batch  # the probe's timed train_batch
        wiring = self.wiring

        def train_batch(*args: Any, **kwargs: Any) -> Any:
            loss = measured(*args, **kwargs)
            self.calls += 1
            if not wiring.go_on():  # the same decision on every rank, at the same call (layer costs last)
                self.stop()
            return loss

        engine.train_batch = train_batch
        self.wiring.watch_steps(engine, self.watchdog)  # outermost: the whole step, the budget's decision too

    def stop(self) -> None:
        """End the rank after the trial's last step: metrics flushed, peers at the same point.

        The barrier first: every rank has finished the same step, so none leaves while a
        peer still waits on it in a collective (that peer would hang or crash). Then
        os._exit(0) rather than returning or sys.exit(): the script would go on training
        for days, and a SystemExit would run its `finally:`/atexit code, which commonly
        saves a checkpoint or evaluates. os._exit runs none of it, nor the process-group
        teardown that can hang under gloo.
        """
        self.stopping = True
        self.close_sinks()
        if self.wiring is not None:
            self.wiring.write_step_record(self.rank)
        self.write_marker("done", {"train_batch_calls": self.calls})
        _flush_std()
        try:
            if self.torch_schedule:  # the script's own process group (it may never start DeepSpeed's)
                import torch.distributed as dist
            else:
                import deepspeed.comm as dist  # type: ignore[no-redef]

            dist.barrier()
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            _flush_std()
            os._exit(0)

    def close_sinks(self) -> None:
        if self.wiring is not None:
            self.wiring.close()

    def on_normal_exit(self) -> None:
        """The script ended by itself (its own --steps ran out) before the trial's steps."""
        if self.engine is None or self.stopping:
            return
        self.close_sinks()
        self.write_marker("exit", {"train_batch_calls": self.calls})


CONFIG_KEYS = ("config", "config_params")
"""`deepspeed.initialize`'s keywords for a config given in code (config_params: the older name)."""


def script_config(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The config the script hands `deepspeed.initialize`, as the start-up check records it: a
    dict given in code, a path given in code, or `args.deepspeed_config` (the command's)."""
    given = next((kwargs[k] for k in CONFIG_KEYS if kwargs.get(k) is not None), None)
    if isinstance(given, dict):
        try:
            return {"source": "code", "config": json.loads(json.dumps(given))}
        except (TypeError, ValueError) as exc:  # a value JSON cannot hold (a callable, a tensor)
            return {"source": "code", "config": None, "error": f"not JSON: {exc}"}
    if isinstance(given, (str, os.PathLike)):
        return {"source": "path", "path": os.path.abspath(os.fspath(given))}
    cli = getattr(kwargs.get("args", args[0] if args else None), "deepspeed_config", None)
    return {"source": "args", "path": os.path.abspath(cli)} if cli else {"source": "none"}


BUILDERS = {"transformers.trainer": "hf_trainer", "lightning.pytorch.strategies.deepspeed": "lightning",
            "pytorch_lightning.strategies.deepspeed": "lightning"}
"""The modules that call `deepspeed.initialize` for a framework's user, and the framework's name."""


def engine_builder() -> str | None:
    """Which framework builds the engine (its module on the caller's stack: the HF Trainer
    through accelerate, Lightning's DeepSpeedStrategy), None: the script itself. The start-up
    check's marker carries it: an HF Trainer job's batch lives in the Trainer's arguments."""
    frame = sys._getframe(1)
    while frame is not None:
        found = BUILDERS.get(frame.f_globals.get("__name__", ""))
        if found:
            return found
        frame = frame.f_back  # type: ignore[assignment]
    return None


def trial_config_in_place(args: tuple[Any, ...], kwargs: dict[str, Any], path: str) -> dict[str, Any]:
    """`deepspeed.initialize`'s keywords with the trial's config in place of the script's own."""
    with open(path, encoding="utf-8") as fh:
        trial = json.load(fh)
    out = dict(kwargs)
    key = next((k for k in CONFIG_KEYS if out.get(k) is not None), "config")
    out[key] = trial
    holder = out.get("args", args[0] if args else None)
    if getattr(holder, "deepspeed_config", None):  # DeepSpeed refuses a config given twice
        holder.deepspeed_config = None
    return out


def layer_classes(module: Any) -> list[str]:
    """The class of each layer of a PipelineModule (all stages'), as DeepSpeed 0.19.8's `type:`
    method reads it (`_find_layer_type`): a LayerSpec's typename, a module's class, a function's
    name ("function" where it has none, as the layer-costs file names it)."""
    out = []
    for spec in getattr(module, "_layer_specs", None) or []:
        typename = getattr(spec, "typename", None)
        if isinstance(typename, type):
            out.append(typename.__name__)
        elif hasattr(spec, "register_forward_hook"):
            out.append(type(spec).__name__)
        else:
            out.append(str(getattr(spec, "__name__", "function")))
    return out


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
