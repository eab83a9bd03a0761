"""The knob sweep: a setting step (autotune/tuning/steps.py) that measures each candidate value
of a model setting once, at the baseline's micro-batch and GAS, one knob after the other.

Model settings change how the model is built, not the batch layout, so they are swept once
around the search rather than searched with it: each candidate value is one trial; the fastest
value is kept for every later trial when it beats the measurement in force (the baseline's, or
an earlier knob's kept value) by more than the noise between launches (a tie keeps the value in
force: one trial each cannot tell them apart), and the Bayesian search spends its trials on micro-batch, GAS
and bucket. The sweep is written to `STUDY/knobs.json` and rebuilt from it on resume.

Whose knobs: the user's own script's (`--knob`, autotune/usercmd/knobs.py maps them to its
flags) and an engine's own settings (the torch engine's schedule, autotune/engines/torch_pipe/).
What this does not see: a knob whose best value depends on the micro-batch (activation
checkpointing frees memory for a larger one); docs/user-script.md says so. One such knob can be
named `again`: the ZeRO stage, whose winner changes with the micro-batch (ZeRO-0 at a small one,
ZeRO-1 at a large one, on the side-by-side's job). Before the search ends (`before_end`), its
runner-up value at the baseline is tried once at the best trial's layout, and kept when it beats
that configuration's runs by more than the noise.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from autotune.core.fileio import write_atomic
from autotune.core.knob import Knob
from autotune.core.measurements import best_of
from autotune.core.noise import NOISE_MARGIN, beats
from autotune.core.summary import TrialSummary
from autotune.core.trial_kind import BASELINE, Step, TrialKind
from autotune.core.trial_kind import KNOB_PREFIX as SOURCE_PREFIX
from autotune.study.store import TrialRow
from autotune.trials.contract import TrialRequest
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.steps import TrialEnd

RESULT_NAME = "knobs.json"


class KnobSweep:
    """The knob step of a tuning run: one trial per candidate value, at the baseline's layout."""

    def __init__(self, knobs: list[Knob], own: Mapping[str, str | None], study_root: Path,
                 note: Callable[[str], None] = print,
                 inert: Callable[[str, Mapping[str, str | None]], str | None] | None = None,
                 again: str | None = None,
                 refuse: Callable[[str, str, TrialSummary | None], str | None] | None = None) -> None:
        self.knobs, self.root, self.note = knobs, Path(study_root), note
        self.refuse = refuse
        """Why a candidate value is not run, from the baseline's trial (None: it is run): a ZeRO
        stage predicted not to fit the device (autotune/model/zero_memory.py)."""
        self.refused: dict[str, dict[str, str]] = {}
        self.again = again
        """The knob tried once more at the best trial's layout before the search ends (None: none)."""
        self.again_reference: float | None = None
        """samples/s of the best's configuration when its `again` trial was queued (None: not yet)."""
        self.again_result: dict[str, float | None] = {}
        self.inert = inert
        """Why a knob cannot act with the values kept so far (None: it can): its queued trials are
        dropped once an earlier knob's decision makes it inert (ZeRO-0 has no `overlap_comm`)."""
        self.kept: dict[str, str | None] = {k.name: own.get(k.name) for k in knobs}
        """The value each knob runs with outside its sweep: the job's own (the user's command's
        flag, an engine option's value), None where it has none (the script's own default)."""
        self.own = dict(self.kept)
        """The values the baseline ran with."""
        self.queue: list[Proposal] = []
        self.results: dict[str, dict[str, float | None]] = {k.name: {} for k in knobs}
        self.baseline_sps: float | None = None
        self.current_sps: float | None = None
        """samples/s of the measurement in force at the baseline's layout: the baseline's, then
        each kept value's (a later knob's trials run with the earlier knobs' kept values)."""
        self.baseline_key: tuple | None = None
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
        self._after(end.proposal, end.ok, end.samples_per_second, end.summary)

    def _after(self, proposal: Proposal, ok: bool, samples_per_second: float | None,
               summary: TrialSummary | None = None) -> None:
        self.running = None
        kind = proposal.kind
        if kind.is_baseline:
            if ok:
                self.baseline_key = proposal.config.key()
                self.baseline_sps = self.current_sps = float(samples_per_second or 0.0)
                self._plan(proposal, summary)
        elif kind.at_best and (setting := kind.knob_setting) is not None:
            self._decide_at_best(*setting, float(samples_per_second) if ok and samples_per_second else None)
        elif (setting := kind.knob_setting) is not None:
            name, value = setting
            self.results[name][value] = float(samples_per_second) if ok and samples_per_second else None
            if not any(p.source.startswith(f"{SOURCE_PREFIX}{name}=") for p in self.queue):
                self._decide(name)
        self._write()

    def next_proposal(self) -> Proposal | None:
        return self.queue.pop(0) if self.queue else None

    def before_end(self, best: TrialRow | None, room: int) -> Proposal | None:
        """The `again` knob's runner-up value at the best's layout, once, when the best is not the
        baseline's configuration (there the sweep measured it already). Its runner-up: the
        fastest other value at the baseline; a value that failed there (out of memory at a
        smaller micro-batch) is not tried; the baseline's own value counts with its measurement."""
        if (self.again is None or self.again_reference is not None or self.deciding or room < 1
                or best is None or not best.samples_per_second or self.baseline_key is None
                or best.config.key() == self.baseline_key):
            return None
        own = self.own.get(self.again)  # the baseline ran it: its measurement is the baseline's
        measured = {**({own: self.baseline_sps} if own is not None else {}), **self.results[self.again]}
        tried = {v: s for v, s in measured.items() if s is not None and v != self.kept[self.again]}
        if not tried:
            return None
        value = max(tried, key=lambda v: tried[v])
        self.again_reference = float(best.samples_per_second)
        cfg = best.config
        self._write()
        return Proposal(config=cfg, source=TrialKind.knob_at_best(self.again, value),
                        reason=f"knob {self.again}: {value} again at the best's micro-batch {cfg.micro_batch_size} "
                               f"and GAS {cfg.gradient_accumulation_steps} (it was decided at the baseline's, "
                               f"{self.kept[self.again]} winning there); kept if it beats "
                               f"{self.again_reference:.1f} samples/s by more than the noise")

    @property
    def deciding(self) -> bool:
        """Knob trials are queued or running: the baseline's key has no final measurement yet
        (the tuner holds what it tells the proposer until then; autotune/tuning/balance.py `superseded`)."""
        return bool(self.queue) or self.running is not None

    def replay(self, finished: Sequence[TrialRow], redo: Sequence[TrialRow], budget: int | None = None) -> None:
        """Rebuild the sweep from the study's finished trials (a resume)."""
        base = next((t for t in finished if t.number == 0), None)
        if base is None or base.status != "ok":
            return
        self._after(Proposal(config=base.config, source=BASELINE), True, base.samples_per_second,
                    TrialSummary.from_dict(base.summary) if base.summary else None)
        for t in sorted(finished, key=lambda t: t.number):
            kind = TrialKind.of(t.source)
            if kind.at_best:  # its reference: the best as it stood when it was queued
                self.again_reference = _best_before(finished, t.number)
            if kind.step is Step.KNOB:
                self.queue = [p for p in self.queue if p.source != t.source]
                self._after(Proposal(config=t.config, source=t.source), t.status == "ok", t.samples_per_second)
        for t in redo:  # queued and interrupted: it runs again as itself, against the best before it
            if TrialKind.of(t.source).at_best:
                self.again_reference = _best_before(finished, t.number)
        pending = {t.source for t in redo}
        self.queue = [p for p in self.queue if p.source not in pending]

    # -- the decision -----------------------------------------------------------------------------
    def _plan(self, baseline: Proposal, summary: TrialSummary | None = None) -> None:
        if self.planned:
            return
        self.planned = True
        for k in self.knobs:
            for v in k.values:
                why = self.refuse(k.name, v, summary) if self.refuse is not None and v != self.kept[k.name] else None
                if why:
                    self.refused.setdefault(k.name, {})[v] = why
                    self.note(f"      knob {k.name}: {v} not tried: {why}")
                elif v != self.kept[k.name]:
                    self.queue.append(Proposal(
                        config=baseline.config, source=TrialKind.knob(k.name, v),
                        reason=f"knob {k.name}: {' '.join(k.tokens(v))} at the baseline's micro-batch and GAS"))
        self._drop_inert()  # e.g. the config's ZeRO-0 with no other stage to try: no reducer settings

    def _decide_at_best(self, name: str, value: str, measured: float | None) -> None:
        """The rule `superseded` replays for a `knob-at-best:` round (autotune/core/measurements.py)."""
        self.again_result[value] = measured
        base = self.again_reference or 0.0
        if measured is not None and beats(measured, base):
            self.kept[name] = value
            self.note(f"      knob {name}: {value} kept at the best's layout ({measured:.1f} against {base:.1f} "
                      "samples/s with the value before it)")
        elif measured is None:
            self.note(f"      knob {name}: {value} failed at the best's layout; the value in force is kept")
        else:
            self.note(f"      knob {name}: {value} read {measured:.1f} against {base:.1f} samples/s at the best's "
                      "layout: not faster by more than the noise, so the value in force is kept")

    def _decide(self, name: str) -> None:
        """Keep the fastest value if it beats the measurement in force by more than the noise
        (core/noise.py `beats`; a tie keeps the value in force: the rule `superseded` replays)."""
        base = self.current_sps or 0.0
        measured = {v: s for v, s in self.results[name].items() if s is not None}
        best = max(measured, key=lambda v: measured[v]) if measured else None
        if best is not None and beats(measured[best], base):
            self.kept[name] = best
            self.current_sps = measured[best]
            self.note(f"      knob {name}: {best} kept for the later trials ({measured[best]:.1f} against "
                      f"{base:.1f} samples/s with the value before it)")
        elif best is not None and measured[best] > base:
            self.note(f"      knob {name}: {best} read {measured[best]:.1f} against {base:.1f} samples/s, within the "
                      f"{NOISE_MARGIN:.0%} noise between launches: a tie, so the value in force is kept")
        else:
            self.note(f"      knob {name}: no value beat the one in force ({base:.1f} samples/s); kept as it was")
        self._drop_inert()

    def _drop_inert(self) -> None:
        """Drop the queued trials of the knobs the kept values make inert, up to the first knob
        still to be decided (a later knob's fate waits for that knob's decision)."""
        for k in self.knobs if self.inert is not None else ():
            queued = [p for p in self.queue if p.source.startswith(f"{SOURCE_PREFIX}{k.name}=")]
            if not queued:
                continue
            why = self.inert(k.name, self.kept) if self.inert is not None else None
            if not why:
                return
            self.queue = [p for p in self.queue if p not in queued]
            self.note(f"      knob {k.name}: not swept: {why}")

    def _write(self) -> None:
        info: dict[str, object] = {"baseline_samples_per_second": self.baseline_sps, "kept": self.kept,
                                   "measured": self.results, "pending": [p.source for p in self.queue]}
        if self.refused:
            info["not_tried"] = self.refused
        if self.again is not None:
            info["at_best"] = {"knob": self.again, "reference_samples_per_second": self.again_reference,
                               "measured": self.again_result}
        write_atomic(self.root / RESULT_NAME, json.dumps(info, indent=2) + "\n")


def _best_before(finished: Sequence[TrialRow], number: int) -> float:
    """samples/s of the study's best among the trials before `number` (core/measurements.py)."""
    before = best_of([r for r in finished if r.number < number])
    return float(before.samples_per_second) if before is not None else 0.0


def kept_values(study_root: Path) -> dict[str, str]:
    """The values a finished study's sweep kept (`STUDY/knobs.json`; the ZeRO stage, ...): what its
    best trial ran with; {} where the study has no sweep."""
    try:
        kept = json.loads((Path(study_root) / RESULT_NAME).read_text())["kept"]
    except (OSError, ValueError, KeyError):
        return {}
    return {k: v for k, v in kept.items() if v is not None}
