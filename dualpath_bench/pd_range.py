"""DualPath's bottleneck-free P/D range (paper §4.2, Eqs. 1-9): which prefill/decode node ratios let the
storage NICs run flat out without the compute NICs or the DE's DRAM becoming the bottleneck.

Notation as in the paper: every node has ``g`` GPUs, each with one compute NIC of bandwidth ``B``;
a node's storage NICs give ``s * B`` (shared by its engines); ``M`` is a node's memory bandwidth.
With storage reads saturated and load balanced, one PE-DE pair carries ``T_p = Bs / (D g^2)`` on the
PE read path and ``T_c = Bs / (P g^2)`` on the DE read path (per-link traffic is the sum over pairs).
Every constraint below is a load on one link, as a fraction of that link's bandwidth, so a ratio is
bottleneck-free when every load is at most 1:

- PE compute NIC, reads (Eq. 1): ``2 s / g``, independent of P/D;
- PE compute NIC, writes (Eq. 2): ``(s / g) (1 + D/P)``   -> ``P/D >= s / (g - s)`` (Eq. 3);
- DE compute NIC, reads (Eq. 4): ``(s / g) (P/D + 2)``    -> ``P/D <= (g - 2s) / s`` (Eq. 5);
- DE compute NIC, writes (Eq. 6): ``(s / g) (2 P/D + 1)`` -> ``P/D <= (g - s) / (2s)`` (Eq. 7);
- PE DRAM: ``2 s B / M``, independent of P/D;
- DE DRAM (Eq. 8): ``(3 + 2 P/D) s B / M``                -> ``P/D <= (M / (s B) - 3) / 2``.

Exact arithmetic (``Fraction``) where the inputs are rational, so the paper's example prints as
``1/7 <= P/D <= 7/2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from numbers import Rational


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int  # g
    storage_per_node: Fraction  # s: a node's storage bandwidth in compute-NIC units (s * B)
    compute_nic_gbps: Fraction  # B, per GPU
    memory_gbps: Fraction  # M, per node

    def __post_init__(self) -> None:
        if self.gpus_per_node <= 0 or self.storage_per_node <= 0 or self.compute_nic_gbps <= 0 \
                or self.memory_gbps <= 0:
            raise ValueError(f"every hardware figure must be positive: {self}")

    @property
    def storage_gbps(self) -> Fraction:
        return self.storage_per_node * self.compute_nic_gbps


@dataclass(frozen=True)
class PDRange:
    lower: Fraction  # the smallest bottleneck-free P/D
    upper: Fraction  # the largest
    lower_bound_by: str
    upper_bound_by: str

    @property
    def empty(self) -> bool:
        return self.lower > self.upper

    def contains(self, ratio: Rational) -> bool:
        return self.lower <= ratio <= self.upper


def link_loads(hw: Hardware, ratio: Rational) -> dict[str, Fraction]:
    """Each link's load at P/D = ``ratio``, as a fraction of its bandwidth (Eqs. 1, 2, 4, 6, 8)."""
    if ratio <= 0:
        raise ValueError(f"P/D must be positive, got {ratio}")
    g, s, r = Fraction(hw.gpus_per_node), Fraction(hw.storage_per_node), Fraction(ratio)
    memory = Fraction(hw.memory_gbps) / hw.storage_gbps  # M / (s B)
    return {
        "PE compute NIC, reads (Eq. 1)": 2 * s / g,
        "PE compute NIC, writes (Eq. 2)": s / g * (1 + 1 / r),
        "DE compute NIC, reads (Eq. 4)": s / g * (r + 2),
        "DE compute NIC, writes (Eq. 6)": s / g * (2 * r + 1),
        "PE DRAM": 2 / memory,
        "DE DRAM (Eq. 8)": (3 + 2 * r) / memory,
    }


def pd_range(hw: Hardware) -> PDRange:
    """Eq. 9: ``s/(g-s) <= P/D <= min{(g-2s)/s, (g-s)/(2s), (M/Bs-3)/2}``, with the binding constraints named.

    Two loads do not depend on P/D: the PE's compute NIC on reads (``2s/g``, Eq. 1; the paper takes it as
    given) and the PE's DRAM (``2sB/M``). When either is over, no ratio is bottleneck-free: the range is
    empty (``1 > 0``) and names that constraint.
    """
    g, s = Fraction(hw.gpus_per_node), Fraction(hw.storage_per_node)
    memory = Fraction(hw.memory_gbps) / hw.storage_gbps
    for name, load in (("PE compute NIC, reads (Eq. 1)", 2 * s / g), ("PE DRAM", 2 / memory)):
        if load > 1:
            return PDRange(Fraction(1), Fraction(0), name, name)
    uppers = {
        "DE compute NIC, reads (Eq. 5)": (g - 2 * s) / s,
        "DE compute NIC, writes (Eq. 7)": (g - s) / (2 * s),
        "DE DRAM (Eq. 8)": (memory - 3) / 2,
    }
    upper = min(uppers.values())
    upper_by = ", ".join(name for name, value in uppers.items() if value == upper)  # ties: all of them
    return PDRange(s / (g - s), upper, "PE compute NIC, writes (Eq. 3)", upper_by)


def fraction(text: str) -> Fraction:
    """A command-line number: ``8``, ``0.5``, ``1/2``."""
    value = Fraction(text)
    if value <= 0:
        raise ValueError(f"must be positive, got {text}")
    return value
