"""The bottleneck-free P/D range (DualPath §4.2, Eqs. 1-9) and ``dualpath-bench pd-range``."""

from __future__ import annotations

from fractions import Fraction as F

import pytest

from dualpath_bench.cli import main
from dualpath_bench.pd_range import Hardware, link_loads, pd_range

PAPER = Hardware(gpus_per_node=8, storage_per_node=F(1), compute_nic_gbps=F(50), memory_gbps=F(500))


def test_the_papers_example_is_one_seventh_to_seven_halves():
    found = pd_range(PAPER)
    assert (found.lower, found.upper) == (F(1, 7), F(7, 2))
    assert found.lower_bound_by == "PE compute NIC, writes (Eq. 3)"
    assert found.upper_bound_by == "DE compute NIC, writes (Eq. 7), DE DRAM (Eq. 8)"  # a tie: both named


@pytest.mark.parametrize("hw", [
    PAPER,
    Hardware(8, F(2), F(50), F(2000)),  # more storage: DE reads bind
    Hardware(8, F(1, 2), F(25), F(120)),  # little DRAM: Eq. 8 binds
    Hardware(16, F(3), F(50), F(1600)),
])
def test_the_range_is_exactly_where_every_link_keeps_up(hw):
    """Independent of Eq. 9: on a fine grid of ratios, every load <= 1 exactly inside the range."""
    found = pd_range(hw)
    grid = [F(n, 60) for n in range(1, 601)] + [found.lower, found.upper]
    for ratio in grid:
        keeps_up = max(link_loads(hw, ratio).values()) <= 1
        assert keeps_up == found.contains(ratio), (ratio, link_loads(hw, ratio))
    assert max(link_loads(hw, found.upper).values()) == 1  # the ends are tight


def test_dram_bound_upper_end():
    found = pd_range(Hardware(8, F(1, 2), F(25), F(120)))
    assert found.upper_bound_by == "DE DRAM (Eq. 8)" and found.upper == (F(120) / F(25, 2) - 3) / 2


@pytest.mark.parametrize("hw,named", [
    (Hardware(4, F(3), F(50), F(500)), "PE compute NIC, reads (Eq. 1)"),  # s > g/2
    (Hardware(8, F(1), F(50), F(90)), "PE DRAM"),  # 2 s B > M
])
def test_a_constant_overload_leaves_no_ratio(hw, named):
    found = pd_range(hw)
    assert found.empty and found.lower_bound_by == found.upper_bound_by == named
    assert not any(max(link_loads(hw, F(n, 10)).values()) <= 1 for n in range(1, 100))


def test_ends_that_cross_leave_no_ratio():
    found = pd_range(Hardware(8, F(7, 2), F(50), F(10_000)))  # needs >= 7/9 and <= 2/7
    assert found.empty and found.lower == F(7, 9) and found.upper == F(2, 7)


def test_the_command_prints_the_range_and_the_loads(capsys):
    assert main(["pd-range", "--gpus-per-node", "8", "--snic", "1", "--ratio", "4"]) == 0
    out = capsys.readouterr().out
    assert "bottleneck-free: 1/7 <= P/D <= 7/2" in out
    assert "P/D 4: " in out and "over: DE compute NIC, writes (Eq. 6)" in out


def test_a_bad_number_is_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["pd-range", "--snic", "zero"])
    assert exit_info.value.code == 2 and "--snic" in capsys.readouterr().err
