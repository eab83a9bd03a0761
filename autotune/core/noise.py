"""The between-launch noise margin: how far apart two trials' samples/s may read and still tie.

Part of the data model (no imports): the controller's tuner, proposers and setting steps
use it, and so do the ranks, which get it in their trial description to stop a trial that
cannot win (autotune/core/step_budget.py).
"""

NOISE_MARGIN = 0.10
"""Relative margin (0.10 = 10 %) within which two measurements of throughput are a tie, used
wherever a trial is compared with another: the hybrid proposer's assumed noise (a runner-up
within it is measured again; the convergence threshold is a share of it), a trial's early stop
(it must be able to beat the best by more than this), and the partition step's recheck of a
round's pair.

Where it comes from: repeated real CPU trials of one configuration read within about 14 %
(docs/tuner.md), and fresh launches spread more than any one trial's own interval says
(docs/trial-length.md, benchmarks/launch_noise.py). 10 % is the assumed value; the convergence
test replaces it by the measured spread once repeats give enough degrees of freedom
(autotune/tuning/proposers/convergence.py)."""


def tie_floor(best: float, margin: float = NOISE_MARGIN) -> float:
    """The lowest throughput that still ties with `best`: best x (1 - margin)."""
    return best * (1.0 - margin)


def ties(a: float, b: float, margin: float = NOISE_MARGIN) -> bool:
    """Whether two throughputs read within the margin of each other: the lower at least the
    higher's `tie_floor`. The one tie rule: the hybrid proposer's re-measure, the partition
    step's recheck, the knob sweep's keep, and a trial's early stop (which asks whether it can
    still reach the incumbent's floor) all use it."""
    hi, lo = max(a, b), min(a, b)
    return hi > 0 and lo >= tie_floor(hi, margin)


def beats(candidate: float, reference: float, margin: float = NOISE_MARGIN) -> bool:
    """Whether `candidate` is faster than `reference` by more than the noise: faster, no tie."""
    return candidate > reference and not ties(candidate, reference, margin)
