"""A knob: a model setting swept one value per trial at the baseline's layout (the user's
`--knob`, autotune/usercmd/knobs.py; an engine's own setting, such as the torch engine's
schedule, autotune/engines/torch_pipe/). Data only: the sweep is autotune/tuning/knob_sweep.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Knob:
    name: str
    flag: str
    joined: bool
    """`--flag={value}` (one word) rather than `--flag {value}`."""
    values: tuple[str, ...]

    def tokens(self, value: str) -> list[str]:
        return [f"{self.flag}={value}"] if self.joined else [self.flag, value]
