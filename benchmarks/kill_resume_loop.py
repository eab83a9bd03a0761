"""SIGKILL the controller at random moments, resume, and check the study every time.

One small study (2 ranks, 3 steps per trial). Each round starts `autotune run` on
it (a resume after the first round), SIGKILLs the controller after a random
delay, and checks: every trial number counted at most once, nothing left
`running` that a resume would not fix, summary.json whole. A last run without a
kill must end with exactly `--budget` counted trials (numbers 0..budget-1, each
once), no process of any round left alive, and no DeepSpeed /dev/shm buffer of
any trial left behind.

    .venv/bin/python benchmarks/kill_resume_loop.py --kills 10 --budget 4 --seed 1
    .venv/bin/python benchmarks/kill_resume_loop.py --quick    # CI smoke run: 1 kill, budget 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.launcher import group_alive, processes_with, shm_buffers  # noqa: E402

CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}


def rows(study: Path) -> list[tuple]:
    if not (study / "study.db").exists():
        return []
    db = sqlite3.connect(study / "study.db", timeout=30)
    try:
        return db.execute("SELECT number, status, pgid FROM trials ORDER BY id").fetchall()
    except sqlite3.Error:
        return []
    finally:
        db.close()


def check(study: Path) -> list[str]:
    """Invariants that must hold at any moment, even right after a SIGKILL."""
    problems = []
    rs = rows(study)
    counted = [r[0] for r in rs if r[1] in ("ok", "failed")]
    if len(counted) != len(set(counted)):
        problems.append(f"a trial counted twice: {counted}")
    if sum(1 for r in rs if r[1] == "running") > 1:
        problems.append("more than one trial running")
    summary = study / "summary.json"
    if summary.exists():
        try:
            s = json.loads(summary.read_text())
            if s["counted_trials"] > len(counted):
                problems.append("summary.json counts trials the database does not have")
        except (ValueError, KeyError) as exc:
            problems.append(f"summary.json damaged: {exc}")
    for name in ("best_ds_config.json",):
        p = study / name
        if p.exists():
            try:
                json.loads(p.read_text())
            except ValueError as exc:
                problems.append(f"{name} damaged: {exc}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--max-delay", type=float, default=40.0, help="seconds; kill delay is uniform in [0.5, this]")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="1 kill within 8 s, budget 1: a smoke run (CI)")
    args = ap.parse_args(argv)
    if args.quick:
        args.kills, args.budget, args.max_delay = 1, 1, 8.0
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kill-resume-"))
    (work / "ds.json").write_text(json.dumps(CONFIG))
    study = work / "st"
    cmd = [sys.executable, "-m", "autotune", "run", "--budget", str(args.budget), "--study", str(study),
           "--config", str(work / "ds.json"), "--dp", "1", "--steps", "2", "--warmup-steps", "1"]
    t0 = time.time()
    failures: list[str] = []
    pgids: set[int] = set()
    print(f"kill_resume_loop: {args.kills} random SIGKILLs, budget {args.budget}, study {study}")
    print(f"{'round':>5} {'delay_s':>7} {'state at kill':<28} {'counted':>7} {'interrupted':>11} "
          f"{'orphans':>7}  checks")
    rounds = 0
    while rounds < args.kills:
        proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        delay = rng.uniform(0.5, args.max_delay)
        try:
            proc.wait(timeout=delay)
            state = f"finished first (rc {proc.returncode})"
            if proc.returncode != 0:  # a run that fails on its own proves nothing about resuming
                failures.append(f"round {rounds + 1}: the run exited {proc.returncode} before the kill")
        except subprocess.TimeoutExpired:
            running = [r for r in rows(study) if r[1] == "running"]
            state = f"trial {running[0][0]} running" if running else "between trials"
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        rounds += 1
        rs = rows(study)
        pgids |= {r[2] for r in rs if r[2]}
        orphans = len(processes_with(str(study.resolve())))
        problems = check(study)
        failures += [f"round {rounds}: {p}" for p in problems]
        counted = len({r[0] for r in rs if r[1] in ("ok", "failed")})
        print(f"{rounds:>5} {delay:>7.1f} {state:<28} {counted:>7} "
              f"{sum(1 for r in rs if r[1] == 'interrupted'):>11} {orphans:>7}  "
              f"{'ok' if not problems else '; '.join(problems)}")
        if state.startswith("finished"):  # budget reached before the kill: start a fresh study
            final = check_final(study, args.budget, pgids)
            failures += [f"round {rounds}: {p}" for p in final]
            study = work / f"st{rounds}"
            cmd[cmd.index("--study") + 1] = str(study)
    # the last run, no kill: it must complete the study exactly
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    if done.returncode != 0:
        failures.append(f"final run exited {done.returncode}: {done.stderr[-500:]}")
    final = check_final(study, args.budget, pgids)
    failures += [f"final: {p}" for p in final]
    rs = rows(study)
    print(f"final run: rc {done.returncode}; counted trials {len({r[0] for r in rs if r[1] in ('ok', 'failed')})}"
          f" (budget {args.budget}); interrupted rows {sum(1 for r in rs if r[1] == 'interrupted')}; "
          f"processes left {len(processes_with(str(work.resolve())))}")
    print(f"total {time.time() - t0:.0f} s; {rounds} kills; consistency failures: {len(failures)}")
    for f in failures:
        print("  FAIL", f)
    return 1 if failures else 0


def ports(study: Path) -> set[int]:
    if not (study / "study.db").exists():
        return set()
    db = sqlite3.connect(study / "study.db", timeout=30)
    try:
        return {r[0] for r in db.execute("SELECT master_port FROM trials WHERE master_port IS NOT NULL")}
    finally:
        db.close()


def check_final(study: Path, budget: int, pgids: set[int]) -> list[str]:
    problems = check(study)
    rs = rows(study)
    counted = sorted(r[0] for r in rs if r[1] in ("ok", "failed"))
    if counted != list(range(budget)):
        problems.append(f"counted trials {counted}, expected 0..{budget - 1} once each")
    if any(r[1] == "running" for r in rs):
        problems.append("a trial still marked running after a completed run")
    alive = [g for g in pgids if group_alive(g) and processes_with(str(study.resolve()))]
    if alive or processes_with(str(study.resolve())):
        problems.append(f"processes of the study still alive (groups {alive})")
    leaked = [f.name for port in ports(study) for f in shm_buffers(port)]
    if leaked:
        problems.append(f"{len(leaked)} DeepSpeed /dev/shm buffers of the study's trials left: {leaked[:3]}")
    if not (study / "summary.json").exists():
        return problems + ["no summary.json"]
    summary = json.loads((study / "summary.json").read_text())
    if summary["counted_trials"] != budget:
        problems.append(f"summary.json counts {summary['counted_trials']} trials")
    return problems


if __name__ == "__main__":
    sys.exit(main())
