"""A point-to-point instruction's time split into transfer and waiting (autotune/rank/p2p_split.py);
the real-process truth is in tests/test_signal_truth.py and tests/test_unknown_not_zero.py."""

from __future__ import annotations

import time

import pytest

from autotune.rank.engine_face import DEEPSPEED_CATEGORY as INSTRUCTION_CATEGORY
from autotune.rank.instrument import P2P_CATEGORIES
from autotune.rank.p2p_split import P2P_INSTRUCTIONS, TransferSplit, p2p_category
from autotune.rank.timing import HostTimer, WallAndCpuTimer


def test_the_fastest_instance_of_a_kind_is_its_transfer_and_the_rest_is_waiting():
    split = TransferSplit()
    send = p2p_category("SendGrad")
    # Four sends of the same tensor: two waited for the peer (0.5 s, 0.3 s), two did not.
    transfer, wait = split.split({send: [0.51, 0.01, 0.31, 0.01]})
    assert transfer == pytest.approx(0.04) and wait == pytest.approx(0.8)
    # The estimate is kept over the trial: a later step in which every send waited still
    # counts only the transfer seen before as transfer.
    transfer, wait = split.split({send: [0.2, 0.2]})
    assert transfer == pytest.approx(0.02) and wait == pytest.approx(0.38)
    assert split.fastest_seconds() == pytest.approx(0.01)


def test_each_kind_has_its_own_transfer():
    split = TransferSplit()
    act, grad = p2p_category("SendActivation"), p2p_category("RecvGrad")
    transfer, wait = split.split({act: [0.002, 0.004], grad: [0.05, 0.09]})
    assert transfer == pytest.approx(2 * 0.002 + 2 * 0.05) and wait == pytest.approx(0.002 + 0.04)
    assert split.split({}) == (0.0, 0.0) and split.split({"compute": [1.0]}) == (0.0, 0.0)


def test_every_point_to_point_instruction_is_timed_one_by_one():
    assert {INSTRUCTION_CATEGORY[name] for name in P2P_INSTRUCTIONS} == set(P2P_CATEGORIES)
    for timer in (HostTimer(P2P_CATEGORIES), WallAndCpuTimer(P2P_CATEGORIES)):
        cat = p2p_category("RecvActivation")
        for seconds in (0.002, 0.004):
            token = timer.begin()
            time.sleep(seconds)
            timer.end(token, cat)
        token = timer.begin()
        timer.end(token, "compute")
        sums = timer.collect()
        each = timer.intervals()
        assert len(each[cat]) == 2 and sum(each[cat]) == pytest.approx(sums[cat])
        assert each[cat][0] >= 0.002 and "compute" not in each  # only the categories asked for
        timer.collect()
        assert timer.intervals() == {}  # one step's intervals, not the trial's
