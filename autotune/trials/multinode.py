"""Trials across nodes, through DeepSpeed's own multi-node launchers (pdsh, openmpi, slurm, ...).

autotune does not launch remote processes itself: every trial is one `deepspeed` launcher
command with the user's `--hostfile`, `--include`/`--exclude`, `--num_nodes`, `--num_gpus`,
`--master_addr`, `--launcher` and `--launcher_args` passed through. What this module adds is
what a tuning run needs around that command:

- the checks before the first trial (`resolve_cluster`): the hostfile read with DeepSpeed's
  own parser and filters, its slots against stages x dp, the launcher's binary installed
  (and for mpich, that `mpirun` is MPICH's), each host resolving and reachable over ssh the
  way pdsh and mpirun will connect (PDSH_SSH_ARGS_APPEND, --ssh_port); under Slurm, the
  allocation's tasks and nodes instead of ssh;
- the master address (`cluster_args`) and, for the runners that export none (openmpi,
  slurm), the master in every rank's environment (`rendezvous_env`, read by
  autotune/rank/launcher_ranks.py);
- the environment every node's ranks need (`write_node_env`): DeepSpeed's multi-node
  runners export only a few variable prefixes (PYTHON*, MLFLOW*, ...) plus the lines of a
  `.deepspeed_env` file, so autotune writes one such file per trial (the user's own lines
  first) and points DeepSpeed at it with DS_ENV_FILE;
- stopping a trial on every node (`stop_on_nodes`): the local launcher's process group holds
  only pdsh/ssh (or mpirun/srun); ranks on other nodes are found by the trial folder on their
  command line, which is also how a resumed study finds leftovers.

The study folder must be on a filesystem every node sees under the same path (NFS, Lustre,
a cluster's home): each rank writes its metrics CSV into the trial folder and reads its
trial description from there. That is how clusters that run DeepSpeed already work (the
script and the config are read from shared storage too), and it keeps the rank side the
same as on one machine. docs/multi-node.md says so to the user.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from autotune.core.errors import UserError
from autotune.core.nodes import NODES_ENV, encode_nodes
from autotune.core.options import LauncherOptions

ENV_FILE_NAME = "deepspeed_env"
"""Per-trial `.deepspeed_env` (DS_ENV_FILE): the variables the ranks of every node get."""

LAUNCHER_BINARIES = {"pdsh": "pdsh", "openmpi": "ompi_info", "mpich": "mpirun", "impi": "mpirun",
                     "mvapich": "mpiname", "slurm": "sinfo"}
"""The binary each DeepSpeed launcher backend checks for (multinode_runner.py backend_exists)."""
SSH_LAUNCHERS = ("pdsh", "openmpi", "mpich", "impi", "mvapich")
"""Launchers that start each node's processes over ssh (pdsh itself; mpirun's daemons by default).
srun starts them through slurmd instead."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Where a trial's ranks run: host -> slot count, in DeepSpeed's rank order."""

    hosts: OrderedDict[str, int]
    options: LauncherOptions

    @property
    def world_size(self) -> int:
        return sum(self.hosts.values())

    @property
    def multi_node(self) -> bool:
        return len(self.hosts) > 1

    def host_of_rank(self, rank: int) -> str:
        """DeepSpeed numbers ranks node by node in hostfile order (launch.py's world_info)."""
        first = 0
        for host, slots in self.hosts.items():
            if rank < first + slots:
                return host
            first += slots
        raise ValueError(f"rank {rank} is outside the cluster's {self.world_size} slots")

    def describe(self) -> str:
        return ", ".join(f"{h}:{n}" for h, n in self.hosts.items())


def resolve_cluster(opts: LauncherOptions, world_size: int | None, *, check_hosts: bool = True) -> Cluster | None:
    """The cluster a run's trials use, checked before any trial; None for a plain local launch.

    Every problem is one UserError: an unreadable or malformed hostfile, filters that leave
    other than stages x dp slots, a launcher that is not installed, a host ssh cannot reach.
    `world_size` None: the ranks are what the slots give (the user's own command).
    """
    if not opts.given:
        return None
    if opts.num_gpus is not None and opts.hostfile is None and world_size is not None \
            and opts.num_gpus != world_size:
        raise UserError(f"--num_gpus {opts.num_gpus} on one machine gives {opts.num_gpus} ranks; the run "
                        f"needs stages x dp = {world_size}")
    if (opts.include or opts.exclude) and (opts.num_nodes is not None or opts.num_gpus is not None):
        raise UserError("--num_nodes/--num_gpus cannot be combined with --include/--exclude "
                        "(the deepspeed launcher refuses it too)")
    if opts.launcher not in LAUNCHER_BINARIES:
        raise UserError(f"--launcher {opts.launcher!r} is not one of DeepSpeed's: "
                        f"{', '.join(sorted(LAUNCHER_BINARIES))}")
    if opts.hostfile is None and world_size is None:
        return None  # the user's own one-machine launch: nothing to place or check
    pool = _read_hostfile(opts.hostfile) if opts.hostfile else OrderedDict(localhost=world_size)
    hosts = _apply_filters(pool, opts)
    cluster = Cluster(hosts=hosts, options=opts)
    if world_size is not None and cluster.world_size != world_size:
        raise UserError(f"the hostfile{' and filters give' if opts.include or opts.exclude or opts.num_nodes else ' gives'} "
                        f"{cluster.world_size} slots ({cluster.describe()}); the run needs "
                        f"stages x dp = {world_size}: change --stages/--dp or the slots")
    if not cluster.multi_node and opts.hostfile is not None:
        (host,) = hosts
        if not is_this_machine(host):
            raise UserError(f"--hostfile {opts.hostfile} names one host, {host}, and it is not this machine "
                            f"({_where(host)}): DeepSpeed runs a one-host hostfile here, so every trial would "
                            f"run on this machine; start autotune on {host}, or list this machine too")
    if cluster.multi_node:
        binary = LAUNCHER_BINARIES[opts.launcher]
        if shutil.which(binary) is None:
            raise UserError(f"--launcher {opts.launcher} needs {binary!r}, which is not installed here "
                            f"(on Debian: apt-get install {_DEBIAN_PACKAGE.get(opts.launcher, binary)})")
        if opts.launcher == "mpich":
            _check_mpirun_is_mpich()
        if opts.launcher == "slurm":
            check_slurm_allocation(cluster.world_size, os.environ)
        if opts.launcher == "slurm" and check_hosts:
            check_slurm_nodes(hosts, os.environ)
        elif check_hosts:
            for host in hosts:  # every name first: a typo is said as one, not as ssh's failure
                _check_resolves(host, opts.ssh_port)
            for host in hosts if opts.launcher in SSH_LAUNCHERS else ():
                _check_ssh(host, opts.ssh_port)
    return cluster


def check_slurm_nodes(hosts: OrderedDict[str, int], env: dict[str, str] | os._Environ[str]) -> None:
    """Under srun the hostfile's hosts are Slurm's node names (`scontrol show hostnames`, as
    docs/multi-node.md writes the file): each must be a node of this allocation, since srun
    places the ranks on the allocation's nodes whatever the hostfile says."""
    nodes = slurm_job_nodes(env)
    if nodes is None:
        return  # no node list to compare with (an allocation that does not say, or no scontrol)
    missing = [h for h in hosts if h not in nodes]
    if missing:
        raise UserError(f"hostfile host{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                        f"{'are' if len(missing) > 1 else 'is'} not in Slurm allocation {env.get('SLURM_JOB_ID')} "
                        f"(its nodes: {', '.join(nodes)}); write the hostfile from the allocation: "
                        "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed 's/$/ slots=N/'")


def slurm_job_nodes(env: dict[str, str] | os._Environ[str]) -> list[str] | None:
    """The allocation's node names, expanded by Slurm itself; None when it cannot say."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist or shutil.which("scontrol") is None:
        return None
    try:
        r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.split() if r.returncode == 0 and r.stdout.split() else None


def slurm_node_address(node: str) -> str | None:
    """The address slurmctld reaches a node at (its NodeAddr), which is where its ranks listen."""
    try:
        r = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for word in r.stdout.split() if r.returncode == 0 else []:
        if word.startswith("NodeAddr=") and len(word) > len("NodeAddr="):
            return word.split("=", 1)[1]
    return None


def _check_mpirun_is_mpich() -> None:
    """DeepSpeed's mpich runner calls plain `mpirun` with hydra's options (-ppn, -genv, -hosts).
    Debian's openmpi-bin and mpich both provide `mpirun` (update-alternatives), and Open MPI's
    refuses those options only after the launch; said here, before any trial."""
    try:
        r = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return  # not installed was said above; a hung mpirun is for the trial to show
    if "Open MPI" in r.stdout + r.stderr:
        raise UserError(f"--launcher mpich runs `mpirun`, and {shutil.which('mpirun')} is Open MPI's: put "
                        "MPICH's first on PATH (a wrapper script `exec /usr/bin/mpirun.mpich \"$@\"`; a symlink leaves "
                        "hydra without its proxy) or "
                        "`update-alternatives --set mpirun /usr/bin/mpirun.mpich`; or use --launcher openmpi")


def check_slurm_allocation(world_size: int, env: dict[str, str] | os._Environ[str]) -> None:
    """DeepSpeed's slurm runner starts every trial's ranks with `srun -n WORLD` (multinode_runner.py
    SlurmRunner), which needs an allocation holding that many tasks: outside one, or in one with
    fewer tasks, each trial would fail the same way. Only the counts Slurm sets are compared
    (SLURM_NTASKS: the allocation was asked for tasks, `salloc -n`)."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        raise UserError("--launcher slurm starts the ranks with srun inside an allocation, and this is "
                        f"not one (no SLURM_JOB_ID): start autotune inside `salloc -n {world_size} ...` or "
                        "an sbatch script (docs/multi-node.md)")
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or ""
    if tasks.isdigit() and int(tasks) < world_size:
        raise UserError(f"Slurm allocation {job} holds {tasks} tasks; every trial needs stages x dp = "
                        f"{world_size} (srun -n {world_size}): allocate at least that many")


def is_this_machine(host: str) -> bool:
    """Whether `host` names this machine: localhost, its own name, or an address that resolves to
    a loopback address or to one of this machine's name's addresses."""
    import ipaddress
    import socket

    name = socket.gethostname()
    if host in ("localhost", name, socket.getfqdn()):
        return True
    own = set(_addresses(name))
    for address in _addresses(host):
        try:
            if ipaddress.ip_address(address.split("%", 1)[0]).is_loopback or address in own:
                return True
        except ValueError:
            continue
    return False


def _addresses(host: str) -> list[str]:
    import socket

    try:
        return [str(info[4][0]) for info in socket.getaddrinfo(host, None)]
    except (OSError, UnicodeError):
        return []


def _where(host: str) -> str:
    found = _addresses(host)
    return f"it resolves to {', '.join(dict.fromkeys(found))}" if found else "it does not resolve"


_DEBIAN_PACKAGE = {"pdsh": "pdsh", "openmpi": "openmpi-bin", "mpich": "mpich", "slurm": "slurm-client",
                   "mvapich": "mvapich (not in Debian)", "impi": "Intel MPI (not in Debian)"}


def _read_hostfile(path: str) -> OrderedDict[str, int]:
    from deepspeed.launcher.runner import _parse_hostfile  # DeepSpeed's own reading of the format

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"--hostfile {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--hostfile {path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        return _parse_hostfile(lines)
    except ValueError as exc:
        raise UserError(f"--hostfile {path}: {exc} (one 'HOST slots=N' per line)") from None


def _apply_filters(pool: OrderedDict[str, int], opts: LauncherOptions) -> OrderedDict[str, int]:
    """DeepSpeed's --include/--exclude and --num_nodes/--num_gpus, applied as its runner applies them."""
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, parse_inclusion_exclusion

    try:
        active = parse_inclusion_exclusion(pool, opts.include, opts.exclude)
        active = apply_num_nodes_and_gpus(active, -1 if opts.num_nodes is None else opts.num_nodes,
                                          -1 if opts.num_gpus is None else opts.num_gpus)
    except (ValueError, KeyError) as exc:
        raise UserError(f"--include/--exclude: {exc}") from None
    return OrderedDict((h, len(slots)) for h, slots in active.items() if slots)


def ssh_command(host: str, ssh_port: int | None) -> list[str]:
    """ssh to `host` as pdsh will: its extra arguments (PDSH_SSH_ARGS_APPEND) and --ssh_port."""
    extra = shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", *extra, *port, host]


def _check_resolves(host: str, ssh_port: int | None) -> None:
    """A host must have an address: by DNS (or /etc/hosts), or through the ssh configuration the
    launcher connects with (a `Host` alias with its `HostName`), which `ssh -G` reads."""
    if _addresses(host):
        return
    try:
        r = subprocess.run([*ssh_command(host, ssh_port)[:-1], "-G", host], capture_output=True, text=True,
                           timeout=10)
        mapped = next((ln.split(None, 1)[1] for ln in r.stdout.splitlines() if ln.startswith("hostname ")), host)
    except (OSError, subprocess.TimeoutExpired, IndexError):
        mapped = host
    if mapped != host and _addresses(mapped):
        return
    raise UserError(f"hostfile host {host!r} does not resolve (no DNS or /etc/hosts entry"
                    f"{'' if mapped == host else f', and its ssh HostName {mapped!r} neither'}); "
                    "check the spelling in the hostfile")


def _check_ssh(host: str, ssh_port: int | None) -> None:
    try:
        r = subprocess.run([*ssh_command(host, ssh_port), "true"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise UserError("multi-node trials need ssh (apt-get install openssh-client)") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"host {host} did not answer ssh within 30 s; check the hostfile and the network") from None
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise UserError(f"host {host} cannot be reached over ssh ({why}); pdsh needs passwordless ssh "
                        "to every host of the hostfile")


def node_env_lines(env: dict[str, str], *, cwd: Path | None = None) -> list[str]:
    """The `.deepspeed_env` lines for a trial: the user's own files first (DS_ENV_FILE replaces
    their name, so they would otherwise be dropped), then what autotune's ranks need. A PATH
    the user's file sets is theirs: autotune's is then left out."""
    lines: list[str] = []
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    for folder in (Path.home(), cwd or Path.cwd()):
        f = folder / name
        if f.is_file():
            lines += [ln.rstrip("\n") for ln in f.read_text(encoding="utf-8").splitlines() if "=" in ln]
    users = {ln.split("=", 1)[0].strip() for ln in lines}
    lines += [f"{k}={v}" for k, v in env.items() if not (k == "PATH" and "PATH" in users)]
    return lines


def launch_path(path: str) -> dict[str, str]:
    """PATH for every node's ranks: the one this launch runs with, so a rank elsewhere finds the
    same ninja the pre-flight built the ops with (DeepSpeed's runner gives remote ranks the node's
    login PATH; another ninja there rebuilds the ops inside their start-up, docs/robustness.md).
    DeepSpeed writes the line unquoted into a shell command: a PATH a shell would split is left out."""
    return {"PATH": path} if path and not set(path) & set(" \t\n'\"$`\\;&|<>(){}*?!#~") else {}


def rank_env(*, own_tools: bool = True) -> dict[str, str]:
    """What every node's ranks need from the controller's environment: DS_ACCELERATOR only when
    the user set it (a login node without GPUs must not make GPU nodes run on CPU), autotune's
    own AUTOTUNE_* settings, one torch thread per rank unless the user chose otherwise, and the
    PATH the launch runs with (`own_tools`: this environment's bin first, as the local ranks
    autotune starts get it, launcher.TrialProcess.launch_env; a user's command keeps its own)."""
    from autotune.trials.launcher import with_own_tools

    env = {k: v for k, v in os.environ.items() if k.startswith("AUTOTUNE_") or k == "DS_ACCELERATOR"}
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    path = os.environ.get("PATH", "")
    env.update(launch_path(with_own_tools(path) if own_tools else path))
    return env


def node_env(trial_dir: Path, cluster: Cluster, extra: dict[str, str] | None = None, *, cwd: Path | None = None,
             own_tools: bool = True) -> dict[str, str]:
    """Write the trial's env file; returns the launcher-side variable that points DeepSpeed at it.
    Every rank also learns the cluster's nodes by their hostfile names (core/nodes.py), so it
    lists its metrics endpoint under the name the controller reached its node by."""
    path = trial_dir / ENV_FILE_NAME
    nodes = {NODES_ENV: encode_nodes(cluster.hosts.items())}
    lines = node_env_lines({**rank_env(own_tools=own_tools), **nodes, **(extra or {})}, cwd=cwd)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"DS_ENV_FILE": str(path)}  # absolute: os.path.join(home, abs) is abs in DeepSpeed's runner


def cluster_args(cluster: Cluster) -> list[str]:
    """The launcher options of every trial on `cluster`. A multi-node launch gets the master
    address resolved and `--no_ssh_check`: autotune checked each host itself, the way the
    launcher connects (DeepSpeed's own check and address lookup call plain `ssh HOST` and
    ignore PDSH_SSH_ARGS_APPEND; under Slurm there may be no ssh at all). A one-host launch
    runs locally, so it needs no ssh at all."""
    opts = cluster.options
    args = opts.argv()
    if cluster.multi_node:
        if not opts.master_addr:
            first = next(iter(cluster.hosts))
            args += ["--master_addr", master_address(first, opts.ssh_port, over_ssh=opts.launcher in SSH_LAUNCHERS)]
        args.append("--no_ssh_check")
    else:
        # One host: DeepSpeed launches every rank on this machine (its local path), but with a
        # hostfile it still runs `ssh HOST hostname` and `ssh HOST hostname -I` first, which
        # fail on a machine that has no ssh server to itself.
        if not opts.master_addr:
            args += ["--master_addr", "127.0.0.1"]
        args.append("--no_ssh_check")
    return args


RENDEZVOUS_BY_ENV_FILE = ("openmpi", "slurm")
"""Runners that start the script directly and export no master (DeepSpeed 0.19.8
multinode_runner.py): the trial's env file carries it (autotune/rank/launcher_ranks.py)."""


def rendezvous_env(cluster: Cluster | None, args: list[str], master_port: int) -> dict[str, str]:
    """MASTER_ADDR and MASTER_PORT for every rank, where the runner does not set them itself."""
    if cluster is None or not cluster.multi_node or cluster.options.launcher not in RENDEZVOUS_BY_ENV_FILE:
        return {}
    addr = next((a.split("=", 1)[1] for a in args if a.startswith("--master_addr=")), None)
    if addr is None:
        addr = args[args.index("--master_addr") + 1]  # cluster_args always gives one
    return {"MASTER_ADDR": addr, "MASTER_PORT": str(master_port)}


def master_address(host: str, ssh_port: int | None, *, over_ssh: bool = True) -> str:
    """The address the other nodes reach rank 0 at: `host` itself when the hostfile gives an
    address (it is the one the controller reached that node by; `hostname -I` there may put a
    container bridge first), else the first address `hostname -I` gives there, as DeepSpeed's
    runner asks it; without ssh (Slurm), the name's first address as this machine resolves it."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not over_ssh:  # srun: Slurm knows the node's address; else this machine's resolver
        slurm = slurm_node_address(host) if shutil.which("scontrol") else None
        if slurm:
            return slurm
        found = _addresses(host)
        if not found:
            raise UserError(f"cannot find the address of {host}; give --master_addr")
        return found[0]
    try:
        r = subprocess.run([*ssh_command(host, ssh_port), "hostname", "-I"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        r = None
    words = r.stdout.split() if r is not None and r.returncode == 0 else []
    if not words:
        raise UserError(f"cannot find the address of {host} (`hostname -I` over ssh); give --master_addr")
    return words[0]


class _HasMasterPort(Protocol):
    master_port: int | None


def stop_on_other_nodes(cluster: Cluster | None, marker: str | None) -> Callable[[_HasMasterPort], None]:
    """The one hook every launch runs once its local process group is gone (`run_launch`'s
    `after_stop`; `autotune watch` calls it too): on several nodes, the ranks there are children
    of each node's sshd, not of the launcher's group, so they are stopped over ssh
    (`stop_on_nodes`); on one node, nothing. `marker`: the trial folder on the ranks' command
    lines, None for a watched job (its launcher's master port names it)."""
    def stop(proc: _HasMasterPort) -> None:
        if cluster is not None and cluster.multi_node:
            stop_on_nodes(cluster, marker, master_port=proc.master_port)

    return stop


def stop_on_nodes(cluster: Cluster, marker: str | None, *, master_port: int | None = None,
                  timeout: float = 30.0) -> list[str]:
    """Stop what a trial (or a watched job) left on every host of the cluster, over ssh the way
    pdsh connects. Returns the hosts that could not be reached.

    A multi-node job's ranks are children of each node's sshd, not of the local launcher, so
    stopping the launcher's process group does not reach them; DeepSpeed's own pdsh kill
    command runs only when its runner gets SIGINT/SIGTERM and lives long enough to send it.
    Each node's `deepspeed.launcher.launch` carries the job's `--master_port`: it gets SIGTERM
    first (it stops its ranks), then every process whose command line names `marker` (a trial
    folder) or that launcher gets SIGKILL, and the job's /dev/shm buffers there go too.
    """
    patterns = []
    if master_port is not None:
        patterns.append(f"[d]eepspeed.launcher.launch.*--master_port={int(master_port)}")
    if marker:
        patterns.append("[" + marker[0] + "]" + marker[1:])  # matches the marker, not this command
    if not patterns:
        return []
    steps = []
    if master_port is not None:
        steps.append(f"pkill -TERM -f {shlex.quote(patterns[0])}; sleep 2")
    steps += [f"pkill -9 -f {shlex.quote(p)}" for p in patterns]
    if master_port is not None:
        steps.append(f"sleep 0.5; rm -f /dev/shm/deepspeed_allreduce_buffer_*_{int(master_port)}_*")
    remote = "; ".join(steps) + "; true"
    missed = []
    for host in cluster.hosts:
        try:
            r = subprocess.run([*ssh_command(host, cluster.options.ssh_port), remote],
                               capture_output=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            missed.append(host)
            continue
        if r.returncode != 0:  # ssh's own 255: not reached
            missed.append(host)
    return missed
