"""One trial rank of the built-in workload under torch.distributed.pipelining (`--engine torch`).

Launched by torchrun (`torchrun --nproc-per-node N train.py --trial-spec trial.json`), one
process per rank, as autotune/rank/workload/train.py is by DeepSpeed's launcher: the same trial
description, the same rank plan (probe, records, endpoint, step budget, watchdog), the same exit
codes and the same loop (`_train`); only the engine differs (autotune/rank/torch_pp/engine.py).
"""

from __future__ import annotations

import json
import os
import sys

from autotune.rank.engine_face import layout_of
from autotune.rank.workload.train import TrialRun, parse_args, startup_fault


def main(argv: list[str] | None = None) -> int:
    spec = parse_args(argv)
    if spec.fault == "nometrics":  # testing seam: every rank exits 0 at once, no metrics written
        return 0
    from autotune.rank.wiring import rank_watchdog

    dog = rank_watchdog(spec.plan)
    if dog is not None:
        dog.startup()
    startup_fault(spec)
    setup_process(spec.workload.threads)
    return run_trial(spec, watchdog=dog).exit_code


def setup_process(threads: int) -> None:
    """Once per rank: torch's threads and the process group (NCCL on a GPU, gloo on a CPU)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        import os

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def run_trial(spec, *, watchdog=None) -> TrialRun:
    import torch
    import torch.distributed as dist

    from autotune.rank.torch_pp.engine import build
    from autotune.rank.wiring import wire
    from autotune.rank.workload.data import batches, load_token_file, synthetic_tokens
    from autotune.rank.workload.presets import get_preset
    from autotune.rank.workload.train import steps_then_close

    wl = spec.workload
    preset = get_preset(wl.preset)
    with open(spec.ds_config, encoding="utf-8") as fh:
        ds_config = json.load(fh)
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    micro = int(ds_config["train_micro_batch_size_per_gpu"])
    engine = build(preset, schedule_name=wl.schedule, virtual_stages=wl.virtual_stages, micro_batch_size=micro,
                   micro_batches=int(ds_config["gradient_accumulation_steps"]),
                   data_parallel_size=wl.data_parallel_size, ds_config=ds_config,
                   seed=wl.seed, device=device)
    wiring = wire(engine, spec.plan, seq_length=preset.seq_length)
    tokens = (load_token_file(wl.tokens, preset.vocab_size) if wl.tokens
              else synthetic_tokens(preset.vocab_size, 200_000, seed=wl.seed))
    data = batches(tokens, micro_batch=micro, seq=preset.seq_length, seed=wl.seed + layout_of(engine).data_parallel_rank)
    losses: list[float] = []
    code = steps_then_close(spec, engine, wiring, data, watchdog, losses)  # the CSV written either way
    if code == 0:
        dist.destroy_process_group()  # a failed rank ends without a shutdown (`exit_now`)
    return TrialRun(exit_code=code, losses=losses)


def exit_now(code: int) -> None:
    """End a failed rank with its exit code and no interpreter shutdown. At shutdown the process
    group's gloo threads can be torn down while still joinable: in a fresh-clone suite run
    (2026-12-06) the NaN-loss trial's rank aborted there ("terminate called without an active
    exception", SIGABRT), so torchrun reported signal 6 and the trial read as killed, not
    nonfinite_loss."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if code != 0:
        exit_now(code)
    sys.exit(code)
