"""Trials through DeepSpeed's slurm launcher, on a real Slurm (tests/slurm_cluster.py).

autotune runs inside an allocation, as a user runs it: from `salloc`, and from the sbatch
template users submit (examples/slurm/autotune.sbatch). Every trial's ranks are started by
`srun -n WORLD` on the allocation's two nodes; the ranks take RANK from srun's SLURM_PROCID
(autotune/rank/launcher_ranks.py) and the master, node-a's NodeAddr, from the trial's env
file. `scancel` mid-trial stops the study as SIGTERM does, leaving nothing behind, and
submitting again continues the study in the new allocation.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster
from robust_helpers import alive_under, rows, write_config

from exporters.file_sd import read_rank_endpoints

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "examples" / "slurm" / "autotune.sbatch"
AUTOTUNE = f"{shlex.quote(sys.executable)} -m autotune"
SHORT = ["--stages", "2", "--dp", "2", "--steps", "2", "--warmup-steps", "1", "--fixed-steps",
         "--trial-timeout", "300"]

pytestmark = pytest.mark.skipif(slurm_cluster.available() is not None, reason=str(slurm_cluster.available()))


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def _env(slurm) -> dict[str, str]:
    return {**os.environ, **slurm.env, "DS_ACCELERATOR": "cpu"}


def _hostfile(tmp_path: Path, text: str = "node-a slots=2\nnode-b slots=2\n") -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_refused_in_a_real_allocation_too_small_or_not_holding_the_hosts(tmp_path, slurm):
    """The allocation's own variables, from a real salloc: one line, exit 2, before any trial."""
    run = [sys.executable, "-m", "autotune", "run", "--study", "st", "--budget", "1", *SHORT, "--launcher", "slurm"]
    r = subprocess.run(["salloc", "-n", "2", *run, "--hostfile", _hostfile(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, env=_env(slurm), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(r"autotune: error: Slurm allocation \d+ holds 2 tasks; every trial needs stages x dp = 4",
                     r.stderr), r.stderr
    r = subprocess.run(["salloc", "-n", "4", *run, "--hostfile", _hostfile(tmp_path, "node-a slots=2\nnode-c slots=2\n")],
                       cwd=tmp_path, capture_output=True, text=True, env=_env(slurm), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(r"autotune: error: hostfile host node-c is not in Slurm allocation \d+ \(its nodes: node-a, "
                     "node-b\\)", r.stderr), r.stderr
    assert not (tmp_path / "st").exists()


@pytest.mark.slow
def test_a_study_inside_salloc_runs_its_trials_through_srun_on_both_nodes(tmp_path, slurm):
    r = subprocess.run(["salloc", "-n", "4", sys.executable, "-m", "autotune", "run", "--study", "st", "--budget", "1",
                        *SHORT, "--hostfile", _hostfile(tmp_path), "--launcher", "slurm", "--metrics-addr", "0.0.0.0"],
                       cwd=tmp_path, capture_output=True, text=True, env=_env(slurm), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "nodes: node-a:2, node-b:2 (multi-node through slurm)" in r.stdout + r.stderr
    trial = tmp_path / "st" / "trial-000"
    assert rows(tmp_path / "st")[0][1] == "ok", (trial / "launcher.log").read_text()[-3000:]
    log = (trial / "launcher.log").read_text()
    assert "cmd = srun -n 4 --export=ALL," in log
    assert "MASTER_ADDR=127.0.0.2" in log  # node-a's NodeAddr, as slurmctld reaches it
    for rank in range(4):
        assert len((trial / f"metrics-rank{rank}.csv").read_text().splitlines()) == 1 + 3
    # srun placed ranks 0, 1 on node-a and 2, 3 on node-b (block distribution), and each says so
    assert {t.labels["rank"]: t.host for t in read_rank_endpoints(trial)} == {
        "0": "node-a", "1": "node-a", "2": "node-b", "3": "node-b"}
    assert alive_under(tmp_path / "st") == []


@pytest.mark.slow
def test_the_users_own_script_tunes_through_srun_unchanged(tmp_path, slurm):
    """`autotune run --launcher slurm -- deepspeed script.py`: the bootstrap maps srun's ranks
    before the script's own `deepspeed.init_distributed` runs, which would otherwise look for
    mpi4py; the script is the public example, unchanged."""
    command = ["deepspeed", str(REPO / "examples" / "pipeline_train.py"), "--deepspeed_config",
               str(REPO / "examples" / "ds_config.json"), "--steps", "100000"]
    env = {**_env(slurm), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["salloc", "-N", "2", "-n", "2", sys.executable, "-m", "autotune", "run", "--budget", "1", "--study",
                        "st", "--steps", "2", "--warmup-steps", "1", "--fixed-steps", "--trial-timeout", "300",
                        "--hostfile", _hostfile(tmp_path, "node-a slots=1\nnode-b slots=1\n"), "--launcher",
                        "slurm", "--", *command], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    trial = tmp_path / "st" / "trial-000"
    log = (trial / "launcher.log").read_text()
    assert rows(tmp_path / "st")[0][1] == "ok", log[-3000:]
    assert "cmd = srun -n 2 " in log and "mpi4py" not in log
    for rank in (0, 1):  # instrumented on both nodes by the bootstrap
        assert len((trial / f"metrics-rank{rank}.csv").read_text().splitlines()) == 1 + 3
    assert alive_under(tmp_path / "st") == []


def _job_state(job: str, slurm) -> str:
    r = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=_env(slurm))
    found = re.search(r"JobState=(\w+)", r.stdout)
    return found.group(1) if found else "GONE"


def _submit(tmp_path: Path, slurm, *args: str) -> str:
    env = {**_env(slurm), "AUTOTUNE": AUTOTUNE, "AUTOTUNE_STUDY": "st"}
    r = subprocess.run(["sbatch", "--parsable", "-n", "4", "--chdir", str(tmp_path), str(SBATCH), *args],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _wait_job_end(job: str, slurm, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    state = _job_state(job, slurm)
    while state in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING") and time.monotonic() < deadline:
        time.sleep(1)
        state = _job_state(job, slurm)
    return state


@pytest.mark.slow
def test_a_batch_job_cancelled_mid_trial_leaves_nothing_and_the_next_allocation_continues(tmp_path, slurm):
    cfg = write_config(tmp_path, train_batch_size=16)
    args = ["--budget", "2", "--full-budget", *SHORT, "--config", str(cfg)]
    job = _submit(tmp_path, slurm, *args)
    trial = (tmp_path / "st" / "trial-000").resolve()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # all four ranks of the first trial run on the nodes
        if len(list(trial.glob("metrics-rank*.csv"))) == 4:
            break
        assert _job_state(job, slurm) in ("PENDING", "RUNNING", "CONFIGURING"), (tmp_path / f"autotune-{job}.out").read_text()
        time.sleep(0.5)
    else:
        pytest.fail("the first trial's ranks never started: " + (tmp_path / f"autotune-{job}.out").read_text()[-2000:])
    subprocess.run(["scancel", job], check=True, env=_env(slurm), timeout=30)
    assert _wait_job_end(job, slurm, 120) in ("CANCELLED", "GONE")
    out = (tmp_path / f"autotune-{job}.out").read_text()
    deadline = time.monotonic() + 15
    while alive_under(tmp_path / "st") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_under(tmp_path / "st") == [], out[-2000:]
    port = re.search(r"MASTER_PORT=(\d+)", (trial / "launcher.log").read_text())
    assert port and not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port.group(1)}_*"))
    assert "stopped" in out.lower(), out[-2000:]  # autotune said it was stopped, not crashed
    before = rows(tmp_path / "st")

    job2 = _submit(tmp_path, slurm, *args)  # a new allocation, the same study
    assert _wait_job_end(job2, slurm, 600) in ("COMPLETED", "GONE")
    out2 = (tmp_path / f"autotune-{job2}.out").read_text()
    after = rows(tmp_path / "st")
    assert [r[1] for r in after].count("ok") == 2, (before, after, out2[-2000:])
    assert len(after) >= len(before)
    assert (tmp_path / "st" / "summary.json").exists(), out2[-2000:]
    assert alive_under(tmp_path / "st") == []
