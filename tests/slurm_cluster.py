"""A real Slurm on this machine: munged, slurmctld and two slurmd, all from one temporary folder.

Debian's `slurm-wlm` (22.05) and `munge`. The two nodes, `node-a` and `node-b`, are this
machine at 127.0.0.2 and 127.0.0.3 (each slurmd is started for its node with `-N`, and its
NodeAddr is that address), with 2 CPUs each whatever the machine has (`config_overrides`), so
an allocation of 4 tasks spans both. Nothing outside the folder is read or written: the
daemons get the configuration through SLURM_CONF, munge its own key and socket, and the
commands a test runs (salloc, sbatch, scancel) get the same SLURM_CONF from `env`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = {"node-a": "127.0.0.2", "node-b": "127.0.0.3"}
DAEMONS = ("munged", "slurmctld", "slurmd")


def available() -> str | None:
    """None when Slurm can run here, else what is missing."""
    for binary, pkg in (("munged", "munge"), ("slurmctld", "slurm-wlm"), ("slurmd", "slurm-wlm"),
                        ("salloc", "slurm-client"), ("sbatch", "slurm-client")):
        if shutil.which(binary) is None and not Path("/usr/sbin", binary).exists():
            return f"{binary} not installed (apt-get install {pkg})"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as their user"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    root: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.root / "slurm.conf")}

    def log(self, name: str) -> str:
        path = self.root / name
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        subprocess.run(["pkill", "-9", "-f", f"slurmstepd.*{self.root}"], capture_output=True)


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def start(root: Path) -> SlurmCluster:
    root.mkdir(parents=True, exist_ok=True)
    cluster = SlurmCluster(root=root)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    cluster.procs.append(subprocess.Popen(
        [_binary("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={root / 'munge.sock'}",
         f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munged.seed'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    ctld_port, *node_ports = _free_ports(1 + len(NODES))
    host = socket.gethostname()
    nodes = "".join(f"NodeName={name} NodeAddr={addr} NodeHostname={host} CPUs=2 Port={port} State=UNKNOWN\n"
                    for (name, addr), port in zip(NODES.items(), node_ports, strict=True))
    (root / "state").mkdir(exist_ok=True)
    (root / "slurm.conf").write_text(
        f"ClusterName=autotune-test\nSlurmctldHost={host}(127.0.0.1)\nSlurmUser=root\n"
        f"SlurmctldPort={ctld_port}\nAuthType=auth/munge\nCredType=cred/munge\n"
        f"AuthInfo=socket={root / 'munge.sock'}\nStateSaveLocation={root / 'state'}\n"
        f"SlurmdSpoolDir={root}/spool-%n\nSlurmctldPidFile={root / 'slurmctld.pid'}\n"
        f"SlurmdPidFile={root}/slurmd-%n.pid\nSlurmctldLogFile={root / 'slurmctld.log'}\n"
        f"SlurmdLogFile={root}/slurmd-%n.log\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nSlurmdParameters=config_overrides\n"
        "ReturnToService=2\nMpiDefault=none\nSwitchType=switch/none\nJobAcctGatherType=jobacct_gather/none\n"
        "AccountingStorageType=accounting_storage/none\nKillWait=5\nInactiveLimit=0\n"
        f"{nodes}PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP\n")
    env = {**os.environ, **cluster.env}
    _wait(lambda: (root / "munge.sock").exists(), "munged", cluster)
    cluster.procs.append(subprocess.Popen([_binary("slurmctld"), "-c", "-D"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for name in NODES:
        cluster.procs.append(subprocess.Popen([_binary("slurmd"), "-N", name, "-D"], env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def idle() -> bool:
        r = subprocess.run(["sinfo", "-h", "-o", "%t %D"], capture_output=True, text=True, env=env)
        return r.returncode == 0 and r.stdout.split() == ["idle", str(len(NODES))]

    _wait(idle, "two idle slurmd nodes", cluster)
    return cluster


def _wait(ready, what: str, cluster: SlurmCluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if any(p.poll() is not None for p in cluster.procs):
            break
        time.sleep(0.3)
    cluster.stop()
    raise RuntimeError(f"Slurm did not come up ({what}): {cluster.log('slurmctld.log')[-600:]}")
