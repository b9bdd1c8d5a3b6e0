"""A PE reads a DE's buffer only while the DE's lease of it surely runs (``RemoteBuffer.deadline``).

The DE hands its slots to other reads once its lease ends, so a READ posted
after the deadline, or seen ending after it, may have brought another
request's chunks: such a hit is repaired from the store instead (from the
layer whose READ was late on; earlier layers ended in time). The injection is
the real one over a small CPU KV cache (:class:`Forward`); the READs are fakes
that write what the DE's buffer holds at the time: the hit's bytes while the
lease runs, another chunk's after it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from dualpath_connector.load import inject as injection
from dualpath_connector.load.loaded_hit import LoadedHit, RemoteBuffer
from tests.unit.test_layer_arrival_injection import (  # noqa: F401 (pool: a fixture)
    CHUNKS,
    LAYERS,
    OBJECTS,
    PATIENT_S,
    Forward,
    _expected,
    _holds,
    _put_layer,
    pool,
)

OTHER = OBJECTS[::-1]  # what the DE's reused slots hold after its lease: other chunks


class FakeRead:
    """One layer's READ from the DE's buffer into the cache; ends at once, unless ``lease_ends_first``."""

    def __init__(self, forward: Forward, hit: LoadedHit, layer: int, lease_ends_first: bool) -> None:
        self.forward, self.hit, self.layer, self.lease_ends_first = forward, hit, layer, lease_ends_first
        self.canceled = False

    def wait(self, timeout_s: float) -> bool:
        assert timeout_s > 0
        if self.lease_ends_first:
            # The READ ends just after the lease did: the DE had reused the slots, the bytes are another chunk's.
            self.hit.remote.deadline = time.monotonic()
        objects = OTHER if self.lease_ends_first else OBJECTS
        for chunk, obj in zip(self.hit.chunks, objects):
            for i, block in enumerate(chunk.block_ids):
                self.forward.view.layers[self.layer][:, block] = _expected(obj, self.layer, chunk.first_sub_block + i)
        return True

    def cancel(self) -> None:
        self.canceled = True


@pytest.fixture
def forward(pool):
    """A forward whose repair reads the hit from the "store" (every layer into pool slots), as the reader's does."""
    made = Forward(pool, "cpu")
    made.repaired = []

    def repair(hit: LoadedHit) -> None:
        made.repaired.append(hit.req_id)
        hit.remote, hit.slots = None, pool.acquire(len(hit.chunks))
        for layer in range(LAYERS):
            _put_layer(pool, hit, layer)

    made.injector.repair = repair
    made.injector.release = lambda hits: [pool.release(h.slots) for h in hits if h.slots]
    return made


def _remote_hit(lease_left_s: float) -> LoadedHit:
    remote = RemoteBuffer("10.0.0.2:5700", SimpleNamespace(agent="de-agent"), "lease-1", [4096, 8192, 12288], 1 << 20,
                          time.monotonic() + lease_left_s)  # fmt: skip
    return LoadedHit("r1", list(CHUNKS), remote=remote)


def _posting(forward: Forward, hit: LoadedHit, monkeypatch, late_layers: set[int]) -> dict[int, FakeRead]:
    """The injector's READs of ``hit``, one per layer, as fakes: those of ``late_layers`` end after the lease."""
    reads: dict[int, FakeRead] = {}

    def post_read(agent, peer, local, local_mem_type, remote, remote_mem_type, notification=b""):
        layer = len(reads)
        reads[layer] = FakeRead(forward, hit, layer, layer in late_layers)
        return reads[layer]

    monkeypatch.setattr(injection, "post_read", post_read)
    return reads


def _layer_right(forward: Forward, layer: int) -> bool:
    return all(_holds(forward.view, c, o, layer) for c, o in zip(CHUNKS, OBJECTS))


@pytest.mark.parametrize("mode", ["bulk", "layerwise"])
def test_a_hit_whose_lease_ended_before_its_reads_is_read_from_the_store_and_never_from_the_de(
    forward, monkeypatch, mode
):
    hit = _remote_hit(lease_left_s=-1.0)
    reads = _posting(forward, hit, monkeypatch, late_layers=set())
    if mode == "bulk":
        forward.injector.inject_whole(hit)
    else:
        forward.run([hit])
    assert reads == {} and forward.repaired == ["r1"]  # no READ was posted
    assert all(_layer_right(forward, layer) for layer in range(LAYERS))


@pytest.mark.parametrize("trusted", [False, True], ids=["checked", "control-trusted"])
@pytest.mark.parametrize("mode, late", [("layerwise", 0), ("layerwise", 2), ("bulk", LAYERS - 1)])
def test_a_read_seen_ending_after_the_lease_is_not_trusted(forward, monkeypatch, mode, late, trusted):
    """Layerwise, layers before the late one came from the DE in time, the late one and later from the store;
    bulk, the whole hit from the store. The control trusts a READ that ended (the check before protocol 6):
    the late layer then holds another chunk's KV."""
    hit = _remote_hit(lease_left_s=PATIENT_S)
    reads = _posting(forward, hit, monkeypatch, late_layers={late})
    if trusted:
        monkeypatch.setattr(forward.injector, "remote_read_done", lambda hit, read: read.wait(1.0))
    if mode == "bulk":
        forward.injector.inject_whole(hit)
    else:
        forward.run([hit])
    if trusted:
        assert forward.repaired == [] and not _layer_right(forward, late)
        return
    assert forward.repaired == ["r1"] and all(read.canceled for read in reads.values())
    assert all(_layer_right(forward, layer) for layer in range(LAYERS))
