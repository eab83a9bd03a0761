"""A rank started by mpirun or srun learns its torch.distributed rank from its process manager.

DeepSpeed's pdsh path runs `deepspeed.launcher.launch` on every node, which sets RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; its mpich path runs launcher_helper.py,
which maps MPICH's PMI_RANK. Its openmpi and slurm runners (DeepSpeed 0.19.8,
multinode_runner.py) start the script directly and set none of them: `deepspeed.init_distributed`
then falls back to `mpi_discovery`, which needs mpi4py (an MPI build of a Python package that
a CPU-only or a container environment rarely has), and asks `hostname -I` of rank 0 for the
master address.

The process managers already say everything needed: Open MPI's OMPI_COMM_WORLD_* and Slurm's
SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS. The controller puts MASTER_ADDR and MASTER_PORT in
the trial's `.deepspeed_env`, which both runners export to every rank. `adopt()` maps the rest
before anything reads RANK; it changes nothing when the launcher set RANK itself.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# (rank, local rank, world size, local size): the first variable present names the manager
SOURCES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", None),
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
)


def adopt(env: MutableMapping[str, str] | None = None) -> bool:
    """Set RANK, LOCAL_RANK, WORLD_SIZE (and LOCAL_SIZE) from the process manager's variables
    when the launcher set no RANK and the controller gave the master; True when it did."""
    env = os.environ if env is None else env
    if "RANK" in env or "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return False
    for rank, local_rank, size, local_size in SOURCES:
        if rank in env and local_rank in env and size in env:
            env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"] = env[rank], env[local_rank], env[size]
            if local_size is not None and local_size in env:
                env.setdefault("LOCAL_SIZE", env[local_size])
            return True
    return False
