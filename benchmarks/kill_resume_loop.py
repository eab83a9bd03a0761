"""SIGKILL the controller (and ranks) at chosen moments, resume, and check the study every time.

One small study (2 ranks, 2 steps per trial). Each round starts `autotune run` on it
(a resume after the first round) and ends it with one kind of kill, the kinds taken
in turn (a seeded shuffle per cycle, so every kind appears):

- controller-random: SIGKILL the controller after a uniform random delay;
- controller+rank-aimed:PHASE: wait until the running trial reaches PHASE, then SIGKILL
  one of its ranks and the controller at once (the other ranks are left for the next
  resume's clean-up). PHASE is
  - op-load: a torch JIT-extension lock file appears under the benchmark's own
    TORCH_EXTENSIONS_DIR (every rank takes `<op>/lock` for a moment when it loads
    DeepSpeed's ops at start-up); the rank holding the lock is the one killed;
  - rendezvous: the ranks' log says DeepSpeed created its TorchBackend, just before
    `torch.distributed.init_process_group`;
  - engine-build: the ranks' log shows the PipelineModule built, just before
    `deepspeed.initialize`;
  when the phase is not seen within the round's limit the kill happens then, and the
  row says so;
- rank-only: SIGKILL one rank of the running trial at a random moment (0-6 s after the
  ranks appear; trials are short) and not the controller: the trial ends failed
  `killed` and the run goes on (expected failed trials, not consistency failures); the
  controller is killed 0.5-5 s later.

After every round: every trial number counted at most once, at most one trial
`running`, summary.json whole; the extension locks left are counted (a kill during an
op load leaves one: what must hold is that the next run is not stalled by it). Rounds
in a row that finished no trial (an aimed round that reached its phase ends such a
run) while the attempts they killed had been running more than 80 s in all made no
progress: a failure.

A last run without a kill must exit 0 within --final-timeout, end with exactly
`--budget` counted trials, each `ok` but those a rank-only round killed, and leave no
extension lock, no process naming the work folder and no DeepSpeed /dev/shm buffer
of the studies' ports. The runs use the installed autotune, as the tests do; the
header says when it differs from this checkout (scripts/setup refreshes it).

    .venv/bin/python benchmarks/kill_resume_loop.py --kills 10 --budget 4 --seed 1
    .venv/bin/python benchmarks/kill_resume_loop.py --quick    # CI smoke run: 2 kills, budget 1
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.trials.launcher import processes_with, remove_shm_buffers, shm_buffers  # noqa: E402

CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}

PHASES = ("op-load", "rendezvous", "engine-build")
KINDS = ("controller-random", *(f"controller+rank-aimed:{p}" for p in PHASES), "rank-only")
QUICK_KINDS = ("controller-random", "controller+rank-aimed:op-load")
MARKERS = {
    # DeepSpeed 0.19.8's logger is at WARNING, so its INFO lines ("Initializing TorchBackend",
    # "DeepSpeed info: version=") are not printed by default; the first marker of each phase
    # is what a real trial's log shows (comm/torch.py build_shm_op prints it right before
    # init_process_group; PipelineModule prints its partition, ending with the loss, right
    # before the workload calls deepspeed.initialize).
    "rendezvous": ("deepspeed_shm_comm_op built successfully", "Initializing TorchBackend"),
    "engine-build": ("\n  loss: ", "DeepSpeed info: version=", "DeepSpeed Flops Profiler"),
}
RANK_SCRIPTS = ("autotune/rank/workload/train.py", "autotune/rank/workload/worker.py")
NO_PROGRESS_S = 80.0
RANK_WINDOW_S = 6.0
SOURCE_LOCK_WAIT_S = 600.0
OP_LOAD_POLL_S = 0.002
POLL_S = 0.01


# ---------------------------------------------------------------- the study

def rows(study: Path) -> list[tuple]:
    """(id, number, status, pgid, started, finished, failure_reason, failure_detail) per trial row."""
    if not (study / "study.db").exists():
        return []
    db = sqlite3.connect(study / "study.db", timeout=30)
    try:
        return db.execute("SELECT id, number, status, pgid, started, finished, failure_reason, failure_detail"
                          " FROM trials ORDER BY id").fetchall()
    except sqlite3.Error:
        return []
    finally:
        db.close()


def counted_rows(rs: list[tuple]) -> list[tuple]:
    return [r for r in rs if r[2] in ("ok", "failed")]


def ports(study: Path) -> set[int]:
    if not (study / "study.db").exists():
        return set()
    db = sqlite3.connect(study / "study.db", timeout=30)
    try:
        return {r[0] for r in db.execute("SELECT master_port FROM trials WHERE master_port IS NOT NULL")}
    except sqlite3.Error:
        return set()
    finally:
        db.close()


def pool_ports(study: Path) -> set[int]:
    """Master ports of the warm-worker pools still on disk (a killed controller's)."""
    found = set()
    for f in (study / "workers").glob("pool-*/pool.json"):
        try:
            found.add(int(json.loads(f.read_text())["master_port"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return found


def check(study: Path) -> list[str]:
    """Invariants that must hold at any moment, even right after a SIGKILL."""
    problems = []
    rs = rows(study)
    counted = [r[1] for r in counted_rows(rs)]
    if len(counted) != len(set(counted)):
        problems.append(f"a trial counted twice: {counted}")
    if sum(1 for r in rs if r[2] == "running") > 1:
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


def check_complete(study: Path, budget: int, expected_killed: set[int]) -> list[str]:
    """A study its run completed: the budget counted once each, every trial ok but the rank-only kills."""
    problems = check(study)
    rs = rows(study)
    counted = sorted(r[1] for r in counted_rows(rs))
    if counted != list(range(budget)):
        problems.append(f"counted trials {counted}, expected 0..{budget - 1} once each")
    for r in counted_rows(rs):
        if r[2] == "failed" and not (r[6] == "killed" and r[0] in expected_killed):
            problems.append(f"trial {r[1]} failed {r[6]}: {(r[7] or '')[:300]}")
    if any(r[2] == "running" for r in rs):
        problems.append("a trial still marked running after a completed run")
    if not (study / "summary.json").exists():
        return problems + ["no summary.json"]
    summary = json.loads((study / "summary.json").read_text())
    if summary["counted_trials"] != budget:
        problems.append(f"summary.json counts {summary['counted_trials']} trials")
    return problems


# ---------------------------------------------------------------- processes, locks, logs

def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def is_rank(pid: int) -> bool:
    """A rank runs the workload's script itself (the launchers only name it as an argument)."""
    argv = [a.decode("utf-8", "replace") for a in _read(Path(f"/proc/{pid}/cmdline")).split(b"\0") if a]
    for a in argv[1:]:
        if a == "-m":  # python -m deepspeed.launcher.launch ... worker.py: a launcher
            return False
        if a.startswith("-"):
            continue
        return a.endswith(RANK_SCRIPTS)  # the first word that is not an option: the script run
    return False


def rank_number(pid: int) -> str:
    for item in _read(Path(f"/proc/{pid}/environ")).split(b"\0"):
        if item.startswith(b"RANK="):
            return item[5:].decode()
    return "?"


def ranks_of(study: Path, controller_pid: int) -> list[int]:
    """The live ranks of this round's trial (warm pool of this controller, or a fresh trial's)."""
    own_pool = f"/workers/pool-{controller_pid}-"
    running = [r[1] for r in rows(study) if r[2] == "running"]
    trial_dirs = [str((study / f"trial-{n:03d}").resolve()) + os.sep for n in running]
    found = []
    for pid in processes_with(str(study.resolve())):
        if not is_rank(pid):
            continue
        cmd = _cmd(pid)
        if own_pool in cmd or any(d in cmd for d in trial_dirs):
            found.append(pid)
    return sorted(found)


def holder_of(lock: Path, pids: list[int]) -> int | None:
    """The process that holds `lock` open (torch's FileBaton keeps the O_EXCL fd until release)."""
    target = str(lock)
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            for fd in fd_dir.iterdir():
                try:
                    if os.readlink(fd) == target:
                        return pid
                except OSError:
                    continue
        except OSError:
            continue
    return None


def _key(p: Path) -> tuple | None:
    try:
        st = p.stat()
    except OSError:
        return None
    return (str(p), st.st_ino, st.st_mtime_ns)


def _cmd(pid: int) -> str:
    return _read(Path(f"/proc/{pid}/cmdline")).replace(b"\0", b" ").decode("utf-8", "replace").strip()


def lock_files(ext: Path) -> list[Path]:
    return sorted(p for p in ext.rglob("lock") if p.is_file())


def kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class LogWatch:
    """New text of the study's launcher logs since the round began (trial and own-pool logs)."""

    def __init__(self, study: Path, controller_pid: int) -> None:
        self.study = study
        self.pool_glob = f"workers/pool-{controller_pid}-*/launcher.log"
        self.seen: dict[Path, tuple[int, int]] = {}  # path -> (inode, bytes read)
        for p in self.paths():  # what is there already is an earlier round's
            try:
                st = p.stat()
                self.seen[p] = (st.st_ino, st.st_size)
            except OSError:
                pass
        self.text = ""
        self.next_scan = 0.0
        self.found: list[Path] = []

    def paths(self) -> list[Path]:
        return [*self.study.glob("trial-*/launcher.log"), *self.study.glob(self.pool_glob)]

    def poll(self) -> str:
        now = time.monotonic()
        if now >= self.next_scan:
            self.found, self.next_scan = self.paths(), now + 0.2
        for p in self.found:
            try:
                st = p.stat()
            except OSError:
                continue
            ino, done = self.seen.get(p, (st.st_ino, 0))
            if ino != st.st_ino:
                done = 0
            if st.st_size > done:
                with open(p, "rb") as fh:
                    fh.seek(done)
                    self.text += fh.read().decode("utf-8", "replace")
                self.seen[p] = (st.st_ino, st.st_size)
        return self.text


# ---------------------------------------------------------------- one round

@dataclass
class Round:
    number: int
    kind: str
    delay: float = 0.0
    state: str = ""
    notes: list[str] = field(default_factory=list)
    finished_first: bool = False
    rc: int | None = None
    rank_killed_at: float | None = None  # wall clock
    attempt_s: float | None = None  # how long the attempt of the trial killed had been running
    phase_reached: bool = False  # an aimed round killed at its phase (the start-up got that far)
    trial: int | None = None


class Loop:
    def __init__(self, args: argparse.Namespace, work: Path, ext: Path) -> None:
        self.args = args
        self.work = work
        self.ext = ext
        self.studies: list[Path] = []
        self.study = self.new_study("st")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_EXTENSIONS_DIR": str(ext)}
        self.expected_killed: set[int] = set()  # row ids failed `killed` by a rank-only round

    def new_study(self, name: str) -> Path:
        study = self.work / name
        self.studies.append(study)
        return study

    def cmd(self) -> list[str]:
        return [sys.executable, "-m", "autotune", "run", "--budget", str(self.args.budget), "--study",
                str(self.study), "--config", str(self.work / "ds.json"), "--dp", "1", "--steps", "2",
                "--warmup-steps", "1", "--no-metrics", "--full-budget"]

    def start(self, out: Path) -> subprocess.Popen:
        with open(out, "wb") as fh:
            return subprocess.Popen(self.cmd(), cwd=self.work, stdout=fh, stderr=subprocess.STDOUT, env=self.env,
                                    stdin=subprocess.DEVNULL)

    def run_round(self, r: Round, rng: random.Random) -> None:
        a = self.args
        stale = set(lock_files(self.ext))  # an earlier round's: not this round's op load
        stale_at_start = len(stale)
        proc = self.start(self.work / f"round-{r.number}.out")
        t0 = time.monotonic()
        logs = LogWatch(self.study, proc.pid)
        delay = rng.uniform(0.5, a.max_delay)
        in_ranks = rng.uniform(0.0, min(RANK_WINDOW_S, a.max_delay))  # rank-only: after the ranks appear
        after = rng.uniform(0.5, 5.0)
        pick = rng.random()
        phase = r.kind.split(":", 1)[1] if ":" in r.kind else None
        limit = a.aim_limit
        ranks_seen: float | None = None
        op_dirs: list[Path] = []
        next_dirs = 0.0
        ranks: list[int] = []
        next_ranks = 0.0
        foreign: set[tuple] = set()  # locks seen that no rank of this round held
        stale_gone: float | None = None
        kill_controller_at: float | None = t0 + delay if r.kind == "controller-random" else None
        poll = OP_LOAD_POLL_S if phase == "op-load" else POLL_S
        while True:
            now = time.monotonic()
            if proc.poll() is not None:
                r.finished_first, r.rc, r.delay = True, proc.returncode, now - t0
                r.state = f"finished first (rc {proc.returncode})"
                break
            if stale:  # once gone, a lock at that path is a new one (its inode may be reused)
                stale = {p for p in stale if p.exists()}
                if not stale:
                    stale_gone = now - t0
            if now >= next_ranks and r.kind != "controller-random":
                ranks, next_ranks = ranks_of(self.study, proc.pid), now + 0.25
                if ranks and ranks_seen is None:
                    ranks_seen = now
            if kill_controller_at is not None and now >= kill_controller_at:
                r.delay = now - t0
                r.state = self.state_at_kill(r)
                kill(proc.pid)
                break
            if phase == "op-load":
                if now >= next_dirs:
                    op_dirs, next_dirs = [d for d in self.ext.iterdir() if d.is_dir()], now + 0.5
                fresh = [(d / "lock", key) for d in op_dirs if d / "lock" not in stale
                         and (key := _key(d / "lock")) is not None and key not in foreign]
                for lock, key in fresh:
                    holder = holder_of(lock, ranks)
                    if holder is None:
                        ranks = ranks_of(self.study, proc.pid)
                        holder = holder_of(lock, ranks)
                    if holder is None:  # a lock this round's ranks do not hold: not the phase
                        foreign.add(key)
                        other = holder_of(lock, [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()])
                        held = f"pid {other}: {_cmd(other)[:60]}" if other else "gone"
                        r.notes.append(f"{lock.parent.name}/lock at {now - t0:.1f} s not held by a rank of this "
                                       f"trial ({held}): ignored")
                        continue
                    self.kill_both(r, proc, holder, t0)
                    r.phase_reached = True
                    r.notes.append(f"lock {lock.parent.name}/lock seen; killed its holder")
                    break
                if r.phase_reached:
                    break
            elif phase is not None:
                text = logs.poll()
                marker = next((m for m in MARKERS[phase] if m in text), None)
                if marker is not None:
                    ranks = ranks_of(self.study, proc.pid)
                    victim = ranks[int(pick * len(ranks))] if ranks else None
                    self.kill_both(r, proc, victim, t0)
                    r.phase_reached = True
                    r.notes.append(f"marker {marker.strip()!r}" + ("" if victim else "; no rank alive"))
                    break
            elif r.kind == "rank-only" and r.rank_killed_at is None:
                if ranks_seen is not None and now >= ranks_seen + in_ranks and ranks \
                        and any(x[2] == "running" for x in rows(self.study)):
                    victim = ranks[int(pick * len(ranks))]
                    r.trial = next((x[1] for x in rows(self.study) if x[2] == "running"), None)
                    who = rank_number(victim)
                    kill(victim)
                    r.rank_killed_at = time.time()
                    r.notes.append(f"rank {who} of trial {r.trial} killed at {now - t0:.1f} s")
                    kill_controller_at = now + after
                elif now >= t0 + limit:
                    kill_controller_at = now
                    r.notes.append(f"no rank of a running trial within {limit:.0f} s: the controller only")
            if phase and now >= t0 + limit:
                ranks = ranks_of(self.study, proc.pid)
                victim = ranks[int(pick * len(ranks))] if ranks else None
                self.kill_both(r, proc, victim, t0)
                r.notes.append(f"{phase} not seen within {limit:.0f} s: killed then"
                               + ("" if victim else " (no rank alive)"))
                break
            time.sleep(poll)
        proc.wait()
        if stale_at_start:
            r.notes.append(f"{stale_at_start} stale lock(s) at start: " + (
                f"gone at {stale_gone:.1f} s" if stale_gone is not None else "still there"))

    def kill_both(self, r: Round, proc: subprocess.Popen, victim: int | None, t0: float) -> None:
        """One rank, then the controller at once: no moment for the controller to see the rank die."""
        who = rank_number(victim) if victim is not None else None
        if victim is not None:
            kill(victim)
        kill(proc.pid)
        r.delay = time.monotonic() - t0
        r.state = self.state_at_kill(r) + (f", rank {who}" if who is not None else "")

    def state_at_kill(self, r: Round) -> str:
        rs = rows(self.study)
        running = [x for x in rs if x[2] == "running"]
        if not running:
            return "between trials"
        r.trial, r.attempt_s = running[0][1], time.time() - running[0][4]
        return f"trial {r.trial} running {r.attempt_s:.0f} s"


def copy_extensions(work: Path) -> tuple[Path, str, dict[str, float]]:
    """The benchmark's own TORCH_EXTENSIONS_DIR: a copy of this user's built ops (mtimes kept).

    A build in progress in the source (a `lock` there) is waited for: a copy taken during it
    holds deleted objects and a half-written ninja log, and every op is compiled again in the
    copy (minutes on a small machine). Whether the copy is up to date is then asked of ninja
    (`ninja -n`), the one next to this interpreter first, as the ranks run it."""
    src = Path.home() / ".cache" / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    ext = (work / "torch_extensions").resolve()  # as /proc/PID/fd shows the lock
    if not src.is_dir():
        ext.mkdir()
        return ext, f"empty ({src} does not exist: the first ranks build the ops)", {}
    waited = time.monotonic()
    while lock_files(src) and time.monotonic() - waited < SOURCE_LOCK_WAIT_S:
        time.sleep(1.0)
    busy = [str(p) for p in lock_files(src)]
    shutil.copytree(src, ext, symlinks=True, copy_function=shutil.copy2, ignore=shutil.ignore_patterns("lock"))
    how = f"a copy of {src}"
    if time.monotonic() - waited > 1.0:
        how += f", taken after waiting {time.monotonic() - waited:.0f} s for a build there to end"
    if busy:
        how += f", taken while {busy} still existed"
    ninja = Path(sys.executable).with_name("ninja")
    ninja_cmd = str(ninja) if ninja.exists() else shutil.which("ninja")
    states = []
    for d in sorted(p for p in ext.iterdir() if (p / "build.ninja").is_file()):
        if ninja_cmd is None:
            break
        out = subprocess.run([ninja_cmd, "-C", str(d), "-n"], capture_output=True, text=True, timeout=60)
        states.append(f"{d.name} {'up to date' if 'no work to do' in out.stdout else 'NOT up to date'}")
    how += f"; ninja -n: {', '.join(states) or 'not run'}"
    if any("NOT" in s for s in states):  # the source was built by another ninja or venv: build here first,
        # as a run's pre-flight would, so that round 1 is about its kill and not about a build
        from autotune.trials.ext_locks import build_ops, unbuilt_ops
        from autotune.trials.launcher import with_own_tools

        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "DS_ACCELERATOR": "cpu",
               "PATH": with_own_tools(os.environ.get("PATH", ""))}
        started = time.monotonic()
        failed = build_ops(unbuilt_ops(env), env, lambda _text: None)
        how += (f"; built in the copy first ({time.monotonic() - started:.0f} s"
                + (f", failed: {failed})" if failed else ")"))
    return ext, how, so_mtimes(ext)


def under_test(env: dict[str, str], cwd: Path) -> tuple[Path, list[str]]:
    """The autotune `autotune run` imports (the installed one, as the tests use), and the files
    where it differs from this checkout (none for an editable install)."""
    out = subprocess.run([sys.executable, "-c", "import autotune; print(autotune.__file__)"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120)
    installed = Path(out.stdout.strip() or ".").resolve().parent
    source = ROOT / "autotune"
    if installed == source:
        return installed, []
    stale = []
    for f in sorted(source.rglob("*.py")):
        twin = installed / f.relative_to(source)
        if "__pycache__" not in f.parts and (not twin.is_file() or not filecmp.cmp(f, twin, shallow=False)):
            stale.append(str(f.relative_to(ROOT)))
    return installed, stale


def so_mtimes(ext: Path) -> dict[str, float]:
    return {str(p.relative_to(ext)): p.stat().st_mtime for p in ext.rglob("*.so")}


def parse_kinds(text: str | None, quick: bool) -> list[str]:
    if not text:
        return list(QUICK_KINDS if quick else KINDS)
    kinds = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        match = [k for k in KINDS if k == word or k.endswith(":" + word)]
        if not match:
            raise SystemExit(f"--kinds: unknown kind {word!r}; choose from {', '.join(KINDS)}")
        kinds.append(match[0])
    return kinds


def schedule(kinds: list[str], n: int, rng: random.Random, shuffle: bool) -> list[str]:
    """n kinds: each cycle a seeded shuffle of `kinds`, so every kind appears once per cycle."""
    out: list[str] = []
    while len(out) < n:
        cycle = list(kinds)
        if shuffle:
            rng.shuffle(cycle)
        out += cycle
    return out[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--max-delay", type=float, default=60.0,
                    help="seconds; a random kill's delay is uniform in [0.5, this]")
    ap.add_argument("--aim-limit", type=float, default=90.0,
                    help="seconds an aimed round waits for its phase before it kills anyway")
    ap.add_argument("--final-timeout", type=float, default=600.0, help="seconds the last run may take")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", help=f"comma list of kinds to use (of {', '.join(KINDS)}; a phase alone will do)")
    ap.add_argument("--quick", action="store_true",
                    help="2 kills (controller-random within 8 s, then op-load aimed), budget 1: a smoke run (CI)")
    args = ap.parse_args(argv)
    if args.quick:
        args.kills, args.budget, args.max_delay = 2, 1, 8.0
    kinds = parse_kinds(args.kinds, args.quick)
    rng = random.Random(args.seed)
    plan = schedule(kinds, args.kills, rng, shuffle=not args.quick)
    work = Path(tempfile.mkdtemp(prefix="kill-resume-")).resolve()
    (work / "ds.json").write_text(json.dumps(CONFIG))
    ext, ext_how, so_before = copy_extensions(work)
    loop = Loop(args, work, ext)
    t_all = time.monotonic()
    failures: list[str] = []
    print(f"kill_resume_loop: {args.kills} kills, budget {args.budget}, seed {args.seed}, work folder {work}")
    tested, stale = under_test(loop.env, work)
    print(f"autotune under test: {tested}" + (
        f" -- WARNING: differs from this checkout in {len(stale)} file(s) ({', '.join(stale[:3])}): the runs "
        "test the installed copy, not these sources (scripts/setup refreshes it)" if stale else ""))
    print(f"TORCH_EXTENSIONS_DIR {ext} ({ext_how})")
    print(f"command: {' '.join(loop.cmd()[1:])}")
    head = (f"{'round':>5} {'kind':<34} {'delay_s':>7} {'state at kill':<30} {'counted':>8} {'interrupted':>11} "
            f"{'orphans':>7} {'locks':>5}  checks")
    print(head, flush=True)
    by_kind: Counter[str] = Counter()
    streak = longest = 0
    stalled_s = 0.0
    for i, kind in enumerate(plan, start=1):
        r = Round(i, kind)
        before = {x[0] for x in counted_rows(rows(loop.study))}
        loop.run_round(r, random.Random(args.seed * 100_003 + i))
        by_kind[kind] += 1
        rs = rows(loop.study)
        new = [x for x in counted_rows(rs) if x[0] not in before]
        if kind == "rank-only" and r.rank_killed_at is not None:
            loop.expected_killed |= {x[0] for x in new if x[2] == "failed" and x[6] == "killed"
                                     and (x[5] or 0) >= r.rank_killed_at - 1}
            if not any(x[0] in loop.expected_killed for x in new):
                r.notes.append("the killed trial was not recorded failed (the controller died first)")
        orphans = len(processes_with(str(loop.study.resolve())))
        locks = len(lock_files(ext))
        problems = check(loop.study)
        if r.finished_first and r.rc != 0:  # a run that fails on its own proves nothing about resuming
            problems.append(f"the run exited {r.rc} before the kill (see {work / f'round-{i}.out'})")
        for x in new:
            if x[2] == "failed" and x[0] not in loop.expected_killed:
                problems.append(f"trial {x[1]} failed {x[6]}: {(x[7] or '')[:200]}")
        # No progress: rounds in a row that finished no trial (an aimed round that reached its
        # phase got through start-up that far: it ends the run of rounds), whose killed attempts
        # had been running more than NO_PROGRESS_S in all. A healthy trial takes ~15 s.
        if new or r.phase_reached or r.finished_first:
            streak, stalled_s = 0, 0.0
        else:
            streak, stalled_s = streak + 1, stalled_s + (r.attempt_s or 0.0)
        if stalled_s > NO_PROGRESS_S:
            longest = max(longest, streak)
            problems.append(f"no progress: {streak} round(s) in a row finished no trial while the trial "
                            f"killed had been running {stalled_s:.0f} s in all")
        failures += [f"round {i}: {p}" for p in problems]
        counted = f"{len(counted_rows(rs))} (+{len(new)})"
        checks = "ok" if not problems else "; ".join(problems)
        print(f"{i:>5} {kind:<34} {r.delay:>7.1f} {r.state:<30} {counted:>8} "
              f"{sum(1 for x in rs if x[2] == 'interrupted'):>11} {orphans:>7} {locks:>5}  {checks}"
              + (f"  [{'; '.join(r.notes)}]" if r.notes else ""), flush=True)
        if r.finished_first:  # the budget was reached before the kill: start a fresh study
            failures += [f"round {i}: {p}" for p in check_complete(loop.study, args.budget, loop.expected_killed)]
            loop.study = loop.new_study(f"st{i}")
    # the last run, no kill: it must complete the study exactly, in time, and leave nothing behind
    t_final = time.monotonic()
    proc = loop.start(work / "final.out")
    try:
        rc: int | None = proc.wait(timeout=args.final_timeout)
    except subprocess.TimeoutExpired:
        kill(proc.pid)
        proc.wait()
        rc = None
        failures.append(f"final run still running after {args.final_timeout:.0f} s: killed "
                        f"(see {work / 'final.out'})")
    final_wall = time.monotonic() - t_final
    if rc not in (0, None):
        tail = (work / "final.out").read_text(errors="replace")[-600:]
        failures.append(f"final run exited {rc}: {tail}")
    failures += [f"final: {p}" for p in check_complete(loop.study, args.budget, loop.expected_killed)]
    time.sleep(0.5)  # the launchers' last children exit with them
    left_procs = processes_with(str(work.resolve()))
    left_locks = lock_files(ext)
    all_ports = set().union(*(ports(s) | pool_ports(s) for s in loop.studies))
    left_shm = [f for port in all_ports for f in shm_buffers(port)]
    if left_procs:
        failures.append(f"{len(left_procs)} process(es) naming the work folder left: pids {left_procs[:5]}")
    if left_locks:
        failures.append(f"{len(left_locks)} extension lock(s) left: {[str(p) for p in left_locks]}")
    if left_shm:
        failures.append(f"{len(left_shm)} DeepSpeed /dev/shm buffers of the studies' ports left: "
                        f"{[f.name for f in left_shm[:3]]}")
    rs = rows(loop.study)
    ok = sum(1 for x in rs if x[2] == "ok")
    killed = sum(1 for x in counted_rows(rs) if x[0] in loop.expected_killed)
    print(f"final run: rc {rc} in {final_wall:.0f} s (limit {args.final_timeout:.0f} s); counted trials "
          f"{len({x[1] for x in counted_rows(rs)})} (budget {args.budget}): {ok} ok, {killed} failed killed by "
          f"rank-only rounds; interrupted rows {sum(1 for x in rs if x[2] == 'interrupted')}; "
          f"processes left {len(left_procs)}; locks left {len(left_locks)}; shm buffers left {len(left_shm)}")
    rebuilt = sorted(k for k, v in so_mtimes(ext).items() if so_before.get(k) != v)
    print(f"rounds by kind: {', '.join(f'{k} {by_kind[k]}' for k in kinds)}")
    print(f"extensions: {'rebuilt ' + ', '.join(rebuilt) if rebuilt else 'no op rebuilt in the copy'}; "
          f"longest no-progress streak {longest} round(s)")
    own = resource.getrusage(resource.RUSAGE_SELF)
    print(f"total {time.monotonic() - t_all:.0f} s (the loop's own CPU {own.ru_utime + own.ru_stime:.0f} s); "
          f"{len(plan)} kills; final run {final_wall:.0f} s; consistency failures: {len(failures)}")
    for f in failures:
        print("  FAIL", f)
    for pid in left_procs:  # leave the machine as it was
        kill(pid)
    for port in all_ports:
        remove_shm_buffers(port)
    if not failures:  # the logs stay; the 50 MB copy of the ops only where it can explain a failure
        shutil.rmtree(ext, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
