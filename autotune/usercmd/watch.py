"""`autotune watch -- deepspeed train.py ...`: run the user's job unchanged, watched, for as long as it runs.

The same bootstrap as a tuning trial (hook.py), in watch mode: every rank's
PipelineEngine is instrumented (metrics CSV, Prometheus endpoint) and never
stopped. Meanwhile this process

- echoes the job's output (it also lands in RUN/launcher.log),
- lists every rank endpoint, with the port it really bound, in
  OUT/prometheus_targets.json (exporters/file_sd.py) and serves the findings
  on the controller endpoint (exporters/prometheus_watch.py),
- re-evaluates the advisor every `interval` seconds over the last `window`
  steps of each rank's CSV, and prints the findings when they change,
- passes the job's exit code through; on SIGINT/SIGTERM stops the whole process
  group (ranks, launcher, endpoint children), removes DeepSpeed's /dev/shm
  buffers and returns 128 + the signal (130 for Ctrl-C; autotune/tuning/stop_signals.py).

Each watch writes a new folder OUT/run-NNN (nothing of an earlier watch is overwritten).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.core.dsconfig import parse_config_text
from autotune.core.errors import ConfigError, InputFileError, UserError
from autotune.core.fileio import write_atomic
from autotune.core.options import endpoint_defaults
from autotune.core.rank_plan import RankPlan
from autotune.rank.hook import MODE_WATCH, BootstrapSettings
from autotune.trials.launcher import LaunchSpec, free_port, run_launch
from autotune.trials.multinode import resolve_cluster, stop_on_other_nodes
from autotune.trials.user_command import CommandProcess, multi_node_command, rank_env, read_markers
from autotune.tuning.stop_signals import (
    Stopped,
    ignore_stop_signals,
    restore_stop_signals,
    stop_on_signals,
)
from autotune.tuning.validation import validate_endpoints
from autotune.usercmd.command import UserCommand, check_launcher_installed, parse_command

RUN_PREFIX = "run-"
_ENDPOINTS = endpoint_defaults()
POLL_SECONDS = 0.5


@dataclass(kw_only=True, slots=True)
class WatchOptions:
    """What `autotune watch` is told (autotune/cli/watch.py)."""

    out: str = "autotune-watch"
    """Folder of the watches; each one writes OUT/run-NNN."""
    config: str | None = None
    """The config, for a command that takes it through the {config} placeholder."""
    job: str = "autotune"
    # The endpoint options are `autotune run`'s (autotune/core/options.py), defaults included.
    metrics_port: int | None = _ENDPOINTS["metrics_port"]
    rank_metrics_port: int | None = _ENDPOINTS["rank_metrics_port"]
    metrics_addr: str = _ENDPOINTS["metrics_addr"]
    no_metrics: bool = _ENDPOINTS["no_metrics"]
    interval: float = 10.0
    """Seconds between advisor evaluations."""
    window: int = 200
    """Each evaluation summarizes the last `window` steps of every rank (0: all so far)."""
    warmup_steps: int = 2
    """The first steps of each rank, left out of every summary (start-up is not the job)."""
    trace_steps: int = 0
    """Record a torch.profiler trace of this many steps on every rank, after the warm-up, into
    RUN/traces/ (autotune/rank/trace_recorder.py); 0: none."""
    echo: bool = True
    """Echo the job's output here (it is in RUN/launcher.log either way)."""


@dataclass(kw_only=True, slots=True)
class PreparedWatch:
    command: UserCommand
    config: Path | None
    """The DeepSpeed config the command names; None: it names none (built in code, or a torch job)."""
    cwd: Path


def prepare(argv: list[str], opts: WatchOptions, *, cwd: Path) -> PreparedWatch:
    """Every check of the command and its config, before anything starts: one UserError each."""
    validate_endpoints({name: getattr(opts, name) for name in _ENDPOINTS})  # as `autotune run` checks them
    if not any(a.strip() for a in argv):
        raise UserError("no training command after `--`; write it as: autotune watch -- deepspeed "
                        "train.py --deepspeed_config ds_config.json")
    cmd = parse_command(argv, cwd=cwd)
    # the one rule `autotune run` follows too; None: the command names none (a DeepSpeed script that
    # builds its config in code, or a torch.distributed.pipelining script, which has none)
    config = cmd.config_path(opts.config, cwd, in_code=True)
    if config is not None:
        _check_config(config)
    check_launcher_installed(cmd)
    resolve_cluster(cmd.cluster_options(), None)  # the command's hostfile, launcher and hosts (pdsh/ssh)
    if opts.interval <= 0 or opts.window < 0 or opts.warmup_steps < 0 or opts.trace_steps < 0:
        raise UserError("--interval must be > 0, --window, --warmup-steps and --trace-steps >= 0")
    return PreparedWatch(command=cmd, config=config, cwd=cwd)


def _check_config(config: Path) -> None:
    """The config the command names, read as DeepSpeed reads it: one UserError where it cannot be."""
    try:
        raw, _ = parse_config_text(config.read_text(encoding="utf-8"))  # as DeepSpeed reads it
    except FileNotFoundError:
        raise UserError(f"DeepSpeed config {config} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"DeepSpeed config {config}: cannot read ({exc.__class__.__name__})") from None
    except ConfigError as exc:
        raise UserError(f"DeepSpeed config {config}: {exc}") from None
    if not isinstance(raw, dict):
        raise UserError(f"DeepSpeed config {config}: not a JSON object")


def new_run_dir(out: Path) -> Path:
    """OUT/run-NNN, one past the highest there: an earlier watch's files are never touched."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(100):  # another watch may take the same number at the same moment
        numbers = [int(p.name[len(RUN_PREFIX):]) for p in out.glob(f"{RUN_PREFIX}*")
                   if p.name[len(RUN_PREFIX):].isdigit()]
        run = out / f"{RUN_PREFIX}{max(numbers, default=0) + 1:03d}"
        try:
            run.mkdir()
        except FileExistsError:
            continue
        return run.resolve()
    raise UserError(f"--out {out}: cannot create a new run folder in it")


def own_master_port(cmd: UserCommand) -> int | None:
    """The --master_port the user's command gives its launcher, if any (kept as written)."""
    args = list(cmd.launcher_args)
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in ("--master_port", "--master-port"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            return int(value) if value.isdigit() else None
    return None


# --- the advisor over what the CSVs hold so far ------------------------------------------------

def evaluate_run(run_dir: Path, *, window: int, ds_config: Any = None) -> tuple[list[Any], Any]:
    """(fired findings, summary) over the last `window` complete rows of each rank's CSV;
    ([], None) while there is no measured step yet."""
    from autotune.advisor import evaluate
    from autotune.core.summary import summarize_columns
    from autotune.loaders.metrics import read_trial_columns

    files = sorted(run_dir.glob("metrics-rank*.csv"))
    if not files:
        return [], None
    with tempfile.TemporaryDirectory(prefix="autotune-watch-") as tmp:
        snaps = [p for f in files if (p := _snapshot(f, Path(tmp) / f.name, window)) is not None]
        if not snaps:
            return [], None
        try:
            summaries = summarize_columns(read_trial_columns(snaps), source=str(run_dir))
        except InputFileError:
            return [], None  # a rank's file between two states: the next evaluation reads it
    if not summaries:
        return [], None
    engines = read_markers(run_dir, "engine")
    ctx = {}
    if engines and engines[0].get("pipeline"):
        ctx = {"stages": engines[0]["stages"], "world_size": engines[0]["stages"] * engines[0]["dp"]}
    findings = evaluate(summaries, ds_config=ds_config, context=ctx)
    return [f for f in findings if f.fired], summaries[0]


def _snapshot(src: Path, dst: Path, window: int) -> Path | None:
    """The header and the last `window` complete lines of a CSV the rank is still appending to."""
    try:
        data = src.read_bytes()
    except OSError:
        return None
    data = data[:data.rfind(b"\n") + 1]  # a row being written is not read half
    lines = data.splitlines(keepends=True)
    if len(lines) < 2:
        return None
    body = lines[1:] if window == 0 else lines[1:][-window:]
    dst.write_bytes(lines[0] + b"".join(body))
    return dst


def _load_config(path: Path) -> Any:
    """The user's config for the config rules; None where autotune's model of it refuses it
    (the job runs anyway: DeepSpeed is the judge of its own config)."""
    from autotune.core.dsconfig import load_ds_config

    try:
        return load_ds_config(path)
    except UserError:
        return None


# --- running it ------------------------------------------------------------------------------

class _LogEcho:
    """Prints what the job appends to its log (the job writes the file: our death never stalls it)."""

    def __init__(self, path: Path, out: Any) -> None:
        self.path, self.out, self.offset, self.partial = path, out, 0, b""

    def pump(self, final: bool = False) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except OSError:
            return
        self.offset += len(chunk)
        data = self.partial + chunk
        cut = len(data) if final else data.rfind(b"\n") + 1
        self.partial = data[cut:]
        if cut:
            self.out(data[:cut].decode("utf-8", "replace").rstrip("\n"))


class Watch:
    """One watched run of the job: start, loop (echo, targets, findings), end."""

    def __init__(self, prepared: PreparedWatch, opts: WatchOptions, display: Any) -> None:
        self.p, self.opts, self.display = prepared, opts, display
        self.console = display.console
        self.say = lambda text: self.console.print(text, markup=False, highlight=False)
        """Plain text: the job's command and the findings hold brackets that are not rich markup."""
        self.run_dir = new_run_dir(Path(opts.out) if Path(opts.out).is_absolute() else prepared.cwd / opts.out)
        self.endpoints: Any = None
        self.exporter: Any = None
        self.shown: dict[tuple[str, str], Any] = {}
        self.ds_config = _load_config(prepared.cwd / prepared.config) if prepared.config is not None else None
        self.noted_engine = False

    def run(self) -> int:
        o = self.opts
        live = not o.no_metrics
        settings = BootstrapSettings(mode=MODE_WATCH, plan=RankPlan(
            trial_dir=str(self.run_dir), trial=-1, warmup_steps=o.warmup_steps, trace_steps=o.trace_steps,
            metrics_port=o.rank_metrics_port if live else None, metrics_addr=o.metrics_addr, job=o.job))
        note = self.say
        note(f"watch: {' '.join(self.p.command.argv)}")
        note(f"watch folder: {self.run_dir} (metrics-rankR.csv, launcher.log, findings.json)")
        if live:
            self._start_endpoints(note)
        spec = LaunchSpec(num_ranks=0, script_args=[], log_path=self.run_dir / "launcher.log", timeout=0.0,
                          env=rank_env(settings), launcher=list(self.p.command.prefix))
        command, cluster = multi_node_command(self.p.command, settings, self.run_dir, spec, cwd=self.p.cwd)
        proc = CommandProcess(spec, command, self.p.config, self.p.cwd,
                              master_port=own_master_port(self.p.command) or free_port())
        echo = _LogEcho(spec.log_path, self.console.out if o.echo else (lambda text: None))
        # the trials' one launch-and-stop path (trials/launcher.py `run_launch`): on every way out,
        # a Ctrl-C included, the whole group goes (launcher, ranks, their endpoint children), then
        # the other nodes' ranks (sshd's children there)
        try:
            with stop_on_signals(), self._watching(echo) as tick:
                outcome = run_launch(proc, after_stop=stop_on_other_nodes(cluster, None), tick=tick,
                                     poll=POLL_SECONDS, grace=5.0)
        except Stopped as stop:
            previous = ignore_stop_signals()  # the rest of the clean-up is not cut short either
            try:
                echo.pump(final=True)
            finally:
                self._close()
                restore_stop_signals(previous)
            note(f"watch: stopped ({stop.name}): every rank of the job was stopped; "
                 f"metrics so far in {self.run_dir}")
            return stop.exit_code
        except BaseException:
            self._close()
            raise
        if outcome.launch_error is not None:
            self._close()
            raise UserError(outcome.launch_error)
        echo.pump(final=True)
        self._evaluate_safely(final=True)
        self._close()
        rc = outcome.returncode if outcome.returncode is not None else 1
        rc = 128 - rc if rc < 0 else rc  # killed by a signal: the shell's convention
        note(f"watch: the job exited with code {rc}; metrics in {self.run_dir}")
        return rc

    def _start_endpoints(self, note: Any) -> None:
        from exporters.prometheus_watch import WatchExporter
        from exporters.run_endpoints import start_run_endpoints

        o = self.opts
        self.exporter = WatchExporter(job=o.job)
        out = self.run_dir.parent
        self.endpoints = start_run_endpoints(job=o.job, addr=o.metrics_addr, controller_port=o.metrics_port,
                                             rank_port=o.rank_metrics_port, world_size=None, folder=out,
                                             note=note, controller=self.exporter)
        self.endpoints.watch_folder(self.run_dir)

    @contextmanager
    def _watching(self, echo: _LogEcho) -> Iterator[Callable[[], None]]:
        """What watch does at every poll of the job's wait: echo its log, note its engine and,
        every --interval seconds, evaluate its metrics (the status line says the latest)."""
        next_eval = time.monotonic() + self.opts.interval
        status = self.console.status("watching: waiting for the first steps") if self.console.is_terminal else None

        def tick() -> None:
            nonlocal next_eval
            echo.pump(final=False)
            self._note_engine()
            if time.monotonic() >= next_eval:
                summary = self._evaluate_safely()
                next_eval = time.monotonic() + self.opts.interval
                if status is not None and summary is not None:
                    status.update(f"watching: {_describe(summary)}")

        if status is not None:
            status.start()
        try:
            yield tick
        finally:
            if status is not None:
                status.stop()

    def _note_engine(self) -> None:
        if self.noted_engine:
            return
        engines = read_markers(self.run_dir, "engine")
        if not engines:
            return
        self.noted_engine = True
        e = engines[0]
        if e.get("torch_pipelining"):
            self.say(f"watch: the job: a torch.distributed.pipelining schedule, {e.get('engine')}: {e['stages']} "
                     f"pipeline ranks x {e['dp']} data-parallel, n_microbatches {e.get('micro_batches')}")
            return
        if e.get("deepspeed") is False:
            self.say(f"watch: deepspeed.initialize returned a {e.get('engine')}, not a DeepSpeed engine: it "
                     "runs on, without metrics")
            return
        if not e.get("pipeline"):
            self.say(f"watch: the job: {e['dp']} data-parallel ranks of a plain {e.get('engine')} (ZeRO-"
                     f"{e.get('zero_stage', 0)}, not a pipeline job), micro {e['micro_batch_size']} x GAS "
                     f"{e['gradient_accumulation_steps']}")
            return
        self.say(f"watch: the job: {e['stages']} pipeline stages x {e['dp']} data-parallel = "
                          f"{e['stages'] * e['dp']} ranks, micro {e['micro_batch_size']} x GAS "
                          f"{e['gradient_accumulation_steps']}")

    def _evaluate_safely(self, final: bool = False) -> Any:
        """A failing evaluation is said and skipped: the watcher never takes the job down."""
        try:
            return self._evaluate(final)
        except Exception as exc:  # noqa: BLE001 - the job runs on; the next evaluation tries again
            self.say(f"watch: the advisor could not evaluate the metrics so far ({exc.__class__.__name__}: "
                     f"{exc}); trying again in {self.opts.interval:g} s")
            return None

    def _evaluate(self, final: bool = False) -> Any:
        """Findings over the CSVs so far; printed (and served) when they changed."""
        from autotune.advisor.render import to_json

        fired, summary = evaluate_run(self.run_dir, window=self.opts.window, ds_config=self.ds_config)
        if summary is None:
            return None
        now = {(f.rule_id, f.severity): f for f in fired}
        if self.exporter is not None:
            self.exporter.set_findings(now)
        if set(now) != set(self.shown) or final:
            self._print_changes(now, summary, final)
        self.shown = now
        try:
            write_atomic(self.run_dir / "findings.json", to_json(fired, input=str(self.run_dir), format="watch"))
        except OSError:
            pass
        return summary

    def _print_changes(self, now: dict, summary: Any, final: bool) -> None:
        note = self.say
        head = "findings at the end" if final else "findings changed"
        note(f"watch: {head} ({_describe(summary)}):" if now or self.shown else
             f"watch: no finding ({_describe(summary)})")
        for key, f in now.items():
            if key in self.shown and not final:
                continue
            change = f"; try {f.changes[0].describe()}" if f.changes else ""
            evidence = f" [{f.evidence[0].describe()}]" if f.evidence else ""
            note(f"  + {f.severity:<8} {f.rule_id}: {f.title}{evidence}{change}")
        for key in self.shown:
            if key not in now:
                note(f"  - cleared  {key[0]}")

    def _close(self) -> None:
        if self.endpoints is not None:
            self.endpoints.close()
            self.endpoints = None


def _describe(summary: Any) -> str:
    bubble = ("not a pipeline job" if summary.bubble_fraction_measured is None
              else f"bubble {summary.bubble_fraction_measured:.2f} (ideal {summary.bubble_fraction_ideal:.2f})")
    return f"{summary.steps} measured steps in the window, {summary.samples_per_second:.1f} samples/s, {bubble}"


def watch(argv: list[str], opts: WatchOptions, *, cwd: Path, display: Any) -> int:
    """Run the job watched; its exit code (or 128 + signal when stopped)."""
    prepared = prepare(argv, opts, cwd=cwd)
    return Watch(prepared, opts, display).run()
