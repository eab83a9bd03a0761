"""Model-level knobs of the user's own script, mapped to its flags: `--knob NAME[:V1,V2,...]=TEMPLATE`.

The script owns its model settings (partition method, activation checkpoint interval), so
autotune leaves them alone unless the user maps one to a flag of theirs:

    --knob 'partition_method=--partition {value}'
    --knob 'activation_checkpoint_interval:0,1,2=--ckpt-every={value}'

TEMPLATE is the flag as the script takes it, `{value}` where the value goes (one word,
`--flag {value}`, or `--flag={value}`). The values after NAME are the candidates; the known
names have defaults (`KNOWN`). The command's own value of the flag, when it has one, is the
baseline's; every trial that sets another value replaces it in place (or appends the flag).

How a knob is searched: the knob sweep, a setting step (autotune/tuning/knob_sweep.py); this
module parses the knobs and puts their values into the command.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from autotune.core.errors import UserError
from autotune.core.knob import Knob

if TYPE_CHECKING:
    from autotune.usercmd.command import UserCommand

PLACE = "{value}"
KNOWN = {"partition_method": ("parameters", "uniform"), "activation_checkpoint_interval": ("0", "1")}
"""Default candidates of the knobs every PipelineModule has (its constructor's arguments)."""
REFUSED = {"stages": "the stage count is the engine's (measured on the start-up check); another "
                     "count changes the ranks, so it cannot be swept inside one study"}
TRIAL_FILE = "knobs.json"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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


def own_values(knobs: list[Knob], script_args: tuple[str, ...]) -> dict[str, str | None]:
    """Each knob's value in the user's command (None: the flag is not given), the sweep's start."""
    return {k.name: value_in(script_args, k) for k in knobs}


def check_against_command(knobs: list[Knob], script_args: tuple[str, ...], config_at: int | None) -> None:
    """A knob may not take over the flag that carries the DeepSpeed config (autotune owns it)."""
    from autotune.usercmd.command import CONFIG_FLAGS

    for k in knobs:
        at_config = any(a.partition("=")[0] == k.flag and config_at in (i, i + 1)
                        for i, a in enumerate(script_args))
        if k.flag in CONFIG_FLAGS or at_config:
            raise UserError(f"--knob {k.name}: {k.flag} is where the command takes the DeepSpeed config")


def apply_knobs(command: UserCommand, values: dict[str, str], knobs: list[Knob]) -> UserCommand:
    """The command with each knob's value in its script args."""
    args = command.script_args
    for k in knobs:
        if k.name in values:
            args = with_value(args, k, values[k.name])
    return dataclasses.replace(command, script_args=args)
