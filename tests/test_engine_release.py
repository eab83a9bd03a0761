"""`train.drop_autograd_graphs`: what a warm rank does so that a trial's engine is freed.

DeepSpeed hooks the forward outputs with the engine's bound methods, and the last stage keeps
those outputs (`pipe_buffers`, `loss`). The stand-in below builds the same cycle with real
torch tensors: engine -> tensor -> graph (C++) -> hook -> engine. The slow test of the real
engine is in tests/test_warm_workers.py (no rank's threads grow from trial to trial)."""

from __future__ import annotations

import gc
import weakref

import torch

from autotune.rank.workload.train import drop_autograd_graphs


class Engine:
    """The shape of DeepSpeed's engine for this purpose: a hook that is one of its methods."""

    def scale(self, grad: torch.Tensor) -> torch.Tensor:
        return grad


def trained_engine() -> Engine:
    e = Engine()
    x = torch.ones(3, requires_grad=True)
    out = x * 2
    out.register_hook(e.scale)  # as register_output_backward_hooks does
    e.pipe_buffers = {"outputs": [out], "labels": [torch.zeros(3)]}
    e.loss = (out * 3).sum()
    e.total_loss = e.loss.detach()  # no graph: kept
    e.global_steps = 3
    return e


def test_the_cycle_through_the_graph_is_never_collected_on_its_own():
    ref = weakref.ref(trained_engine())
    gc.collect()
    assert ref() is not None  # the premise: gc cannot follow a hook in C++


def test_dropping_the_graphs_frees_the_engine_and_keeps_the_rest():
    e = trained_engine()
    drop_autograd_graphs(e)
    assert e.pipe_buffers is None and e.loss is None
    assert e.global_steps == 3 and e.total_loss is not None  # only what holds a graph goes
    ref = weakref.ref(e)
    del e
    gc.collect()
    assert ref() is None
