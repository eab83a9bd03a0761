"""A private sshd on loopback, so DeepSpeed's pdsh launcher can reach "two nodes" that are
both this machine (`localhost` and `127.0.0.1`).

Nothing of the user's own ssh set-up is read or changed: the server has its own host key,
port and authorized_keys in a temporary folder, and the client side is one ssh config file
handed to pdsh through PDSH_SSH_ARGS_APPEND (`-F FILE`), the variable pdsh documents for
extra ssh arguments. Needs Debian's `openssh-server` and `pdsh`; `available()` says why not.
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


@dataclass
class SshCluster:
    root: Path
    port: int
    config: Path
    proc: subprocess.Popen

    @property
    def env(self) -> dict[str, str]:
        """What a launcher needs to reach the nodes through this server."""
        return {"PDSH_SSH_ARGS_APPEND": f"-F {self.config}"}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(root: Path) -> SshCluster:
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "host_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "client_key")], check=True)
    (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
    os.chmod(root / "authorized_keys", 0o600)
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory sshd insists on
    port = _free_port()
    sshd_config = root / "sshd_config"
    sshd_config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {root / 'host_key'}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\nPasswordAuthentication no\n"
        f"KbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin prohibit-password\n"
        f"StrictModes no\nPidFile {root / 'sshd.pid'}\nAcceptEnv *\nPermitUserEnvironment no\n")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(sshd_config)], stdout=subprocess.DEVNULL,
                            stderr=open(root / "sshd.log", "wb"))
    config = root / "ssh_config"
    config.write_text(
        f"Host localhost 127.0.0.1\n  Port {port}\n  IdentityFile {root / 'client_key'}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {root / 'known_hosts'}\n"
        "  StrictHostKeyChecking no\n  BatchMode yes\n  LogLevel ERROR\n")
    cluster = SshCluster(root=root, port=port, config=config, proc=proc)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = subprocess.run(["ssh", "-F", str(config), "127.0.0.1", "true"], capture_output=True)
        if r.returncode == 0:
            return cluster
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    cluster.stop()
    raise RuntimeError(f"private sshd did not come up: {(root / 'sshd.log').read_text()[-500:]}")
