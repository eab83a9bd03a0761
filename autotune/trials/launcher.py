"""Starts one trial's ranks through DeepSpeed's own launcher and waits for them.

The launcher runs in its own session (process group) so that a timeout, a
Ctrl-C or a controller crash can stop every rank at once and leave nothing
behind. No shell is involved: the command line is a list of validated values.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from autotune.trials import ext_locks

TRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "rank" / "workload" / "train.py"
DEEPSPEED_RUNNER = (sys.executable, "-m", "deepspeed.launcher.runner")
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
DEEPSPEED_STYLE, TORCHRUN_STYLE = "deepspeed", "torchrun"
"""How a launcher's command line is spelled (`build_command`): DeepSpeed's runner's options
(`--num_gpus` or the cluster's, `--no_local_rank`) or torchrun's (`--nproc-per-node`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankLaunch:
    """How an engine's ranks are started: chosen by the engine (autotune/engines/), run here.

    The launch mechanisms are the trial's (DeepSpeed's runner, torchrun); which one starts which
    rank entry is the engine's, so a runner is handed this value and never asks for an engine."""

    launcher: tuple[str, ...]
    script: Path
    """The rank entry (autotune/rank/...): started once per rank by the launcher."""
    style: str = DEEPSPEED_STYLE
    """DEEPSPEED_STYLE or TORCHRUN_STYLE: how the command line is spelled."""
    builds_ops: bool = True
    """DeepSpeed's ops are built (and stale extension locks removed) before the ranks start."""
    warm_refusal: str | None = None
    """Why warm workers cannot run this engine's trials (they run fresh, and the run says so);
    None: they can."""


DEEPSPEED_LAUNCH = RankLaunch(launcher=DEEPSPEED_RUNNER, script=TRAIN_SCRIPT)
"""The built-in workload's ranks under DeepSpeed's runner (the default of the built-in runner)."""


@dataclass(kw_only=True, slots=True)
class LaunchSpec:
    num_ranks: int
    script_args: list[str]
    log_path: Path
    timeout: float
    env: dict[str, str] = field(default_factory=dict)
    launcher: list[str] = field(default_factory=lambda: list(DEEPSPEED_RUNNER))
    script: Path = TRAIN_SCRIPT
    style: str = DEEPSPEED_STYLE
    """How the launcher's command line is spelled (RankLaunch.style)."""
    cluster_args: list[str] | None = None
    """DeepSpeed launcher options that place the ranks (--hostfile, --include, --launcher, ...;
    autotune/trials/multinode.py); None: `--num_gpus num_ranks` on this machine."""
    master_port: int | None = None
    """The torch.distributed master's port; None: a free one drawn at start. Preset where the
    ranks read it from a file written before the launch (multinode.rendezvous_env)."""
    preflight: Callable[[Mapping[str, str]], None] | None = field(default_factory=lambda: ext_locks.PREFLIGHT)
    """Run in the controller with the ranks' environment before they start: stale torch
    extension locks removed, DeepSpeed's ops built (autotune/trials/ext_locks.py); None: nothing."""


@dataclass(kw_only=True, slots=True)
class LaunchOutcome:
    returncode: int | None
    """None when the trial was stopped (timeout or interrupt)."""
    timed_out: bool
    wall_seconds: float
    log_path: Path
    launch_error: str | None = None
    """Set when the launcher itself could not be started."""


MASTER_PORT_FLOOR = 20000
"""Master ports are drawn from here up to just below the kernel's ephemeral range."""


def free_port() -> int:
    """A port for a trial's torch.distributed master that nothing listens on now.

    Drawn below the kernel's ephemeral range (Linux: 32768-60999): the ranks' own outgoing
    connections (gloo opens several per peer) take their ports from that range, so a port seen
    free there could be taken by one before the master's TCPStore listened on it (seen: a
    start-up check failed with EADDRINUSE on port 33625 beside another test suite)."""
    low, high = MASTER_PORT_FLOOR, _ephemeral_low() - 1
    if high > low:
        draw = random.SystemRandom()
        for _ in range(64):
            port = draw.randint(low, high)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    """Whether `port` can be listened on, on every interface (the master's store listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


GPU_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""Device files a GPU torch can use shows up as (NVIDIA, ROCm, WSL): without any of them
`torch.cuda.is_available()` is False, so the controller need not import torch to know."""


def gpu_device_nodes() -> list[str]:
    return [n for n in GPU_DEVICE_NODES if os.path.exists(n)]


def accelerator_env() -> dict[str, str]:
    """DS_ACCELERATOR=cpu (gloo) unless a CUDA device is present or the user chose one."""
    env: dict[str, str] = {}
    if "DS_ACCELERATOR" not in os.environ and not _torch_sees_cuda():
        env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def with_own_tools(path: str) -> str:
    """PATH with this Python's own bin folder first, as in an activated environment.

    torch builds DeepSpeed's ops with the first `ninja` on the ranks' PATH. The pip `ninja`
    DeepSpeed brings (1.13) reads a log written by Debian's ninja 1.11 as too old and
    rebuilds the op from scratch (and the reverse), so ranks started with and without the
    environment's folder on PATH rebuilt the ops in turn: a minute of compiling inside a
    rank's start-up, holding the lock a kill then leaves behind."""
    own = os.path.dirname(sys.executable)
    parts = [p for p in path.split(os.pathsep) if p]
    return os.pathsep.join([own, *[p for p in parts if p != own]]) if parts[:1] != [own] else path


def _torch_sees_cuda() -> bool:
    if not gpu_device_nodes():  # no GPU device at all: torch would say so after a 1-3 s import
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def build_command(spec: LaunchSpec, master_port: int) -> list[str]:
    if spec.style == TORCHRUN_STYLE:  # torchrun's own spelling, on one machine
        return [*spec.launcher, "--nproc-per-node", str(spec.num_ranks), "--master-addr", "127.0.0.1",
                "--master-port", str(master_port), str(spec.script), *spec.script_args]
    place = ["--num_gpus", str(spec.num_ranks)] if spec.cluster_args is None else spec.cluster_args
    return [*spec.launcher, *place, "--no_local_rank",
            "--master_port", str(master_port), str(spec.script), *spec.script_args]


POLL_SECONDS = 0.02
"""How often a wait with something to do between polls looks (a warm pool's answers)."""


class TrialProcess:
    """A running trial; `wait()` enforces the timeout; `stop()` ends the whole group."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.started = time.monotonic()
        self.master_port: int | None = None

    def launch_env(self, *, own_tools: bool = True) -> dict[str, str]:
        """The ranks' environment, after the pre-flight that keeps a stale lock from stalling them.

        `own_tools`: this environment's bin folder first on PATH (the ranks autotune starts with
        its own Python); the user's own command keeps the PATH it was given, and the pre-flight
        asks and builds with the ninja that PATH names."""
        env = {**os.environ, **accelerator_env(), **self.spec.env}
        if own_tools:
            env["PATH"] = with_own_tools(env.get("PATH", ""))
        if self.spec.preflight is not None:
            self.spec.preflight(env)
        return env

    def start(self) -> str | None:
        """Start the launcher; returns an error line when it cannot be started."""
        env = self.launch_env()
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.spec.log_path, "wb")
        self.master_port = self.spec.master_port or free_port()
        try:
            self.proc = subprocess.Popen(
                build_command(self.spec, self.master_port), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            )
        except OSError as exc:
            return f"cannot start the launcher {self.spec.launcher[0]!r}: {exc.strerror}"
        finally:
            log.close()
        return None

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def wait(self, *, tick: Callable[[], None] | None = None, poll: float = POLL_SECONDS) -> tuple[int | None, bool]:
        """(exit code, timed out) of the launcher, within the spec's timeout (0: none)."""
        assert self.proc is not None
        deadline = self.started + self.spec.timeout if self.spec.timeout > 0 else None
        rc, timed_out = wait_for(self.proc, deadline=deadline, tick=tick, poll=poll)
        if timed_out:
            self.stop()
        return rc, timed_out

    def stop(self, grace: float = 5.0, *, polite: bool = True) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left (SIGKILL at once unless `polite`)."""
        if self.proc is None:
            return
        kill_group(self.proc.pid, grace, polite=polite)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        if self.master_port is not None and not group_alive(self.proc.pid):
            remove_shm_buffers(self.master_port)


SHM_DIR = Path("/dev/shm")


def shm_buffers(master_port: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    """The /dev/shm buffers DeepSpeed's CPU comm op created for the run on `master_port`."""
    return list(shm_dir.glob(f"deepspeed_allreduce_buffer_*_{master_port}_*"))


def remove_shm_buffers(master_port: int, shm_dir: Path = SHM_DIR) -> int:
    """Delete the shared-memory buffers DeepSpeed's CPU comm op leaves behind.

    DeepSpeed 0.19.8 (CPU accelerator) creates
    `/dev/shm/deepspeed_allreduce_buffer_<n>_<addr>_<master_port>_<rank>` (about
    66 MB per rank) at init and never unlinks them, even on a clean exit. Each
    trial uses a fresh master port, so without this a 20-trial study leaks
    gigabytes of RAM-backed files. Only this trial's port is touched.
    """
    removed = 0
    for f in shm_buffers(master_port, shm_dir):
        try:
            f.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def kill_group(pgid: int, grace: float = 5.0, *, polite: bool = True) -> None:
    """SIGTERM the group, then SIGKILL what is left after `grace`; SIGKILL at once unless `polite`."""
    for sig in (signal.SIGTERM, signal.SIGKILL) if polite else (signal.SIGKILL,):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not group_alive(pgid):
                return
            time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # A group of zombies still "exists": check /proc for a live member.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def wait_for(proc: subprocess.Popen, *, deadline: float | None, answered: Callable[[], bool] | None = None,
             tick: Callable[[], None] | None = None, poll: float = POLL_SECONDS) -> tuple[int | None, bool]:
    """The one wait of every launch (a fresh trial, a warm pool's job, `watch`): until the
    launcher exits (its code), `answered()` says the job is done (0: a warm pool's ranks
    answered and stay up), or `deadline` (time.monotonic) passes: (None, True). `tick` runs at
    every poll (watch echoes the log and evaluates). Stopping is the caller's: what it stops
    differs (the group, or a pool kept for the next trial)."""
    if answered is None and tick is None:  # nothing to do between polls: the kernel's wait
        try:
            return proc.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())), False
        except subprocess.TimeoutExpired:
            return None, True
    while True:
        if answered is not None and answered():
            return 0, False
        rc = proc.poll()
        if tick is not None:
            tick()
        if rc is not None:
            return rc, False
        if deadline is not None and time.monotonic() > deadline:
            return None, True
        time.sleep(poll)


def run_launch(proc: TrialProcess, *, on_start: Callable[[TrialProcess], None] | None = None,
               after_stop: Callable[[TrialProcess], None] | None = None,
               tick: Callable[[], None] | None = None, poll: float = POLL_SECONDS,
               grace: float = 2.0) -> LaunchOutcome:
    """The one launch-and-stop path of every fresh launch (a trial, a user's command, `watch`):
    start, wait (the spec's timeout; `tick` at every poll), and stop the whole group on every
    way out, a Ctrl-C included (within `stop_on_signals` a second one cannot cut it short).
    `on_start` receives the running process (the study records its group and port);
    `after_stop` runs once the group is gone (the ranks on other nodes, which are sshd's
    children and not in the launcher's group). A warm pool's job waits with `wait_for` too and
    stops its pool only when the job failed."""
    log_path = proc.spec.log_path
    try:
        error = proc.start()
        if error is not None:
            log_path.write_text(error + "\n", encoding="utf-8")  # the trial folder holds the evidence
            return LaunchOutcome(returncode=None, timed_out=False, wall_seconds=0.0, log_path=log_path,
                                 launch_error=error)
        if on_start is not None:
            on_start(proc)
        rc, timed_out = proc.wait(tick=tick, poll=poll)
    finally:
        proc.stop(grace=grace)  # ranks the launcher left behind, or a Ctrl-C: the whole group goes
        if after_stop is not None:
            after_stop(proc)
    return LaunchOutcome(returncode=rc, timed_out=timed_out, wall_seconds=time.monotonic() - proc.started,
                         log_path=log_path)


def run_trial_process(spec: LaunchSpec) -> LaunchOutcome:
    """Launch `spec` with autotune's own rank script and wait for it (benchmarks, tests)."""
    return run_launch(TrialProcess(spec))


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, pgid) of a process, or None when it is gone."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line contains `marker` (e.g. a trial's ds_config path)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        st = _stat(int(entry.name))
        if st is not None and st[0] != "Z" and marker in _cmdline(int(entry.name)):
            out.append(int(entry.name))
    return out


def leftover_ports(marker: str) -> set[int]:
    """Master ports on the command lines of the live processes of a trial (`--master_port N`).

    The launcher and its per-node launcher carry the port: a controller that died
    between starting the launcher and storing the port in the study leaves only this
    trace of it, and the /dev/shm buffers are named by it.
    """
    ports: set[int] = set()
    for pid in processes_with(marker):
        words = _cmdline(pid).split()
        for i, w in enumerate(words):
            if w == "--master_port" and i + 1 < len(words):
                value = words[i + 1]
            elif w.startswith("--master_port="):
                value = w.split("=", 1)[1]
            else:
                continue
            if value.isascii() and value.isdigit():
                ports.add(int(value))
    return ports


def stop_leftovers(pgid: int | None, marker: str, grace: float = 5.0) -> int:
    """Stop what a dead controller left of a trial; returns how many processes were found.

    The stored process group is only signalled when one of its members still runs
    this trial (its command line names `marker`), so a recycled group id of an
    unrelated program is never touched. Processes that name the trial but sit in
    another group (the controller died before it stored the group id) go too.
    """
    found = processes_with(marker)
    groups = {st[1] for pid in found if (st := _stat(pid)) is not None}
    if pgid and group_alive(pgid) and pgid in groups:
        kill_group(pgid, grace)
    for g in groups - {pgid}:
        if g != os.getpgid(0):
            kill_group(g, grace)
    for pid in processes_with(marker):  # anything still there, one by one
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace  # SIGKILL is delivered asynchronously: wait for it
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(found)
