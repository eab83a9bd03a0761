"""The built-in workload as a torch.distributed.pipelining job, behind the engine face the rank
side reads (issue 28; autotune/rank/engine_face.py).

The probe (autotune/rank/instrument.py), the step budget, the watchdog and the trial loop
(autotune/rank/workload/train.py `_train`) read the engine face (autotune/rank/engine_face.py):
its instructions with their categories, its layout, and its `train_batch`. `TorchPipeEngine`
declares both over `PipelineStage`s and a `PipelineSchedule*` (`autotune_instructions`,
`autotune_layout`), so the same probe writes the same CSV columns, and nothing downstream (the
summary, the rules, `advise`, the report, Prometheus) knows which engine ran.

What runs under each instruction (named as DeepSpeed's, so a trace's labels read the same):
- ForwardPass: each stage's `forward_one_chunk`, and the loss (`_maybe_compute_loss`: DeepSpeed
  computes it inside its last stage's forward);
- BackwardPass: `backward_one_chunk` and, in the zero-bubble schedules, `backward_weight_one_chunk`;
- Recv/Send Activation/Grad: the wait on a batch of point-to-point operations
  (`schedules._wait_batch_p2p`), named by the operations it waits for (the schedule's `desc`, or
  the stage's `get_{fwd,bwd}_{recv,send}_ops` that made them); a wait on sends and receives at
  once counts as its receive. The probe splits each kind into transfer and wait
  (autotune/rank/p2p_split.py);
- ReduceGrads: with dp > 1, the all-reduce of every gradient over the stage's replicas;
- OptimizerStep: gradient clipping (one all-reduce of the squared norm over the ranks), the
  optimizer's step and zeroing the gradients;
- LoadMicroBatch: drawing the step's micro-batches on the ranks holding the first or last stage.
What is timed under none: issuing the point-to-point operations (gloo and NCCL queue them) and
splitting the batch into micro-batches; the probe counts that as idle, as DeepSpeed's own
untimed work.

The two module functions of `torch.distributed.pipelining.schedules` are replaced once per
process (the schedules look them up by name at each call); nothing else of torch is patched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from autotune.core import pp_schedules
from autotune.rank.engine_face import (
    COMM,
    COMPUTE,
    DATA,
    OPTIMIZER,
    EngineLayout,
    Instruction,
    InstructionTable,
    MappedInstructions,
    Topology,
)
from autotune.rank.p2p_split import P2P_INSTRUCTIONS, p2p_category

INSTRUCTION_CATEGORY: dict[str, str] = {
    "ForwardPass": COMPUTE, "BackwardPass": COMPUTE, "OptimizerStep": OPTIMIZER, "LoadMicroBatch": DATA,
    "ReduceGrads": COMM, **{name: p2p_category(name) for name in P2P_INSTRUCTIONS}}
"""The torch engine's instructions and their categories in the probe (see the module doc)."""

WAIT_KIND = {"fwd_recv": "RecvActivation", "bwd_recv": "RecvGrad", "fwd_send": "SendActivation",
             "bwd_send": "SendGrad", "fwd_send_bwd_recv": "RecvGrad", "bwd_send_fwd_recv": "RecvActivation"}
"""The schedules' `desc` of a batch of point-to-point operations -> the instruction its wait counts as."""
OPS_KIND = {"get_fwd_recv_ops": "RecvActivation", "get_bwd_recv_ops": "RecvGrad",
            "get_fwd_send_ops": "SendActivation", "get_bwd_send_ops": "SendGrad"}
DEFAULT_WAIT = "RecvActivation"
"""A wait on operations of no known kind (the first step's shape exchange)."""


class _Tagged(list):
    """A list of point-to-point operations or their works, with the instruction its wait counts as."""

    kind: str = DEFAULT_WAIT


def _tagged(items: list, kind: str) -> _Tagged:
    out = _Tagged(items)
    out.kind = kind
    return out


class Grid:
    """The ranks' layout as DeepSpeed's PipeDataParallelTopology has it (pipe outer, data inner:
    rank = stage x dp + replica), with this rank's pipeline and data-parallel groups."""

    def __init__(self, rank: int, world: int, data_parallel_size: int) -> None:
        import torch.distributed as dist

        self.data_parallel_size = dp = data_parallel_size
        self.pipe_size = p = world // dp
        self.stage, self.replica = divmod(rank, dp)
        self.pipe_ranks = [s * dp + self.replica for s in range(p)]
        self.pipe_group = self.data_group = None
        for d in range(dp):  # every rank creates every group, in the same order (torch.distributed's rule)
            group = dist.new_group([s * dp + d for s in range(p)])
            if d == self.replica:
                self.pipe_group = group
        for s in range(p):
            group = dist.new_group([s * dp + d for d in range(dp)]) if dp > 1 else None
            if s == self.stage:
                self.data_group = group

    def get_data_parallel_rank(self) -> int:
        return self.replica


class ScheduleFace:
    """The engine face over torch stages and a schedule (autotune/rank/engine_face.py): what the
    probe reads, shared by the built-in engine and a user's own schedule object
    (autotune/rank/torch_pp/user_schedule.py). A subclass sets `global_rank`, `num_stages` (the
    pipeline's ranks), `stage_id`, `data_parallel_size`, `replica`, `micro`, `m`, `first`, `last`
    and `_instructions` (`time_schedule` routes the work through it)."""

    global_rank: int
    num_stages: int
    stage_id: int
    micro: int
    m: int
    first: bool
    last: bool
    _instructions: dict[str, Callable[..., Any]]

    @property
    def data_parallel_size(self) -> int:
        raise NotImplementedError

    @property
    def replica(self) -> int:
        raise NotImplementedError

    # -- the engine face -----------------------------------------------------------------------
    def autotune_instructions(self) -> InstructionTable:
        """The instructions the probe times (autotune/rank/engine_face.py), by name."""
        return MappedInstructions(self, "_instructions", lambda name: Instruction(name, INSTRUCTION_CATEGORY[name]))

    def autotune_layout(self) -> EngineLayout:
        """The engine face's layout (autotune/rank/engine_face.py), stated rather than read as DeepSpeed's."""
        return EngineLayout(rank=self.global_rank, micro_batch_size=self.micro, accumulation_steps=self.m,
                            data_parallel_size=self.data_parallel_size, data_parallel_rank=self.replica,
                            topology=Topology(stages=self.num_stages, stage=self.stage_id))

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro

    def gradient_accumulation_steps(self) -> int:
        return self.m

    def is_first_stage(self) -> bool:
        return self.first

    def is_last_stage(self) -> bool:
        return self.last

    def fp16_enabled(self) -> bool:
        return False

    def zero_optimization_stage(self) -> int:
        return 0

    def zero_reduce_bucket_size(self) -> int:
        return 0

    def destroy(self) -> None:
        """Nothing held beyond the objects themselves."""

    # -- the instructions --------------------------------------------------------------------------
    def run(self, instruction: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call `fn` as the instruction `instruction`: through the map, which the probe times."""
        return self._instructions[instruction](self, call=lambda: fn(*args, **kwargs))


class TorchPipeEngine(ScheduleFace):
    """One rank's stages, schedule and optimizer, behind the engine face (see the module doc)."""

    def __init__(self, *, stages: list[Any], schedule: Any, optimizer: Any, grid: Grid,
                 micro_batch_size: int, micro_batches: int, device: Any, schedule_name: str,
                 gradient_clipping: float = 0.0, last_rank: int) -> None:
        import torch
        import torch.distributed as dist

        self.stages, self.schedule, self.optimizer = stages, schedule, optimizer
        self.global_rank, self.num_stages, self.stage_id = dist.get_rank(), grid.pipe_size, grid.stage
        """`num_stages`: the pipeline's ranks (the CSV's pipeline_stages); `stage_id`: this rank's
        place in its pipeline (its first stage)."""
        self.grid = grid
        self.device = device
        self.schedule_name = schedule_name
        self.module = torch.nn.ModuleList([s.submod for s in stages])
        self.micro, self.m, self.clip, self.last_rank = micro_batch_size, micro_batches, gradient_clipping, last_rank
        self.first = any(s.is_first for s in stages)
        self.last = any(s.is_last for s in stages)
        self.skipped_steps = 0
        self._instructions: dict[str, Callable[..., Any]] = {name: _run_call for name in INSTRUCTION_CATEGORY}
        time_schedule(self, stages, schedule)

    @property
    def data_parallel_size(self) -> int:
        return self.grid.data_parallel_size

    @property
    def replica(self) -> int:
        return self.grid.replica

    def train_batch(self, data_iter: Iterator[tuple[Any, Any]] | None = None) -> Any:
        """One optimizer step over `gradient_accumulation_steps` micro-batches, as DeepSpeed's;
        returns the mean loss of its micro-batches on every rank (DeepSpeed broadcasts it too)."""
        import torch
        import torch.distributed as dist

        inputs = target = None
        if self.first or self.last:
            inputs, target = self.run("LoadMicroBatch", _draw, data_iter, self.m)
        losses: list[Any] | None = [] if self.last else None
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.last else {}
        if self.first:
            self.schedule.step(inputs, **kwargs)
        else:
            self.schedule.step(**kwargs)
        if self.grid.data_group is not None:
            self.run("ReduceGrads", self._reduce_grads)
        self.run("OptimizerStep", self._optimizer_step)
        loss = torch.zeros(1)
        if self.last and losses:
            loss = torch.stack([x.detach().float().reshape(()) for x in losses]).mean().reshape(1)
        dist.broadcast(loss, src=self.last_rank, group=self.grid.pipe_group)
        return loss

    def _reduce_grads(self) -> None:
        """Data parallelism as DDP does it without its buckets: every gradient averaged over the
        stage's replicas, after the schedule (DeepSpeed's pipeline reduces after its schedule too)."""
        import torch.distributed as dist

        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.grid.data_group)
                p.grad.div_(self.grid.data_parallel_size)

    def _optimizer_step(self) -> None:
        import torch
        import torch.distributed as dist

        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.clip > 0:  # DeepSpeed's gradient_clipping: the global norm over every stage
            local = torch.zeros(1)
            for p in params:
                local += p.grad.detach().float().pow(2).sum()
            dist.all_reduce(local, group=self.grid.pipe_group)  # the replicas hold the same gradients
            norm = math.sqrt(float(local))
            if norm > self.clip:
                scale = self.clip / (norm + 1e-6)
                for p in params:
                    p.grad.mul_(scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def time_schedule(engine: Any, stages: list[Any], schedule: Any) -> None:
    """Route the stages' and the schedule's work through `engine.run` (see the module doc): the
    built-in engine's, and a user's own schedule object (autotune/rank/torch_pp/user_schedule.py)."""
    for stage in stages:
        _hook(engine, stage, "forward_one_chunk", "ForwardPass")
        _hook(engine, stage, "backward_one_chunk", "BackwardPass")
        if hasattr(stage, "backward_weight_one_chunk"):
            _hook(engine, stage, "backward_weight_one_chunk", "BackwardPass")
        for method, kind in OPS_KIND.items():
            _tag_ops(stage, method, kind)
    _hook(engine, schedule, "_maybe_compute_loss", "ForwardPass")
    install_p2p_timing(engine)


def _hook(engine: Any, owner: Any, method: str, instruction: str) -> None:
    inner = getattr(owner, method)

    def timed(*args: Any, **kwargs: Any) -> Any:
        return engine.run(instruction, inner, *args, **kwargs)

    setattr(owner, method, timed)  # an instance attribute: the class's method is untouched


def _run_call(engine: Any, *, call: Callable[[], Any]) -> Any:
    """An instruction's function in the map: the call it was handed (the probe wraps it)."""
    return call()


def _draw(data_iter: Iterator[tuple[Any, Any]], m: int) -> tuple[Any, Any]:
    """The step's m micro-batches as one batch (the schedule splits it back along dim 0)."""
    import torch

    pairs = [next(data_iter) for _ in range(m)]
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])


def _tag_ops(stage: Any, method: str, kind: str) -> None:
    inner = getattr(stage, method)

    def tagged(*args: Any, **kwargs: Any) -> Any:
        return _tagged(list(inner(*args, **kwargs)), kind)

    setattr(stage, method, tagged)


_ACTIVE: list[Any] = []
"""The engine whose probe times the point-to-point waits (one per trial; the latest)."""


def install_p2p_timing(engine: Any) -> None:
    """Route `schedules._batch_p2p` and `_wait_batch_p2p` through `engine` (once per process)."""
    from torch.distributed.pipelining import schedules

    _ACTIVE[:] = [engine]
    if getattr(schedules, "_autotune_timed", False):
        return
    batch, wait = schedules._batch_p2p, schedules._wait_batch_p2p

    def batch_p2p(p2p_ops: list, desc: str | None = None) -> Any:
        kind = WAIT_KIND.get(desc or "", getattr(p2p_ops, "kind", DEFAULT_WAIT))
        works = batch(p2p_ops, desc=desc)
        return _tagged(list(works), kind) if isinstance(works, list) else works

    def wait_batch_p2p(work: Any) -> Any:
        if not _ACTIVE:
            return wait(work)
        return _ACTIVE[0].run(getattr(work, "kind", DEFAULT_WAIT), wait, work)

    schedules._batch_p2p = batch_p2p
    schedules._wait_batch_p2p = wait_batch_p2p
    schedules._autotune_timed = True


def build(preset: Any, *, schedule_name: str, virtual_stages: int, micro_batch_size: int, micro_batches: int,
          data_parallel_size: int, ds_config: dict[str, Any], seed: int, device: Any) -> TorchPipeEngine:
    """This rank's part of the built-in model as `PipelineStage`s, the schedule over them and the
    optimizer the ds_config names (torch.distributed must be initialized)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules

    from autotune.rank.workload.model import (
        DecoderLayerPipe,
        EmbeddingPipe,
        LMHeadPipe,
        cross_entropy_loss,
    )

    grid = Grid(dist.get_rank(), dist.get_world_size(), data_parallel_size)
    p = grid.pipe_size
    total = p * pp_schedules.stages_per_rank(schedule_name, virtual_stages)
    parts = pp_schedules.even_parts(preset.num_layers, total)
    kinds = [EmbeddingPipe] + [DecoderLayerPipe] * preset.num_layers + [LMHeadPipe]
    stages = []
    torch.manual_seed(seed)  # each rank builds its own layers in order, as DeepSpeed's LayerSpecs do
    for sid in pp_schedules.stage_ids(schedule_name, grid.stage, p, virtual_stages):
        layers = [kinds[i](preset) for i in range(parts[sid], parts[sid + 1])]
        stages.append(PipelineStage(torch.nn.Sequential(*layers).to(device), sid, total, device,
                                    group=grid.pipe_group))
    cls = getattr(schedules, pp_schedules.class_name(schedule_name))
    single = pp_schedules.SCHEDULES[schedule_name] is pp_schedules.Shape.SINGLE
    schedule = cls(stages[0] if single else stages, n_microbatches=micro_batches, loss_fn=cross_entropy_loss)
    params = [q for s in stages for q in s.submod.parameters()]
    last = next(r for r in range(p) if total - 1 in pp_schedules.stage_ids(schedule_name, r, p, virtual_stages))
    return TorchPipeEngine(stages=stages, schedule=schedule, optimizer=make_optimizer(ds_config, params), grid=grid,
                           micro_batch_size=micro_batch_size, micro_batches=micro_batches, device=device,
                           schedule_name=schedule_name,
                           gradient_clipping=float(ds_config.get("gradient_clipping") or 0.0),
                           last_rank=grid.pipe_ranks[last])


OPTIMIZERS = ("adam", "adamw", "sgd")


def make_optimizer(ds_config: dict[str, Any], params: list[Any]) -> Any:
    """The ds_config's optimizer as torch builds it: DeepSpeed's `Adam` is AdamW unless
    `adam_w_mode` is false (its FusedAdam/CPUAdam default), `AdamW` is AdamW, `SGD` is SGD."""
    import torch

    section = ds_config.get("optimizer") or {}
    kind = str(section.get("type", "AdamW")).lower()
    opts = dict(section.get("params") or {})
    w_mode = bool(opts.pop("adam_w_mode", True))
    opts.pop("torch_adam", None)
    if kind == "sgd":
        return torch.optim.SGD(params, **opts)
    if kind not in OPTIMIZERS:
        raise ValueError(f"the torch engine builds {', '.join(OPTIMIZERS)} optimizers, not {kind!r}")
    if "betas" in opts:
        opts["betas"] = tuple(opts["betas"])
    return (torch.optim.AdamW if kind == "adamw" or w_mode else torch.optim.Adam)(params, **opts)
