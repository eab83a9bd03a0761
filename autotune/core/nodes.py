"""Which node of a multi-node trial a rank runs on, by the name the controller reached it by.

A rank's metrics endpoint must be listed in the run's Prometheus targets file under an address
the controller's side can scrape. A rank bound to a wildcard address (`--metrics-addr 0.0.0.0`)
knows only its machine's own name (`socket.gethostname()`), which is often a short name that
does not resolve elsewhere, and on a test cluster of loopback "nodes" is the same everywhere.
The hostfile's name for the node is how pdsh, mpirun and srun reached it, so that is what the
controller tells every rank (one variable in the trial's `.deepspeed_env`, read on every node):

    AUTOTUNE_NODES=127.0.0.2=2,127.0.0.3=2

A rank finds its node from its global rank, numbered node by node in hostfile order as
DeepSpeed's launch.py (pdsh), mpirun's by-slot mapping (openmpi) and `-ppn` (mpich) number them.
Under srun, Slurm names the node itself (SLURMD_NODENAME), since srun places tasks by its own
node list rather than the hostfile's order.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping

NODES_ENV = "AUTOTUNE_NODES"


def encode_nodes(hosts: Iterable[tuple[str, int]]) -> str:
    """The variable's value: `host=slots` pairs in rank order (host names hold no `=` or `,`)."""
    return ",".join(f"{host}={int(slots)}" for host, slots in hosts)


def node_of_rank(rank: int, value: str) -> str | None:
    """The node that holds global `rank`, from an encoded node list; None when it says nothing."""
    first = 0
    for pair in value.split(","):
        host, sep, slots = pair.rpartition("=")
        if not sep or not host or not slots.isdigit():
            return None  # not ours: the machine's own name is the honest fallback
        if rank < first + int(slots):
            return host
        first += int(slots)
    return None


def this_node(env: Mapping[str, str] | None = None) -> str:
    """This rank's node: Slurm's name for it, else the hostfile's, else the machine's own name."""
    env = os.environ if env is None else env
    if env.get("SLURMD_NODENAME"):
        return env["SLURMD_NODENAME"]
    rank = env.get("RANK", "")
    if env.get(NODES_ENV) and rank.isdigit():
        host = node_of_rank(int(rank), env[NODES_ENV])
        if host:
            return host
    return socket.gethostname()
