"""Links that carry KV bytes, and the legs a hit's bytes take on the PE and DE read paths (paper §4.1, §4.2).

A link serves its transfers first come, first served at its full bandwidth: the aggregate throughput
of concurrent transfers, with none of the cost of modelling fair sharing. A transfer over several
links finishes when its slowest link has carried it: layerwise streaming pipelines the legs (§4.1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Link:
    name: str
    kind: str  # what the utilisation table groups by: "storage NIC", "PE compute NIC, writes", ...
    bytes_per_s: float
    free_at: float = 0.0
    bytes: float = 0.0

    def carry(self, now: float, nbytes: float) -> float:
        """Queue ``nbytes`` behind what the link already carries; returns when they are through."""
        start = self.free_at if self.free_at > now else now
        self.free_at = start + nbytes / self.bytes_per_s
        self.bytes += nbytes
        return self.free_at

    def utilisation(self, makespan_s: float) -> float:
        return self.bytes / (self.bytes_per_s * makespan_s) if makespan_s > 0 else 0.0


@dataclass
class NodeLinks:
    """A machine's storage NIC (reads; writes, the other direction) and its DRAM (half duplex: reads and
    writes add up, §4.2)."""

    storage: Link
    dram: Link
    storage_write: Link


@dataclass
class GpuLinks:
    """The PCIe side of one engine's compute NIC(s), per direction.

    The CNIC also carries the engine's own H2D/D2H copies (§5, CNIC-assisted copies), and its PCIe
    side carries at least what crosses the switch (§4.2), so these two links are the engine's PCIe
    and compute-network load together.
    """

    read: Link
    write: Link


def hit_legs(read_side: str, pe_node: NodeLinks, pe: GpuLinks, de_node: NodeLinks, de: GpuLinks
             ) -> tuple[tuple[Link, int], ...]:
    """(link, times the hit bytes cross it) for each link a hit read on ``read_side`` uses.

    PE read path, Fig. 4a: storage -> PE DRAM (1, 2), DRAM -> PE HBM over the CNIC (3, 4), PE HBM ->
    DE buffer (5-7), DE buffer -> DE HBM (8, 9). DE read path, Fig. 4b: storage -> DE DRAM (1, 2),
    DE buffer -> PE HBM (3-5), DE buffer -> DE HBM for decode (6, 7). The counts are §4.2's: PE CNIC
    reads 2 T_p (Eq. 1), PE CNIC writes T_p + T_c (Eq. 2), DE CNIC reads T_p + 2 T_c (Eq. 4), DE CNIC
    writes 2 T_p + T_c (Eq. 6), PE DRAM 2 T_p, DE DRAM 2 T_p + 3 T_c (Eq. 8).
    """
    if read_side == "pe":
        return ((pe_node.storage, 1), (pe_node.dram, 2), (pe.read, 2), (pe.write, 1),
                (de.write, 2), (de.read, 1), (de_node.dram, 2))  # fmt: skip
    return ((de_node.storage, 1), (de_node.dram, 3), (de.read, 2), (pe.write, 1), (de.write, 1))
