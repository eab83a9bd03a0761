"""Trials through DeepSpeed's own multi-node launchers (autotune/trials/multinode.py).

The checks before the first trial are tested in-process; the real runs go through DeepSpeed's
hostfile path on this machine, and through its pdsh runner to "two nodes" that are this machine
at two addresses that are not the controller's (127.0.0.2 and 127.0.0.3, each its own private
sshd: tests/ssh_cluster.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ssh_cluster
from launch_helpers import autotune_in_process
from robust_helpers import alive_under, rows, start_cli, write_config

from autotune.core.errors import UserError
from autotune.core.nodes import NODES_ENV, encode_nodes, node_of_rank, this_node
from autotune.trials.launcher import processes_with
from autotune.trials.multinode import (
    ENV_FILE_NAME,
    LauncherOptions,
    _check_resolves,
    cluster_args,
    is_this_machine,
    launch_path,
    master_address,
    node_env,
    resolve_cluster,
    stop_on_nodes,
)
from exporters.file_sd import TARGETS_FILE, read_rank_endpoints, read_targets

TWO_NODES = "localhost slots=2\n127.0.0.1 slots=2\n"


def _hostfile(tmp_path: Path, text: str) -> str:
    p = tmp_path / "hostfile"
    p.write_text(text)
    return str(p)


# --- before the first trial --------------------------------------------------------------------

def test_no_launcher_options_is_a_plain_local_launch():
    assert resolve_cluster(LauncherOptions(), 4) is None


def test_one_node_hostfile_gives_its_slots(tmp_path):
    cluster = resolve_cluster(LauncherOptions(hostfile=_hostfile(tmp_path, "localhost slots=4\n")), 4)
    assert cluster is not None and not cluster.multi_node
    assert cluster_args(cluster) == ["--hostfile", str(tmp_path / "hostfile"), "--master_addr", "127.0.0.1",
                                     "--no_ssh_check"]


def test_ranks_are_numbered_node_by_node(tmp_path):
    if not _has("pdsh"):
        pytest.skip("pdsh not installed (apt-get install pdsh)")
    hf = _hostfile(tmp_path, "# two nodes\nnode-a slots=2\n\nnode-b slots=3\n")
    cluster = resolve_cluster(LauncherOptions(hostfile=hf), 5, check_hosts=False)
    assert [cluster.host_of_rank(r) for r in range(5)] == ["node-a"] * 2 + ["node-b"] * 3
    with pytest.raises(ValueError):
        cluster.host_of_rank(5)


def _has(binary: str) -> bool:
    import shutil

    return shutil.which(binary) is not None


@pytest.mark.parametrize("text, needle", [
    ("", "empty"),
    ("localhost 4\n", "bad entry"),
    ("localhost slots=2\nlocalhost slots=2\n", "multiple entries"),
])
def test_malformed_hostfile_is_one_line_with_deepspeeds_reason(tmp_path, text, needle):
    with pytest.raises(UserError, match=needle):
        resolve_cluster(LauncherOptions(hostfile=_hostfile(tmp_path, text)), 4)


def test_missing_and_unreadable_hostfile(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        resolve_cluster(LauncherOptions(hostfile=str(tmp_path / "nope")), 4)
    bad = tmp_path / "bin"
    bad.write_bytes(b"\xff\xfe\x00slots")
    with pytest.raises(UserError, match="cannot be read"):
        resolve_cluster(LauncherOptions(hostfile=str(bad)), 4)


def test_slots_must_match_stages_times_dp(tmp_path):
    hf = _hostfile(tmp_path, "localhost slots=6\n")
    with pytest.raises(UserError, match=r"the hostfile gives 6 slots \(localhost:6\); the run needs stages x dp = 4"):
        resolve_cluster(LauncherOptions(hostfile=hf), 4)
    # DeepSpeed's own filters count: --include picks 4 of the 6
    cluster = resolve_cluster(LauncherOptions(hostfile=hf, include="localhost:0,1,2,3"), 4)
    assert cluster is not None and cluster.world_size == 4
    with pytest.raises(UserError, match="--include/--exclude"):
        resolve_cluster(LauncherOptions(hostfile=hf, include="elsewhere"), 4)
    with pytest.raises(UserError, match="cannot be combined"):
        resolve_cluster(LauncherOptions(hostfile=hf, include="localhost", num_nodes=1), 4)
    with pytest.raises(UserError, match="--num_gpus 2 on one machine"):
        resolve_cluster(LauncherOptions(num_gpus=2), 4)


def test_launcher_not_installed_is_named(tmp_path, monkeypatch):
    hf = _hostfile(tmp_path, TWO_NODES)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH: no pdsh, no ompi_info
    with pytest.raises(UserError, match=r"--launcher pdsh needs 'pdsh'.*apt-get install pdsh"):
        resolve_cluster(LauncherOptions(hostfile=hf), 4)
    with pytest.raises(UserError, match=r"needs 'ompi_info'.*openmpi-bin"):
        resolve_cluster(LauncherOptions(hostfile=hf, launcher="openmpi"), 4)
    with pytest.raises(UserError, match="not one of DeepSpeed's"):
        resolve_cluster(LauncherOptions(hostfile=hf, launcher="mpiexec"), 4)


@pytest.mark.skipif(ssh_cluster.available() is not None, reason=str(ssh_cluster.available()))
def test_unreachable_host_is_one_line(tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on: ssh is refused at once
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", f"-p {closed}")
    with pytest.raises(UserError, match=r"host localhost cannot be reached over ssh \(.*refused"):
        resolve_cluster(LauncherOptions(hostfile=_hostfile(tmp_path, TWO_NODES)), 4)


def test_node_env_file_keeps_the_users_own_lines(tmp_path, monkeypatch):
    (tmp_path / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("AUTOTUNE_TEST_X", "1")
    trial = tmp_path / "trial-000"
    trial.mkdir()
    env = node_env(trial, _two_node_cluster(tmp_path), cwd=tmp_path)
    assert env == {"DS_ENV_FILE": str(trial / ENV_FILE_NAME)}
    lines = (trial / ENV_FILE_NAME).read_text().splitlines()
    assert lines[0] == "NCCL_IB_DISABLE=1"  # theirs first: DS_ENV_FILE replaces the file's name
    assert {"DS_ACCELERATOR=cpu", "AUTOTUNE_TEST_X=1", "OMP_NUM_THREADS=1"} <= set(lines)
    # every rank learns the nodes by their hostfile names, in rank order (core/nodes.py)
    assert f"{NODES_ENV}=localhost=2,127.0.0.1=2" in lines


def _two_node_cluster(tmp_path):
    return resolve_cluster(LauncherOptions(hostfile=_hostfile(tmp_path, TWO_NODES)), 4, check_hosts=False)


def test_a_rank_names_its_node_as_the_hostfile_does():
    nodes = encode_nodes([("gpu-a", 2), ("127.0.0.9", 3)])
    assert [node_of_rank(r, nodes) for r in range(6)] == ["gpu-a"] * 2 + ["127.0.0.9"] * 3 + [None]
    assert this_node({"RANK": "4", NODES_ENV: nodes}) == "127.0.0.9"
    assert this_node({"RANK": "4", NODES_ENV: nodes, "SLURMD_NODENAME": "n17"}) == "n17"  # srun places by its own list
    assert this_node({"RANK": "1"}) == socket.gethostname()  # one machine: its own name
    assert this_node({"RANK": "1", NODES_ENV: "garbled"}) == socket.gethostname()


def test_the_master_is_the_first_nodes_hostfile_address_when_it_gives_one():
    assert master_address("127.0.0.2", None) == "127.0.0.2"  # no ssh asked: it is the address
    assert master_address("::1", None) == "::1"


def test_a_hostfile_host_that_does_not_resolve_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "ssh_config").write_text("Host node-b\n  HostName 127.0.0.3\nHost node-c\n  HostName nowhere.invalid\n")
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", f"-F {tmp_path / 'ssh_config'}")
    with pytest.raises(UserError, match=r"hostfile host 'bogus-host-that-does-not-exist' does not resolve"):
        _check_resolves("bogus-host-that-does-not-exist", None)
    _check_resolves("node-b", None)  # an alias of the ssh configuration pdsh connects with
    with pytest.raises(UserError, match=r"'node-c' does not resolve .*its ssh HostName 'nowhere.invalid' neither"):
        _check_resolves("node-c", None)
    hf = _hostfile(tmp_path, "127.0.0.2 slots=2\nbogus-host-that-does-not-exist slots=2\n")
    with pytest.raises(UserError, match="'bogus-host-that-does-not-exist' does not resolve"):
        resolve_cluster(LauncherOptions(hostfile=hf), 4)  # every name before any ssh (127.0.0.2 has no server)


def test_every_node_gets_the_launchs_path_unless_the_users_file_sets_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/venv/bin:/usr/bin")
    trial = tmp_path / "trial-000"
    trial.mkdir()

    def paths() -> list[str]:
        return [ln for ln in (trial / ENV_FILE_NAME).read_text().splitlines() if ln.startswith("PATH=")]

    cluster = _two_node_cluster(tmp_path)
    node_env(trial, cluster, cwd=tmp_path, own_tools=False)  # a user's command: the PATH it was given
    assert paths() == ["PATH=/venv/bin:/usr/bin"]
    node_env(trial, cluster, cwd=tmp_path)  # autotune's own ranks: this environment's bin first, as locally
    assert paths() == [f"PATH={Path(sys.executable).parent}:/venv/bin:/usr/bin"]
    (tmp_path / ".deepspeed_env").write_text("PATH=/their/bin:/usr/bin\n")
    node_env(trial, cluster, cwd=tmp_path)
    assert paths() == ["PATH=/their/bin:/usr/bin"]
    assert launch_path("/my dir/bin:/usr/bin") == {}  # DeepSpeed exports it unquoted: a shell would split it


@pytest.mark.parametrize("host,why", [("bogus-host-that-does-not-exist", "it does not resolve"),
                                     ("192.0.2.7", "it resolves to 192.0.2.7")])  # TEST-NET-1: never this machine
def test_a_one_host_hostfile_naming_another_machine_is_refused_not_run_here(tmp_path, host, why):
    """Issue 25: DeepSpeed runs a one-host hostfile locally, so such a run tuned the login node."""
    hf = _hostfile(tmp_path, f"{host} slots=4\n")
    with pytest.raises(UserError, match=re.escape(f"names one host, {host}, and it is not this machine ({why})")):
        resolve_cluster(LauncherOptions(hostfile=hf), 4)
    for local in ("localhost", "127.0.0.1", socket.gethostname()):
        assert is_this_machine(local)
        assert resolve_cluster(LauncherOptions(hostfile=_hostfile(tmp_path, f"{local} slots=4\n")), 4) is not None


def test_the_cli_refuses_a_one_host_hostfile_of_another_machine_before_any_study(tmp_path):
    hf = _hostfile(tmp_path, "bogus-host-that-does-not-exist slots=4\n")  # the default 2 stages x 2 dp
    r = subprocess.run([sys.executable, "-m", "autotune", "run", "--budget", "2", "--study", "st", "--hostfile", hf],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "names one host, bogus-host-that-does-not-exist, and it is not this machine" in line
    assert not (tmp_path / "st").exists()


def test_slurm_needs_an_allocation_with_enough_tasks(tmp_path, monkeypatch):
    """DeepSpeed's slurm runner runs `srun -n WORLD` for every trial: checked once, before any."""
    import autotune.trials.multinode as mn

    hf = _hostfile(tmp_path, "127.0.0.2 slots=2\n127.0.0.3 slots=2\n")
    real_which = mn.shutil.which
    monkeypatch.setattr(mn.shutil, "which", lambda b: "/usr/bin/sinfo" if b == "sinfo" else real_which(b))
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NPROCS"):
        monkeypatch.delenv(name, raising=False)
    opts = LauncherOptions(hostfile=hf, launcher="slurm")
    with pytest.raises(UserError, match=r"inside an allocation, and this is not one \(no SLURM_JOB_ID\).*salloc -n 4"):
        resolve_cluster(opts, 4)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(UserError, match=r"Slurm allocation 42 holds 2 tasks; every trial needs stages x dp = 4"):
        resolve_cluster(opts, 4)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    cluster = resolve_cluster(opts, 4)
    assert cluster is not None and cluster.multi_node and cluster.world_size == 4
    monkeypatch.setattr(mn.shutil, "which", lambda b: None)
    with pytest.raises(UserError, match=r"apt-get install slurm-client"):
        resolve_cluster(opts, 4)


def test_cli_refuses_a_bad_hostfile_before_any_study(tmp_path):
    r = autotune_in_process("run", "--budget", "1", "--study", "st", "--hostfile", "missing-hostfile", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["autotune: error: --hostfile missing-hostfile: no such file"]
    assert not (tmp_path / "st").exists()


# --- real runs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    why = ssh_cluster.available()
    if why is not None:
        pytest.skip(why)
    cluster = ssh_cluster.start(tmp_path_factory.mktemp("sshd"))
    yield cluster
    cluster.stop()


def _env(cluster) -> dict:
    return {**cluster.env, "DS_ACCELERATOR": "cpu"}


@pytest.mark.slow
def test_two_nodes_through_pdsh_tune_and_clean_up(tmp_path, two_nodes):
    hf = two_nodes.hostfile(tmp_path, slots=2)
    cfg = write_config(tmp_path, train_batch_size=16)  # micro 2 x GAS 4 x dp 2
    common = ["--budget", "1", "--stages", "2", "--dp", "2", "--steps", "2", "--warmup-steps", "1",
              "--fixed-steps", "--config", str(cfg), "--hostfile", hf, "--trial-timeout", "400",
              "--metrics-addr", "0.0.0.0"]
    r = subprocess.run([sys.executable, "-m", "autotune", "run", "--study", "st", *common], cwd=tmp_path,
                       capture_output=True, text=True, env={**os.environ, **_env(two_nodes)}, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "nodes: 127.0.0.2:2, 127.0.0.3:2 (multi-node through pdsh)" in r.stdout + r.stderr
    trial = tmp_path / "st" / "trial-000"
    assert rows(tmp_path / "st")[0][1] == "ok"
    log = (trial / "launcher.log").read_text()
    assert "127.0.0.2: " in log and "127.0.0.3: " in log  # pdsh prefixes each node's output
    # rank 0's node is the master, by the address the hostfile gives it (not this machine's eth0)
    assert "--master_addr=127.0.0.2" in log, log[:3000]
    for node in ssh_cluster.NODES:  # each node's own server started its launch
        assert "Starting session: command for root" in two_nodes.log(node), node
    for rank in range(4):  # every rank of both nodes wrote its metrics into the shared folder
        lines = (trial / f"metrics-rank{rank}.csv").read_text().splitlines()
        assert len(lines) == 1 + 3, (rank, lines)  # header, 1 warm-up and 2 measured steps
    # each rank's endpoint is listed under its node's hostfile address, not the machine's name
    listed = {t.labels["rank"]: t.host for t in read_rank_endpoints(trial)}
    assert listed == {"0": "127.0.0.2", "1": "127.0.0.2", "2": "127.0.0.3", "3": "127.0.0.3"}
    summary = json.loads((tmp_path / "st" / "summary.json").read_text())
    assert summary["best"]["samples_per_second"] > 0
    assert summary["best"]["trial"] == 0
    assert alive_under(tmp_path / "st") == []

    # Interrupted while the ranks of both nodes run: none is left on either node. Before that,
    # every rank target the run lists is scraped at the address listed (127.0.0.3's from there).
    long = [("400" if a == "2" and common[i - 1] == "--steps" else a) for i, a in enumerate(common)]
    proc = start_cli("run", "--study", "st2", *long, cwd=tmp_path, env=_env(two_nodes))  # ends by the interrupt
    trial2 = (tmp_path / "st2" / "trial-000").resolve()
    deadline = time.monotonic() + 300
    scraped: dict[str, str] = {}
    while time.monotonic() < deadline:
        cmdlines = [_cmdline(p) for p in processes_with(str(trial2))]
        started = sum("--node_rank=1" in c for c in cmdlines) and sum("train.py" in c for c in cmdlines) >= 4
        if started:
            scraped.update(_scrape_rank_targets(tmp_path / "st2" / TARGETS_FILE))
            if len(scraped) == 4:
                break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"the two nodes' ranks never all started and served (scraped: {scraped})")
    assert {rank: addr.rpartition(":")[0] for rank, addr in scraped.items()} == {
        "0": "127.0.0.2", "1": "127.0.0.2", "2": "127.0.0.3", "3": "127.0.0.3"}
    _interrupt_and_check_nothing_left(proc, tmp_path / "st2")
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{_master_port(trial2)}_*"))


def _mpi_env(tmp_path: Path, launcher: str) -> dict[str, str]:
    """Open MPI refuses root without its two variables (CI runs as root); DeepSpeed's mpich
    runner calls plain `mpirun`, which Debian points at Open MPI's when both are installed: a
    folder first on PATH holds a wrapper (not a symlink: hydra looks for hydra_pmi_proxy beside
    the mpirun it was started as)."""
    binary = {"openmpi": "ompi_info", "mpich": "mpirun.mpich"}[launcher]
    if shutil.which(binary) is None:
        pytest.skip(f"{binary} not installed (apt-get install {'openmpi-bin' if launcher == 'openmpi' else 'mpich'})")
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    if launcher == "mpich":
        shim = tmp_path / "mpich-bin"
        shim.mkdir()
        (shim / "mpirun").write_text(f"#!/bin/sh\nexec {shutil.which('mpirun.mpich')} \"$@\"\n")
        (shim / "mpirun").chmod(0o755)
        env["PATH"] = f"{shim}{os.pathsep}{os.environ.get('PATH', '')}"
    return env


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
def test_a_trial_through_an_mpi_launcher_on_two_nodes(tmp_path, two_nodes, launcher):
    """DeepSpeed's openmpi and mpich runners, for real: mpirun starts its daemons on both nodes
    over their own sshd, and the ranks learn RANK from mpirun's variables (openmpi: from
    OMPI_COMM_WORLD_*, autotune/rank/launcher_ranks.py; mpich: DeepSpeed's launcher_helper)."""
    env = {**os.environ, **_env(two_nodes), **_mpi_env(tmp_path, launcher)}
    hf = two_nodes.hostfile(tmp_path, slots=1)
    r = subprocess.run([sys.executable, "-m", "autotune", "run", "--study", "st", "--budget", "1", "--stages", "2",
                        "--dp", "1", "--steps", "2", "--warmup-steps", "1", "--fixed-steps", "--hostfile", hf,
                        "--launcher", launcher, "--metrics-addr", "0.0.0.0", "--trial-timeout", "300"],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"nodes: 127.0.0.2:1, 127.0.0.3:1 (multi-node through {launcher})" in r.stdout + r.stderr
    trial = tmp_path / "st" / "trial-000"
    assert rows(tmp_path / "st")[0][1] == "ok", (trial / "launcher.log").read_text()[-3000:]
    log = (trial / "launcher.log").read_text()
    assert "cmd = mpirun -n 2 " in log
    assert ("-hosts 127.0.0.2,127.0.0.3" if launcher == "mpich" else f"-hostfile {hf}") in log
    assert "MASTER_ADDR=127.0.0.2" in log or "MASTER_ADDR 127.0.0.2" in log
    for node in ssh_cluster.NODES:  # mpirun's daemon (orted, hydra_pmi_proxy) started there over ssh
        assert "Starting session: command for root" in two_nodes.log(node), node
    for rank in (0, 1):
        assert len((trial / f"metrics-rank{rank}.csv").read_text().splitlines()) == 1 + 3
    assert {t.labels["rank"]: t.host for t in read_rank_endpoints(trial)} == {"0": "127.0.0.2", "1": "127.0.0.3"}
    assert alive_under(tmp_path / "st") == []

    # Interrupted while both ranks run: no process and no /dev/shm buffer is left on either node.
    proc = start_cli("run", "--study", "st2", "--budget", "1", "--stages", "2", "--dp", "1", "--steps", "400",
                     "--warmup-steps", "1", "--fixed-steps", "--hostfile", hf, "--launcher", launcher,
                     "--no-metrics", "--trial-timeout", "300", cwd=tmp_path, env=env)
    trial2 = tmp_path / "st2" / "trial-000"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # both ranks are past their first measured step
        if all(len(_lines(trial2 / f"metrics-rank{r}.csv")) >= 3 for r in (0, 1)):
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the two nodes' ranks never both ran")
    _interrupt_and_check_nothing_left(proc, tmp_path / "st2")
    daemons = {"openmpi": "orted", "mpich": "hydra_pmi_proxy"}[launcher]  # mpirun's per-node daemon
    deadline = time.monotonic() + 10
    while _running(daemons) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(daemons) == []
    port = re.search(r"MASTER_PORT[= ](\d+)", (trial2 / "launcher.log").read_text())
    assert port and not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port.group(1)}_*"))


def _interrupt_and_check_nothing_left(proc: subprocess.Popen, study: Path) -> None:
    """Ctrl-C the run: it ends as interrupted (130) and no process of its study is left."""
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:]
    deadline = time.monotonic() + 10
    while alive_under(study) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_under(study) == []


def _running(name: str) -> list[str]:
    """Command lines of live processes whose program is `name` (ssh's own `bash -c` excluded)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            cmd = _cmdline(int(proc.name))
            if cmd.split(" ", 1)[0].endswith(name):
                out.append(cmd)
    return out


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def test_mpich_with_open_mpis_mpirun_first_is_one_line(tmp_path, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mpirun").write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.1.4'\n")
    (fake / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    hf = _hostfile(tmp_path, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    with pytest.raises(UserError, match=r"--launcher mpich runs `mpirun`, and .*bin/mpirun is Open MPI's"):
        resolve_cluster(LauncherOptions(hostfile=hf, launcher="mpich"), 2, check_hosts=False)


def test_a_rank_of_mpirun_or_srun_takes_its_rank_from_their_variables():
    from autotune.rank.launcher_ranks import adopt

    master = {"MASTER_ADDR": "127.0.0.2", "MASTER_PORT": "29500"}
    env = {**master, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert adopt(env) and (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_SIZE"]) == ("3", "1", "4", "2")
    env = {**master, "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"}
    assert adopt(env) and (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("2", "0", "4")
    launched = {**master, "RANK": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8"}
    assert not adopt(launched) and launched["RANK"] == "0"  # DeepSpeed's launch.py set it: kept
    no_master = {"SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"}
    assert not adopt(no_master) and "RANK" not in no_master  # not our trial: DeepSpeed's own discovery


def _scrape_rank_targets(targets_file: Path) -> dict[str, str]:
    """rank -> address, for each rank target listed that answers /metrics with its own rank label."""
    import urllib.request

    out = {}
    try:
        targets = read_targets(targets_file)
    except (OSError, ValueError):
        return out
    for t in targets:
        rank = t.labels.get("rank")
        if rank is None:
            continue
        try:
            body = urllib.request.urlopen(f"http://{t.address}/metrics", timeout=5).read().decode()
        except OSError:
            continue
        if f'rank="{rank}"' in body:
            out[rank] = t.address
    return out


def _master_port(trial: Path) -> str:
    found = re.search(r"--master_port=(\d+)", (trial / "launcher.log").read_text())
    return found.group(1) if found else "none"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.skipif(ssh_cluster.available() is not None, reason=str(ssh_cluster.available()))
def test_stop_on_nodes_reaches_processes_started_over_ssh(tmp_path, two_nodes, monkeypatch):
    marker = tmp_path / "trial-007"
    marker.mkdir()
    cluster = resolve_cluster(LauncherOptions(hostfile=two_nodes.hostfile(tmp_path)), 4, check_hosts=False)
    env = {**os.environ, **two_nodes.env}
    # a "rank" on the second node: a child of that node's sshd, outside any group of ours
    subprocess.run(["ssh", "-F", str(two_nodes.config), "127.0.0.3",
                    f"nohup {sys.executable} -c 'import time; time.sleep(300)' {marker}/x >/dev/null 2>&1 &"], env=env, check=True, timeout=30)
    deadline = time.monotonic() + 10
    while not processes_with(str(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(str(marker)), "the ssh-started process did not start"
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", two_nodes.env["PDSH_SSH_ARGS_APPEND"])
    assert stop_on_nodes(cluster, str(marker)) == []
    deadline = time.monotonic() + 10
    while processes_with(str(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(str(marker)) == []


# --- the user's own command ---------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


def _user_command(*launcher_opts: str):
    from autotune.usercmd.command import parse_command

    return parse_command(["deepspeed", *launcher_opts, str(REPO / "examples" / "pipeline_train.py"),
                          "--deepspeed_config", "ds.json"], cwd=REPO)


def test_the_commands_own_launcher_options_are_read():
    cmd = _user_command("--hostfile=hf", "-i", "a@b", "--launcher", "openmpi", "--num_gpus", "2")
    assert cmd.cluster_options() == LauncherOptions(hostfile="hf", include="a@b", launcher="openmpi", num_gpus=2)
    with pytest.raises(UserError, match="--num_gpus 'x' in the command is not a number"):
        _user_command("--num_gpus", "x").cluster_options()


def test_autotunes_launcher_options_join_the_command_once():
    cmd = _user_command("--hostfile", "hf").with_launcher_options(["--hostfile", "hf", "--master_addr", "10.0.0.1"])
    assert cmd.launcher_args == ("--hostfile", "hf", "--master_addr", "10.0.0.1")
    with pytest.raises(UserError, match="given twice, 'other' to autotune and 'hf' in the command"):
        _user_command("--hostfile", "hf").with_launcher_options(["--hostfile", "other"])
    from autotune.usercmd.command import parse_command

    torchrun = parse_command(["torchrun", str(REPO / "examples" / "pipeline_train.py"), "--deepspeed_config",
                              "ds.json"], cwd=REPO)
    with pytest.raises(UserError, match="with torchrun, give the nodes in the command"):
        torchrun.with_launcher_options(["--hostfile", "hf"])


@pytest.mark.slow
def test_users_script_on_two_nodes_through_autotunes_hostfile(tmp_path, two_nodes):
    hf = two_nodes.hostfile(tmp_path, slots=1)
    env = {**os.environ, **_env(two_nodes), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = ["deepspeed", str(REPO / "examples" / "pipeline_train.py"), "--deepspeed_config",
               str(REPO / "examples" / "ds_config.json"), "--steps", "100000", "--save-dir", "ckpt"]
    r = subprocess.run([sys.executable, "-m", "autotune", "run", "--budget", "1", "--study", "st",
                        "--steps", "2", "--warmup-steps", "1", "--fixed-steps", "--trial-timeout", "400",
                        "--hostfile", hf, "--", *command],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "nodes: 127.0.0.2:1, 127.0.0.3:1 (multi-node through pdsh)" in r.stdout + r.stderr
    # loopback endpoints on other nodes cannot be scraped from here: said, with the way out
    assert "every node's ranks bind 127.0.0.1, where only that node can scrape them" in r.stdout + r.stderr
    trial = tmp_path / "st" / "trial-000"
    assert rows(tmp_path / "st")[0][1] == "ok"
    log = (trial / "launcher.log").read_text()
    assert "127.0.0.2: " in log and "127.0.0.3: " in log
    for rank in (0, 1):  # the bootstrap instrumented the script on both nodes
        assert len((trial / f"metrics-rank{rank}.csv").read_text().splitlines()) == 1 + 3
    assert not (tmp_path / "ckpt").exists()  # the stop never reached the script's own saving
    assert alive_under(tmp_path / "st") == []


@pytest.mark.slow
def test_watch_a_job_on_two_nodes(tmp_path, two_nodes):
    """`autotune watch` keeps the command's own launcher options: both nodes' ranks are
    instrumented (their settings reach the other node by file) and nothing is left behind."""
    hf = two_nodes.hostfile(tmp_path, slots=1)
    env = {**os.environ, **_env(two_nodes), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "autotune", "watch", "--out", "w", "--no-metrics", "--",
                        "deepspeed", "--hostfile", hf,
                        str(REPO / "examples" / "pipeline_train.py"), "--deepspeed_config",
                        str(REPO / "examples" / "ds_config.json"), "--steps", "4", "--save-dir", "ckpt"],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "w" / "run-001"
    log = (run / "launcher.log").read_text()
    assert "127.0.0.2: " in log and "127.0.0.3: " in log
    for rank in (0, 1):  # every step of the job, on both nodes
        assert len((run / f"metrics-rank{rank}.csv").read_text().splitlines()) == 1 + 4
    assert (tmp_path / "ckpt").exists()  # watched, the job runs to its own end (its checkpoint too)
    assert alive_under(run) == [] and not [p for p in processes_with(str(REPO / "examples"))
                                           if "pipeline_train.py" in _cmdline(p)]


@pytest.mark.slow
def test_a_hostfile_naming_this_machine_goes_through_deepspeeds_hostfile_path(tmp_path):
    hf = _hostfile(tmp_path, "localhost slots=4\n")
    r = subprocess.run([sys.executable, "-m", "autotune", "run", "--study", "st", "--budget", "1", "--stages", "2",
                        "--dp", "2", "--steps", "2", "--warmup-steps", "1", "--hostfile", hf],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "nodes: localhost:4 (one node)" in r.stdout + r.stderr
    trial = tmp_path / "st" / "trial-000"
    assert rows(tmp_path / "st")[0][1] == "ok"
    log = (trial / "launcher.log").read_text()
    assert "Unable to find hostfile" not in log  # DeepSpeed read it (it warns when it does not)
    assert sorted(p.name for p in trial.glob("metrics-rank*.csv")) == [f"metrics-rank{r}.csv" for r in range(4)]


@pytest.mark.parametrize("where", ["autotune", "command"])
def test_the_partition_step_knows_the_users_ranks_span_nodes_wherever_the_hostfile_was_given(tmp_path, where):
    """`autotune run --hostfile hf -- deepspeed ...` and `autotune run -- deepspeed --hostfile hf ...`
    place the same ranks: the partition step must not read the cores as shared in either case (it
    read only the command's own options, so autotune's --hostfile left it believing one machine)."""
    from autotune.core.options import RunOptions
    from autotune.usercmd.job import UserJob

    hf = _hostfile(tmp_path, TWO_NODES)
    own = ["--hostfile", hf] if where == "command" else []
    job = UserJob(argv=["deepspeed", *own, str(REPO / "examples" / "pipeline_train.py"), "--deepspeed_config",
                        "ds.json"], cwd=str(REPO), parameters=1000, pipeline_stages=2, data_parallel_size=2)
    opts = RunOptions()
    opts.workload.balance_stages = True
    opts.workload.hostfile = hf if where == "autotune" else None
    steps = job.steps(opts, None, None, root=tmp_path, note=lambda text: None, noise=0.1, cluster=None)
    assert [type(s).__name__ for s in steps] == ["StageBalancer"] and steps[0].multi_node
    _, cluster = job.launch(opts)
    assert cluster is not None and cluster.multi_node  # the runner's trials run on the same two nodes
