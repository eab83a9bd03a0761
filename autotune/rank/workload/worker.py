"""A warm rank: launched once, runs one trial after another in the same process.

Started by DeepSpeed's launcher like a fresh rank (autotune/trials/warm_pool.py starts it). The
process group and the imported libraries stay; every trial builds a fresh model and
engine from its trial folder (trial.json, ds_config.json) through the same
`run_trial` a fresh rank runs, then releases them.

The protocol is files in the pool folder, written atomically by their one writer:
- the controller writes `job-K.json` ({"trial_spec": PATH}) for the K-th trial of this
  pool, or `stop` to end it;
- each rank answers `done-K-rankR.json` (its memory before and after, its losses) when
  trial K ended well on it. A trial that failed on a rank ends the rank with the exit
  code a fresh rank would use: the launcher then stops the others as it does for a
  fresh trial, the controller reads the same ending, and the next trial starts fresh
  workers (a failed trial may have left the process group or the device unusable).
A rank whose controller is gone (its pid no longer runs) removes its /dev/shm buffer
and exits, so a killed controller leaves nothing running.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

POLL_SECONDS = 0.02


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pool", required=True, help="the pool folder (autotune/trials/warm_pool.py)")
    p.add_argument("--controller-pid", type=int, required=True, help="exit when this process is gone")
    return p.parse_args(argv)


def rss_bytes() -> int:
    """This process's resident memory now (not its peak)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_bytes() -> int | None:
    """CUDA memory allocated and reserved by this process (None without CUDA)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return int(torch.cuda.memory_reserved())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_job(pool: Path, k: int, controller: int) -> Path | None:
    """The trial description of job `k`, or None when told to stop or the controller is gone."""
    job, stop = pool / f"job-{k}.json", pool / "stop"
    while True:
        if job.exists():
            return Path(json.loads(job.read_text(encoding="utf-8"))["trial_spec"])
        if stop.exists() or not _alive(controller):
            return None
        time.sleep(POLL_SECONDS)


def write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def remove_own_shm_buffer(rank: int) -> None:
    """DeepSpeed's CPU comm op never unlinks its /dev/shm buffer; this rank's goes with it."""
    port = os.environ.get("MASTER_PORT")
    if not port:
        return
    for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_{rank}"):
        try:
            f.unlink()
        except OSError:
            pass


def exit_now(rank: int, pool: Path | None = None) -> None:
    """Told to stop (or orphaned): nothing is left to write, so skip the interpreter's teardown
    of torch, DeepSpeed and the gloo group, which takes 1.5-4 s per rank on the CPU demo and
    is paid at the end of every run."""
    remove_own_shm_buffer(rank)
    sys.stdout.flush()
    sys.stderr.flush()
    if pool is not None:
        try:
            (pool / f"exited-rank{rank}").write_text("", encoding="utf-8")
        except OSError:
            pass  # the controller then waits for the launcher instead
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pool = Path(args.pool)
    rank = int(os.environ.get("RANK", "0"))
    from autotune.rank.wiring import rank_watchdog
    from autotune.rank.workload.groups import existing as process_groups
    from autotune.rank.workload.train import run_trial, setup_process, startup_fault
    from autotune.rank.workload.trial_spec import TrialSpec

    k, ready = 0, False
    try:
        while True:
            spec_path = wait_for_job(pool, k, args.controller_pid)
            if spec_path is None:
                exit_now(rank, pool)
            spec = TrialSpec.read(spec_path)
            dog = rank_watchdog(spec.plan)
            if dog is not None:  # later jobs: from taking the job (the engine build)
                dog.startup(from_process_start=not ready)
            startup_fault(spec)
            if not ready:
                setup_process(spec.workload.threads)
                ready = True
            started = time.monotonic()
            rss_before, dev_before = rss_bytes(), device_bytes()
            print(f"autotune: warm worker rank {rank}: trial {spec.plan.trial} (job {k} of this pool)",
                  file=sys.stderr, flush=True)
            run = run_trial(spec, release=True, watchdog=dog)
            if run.exit_code != 0:
                return run.exit_code  # as a fresh rank would: the launcher stops the others
            gc.freeze()  # what outlived the trial (imports, the process group) is left out of later collections
            write_atomic(pool / f"done-{k}-rank{rank}.json", {
                "trial": spec.plan.trial, "rank": rank, "seconds": time.monotonic() - started,
                "rss_before_bytes": rss_before, "rss_after_bytes": rss_bytes(),
                "device_before_bytes": dev_before, "device_after_bytes": device_bytes(),
                "open_fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
                "process_groups": len(process_groups()), "losses": run.losses,  # constant: groups.py
            })
            k += 1
    finally:
        remove_own_shm_buffer(rank)


if __name__ == "__main__":
    sys.exit(main())
