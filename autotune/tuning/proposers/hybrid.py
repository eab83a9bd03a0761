"""The default tuner: rules first, then a Gaussian process with an out-of-memory veto.

Why a hybrid (tuner-facts.md, and our benchmark): rules that read a trial's
signals find the right region in a handful of trials, but they stop at the
first plateau; a GP finds the optimum given twenty points, but wastes the
first ten on random ones and on the memory cliff. So:

1. Candidates come from three places, all filtered through the
   `FeasibilityModel` veto (never a point known or predicted to run out of
   memory) and never a point already run:
   - rules: `moves(summary, incumbent, space)` on the best trial so far
     (`autotune.tuning.proposers.rule_moves.propose_moves` in production). Moves touching
     different knobs are also merged into one compound move, so a bubble fix
     and a bucket fix are tested in the same trial;
   - a micro-batch climb: the next larger micro-batch than the incumbent's
     (throughput grows with the micro-batch until memory runs out; the veto
     stops the climb at the cliff);
   - the GP's own proposal: maximum of expected improvement times the
     estimated probability of fitting in memory over the whole pool.
2. While fewer than `rule_phase` trials have succeeded, a rule (or climb)
   candidate is taken as is. Afterwards every candidate competes on the
   surrogate's constrained expected improvement; rule candidates win ties and
   anything within `rule_bonus` of the best score.
3. Every trial, whoever proposed it, is told to the GP and to the
   feasibility model. Out-of-memory trials shape only the feasibility model
   (the GP would read the cliff as a slope and avoid the good region next to
   it); other failures reach the GP as a finite penalty.
4. Re-measurement: with a known `budget`, the last `remeasure_slots` trials
   re-run the incumbent when it has a single measurement and the runner-up is
   within `noise` of it (real CPU trials repeat within ~14 %), so the final
   choice is not a lucky draw. A re-measure is the one deliberate repeat;
   its source is "remeasure".
5. The budget is a cap (`converged`, autotune/tuning/proposers/convergence.py): after
   `min_trials` told trials and the rule phase, with the incumbent unchanged for
   `patience` trials, once the best constrained expected improvement of any
   candidate is below `stop_ratio x noise`, the
   proposer says the search has converged, but only after the re-measurement
   (and near-cliff confirmation) the final choice needs: while one is owed,
   `converged` returns None and the next `ask` is that re-measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from autotune.core.noise import NOISE_MARGIN, ties
from autotune.core.space import SearchSpace, TrialConfig
from autotune.core.trial_kind import BAYES, CLIMB, CONFIRM, EXPLORE, RECHECK, REMEASURE, RULE_JOIN
from autotune.core.trial_result import TrialResult
from autotune.tuning.proposers import convergence
from autotune.tuning.proposers.base import Proposal
from autotune.tuning.proposers.bayes import BayesProposer, Surrogate
from autotune.tuning.proposers.feasibility import FeasibilityModel
from autotune.tuning.proposers.pool import candidate_pool, valid_pairs

MovesFn = Callable[..., list[Proposal]]
"""`propose_moves(summary, current, space, rules=None) -> list[Proposal]`."""


def _knobs(space: SearchSpace, a: TrialConfig, b: TrialConfig) -> frozenset[str]:
    """Which knobs differ between a and b (micro and GAS are one knob with a fixed global batch)."""
    out = set()
    if space.global_batch is not None:
        if a.micro_batch_size != b.micro_batch_size:
            out.add("batch")
    else:
        if a.micro_batch_size != b.micro_batch_size:
            out.add("micro")
        if a.gradient_accumulation_steps != b.gradient_accumulation_steps:
            out.add("gas")
    if a.reduce_bucket_size != b.reduce_bucket_size:
        out.add("bucket")
    return frozenset(out)


def _apply(space: SearchSpace, base: TrialConfig, move: TrialConfig, knobs: frozenset[str]) -> TrialConfig:
    cfg = base
    if "batch" in knobs:
        cfg = replace(cfg, micro_batch_size=move.micro_batch_size,
                      gradient_accumulation_steps=move.gradient_accumulation_steps)
    if "micro" in knobs:
        cfg = replace(cfg, micro_batch_size=move.micro_batch_size)
    if "gas" in knobs:
        cfg = replace(cfg, gradient_accumulation_steps=move.gradient_accumulation_steps)
    if "bucket" in knobs:
        cfg = replace(cfg, reduce_bucket_size=move.reduce_bucket_size)
    return cfg


class HybridProposer:
    """Rules and a micro-batch climb first, then a GP with an out-of-memory veto (see module doc)."""

    def __init__(self, space: SearchSpace, *, seed: int = 0, moves: MovesFn | None = None,
                 budget: int | None = None, rule_phase: int = 8, rule_bonus: float = 0.5,
                 n_initial_points: int = 3, noise: float = NOISE_MARGIN, remeasure_slots: int = 1,
                 max_rechecks: int = 2, feasibility: FeasibilityModel | None = None,
                 min_trials: int = 10, stop_ratio: float = 0.25, patience: int = 5) -> None:
        self.space = space
        self.moves = moves
        self.budget = budget
        self.rule_phase = rule_phase
        self.rule_bonus = rule_bonus
        self.noise = noise
        self.remeasure_slots = remeasure_slots
        self.max_rechecks = max_rechecks
        self.straggler_gap = 0.10
        """Relative shortfall against physics that flags a measurement as a likely straggler."""
        self._rechecks = 0
        self.min_trials = min_trials
        """Told trials before the search may stop early (`converged`)."""
        self.stop_ratio = stop_ratio
        """Stop when the best expected improvement is below stop_ratio x noise."""
        self.patience = patience
        """Told trials since the incumbent last changed before the search may stop."""
        self._incumbent: tuple | None = None
        self._incumbent_since = 0
        self._stopping = False
        """The last `converged` found nothing worth a trial: re-measure now, whatever the budget."""
        self._fitted: tuple[int, Surrogate | None] | None = None
        self.feasibility = feasibility or FeasibilityModel(space)
        self.bayes = BayesProposer(space, seed=seed, n_initial_points=n_initial_points,
                                   veto=self.feasibility.vetoed, oom_as_penalty=False)
        self.history = self.bayes.history

    # ---- contract ------------------------------------------------------
    def tell(self, config: TrialConfig, result: TrialResult) -> None:
        self.bayes.tell(config, result)
        self.feasibility.observe(config, result)
        best = self.history.best()
        if best is not None and best.key() != self._incumbent:
            self._incumbent = best.key()
            self._incumbent_since = len(self.history.observations) + self.history.ignored

    def ask(self) -> Proposal:
        prop = self._remeasure() or self._confirm() or self._recheck() or self._choose()
        if prop.source in (CONFIRM, RECHECK):
            self._rechecks += 1
        self.history.pending.add(prop.config.key())
        return prop

    def converged(self) -> str | None:
        """Why the search may stop now (None: keep going). Ask it before each `ask`."""
        self._stopping = False
        told = len(self.history.observations) + self.history.ignored
        if told < self.min_trials or len(self.history.ok) < self.rule_phase:
            return None
        if self.budget is not None and told >= self.budget:
            return None
        if told - self._incumbent_since < self.patience:
            return None
        v = self.stop_verdict()
        if v is None or v.expected_gain >= v.threshold:
            return None
        self._stopping = True
        if self._remeasure() or self._confirm() or self._recheck():
            return None  # the final choice is re-measured first: the next ask() does it
        return v.reason()

    def stop_verdict(self) -> convergence.Verdict | None:
        """The best candidate's expected gain against the noise (None before the GP has data)."""
        incumbent = self.history.best()
        surrogate = self._surrogate()
        if incumbent is None or surrogate is None:
            return None
        seen = self.history.seen
        rules = [c.config for c in self._rule_candidates(incumbent, seen)]
        # The grid without random buckets: the stop check draws nothing from the search's
        # random stream, so a capped run is the prefix of the same run without a cap.
        pool = [c for c in candidate_pool(self.space, self.bayes._rng, random_buckets=0, extra=rules)
                if c.key() not in seen and not self.feasibility.vetoed(c)]
        noise, source = convergence.noise_estimate(self.history, self.noise)
        return convergence.verdict(surrogate, incumbent, pool, self.feasibility.p_ok, noise, source,
                                   ratio=self.stop_ratio)

    def _surrogate(self) -> Surrogate | None:
        """The GP on every told trial, fitted once per number of observations."""
        n = len(self.history.observations)
        if n < self.bayes.n_initial_points:
            return None
        if self._fitted is None or self._fitted[0] != n:
            self._fitted = (n, self.bayes.fit())
        return self._fitted[1]

    # ---- candidates ------------------------------------------------------
    def _allowed(self, cfg: TrialConfig, seen: set[tuple]) -> bool:
        return self.space.contains(cfg) and cfg.key() not in seen and not self.feasibility.vetoed(cfg)

    def _climb(self, incumbent: TrialConfig) -> Proposal | None:
        micros = self.space.micro_batch_sizes
        i = micros.index(incumbent.micro_batch_size)
        if i + 1 >= len(micros):
            return None
        m = micros[i + 1]
        pairs = [p for p in valid_pairs(self.space) if p[0] == m]
        if not pairs:
            return None
        g = min(pairs, key=lambda p: abs(p[1] - incumbent.gradient_accumulation_steps))[1]
        cfg = replace(incumbent, micro_batch_size=m, gradient_accumulation_steps=g)
        return Proposal(config=cfg, source=CLIMB,
                        reason=f"micro-batch {incumbent.micro_batch_size} -> {m}: larger micro-batches use the "
                               "device better and no trial has run out of memory there")

    def _rule_candidates(self, incumbent: TrialConfig, seen: set[tuple]) -> list[Proposal]:
        """Rule moves (compound first), then the climb; all allowed and unseen."""
        raw: list[Proposal] = []
        summary = self.history.latest_summary(incumbent)
        if self.moves is not None and summary is not None:
            raw = [p for p in self.moves(summary, incumbent, self.space) if self.space.contains(p.config)]
        climb = self._climb(incumbent)
        if climb is not None:
            raw.append(climb)
        out: list[Proposal] = []
        # Compound: apply moves on disjoint knobs in order.
        cfg, used, names, why = incumbent, frozenset(), [], []
        for p in raw:
            k = _knobs(self.space, incumbent, p.config)
            if k and not (k & used):
                nxt = _apply(self.space, cfg, p.config, k)
                if self.space.contains(nxt):
                    cfg, used = nxt, used | k
                    if p.source not in names:
                        names.append(p.source)
                    why.append(p.reason)
        if len(why) > 1:
            out.append(Proposal(config=cfg, source=RULE_JOIN.join(names), reason="; ".join(why)))
        out.extend(raw)
        uniq: dict[tuple, Proposal] = {}
        for p in out:
            if self._allowed(p.config, seen):
                uniq.setdefault(p.config.key(), p)
        return list(uniq.values())

    # ---- decisions -----------------------------------------------------------
    def _choose(self) -> Proposal:
        seen = self.history.seen
        incumbent = self.history.best()
        cands = self._rule_candidates(incumbent, seen) if incumbent is not None else []
        if cands and len(self.history.ok) < self.rule_phase:
            return cands[0]
        surrogate = self._surrogate()
        if surrogate is not None:
            pick = self.bayes.best_candidate(surrogate, seen, extra=[c.config for c in cands],
                                             weight=self.feasibility.p_ok)
            if pick is not None:
                cfg, score = pick
                if cands:
                    scores = surrogate.expected_improvement([c.config for c in cands])
                    scores = scores * [self.feasibility.p_ok(c.config) for c in cands]
                    j = int(scores.argmax())
                    if scores[j] >= (1 - self.rule_bonus) * score:
                        c = cands[j]
                        return Proposal(config=c.config, source=c.source,
                                        reason=f"{c.reason} (surrogate EI {scores[j]:.3g} vs best {score:.3g})")
                return Proposal(config=cfg, source=BAYES,
                                reason=f"GP expected improvement x P(fits) {score:.3g} over "
                                       f"{len(self.history.observations)} trials")
        if cands:
            return cands[0]
        prop = self.bayes.ask()  # random un-vetoed point while the GP has no data
        self.history.pending.discard(prop.config.key())
        return Proposal(config=prop.config, source=EXPLORE, reason="random point, no rule fired yet")

    def _recheck(self) -> Proposal | None:
        """Re-run a once-measured config that contradicts pipeline physics (a likely straggler).

        A slow node makes one trial look bad, and since points are not
        repeated the configuration would drop out for good. Under 1F1B, more
        micro-batches per step at the same micro-batch and bucket never make a
        step slower per sample (the bubble (p-1)/(m+p-1) shrinks, the reduction
        is amortised), so a config measured more than `straggler_gap` below
        the same config with a smaller GAS is measured again (at most
        `max_rechecks` times per run).
        """
        if self._rechecks >= self.max_rechecks or self.space.global_batch is not None:
            return None
        means = self.history.means().values()
        worst: tuple[float, TrialConfig, float] | None = None
        for c, v, n in means:
            if n != 1:
                continue
            for c2, v2, _ in means:
                if (c2.micro_batch_size == c.micro_batch_size and c2.reduce_bucket_size == c.reduce_bucket_size
                        and c2.gradient_accumulation_steps < c.gradient_accumulation_steps
                        and v2 > v * (1 + self.straggler_gap)):
                    if worst is None or v2 / v > worst[0]:
                        worst = (v2 / v, c, v)
        if worst is None:
            return None
        ratio, cfg, v = worst
        return Proposal(config=cfg, source=RECHECK,
                        reason=f"measured {v:.3g} samples/s, {ratio - 1:.0%} below the same micro-batch with "
                               "fewer micro-batches per step: likely a straggler, measure again")

    def _confirm(self) -> Proposal | None:
        """Run the incumbent again when it sits near the memory cliff (P(fits) < 0.9).

        Near the limit, whether a trial fits is a coin toss; a config that fit
        once by luck would be a bad recommendation. A second run that fails
        removes it from the choice. Shares the `max_rechecks` allowance.
        """
        ranked = self.history.ranked()
        if not ranked or self._rechecks >= self.max_rechecks:
            return None
        best, v, n = ranked[0]
        p = self.feasibility.p_ok(best)
        if n > 1 or p >= 0.9:
            return None
        return Proposal(config=best, source=CONFIRM,
                        reason=f"best so far ({v:.3g} samples/s) fits in memory with estimated probability "
                               f"{p:.0%}: run it again before recommending it")

    def _remeasure(self) -> Proposal | None:
        if self.remeasure_slots <= 0:
            return None
        told = len(self.history.observations) + self.history.ignored
        if not self._stopping and (self.budget is None or self.budget - told > self.remeasure_slots):
            return None
        ranked = self.history.ranked()
        if len(ranked) < 2:
            return None
        (best, v1, n1), (_, v2, _) = ranked[0], ranked[1]
        if n1 > 1 or not ties(v1, v2, self.noise):
            return None
        return Proposal(config=best, source=REMEASURE,
                        reason=f"best {v1:.3g} samples/s within {self.noise:.0%} of the runner-up {v2:.3g}: "
                               "measure it again before choosing")
