"""Interval arithmetic on numpy arrays: the union of overlapping intervals, and its length.

A breakdown is lengths of unions: compute time is the union of the compute kernels (two
kernels on two streams at once count once), and the overlap of A and B is
|A| + |B| - |A ∪ B|. Merging is HTA's rule (`merge_kernel_intervals`): sorted by start, an
interval joins the group before it when it starts no later than the group's end so far.
"""

from __future__ import annotations

import numpy as np


def merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union as disjoint intervals, sorted."""
    if len(starts) == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    group = np.cumsum(new) - 1
    out_s = s[new]
    out_e = np.zeros(len(out_s))
    np.maximum.at(out_e, group, e)
    return out_s, out_e


def union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    s, e = merge(starts, ends)
    return float((e - s).sum())


def clip(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """The intervals cut to [lo, hi]; those outside dropped."""
    s, e = np.maximum(starts, lo), np.minimum(ends, hi)
    keep = e > s
    return s[keep], e[keep]


def overlap_length(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """|A ∩ B| of two interval sets, each possibly self-overlapping."""
    both = union_length(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]))
    return union_length(*a) + union_length(*b) - both
