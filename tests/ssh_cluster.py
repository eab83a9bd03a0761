"""Two private sshd servers on distinct loopback addresses, so DeepSpeed's multi-node launchers
reach "two nodes", 127.0.0.2 and 127.0.0.3, that are not the controller's own address.

Both nodes are this machine, but each is a separate sshd bound to its own address, with its
own log: a rank started "on 127.0.0.3" is a child of that server, the master address a trial
uses is a node's, and a metrics endpoint listed under 127.0.0.3 is only reachable there when
the rank bound a wildcard address. Only addresses in 127.0.0.0/8 are used.

Nothing of the user's own ssh set-up is read or changed: the servers have their own host key,
port and authorized_keys in a temporary folder, and the client side is one ssh config file
handed to each launcher the way it documents extra ssh arguments: pdsh through
PDSH_SSH_ARGS_APPEND (`-F FILE`), Open MPI's mpirun through OMPI_MCA_plm_rsh_args, MPICH's
hydra through HYDRA_LAUNCHER_EXEC (a two-line wrapper). Needs Debian's `openssh-server` and
`pdsh`; `available()` says why not.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def available() -> str | None:
    """None when a private sshd and pdsh can run here, else what is missing."""
    for path, pkg in ((SSHD, "openssh-server"), (shutil.which("ssh") or "/usr/bin/ssh", "openssh-client"),
                      (shutil.which("pdsh") or "/usr/bin/pdsh", "pdsh")):
        if not Path(path).exists():
            return f"{Path(path).name} not installed (apt-get install {pkg})"
    return None


NODES = ("127.0.0.2", "127.0.0.3")


@dataclass
class SshCluster:
    root: Path
    port: int
    config: Path
    procs: list[subprocess.Popen]

    @property
    def env(self) -> dict[str, str]:
        """What each launcher needs to reach the nodes through these servers."""
        return {"PDSH_SSH_ARGS_APPEND": f"-F {self.config}", "OMPI_MCA_plm_rsh_args": f"-F {self.config}",
                "HYDRA_LAUNCHER_EXEC": str(self.root / "ssh-nodes")}

    def log(self, node: str) -> str:
        return (self.root / f"sshd-{node}.log").read_text(errors="replace")

    def hostfile(self, folder: Path, slots: int = 2, name: str = "hostfile") -> str:
        path = folder / name
        path.write_text("".join(f"{node} slots={slots}\n" for node in NODES))
        return str(path)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


def _free_port() -> int:
    """A port free on every node's address (each server binds it on its own address)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((NODES[0], 0))
            port = s.getsockname()[1]
        try:
            for node in NODES[1:]:
                with socket.socket() as s:
                    s.bind((node, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on both node addresses")


def start(root: Path) -> SshCluster:
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "host_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "client_key")], check=True)
    (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
    os.chmod(root / "authorized_keys", 0o600)
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory sshd insists on
    port = _free_port()
    procs = []
    for node in NODES:
        sshd_config = root / f"sshd_config-{node}"
        sshd_config.write_text(
            f"Port {port}\nListenAddress {node}\nHostKey {root / 'host_key'}\n"
            f"AuthorizedKeysFile {root / 'authorized_keys'}\nPasswordAuthentication no\n"
            f"KbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin prohibit-password\n"
            f"StrictModes no\nPidFile {root / f'sshd-{node}.pid'}\nAcceptEnv *\nPermitUserEnvironment no\n"
            "LogLevel VERBOSE\nMaxStartups 100\nMaxSessions 100\n")
        procs.append(subprocess.Popen([SSHD, "-D", "-f", str(sshd_config), "-E", str(root / f"sshd-{node}.log")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    config = root / "ssh_config"
    config.write_text(
        f"Host {' '.join(NODES)}\n  Port {port}\n  IdentityFile {root / 'client_key'}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {root / 'known_hosts'}\n"
        "  StrictHostKeyChecking no\n  BatchMode yes\n  LogLevel ERROR\n")
    wrapper = root / "ssh-nodes"
    wrapper.write_text(f"#!/bin/sh\nexec ssh -F {config} \"$@\"\n")
    wrapper.chmod(0o755)
    cluster = SshCluster(root=root, port=port, config=config, procs=procs)
    deadline = time.monotonic() + 20
    waiting = list(NODES)
    while waiting and time.monotonic() < deadline:
        r = subprocess.run(["ssh", "-F", str(config), waiting[0], "true"], capture_output=True)
        if r.returncode == 0:
            waiting.pop(0)
            continue
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    if not waiting:
        return cluster
    cluster.stop()
    logs = " | ".join(cluster.log(n)[-300:] for n in NODES if (root / f"sshd-{n}.log").exists())
    raise RuntimeError(f"private sshd on {waiting[0]} did not come up: {logs}")
