"""Model-level knobs of the user's own script, mapped to its flags: `--knob NAME[:V1,V2,...]=TEMPLATE`.

The script owns its model settings (partition method, activation checkpoint interval), so
autotune leaves them alone unless the user maps one to a flag of theirs:

    --knob 'partition_method=--partition {value}'
    --knob 'activation_checkpoint_interval:0,1,2=--ckpt-every={value}'

TEMPLATE is the flag as the script takes it, `{value}` where the value goes (one word,
`--flag {value}`, or `--flag={value}`). The values after NAME are the candidates; the known
names have defaults (`KNOWN`). The command's own value of the flag, when it has one, is the
baseline's; every trial that sets another value replaces it in place (or appends the flag).

How a knob is searched (`KnobSweep`): model settings change how the model is built, not the
batch layout, so they are swept once, at the baseline's micro-batch and GAS, one knob after
the other, each candidate value one trial; the fastest value is kept for every later trial
when it beats the measurement in force (the baseline's, or an earlier knob's kept value),
and the Bayesian search spends those trials on micro-batch, GAS and bucket. The sweep is written to `STUDY/knobs.json` and rebuilt from it on resume.
What this does not see: a knob whose best value depends on the micro-batch (activation
checkpointing frees memory for a larger one); docs/user-script.md says so.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.core.errors import UserError
from autotune.core.fileio import write_atomic
from autotune.core.trial_kind import BASELINE, Step, TrialKind
from autotune.core.trial_kind import KNOB_PREFIX as SOURCE_PREFIX
from autotune.trials.contract import TrialRequest
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.steps import TrialEnd

PLACE = "{value}"
KNOWN = {"partition_method": ("parameters", "uniform"), "activation_checkpoint_interval": ("0", "1")}
"""Default candidates of the knobs every PipelineModule has (its constructor's arguments)."""
REFUSED = {"stages": "the stage count is the engine's (measured on the start-up check); another "
                     "count changes the ranks, so it cannot be swept inside one study"}
RESULT_NAME = "knobs.json"
TRIAL_FILE = "knobs.json"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Knob:
    name: str
    flag: str
    joined: bool
    """`--flag={value}` (one word) rather than `--flag {value}`."""
    values: tuple[str, ...]

    def tokens(self, value: str) -> list[str]:
        return [f"{self.flag}={value}"] if self.joined else [self.flag, value]


def parse_knob(text: str) -> Knob:
    """One `--knob` value; every problem is one UserError saying how to write it."""
    head, eq, template = text.partition("=")
    how = "write it as --knob 'NAME=--flag {value}' or --knob 'NAME:V1,V2=--flag={value}'"
    if not eq or not template.strip():
        raise UserError(f"--knob {text!r} maps no flag; {how}")
    name, colon, listed = head.strip().partition(":")
    if not _NAME.match(name):
        raise UserError(f"--knob {text!r}: {name!r} is not a knob name; {how}")
    if name in REFUSED:
        raise UserError(f"--knob {name}: not a knob here: {REFUSED[name]}")
    values = tuple(v.strip() for v in listed.split(",") if v.strip()) if colon else KNOWN.get(name, ())
    if not values:
        raise UserError(f"--knob {name}: no values to try; list them: --knob '{name}:V1,V2=...' "
                        f"(names with default values: {', '.join(sorted(KNOWN))})")
    if len(set(values)) != len(values):
        raise UserError(f"--knob {name}: a value is listed twice")
    words = template.split()
    if PLACE not in template:
        raise UserError(f"--knob {text!r}: the flag has no {PLACE}; {how}")
    if len(words) == 2 and words[1] == PLACE:
        flag, joined = words[0], False
    elif len(words) == 1 and words[0].endswith("=" + PLACE):
        flag, joined = words[0][:-len("=" + PLACE)], True
    else:
        raise UserError(f"--knob {text!r} names no flag of the script; {how}")
    if not flag.startswith("-") or not flag.strip("-") or "=" in flag or PLACE in flag:
        raise UserError(f"--knob {text!r}: {flag!r} is not a flag (it must start with -); {how}")
    return Knob(name=name, flag=flag, joined=joined, values=values)


PRECISION_WORDS = ("precision", "dtype", "fp16", "bf16", "bfloat16", "float16", "half", "amp", "fp8", "fp32")
"""Knob names read as the training precision (`precision`, `mixed_precision`, `dtype`, `bf16`...)."""


def is_precision(name: str) -> bool:
    return any(w in name.lower() for w in PRECISION_WORDS)


def refuse_for_built_in(texts: tuple[str, ...] | list[str]) -> None:
    """`--knob` without a COMMAND: one UserError naming the flag that does it.

    A precision knob gets its own answer: the built-in workload runs its trials in warm
    workers, which build every trial's engine in the same processes; DeepSpeed's engine
    picks its precision's code paths per process (autotune/trials/warm_pool.py starts a new pool when
    the precision changes), so the precision is the study's, set in its starting config."""
    for text in texts:
        name = text.partition("=")[0].partition(":")[0].strip()
        if is_precision(name):
            raise UserError(f"--knob {name}: warm workers cannot change the precision between trials (each "
                            "process keeps its engine's precision); the built-in workload's precision is its "
                            "starting config's: give --config FILE with bf16.enabled or fp16.enabled true, "
                            "one study per precision")
    raise UserError("--knob maps a model setting to a flag of your own script; the built-in workload's "
                    "are --partition-method and --activation-checkpoint-interval")


def parse_knobs(texts: tuple[str, ...] | list[str]) -> list[Knob]:
    knobs = [parse_knob(t) for t in texts]
    names = [k.name for k in knobs]
    for k in knobs:
        if names.count(k.name) > 1:
            raise UserError(f"--knob {k.name} is given more than once")
    flags = [k.flag for k in knobs]
    for k in knobs:
        if flags.count(k.flag) > 1:
            raise UserError(f"--knob: {k.flag} is mapped to more than one knob")
    return knobs


def value_in(script_args: tuple[str, ...], knob: Knob) -> str | None:
    """The command's own value of the knob's flag (either spelling), or None."""
    for i, a in enumerate(script_args):
        name, eq, value = a.partition("=")
        if name == knob.flag:
            if eq:
                return value
            if i + 1 < len(script_args):
                return script_args[i + 1]
    return None


def with_value(script_args: tuple[str, ...], knob: Knob, value: str) -> tuple[str, ...]:
    """The script args with the knob's flag set to `value`: replaced in place, else appended.
    In-place replacement keeps every other argument's index (the config's among them)."""
    out = list(script_args)
    for i, a in enumerate(out):
        name, eq, _ = a.partition("=")
        if name == knob.flag:
            if eq:
                out[i] = f"{name}={value}"
            elif i + 1 < len(out):
                out[i + 1] = value
            return tuple(out)
    return (*out, *knob.tokens(value))


def check_against_command(knobs: list[Knob], script_args: tuple[str, ...], config_at: int | None) -> None:
    """A knob may not take over the flag that carries the DeepSpeed config (autotune owns it)."""
    from autotune.usercmd.command import CONFIG_FLAGS

    for k in knobs:
        at_config = any(a.partition("=")[0] == k.flag and config_at in (i, i + 1)
                        for i, a in enumerate(script_args))
        if k.flag in CONFIG_FLAGS or at_config:
            raise UserError(f"--knob {k.name}: {k.flag} is where the command takes the DeepSpeed config")


class KnobSweep:
    """The knob step of a tuning run: one trial per candidate value, at the baseline's layout."""

    def __init__(self, knobs: list[Knob], script_args: tuple[str, ...], study_root: Path,
                 note: Callable[[str], None] = print) -> None:
        self.knobs, self.root, self.note = knobs, Path(study_root), note
        self.kept: dict[str, str | None] = {k.name: value_in(script_args, k) for k in knobs}
        """The value each knob runs with outside its sweep (None: the script's own default)."""
        self.queue: list[Proposal] = []
        self.results: dict[str, dict[str, float | None]] = {k.name: {} for k in knobs}
        self.baseline_sps: float | None = None
        self.current_sps: float | None = None
        """samples/s of the measurement in force at the baseline's layout: the baseline's, then
        each kept value's (a later knob's trials run with the earlier knobs' kept values)."""
        self.planned = False
        self.running: str | None = None
        """The knob trial between `prepare` and `after`."""

    # -- around each trial --------------------------------------------------------------------
    def prepare(self, request: TrialRequest, kind: TrialKind) -> None:
        """The knobs' values for this trial: the kept ones, and the one a knob trial measures."""
        values = dict(self.kept)
        setting = kind.knob_setting
        self.running = kind.label if setting is not None else None
        if setting is not None:
            values[setting[0]] = setting[1]
        request.knob_values = {k: v for k, v in values.items() if v is not None}

    def after(self, end: TrialEnd) -> None:
        self._after(end.proposal, end.ok, end.samples_per_second)

    def _after(self, proposal: Proposal, ok: bool, samples_per_second: float | None) -> None:
        self.running = None
        kind = proposal.kind
        if kind.is_baseline:
            if ok:
                self.baseline_sps = self.current_sps = float(samples_per_second or 0.0)
                self._plan(proposal)
        elif (setting := kind.knob_setting) is not None:
            name, value = setting
            self.results[name][value] = float(samples_per_second) if ok and samples_per_second else None
            if not any(p.source.startswith(f"{SOURCE_PREFIX}{name}=") for p in self.queue):
                self._decide(name)
        self._write()

    def next_proposal(self) -> Proposal | None:
        return self.queue.pop(0) if self.queue else None

    @property
    def deciding(self) -> bool:
        """Knob trials are queued or running: the baseline's key has no final measurement yet
        (the tuner holds what it tells the proposer until then; autotune/tuning/balance.py `superseded`)."""
        return bool(self.queue) or self.running is not None

    def replay(self, finished: Sequence[Any], redo: Sequence[Any], budget: int | None = None) -> None:
        """Rebuild the sweep from the study's finished trials (a resume)."""
        base = next((t for t in finished if t.number == 0), None)
        if base is None or base.status != "ok":
            return
        self._after(Proposal(config=base.config, source=BASELINE), True, base.samples_per_second)
        for t in sorted(finished, key=lambda t: t.number):
            if TrialKind.of(t.source).step is Step.KNOB:
                self.queue = [p for p in self.queue if p.source != t.source]
                self._after(Proposal(config=t.config, source=t.source), t.status == "ok", t.samples_per_second)
        pending = {t.source for t in redo}
        self.queue = [p for p in self.queue if p.source not in pending]

    # -- the decision -----------------------------------------------------------------------------
    def _plan(self, baseline: Proposal) -> None:
        if self.planned:
            return
        self.planned = True
        for k in self.knobs:
            for v in k.values:
                if v != self.kept[k.name]:
                    self.queue.append(Proposal(
                        config=baseline.config, source=TrialKind.knob(k.name, v).label,
                        reason=f"knob {k.name}: {' '.join(k.tokens(v))} at the baseline's micro-batch and GAS"))

    def _decide(self, name: str) -> None:
        """Keep the fastest value if it beats the measurement in force (the rule `superseded` replays)."""
        base = self.current_sps or 0.0
        measured = {v: s for v, s in self.results[name].items() if s is not None}
        best = max(measured, key=measured.get) if measured else None
        if best is not None and measured[best] > base:
            self.kept[name] = best
            self.current_sps = measured[best]
            self.note(f"      knob {name}: {best} kept for the later trials ({measured[best]:.1f} against "
                      f"{base:.1f} samples/s with the value before it)")
        else:
            self.note(f"      knob {name}: no value beat the one in force ({base:.1f} samples/s); kept as it was")

    def _write(self) -> None:
        info = {"baseline_samples_per_second": self.baseline_sps, "kept": self.kept,
                "measured": self.results, "pending": [p.source for p in self.queue]}
        write_atomic(self.root / RESULT_NAME, json.dumps(info, indent=2) + "\n")


def apply_knobs(command: Any, values: dict[str, str], knobs: list[Knob]) -> Any:
    """The command with each knob's value in its script args."""
    args = command.script_args
    for k in knobs:
        if k.name in values:
            args = with_value(args, k, values[k.name])
    return dataclasses.replace(command, script_args=args)
