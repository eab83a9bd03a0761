"""An HF `transformers.Trainer` job: where its batch lives and how its "auto" values stay the Trainer's.

The Trainer (through accelerate) builds the engine itself: it fills the config's "auto" values from
its own arguments before `deepspeed.initialize` (transformers/integrations/deepspeed.py
`trainer_config_process`), and refuses a config whose explicit batch values disagree with them. So
autotune changes the batch where the Trainer reads it, in its arguments
(`--per_device_train_batch_size`, `--gradient_accumulation_steps`), and keeps "auto" in each trial's
config where the user's file has it (docs/hf-trainer.md):

- the computing base is the config as the Trainer filled it, read at `deepspeed.initialize` by
  the start-up check (autotune/rank/hook.py `script_config`);
- each trial's file is the user's file with the values that trial changes written in: an "auto"
  stays "auto" unless the trial tunes that value;
- the batch keys stay as the file has them: "auto", or the trial's own numbers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from autotune.core.knob import Knob
from autotune.core.trainer_args import GAS_FLAG, MICRO_FLAG
from autotune.usercmd.knobs import value_in, with_value

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
AUTO = "auto"


def _argument(script_args: tuple[str, ...], flag: str) -> Knob:
    """A Trainer argument as a knob's flag, in the spelling the command uses (HfArgumentParser takes
    each field as --a_b and as --a-b; the first where the command gives neither)."""
    spellings = (flag, "--" + flag[2:].replace("_", "-"))
    given = [f for f in spellings if value_in(script_args, Knob(name="arg", flag=f, joined=False, values=()))]
    return Knob(name="arg", flag=(given or spellings)[0], joined=False, values=())


def with_batch(script_args: tuple[str, ...], micro: int, gas: int) -> tuple[str, ...]:
    """The script args with the Trainer's batch arguments set: replaced in place (every other
    argument keeps its index, the config's among them), else appended (usercmd/knobs.py)."""
    for flag, value in ((MICRO_FLAG, micro), (GAS_FLAG, gas)):
        script_args = with_value(script_args, _argument(script_args, flag), str(value))
    return script_args


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    """The user's config file (with its "auto" values) beside the config the Trainer filled from it."""

    own: dict[str, Any]
    """The file as the user wrote it."""
    filled: dict[str, Any]
    """The config the Trainer handed `deepspeed.initialize` at the start-up check."""

    def trial_file(self, trial: dict[str, Any]) -> dict[str, Any]:
        """A trial's config (made from `filled`) as the file the Trainer reads: the user's own file
        with each value the trial changed written in (what the Trainer adds when it fills, such as
        its precision sections and an infinite `steps_per_print`, is left to it); the batch keys stay
        as the file has them ("auto": the Trainer fills them from the arguments autotune sets)."""
        out = copy.deepcopy(self.own)
        for path, value in _leaves(trial):
            if path[0] in BATCH_KEYS:
                continue
            if _get(self.filled, path) != value:
                _set(out, path, copy.deepcopy(value))
        for key in BATCH_KEYS:  # numbers in the file must agree with the arguments: the trial's own
            if key in out and out[key] != AUTO:
                out[key] = trial.get(key, out[key])
        return out


def _leaves(raw: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(raw, dict) and raw:
        return [leaf for k, v in raw.items() for leaf in _leaves(v, (*prefix, k))]
    return [(prefix, raw)] if prefix else []


_MISSING = object()


def _get(raw: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(raw, dict) or key not in raw:
            return _MISSING
        raw = raw[key]
    return raw


def _set(raw: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        raw = raw.setdefault(key, {})
    raw[path[-1]] = value
