"""Full Block round trips through NIXL for every store backend: POSIX files, S3 on SeaweedFS (plain HTTP) and on
versitygw (TLS, trusted through ``ca_bundle``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from botocore.exceptions import ClientError

from dualpath_dev.tls import make_server_tls
from nixl_backends.buffers import HostBufferPool, PoolExhausted
from nixl_backends.deadlines import load_deadline
from nixl_backends.layout import DIGEST_BYTES, BlockLayout, KVNamespace, chunk_hashes, chunk_key
from nixl_backends.posix import PosixStore
from nixl_backends.s3 import S3Store
from nixl_backends.registry import make_store, parse_store_config
from nixl_backends.s3_endpoint import UntrustedServer
from tests.conftest import poll

LAYOUT = BlockLayout(num_layers=4, layer_block_bytes=16384)
# Stores move whole objects: the Full Block and its integrity trailer.
FULL = LAYOUT.object_bytes
CHUNK_TOKENS = 16
POOL_SLOTS = 48
NAMESPACE = KVNamespace(
    model="test-model",
    dtype="bfloat16",
    block_size=16,
    chunk_tokens=CHUNK_TOKENS,
    num_layers=LAYOUT.num_layers,
    num_kv_heads=2,
    head_size=64,
    kv_layout="NHD",
    layer_block_bytes=LAYOUT.layer_block_bytes,
).digest()


# --- fixtures ------------------------------------------------------------------------------------


# "s3-tls": the s3 store against the second S3 server, over TLS.
@pytest.fixture(params=["posix", "s3", "s3-tls"])
def backend(request) -> str:
    return request.param


@pytest.fixture
def s3_server(backend, request):
    """The S3 server of ``backend`` (started only by the tests that need it)."""
    return request.getfixturevalue("versitygw" if backend == "s3-tls" else "seaweedfs")


@pytest.fixture
def s3_client(s3_server):
    return s3_server.client()


@pytest.fixture
def bucket(s3_bucket, s3_client):
    """``s3_bucket``, emptied and deleted afterwards.

    Every bucket is a SeaweedFS collection that takes a volume of its own, and
    the dev server's volume count is bounded (``-volume.max``): the cleanup
    keeps a long session's buckets from using it up.
    """
    yield s3_bucket
    try:
        listed = s3_client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])
    except ClientError:
        return  # never created
    for obj in listed:
        s3_client.delete_object(Bucket=s3_bucket, Key=obj["Key"])
    s3_client.delete_bucket(Bucket=s3_bucket)


@pytest.fixture
def store_config(backend, tmp_path, request):
    if backend == "posix":
        return parse_store_config({"backend": "posix", "root": str(tmp_path / "store")})
    # Only S3 tests start an S3 server.
    return parse_store_config(request.getfixturevalue("s3_server").store_config(request.getfixturevalue("bucket")))


@pytest.fixture
def store(store_config, nixl_agent):
    # The backend must exist on the agent before the pool registers memory.
    opened = make_store(store_config, LAYOUT, nixl_agent)
    yield opened
    opened.close()


@pytest.fixture
def pool(store, nixl_agent):
    opened = HostBufferPool(nixl_agent, FULL, POOL_SLOTS)
    yield opened
    opened.close()


@pytest.fixture
def stored_bytes(store, request):
    """Read a key's stored bytes without NIXL, straight from the file or object."""
    if isinstance(store, PosixStore):
        return lambda key: Path(store.path(key)).read_bytes()
    client = request.getfixturevalue("s3_client")
    return lambda key: client.get_object(Bucket=store.config.bucket, Key=key)["Body"].read()


@pytest.fixture
def truncate(store, request):
    """Cut a stored chunk down to ``keep`` bytes behind the store's back."""
    if isinstance(store, PosixStore):

        def cut(key: str, keep: int) -> None:
            os.truncate(store.path(key), keep)
            assert os.stat(store.path(key)).st_size == keep

        return cut
    client = request.getfixturevalue("s3_client")

    def cut(key: str, keep: int) -> None:
        body = client.get_object(Bucket=store.config.bucket, Key=key)["Body"].read()
        assert len(body) == FULL
        client.put_object(Bucket=store.config.bucket, Key=key, Body=body[:keep])
        assert client.head_object(Bucket=store.config.bucket, Key=key)["ContentLength"] == keep

    return cut


# --- helpers -------------------------------------------------------------------------------------


def make_keys(rng: np.random.Generator, count: int) -> list[str]:
    tokens = rng.integers(0, 32000, size=count * CHUNK_TOKENS).tolist()
    hashes = chunk_hashes(NAMESPACE, tokens, CHUNK_TOKENS)
    assert len(hashes) == count
    return [chunk_key("kv-test", NAMESPACE, h) for h in hashes]


def fill_random(pool: HostBufferPool, slots: list[int], rng: np.random.Generator) -> None:
    for slot in slots:
        pool.slot_view(slot)[:] = rng.integers(0, 256, size=FULL, dtype=np.uint8)


def poison(pool: HostBufferPool, slots: list[int]) -> None:
    for slot in slots:
        pool.slot_view(slot)[:] = 0xA5


def addrs(pool: HostBufferPool, slots: list[int]) -> list[int]:
    return [pool.slot_addr(slot) for slot in slots]


def assert_slots_equal(pool: HostBufferPool, src: list[int], dst: list[int]) -> None:
    for s, d in zip(src, dst, strict=True):
        assert np.array_equal(pool.slot_view(s), pool.slot_view(d)), (s, d)


def write_all(store, pool: HostBufferPool, keys: list[str], slots: list[int]) -> None:
    assert store.write(keys, addrs(pool, slots)) == [True] * len(keys)


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 6])
def test_round_trip(store, pool, count):
    rng = np.random.default_rng(1000 + count)
    keys = make_keys(rng, count)
    src = list(range(count))
    dst = list(range(count, 2 * count))
    fill_random(pool, src, rng)
    poison(pool, dst)
    assert not np.array_equal(pool.slot_view(src[0]), pool.slot_view(dst[0]))

    assert store.lookup(keys) == 0
    write_all(store, pool, keys, src)
    assert store.lookup(keys) == count

    assert store.read(keys, addrs(pool, dst)) == [True] * count
    assert_slots_equal(pool, src, dst)


def test_round_trip_in_permuted_order(store, pool):
    """Each key lands at its own address, whatever the order of the batch."""
    rng = np.random.default_rng(7)
    keys = make_keys(rng, 5)
    src = [0, 1, 2, 3, 4]
    fill_random(pool, src, rng)
    write_all(store, pool, keys, src)

    order = [3, 0, 4, 2, 1]
    dst = [10 + i for i in range(5)]
    poison(pool, dst)
    assert store.read([keys[i] for i in order], addrs(pool, dst)) == [True] * 5
    assert_slots_equal(pool, [src[i] for i in order], dst)


def test_written_bytes_are_the_slot_bytes(store, pool, stored_bytes):
    """Checked outside NIXL, so a symmetric write/read mistake cannot hide."""
    rng = np.random.default_rng(11)
    keys = make_keys(rng, 3)
    src = [5, 6, 7]
    fill_random(pool, src, rng)
    write_all(store, pool, keys, src)
    for key, slot in zip(keys, src):
        data = stored_bytes(key)
        assert len(data) == FULL
        assert data == pool.slot_view(slot).tobytes()
        # Layer l is at [l*S, (l+1)*S) of the stored Full Block.
        for layer in range(LAYOUT.num_layers):
            lo, hi = LAYOUT.layer_range(layer)
            assert data[lo:hi] == pool.slot_view(slot)[lo:hi].tobytes()


def test_many_chunks_cross_the_lookup_window(store, pool):
    rng = np.random.default_rng(20)
    keys = make_keys(rng, 20)
    src = list(range(20))
    fill_random(pool, src, rng)
    present = [i for i in range(20) if i != 17]
    write_all(store, pool, [keys[i] for i in present], [src[i] for i in present])
    assert store.lookup(keys) == 17
    assert store.lookup(keys[:17]) == 17
    assert store.lookup(keys[18:]) == 2

    dst = list(range(20, 40))
    poison(pool, dst)
    flags = store.read(keys, addrs(pool, dst))
    assert flags == [i != 17 for i in range(20)]
    assert_slots_equal(pool, [src[i] for i in present], [dst[i] for i in present])


def test_empty_batches(store, pool):
    assert store.lookup([]) == 0
    assert store.read([], []) == []
    assert store.write([], []) == []


# --- lookup, missing and damaged chunks ----------------------------------------------------------


def test_lookup_returns_leading_run(store, pool):
    rng = np.random.default_rng(30)
    keys = make_keys(rng, 5)
    src = list(range(5))
    fill_random(pool, src, rng)
    written = [0, 1, 3, 4]
    write_all(store, pool, [keys[i] for i in written], [src[i] for i in written])

    assert store.lookup(keys) == 2
    assert store.lookup(keys[:2]) == 2
    assert store.lookup(keys[2:]) == 0
    assert store.lookup(keys[3:]) == 2
    assert store.lookup([keys[2], keys[0]]) == 0

    # Filling the hole completes the run.
    write_all(store, pool, [keys[2]], [src[2]])
    assert store.lookup(keys) == 5


def test_missing_key_fails_alone_on_read(store, pool):
    rng = np.random.default_rng(40)
    keys = make_keys(rng, 4)
    src = [0, 1, 2, 3]
    fill_random(pool, src, rng)
    written = [0, 1, 3]
    write_all(store, pool, [keys[i] for i in written], [src[i] for i in written])

    dst = [4, 5, 6, 7]
    poison(pool, dst)
    assert store.read(keys, addrs(pool, dst)) == [True, True, False, True]
    assert_slots_equal(pool, [src[i] for i in written], [dst[i] for i in written])


@pytest.mark.parametrize("keep", [FULL - 1, FULL // 2, 1, 0], ids=["minus-1", "half", "one-byte", "empty"])
def test_truncated_chunk_stops_lookup_and_fails_read(store, pool, truncate, keep):
    rng = np.random.default_rng(50 + keep)
    keys = make_keys(rng, 4)
    src = [0, 1, 2, 3]
    fill_random(pool, src, rng)
    write_all(store, pool, keys, src)
    assert store.lookup(keys) == 4

    truncate(keys[2], keep)
    assert store.lookup(keys) == 2
    assert store.lookup(keys[3:]) == 1

    dst = [4, 5, 6, 7]
    poison(pool, dst)
    got = store.read(keys, addrs(pool, dst))
    if isinstance(store, S3Store) and keep > FULL - DIGEST_BYTES:
        # One GET per object, the trailer zeroed first: short by less than a digest, the read "succeeds" with
        # the last digest part zero, which the reader's integrity check refuses (never the stored bytes).
        assert got == [True] * 4
        assert not np.array_equal(pool.slot_view(src[2]), pool.slot_view(dst[2]))
        assert not pool.slot_view(dst[2])[keep:].any()
    else:
        assert got == [True, True, False, True]
    intact = [0, 1, 3]
    assert_slots_equal(pool, [src[i] for i in intact], [dst[i] for i in intact])


@pytest.mark.parametrize("backend", ["s3"])
def test_s3_reads_each_object_in_one_request(store, pool, seaweedfs):
    """One GET per chunk object (no second request for its last byte), and a stale trailer in the slot is
    cleared before the read, so a short object cannot pass with the bytes a previous read left."""
    rng = np.random.default_rng(77)
    keys = make_keys(rng, 4)
    fill_random(pool, [0, 1, 2, 3], rng)
    write_all(store, pool, keys, [0, 1, 2, 3])
    bucket = store.config.bucket
    before = seaweedfs.s3_requests("GET", bucket)
    assert store.read(keys, addrs(pool, [4, 5, 6, 7])) == [True] * 4
    # SeaweedFS counts a request after answering it: the count may move only after the read returned.
    assert poll(lambda: seaweedfs.s3_requests("GET", bucket) - before, lambda n: n >= 4, 10, "GETs counted") == 4
    assert_slots_equal(pool, [0, 1, 2, 3], [4, 5, 6, 7])
    # A stale trailer from that read, then the object cut short by a digest: the trailer is cleared first.
    client = seaweedfs.client()
    body = client.get_object(Bucket=bucket, Key=keys[1])["Body"].read()
    client.put_object(Bucket=bucket, Key=keys[1], Body=body[:-DIGEST_BYTES])
    assert store.read(keys[1:2], addrs(pool, [5])) == [False]
    assert not pool.slot_view(5)[FULL - DIGEST_BYTES:].any()


@pytest.mark.parametrize("backend", ["s3"])  # counts GETs with SeaweedFS's metrics
@pytest.mark.parametrize("retries, deadline_passed", [(1, False), (0, False), (1, True)],
                         ids=["retried", "no-retries", "past-the-load-deadline"])
def test_s3_sends_a_failed_request_again(seaweedfs, bucket, nixl_agent, monkeypatch, retries, deadline_passed):
    """A request that failed (a dropped connection, a 5xx the SDK gave up on) is sent again ``io_retries``
    times before its chunk counts as failed; without retries (the control) it fails the read, and so it does
    when the load it serves is past its deadline (recomputing the chunk is then sooner: counted apart).

    The failure is injected at the NIXL boundary (the first round's request for chunk 1 is never posted and
    reports failure): a connection dropped at a chosen request cannot be had from a real server on demand.
    """
    import nixl_backends.s3 as s3_module

    store = make_store(parse_store_config({**seaweedfs.store_config(bucket), "io_retries": retries}), LAYOUT,
                       nixl_agent)  # fmt: skip
    pool = HostBufferPool(nixl_agent, FULL, POOL_SLOTS)
    try:
        rng = np.random.default_rng(91)
        keys = make_keys(rng, 4)
        fill_random(pool, [0, 1, 2, 3], rng)
        write_all(store, pool, keys, [0, 1, 2, 3])
        real, rounds = s3_module.run_nixl_transfers, []

        def first_round_loses_chunk_1(agent, op, transfers, *args, **kwargs):
            rounds.append(len(transfers))
            if len(rounds) > 1:
                return real(agent, op, transfers, *args, **kwargs)
            sent = real(agent, op, transfers[:1] + transfers[2:], *args, **kwargs)
            return sent[:1] + [False] + sent[1:]

        monkeypatch.setattr(s3_module, "run_nixl_transfers", first_round_loses_chunk_1)
        poison(pool, [4, 5, 6, 7])
        before = seaweedfs.s3_requests("GET", bucket)
        with load_deadline(time.monotonic() if deadline_passed else None):
            got = store.read(keys, addrs(pool, [4, 5, 6, 7]))
        resent = retries and not deadline_passed
        sent = poll(lambda: seaweedfs.s3_requests("GET", bucket) - before, lambda n: n >= (4 if resent else 3), 10,
                    "GETs counted")  # fmt: skip
        if resent:
            assert got == [True] * 4 and rounds == [4, 1] and sent == 4  # only the failed request went again
            assert_slots_equal(pool, [0, 1, 2, 3], [4, 5, 6, 7])
        else:
            assert got == [True, False, True, True] and rounds == [4] and sent == 3
        assert store.metrics().counters == {"s3_requests_retried": int(resent),
                                            "s3_retries_past_deadline": int(deadline_passed)}
    finally:
        pool.close()
        store.close()


def test_deleted_chunks_are_misses_and_deleting_again_is_fine(store_config, store, pool):
    rng = np.random.default_rng(55)
    keys = make_keys(rng, 4)
    fill_random(pool, [0, 1, 2, 3], rng)
    write_all(store, pool, keys, [0, 1, 2, 3])
    assert store.lookup(keys) == 4

    # Delete is control path: a lookup-only store (the gc, a reader that found a corrupt chunk) can do it.
    lookup_only = make_store(store_config, LAYOUT, None)
    try:
        lookup_only.delete([keys[1], keys[1], make_keys(rng, 1)[0]])
    finally:
        lookup_only.close()
    assert store.lookup(keys) == 1
    poison(pool, [4, 5])
    assert store.read(keys[:2], addrs(pool, [4, 5])) == [True, False]
    # Writing it again makes it whole (a corrupt chunk dropped by a reader is re-saved this way).
    write_all(store, pool, [keys[1]], [1])
    assert store.lookup(keys) == 4


def test_lookup_only_store(store_config, store, pool):
    rng = np.random.default_rng(60)
    keys = make_keys(rng, 3)
    fill_random(pool, [0, 1], rng)
    write_all(store, pool, keys[:2], [0, 1])

    lookup_only = make_store(store_config, LAYOUT, None)
    try:
        assert type(lookup_only) is type(store)
        assert lookup_only.lookup(keys) == 2
        assert lookup_only.lookup(keys[:1]) == 1
        with pytest.raises(RuntimeError):
            lookup_only.read(keys[:1], addrs(pool, [2]))
        with pytest.raises(RuntimeError):
            lookup_only.write(keys[2:], addrs(pool, [0]))
    finally:
        lookup_only.close()
    # Nothing was written through the lookup-only store.
    assert store.lookup(keys[2:]) == 0


def test_lookup_only_store_without_chunks(store_config):
    lookup_only = make_store(store_config, LAYOUT, None)
    try:
        rng = np.random.default_rng(61)
        assert lookup_only.lookup(make_keys(rng, 3)) == 0
    finally:
        lookup_only.close()


def test_rewriting_a_key_counts_as_written(store, pool):
    rng = np.random.default_rng(70)
    keys = make_keys(rng, 2)
    fill_random(pool, [0, 1], rng)
    write_all(store, pool, keys, [0, 1])
    # Same key, same content (content addressing): written again or skipped, never an error.
    assert store.write(keys, addrs(pool, [0, 1])) == [True, True]
    assert store.lookup(keys) == 2
    poison(pool, [2, 3])
    assert store.read(keys, addrs(pool, [2, 3])) == [True, True]
    assert_slots_equal(pool, [0, 1], [2, 3])


# --- backend specifics ---------------------------------------------------------------------------


@pytest.fixture
def posix_store(tmp_path, nixl_agent):
    opened = make_store(parse_store_config({"backend": "posix", "root": str(tmp_path / "posix")}), LAYOUT, nixl_agent)
    yield opened
    opened.close()


@pytest.fixture
def posix_pool(posix_store, nixl_agent):
    opened = HostBufferPool(nixl_agent, FULL, 8)
    yield opened
    opened.close()


def test_make_store_picks_the_backend(backend, store):
    assert isinstance(store, PosixStore if backend == "posix" else S3Store)


def test_posix_keys_are_files_under_the_root(posix_store, posix_pool, tmp_path):
    rng = np.random.default_rng(80)
    (key,) = make_keys(rng, 1)
    fill_random(posix_pool, [0], rng)
    write_all(posix_store, posix_pool, [key], [0])
    path = Path(posix_store.path(key))
    assert path == tmp_path / "posix" / key
    assert path.is_file() and path.stat().st_size == FULL
    # Written under a temporary name and renamed: nothing else is left behind.
    assert [p for p in (tmp_path / "posix").rglob("*") if p.is_file()] == [path]


def test_posix_write_of_existing_key_keeps_the_file(posix_store, posix_pool):
    rng = np.random.default_rng(90)
    (key,) = make_keys(rng, 1)
    fill_random(posix_pool, [0, 1], rng)
    assert not np.array_equal(posix_pool.slot_view(0), posix_pool.slot_view(1))
    write_all(posix_store, posix_pool, [key], [0])
    path = Path(posix_store.path(key))
    before = path.stat()
    original = path.read_bytes()

    # Different bytes under the same key: the existing file is kept, not replaced.
    assert posix_store.write([key], addrs(posix_pool, [1])) == [True]
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert path.read_bytes() == original == posix_pool.slot_view(0).tobytes()
    assert [p.name for p in path.parent.iterdir()] == [path.name]

    poison(posix_pool, [2])
    assert posix_store.read([key], addrs(posix_pool, [2])) == [True]
    assert_slots_equal(posix_pool, [0], [2])


def test_posix_write_mixes_existing_and_new_keys(posix_store, posix_pool):
    rng = np.random.default_rng(91)
    keys = make_keys(rng, 3)
    fill_random(posix_pool, [0, 1, 2], rng)
    write_all(posix_store, posix_pool, [keys[1]], [1])
    assert posix_store.write(keys, addrs(posix_pool, [0, 1, 2])) == [True, True, True]
    assert posix_store.lookup(keys) == 3
    for key, slot in zip(keys, [0, 1, 2]):
        assert Path(posix_store.path(key)).read_bytes() == posix_pool.slot_view(slot).tobytes()


@pytest.mark.parametrize("backend", ["s3", "s3-tls"])
def test_s3_store_creates_its_bucket(s3_server, bucket, s3_client):
    assert bucket not in {b["Name"] for b in s3_client.list_buckets()["Buckets"]}
    opened = make_store(parse_store_config(s3_server.store_config(bucket)), LAYOUT, None)
    try:
        assert bucket in {b["Name"] for b in s3_client.list_buckets()["Buckets"]}
        # Opening again on an existing bucket is fine.
        make_store(parse_store_config(s3_server.store_config(bucket)), LAYOUT, None).close()
    finally:
        opened.close()


@pytest.mark.parametrize("trusted", ["another CA", "the system's CAs"])
def test_s3_store_over_tls_refuses_a_server_its_ca_bundle_did_not_sign(versitygw, s3_bucket, tmp_path, trusted):
    section = versitygw.store_config(s3_bucket)
    if trusted == "another CA":
        section["ca_bundle"] = str(make_server_tls(tmp_path, ["127.0.0.1"]).ca_file)
    else:
        del section["ca_bundle"]
    with pytest.raises(UntrustedServer, match=r"TLS certificate is not trusted .*set store.ca_bundle"):
        make_store(parse_store_config(section), LAYOUT, None)


# --- host buffer pool ----------------------------------------------------------------------------


def test_pool_slots_are_aligned_and_disjoint(posix_pool):
    stride = -(-FULL // 4096) * 4096
    assert FULL % 4096  # the layout's objects are not page multiples: the stride pads them
    assert posix_pool.array.nbytes == stride * posix_pool.num_slots
    for slot in range(posix_pool.num_slots):
        assert posix_pool.slot_addr(slot) == posix_pool.base_addr + slot * stride
        assert posix_pool.slot_addr(slot) % 4096 == 0
        assert posix_pool.slot_view(slot).nbytes == FULL
        assert posix_pool.slot_view(slot).ctypes.data == posix_pool.slot_addr(slot)
        posix_pool.slot_view(slot)[:] = slot + 1
    for slot in range(posix_pool.num_slots):
        assert (posix_pool.slot_view(slot) == slot + 1).all()


def test_pool_acquire_beyond_capacity_and_release(posix_pool):
    n = posix_pool.num_slots
    assert posix_pool.free_slots == n
    first = posix_pool.acquire(3)
    second = posix_pool.acquire(n - 4)
    assert len(first) == 3 and len(second) == n - 4
    assert len(set(first) | set(second)) == n - 1
    assert set(first) | set(second) <= set(range(n))
    assert posix_pool.free_slots == 1

    with pytest.raises(PoolExhausted):
        posix_pool.acquire(2)
    assert posix_pool.free_slots == 1  # a failed acquire takes nothing

    last = posix_pool.acquire(1)
    assert posix_pool.free_slots == 0
    assert set(last).isdisjoint(set(first) | set(second))
    with pytest.raises(PoolExhausted):
        posix_pool.acquire(1)
    assert posix_pool.acquire(0) == []

    posix_pool.release(first)
    assert posix_pool.free_slots == 3
    again = posix_pool.acquire(3)
    assert sorted(again) == sorted(first)
    with pytest.raises(PoolExhausted):
        posix_pool.acquire(1)

    posix_pool.release(again + second + last)
    assert posix_pool.free_slots == n
    assert sorted(posix_pool.acquire(n)) == list(range(n))


def test_pool_exhausted_is_a_runtime_error():
    assert issubclass(PoolExhausted, RuntimeError)


@pytest.mark.parametrize("slot_bytes,num_slots", [(0, 4), (FULL, 0), (-1, 4)])
def test_pool_rejects_non_positive_sizes(nixl_agent, slot_bytes, num_slots):
    with pytest.raises(ValueError):
        HostBufferPool(nixl_agent, slot_bytes, num_slots)


def test_pool_acquire_negative_count_is_rejected(posix_pool):
    n = posix_pool.num_slots
    try:
        taken = posix_pool.acquire(-1)
    except (ValueError, PoolExhausted):
        return
    # Whatever it returned must not be handed out a second time.
    assert set(taken).isdisjoint(posix_pool.acquire(posix_pool.free_slots)), (taken, n)


# --- layer-major pools ---------------------------------------------------------------------------


def test_layer_major_pool_hands_out_runs_and_pieces(store, nixl_agent):  # the store: a backend to register with
    pool = HostBufferPool(nixl_agent, FULL, 8, layer_major=(LAYOUT.num_layers, LAYOUT.layer_block_bytes))
    try:
        assert pool.acquire(3) == [0, 1, 2] and pool.acquire(2) == [3, 4]
        pool.release([1, 3])
        # No two consecutive slots free among 1, 3, 5, 6, 7 below 5: the lowest run is 5-6.
        assert pool.acquire(2) == [5, 6]
        taken = pool.acquire(3)  # fragmented: any three
        assert sorted(taken) == [1, 3, 7]
        pieces = pool.slot_segments(6)
        assert pieces[:, 1].sum() == FULL and len(pieces) == LAYOUT.num_layers + 1
        # Layer l of consecutive slots is one run: slot 6's layer 1 follows slot 5's.
        assert pool.layer_view(6, 1).ctypes.data == pool.layer_view(5, 1).ctypes.data + LAYOUT.layer_block_bytes
        assert pieces[1, 0] == pool.layer_view(6, 1).ctypes.data
        with pytest.raises(ValueError, match="in pieces"):
            pool.slot_view(6)
    finally:
        pool.close()


def test_reads_into_a_layer_major_pool(store, pool, nixl_agent, truncate):
    """A store that declares reads_segments reads each object into its pieces; the others say they cannot."""
    rng = np.random.default_rng(91)
    keys = make_keys(rng, 4)
    fill_random(pool, [0, 1, 2, 3], rng)
    write_all(store, pool, keys, [0, 1, 2, 3])
    striped = HostBufferPool(nixl_agent, FULL, 6, layer_major=(LAYOUT.num_layers, LAYOUT.layer_block_bytes))
    try:
        if not store.reads_segments:
            with pytest.raises(NotImplementedError):
                store.read_segments(keys, [striped.slot_segments(s) for s in range(4)])
            return
        truncate(keys[2], FULL - 1)
        striped.array[:] = 0xA5
        assert store.read_segments(keys, [striped.slot_segments(s) for s in (1, 2, 3, 4)]) == [True, True, False, True]
        for i, slot in ((0, 1), (1, 2), (3, 4)):
            obj = pool.slot_view(i)
            for layer in range(LAYOUT.num_layers):
                assert np.array_equal(striped.layer_view(slot, layer), obj[slice(*LAYOUT.layer_range(layer))])
            assert np.array_equal(striped.trailer_view(slot), obj[LAYOUT.full_block_bytes :])
        # Negative control: the pieces hold the objects in order, not any copy of the bytes.
        assert not np.array_equal(striped.layer_view(1, 1), pool.slot_view(0)[slice(*LAYOUT.layer_range(0))])
    finally:
        striped.close()


@pytest.mark.parametrize("backend", ["s3"])  # the relay speaks plain HTTP to its store
def test_s3_rides_out_throttling_and_connection_resets(seaweedfs, bucket, nixl_agent):
    """A store that answers a fifth of object requests 503 SlowDown and resets a tenth of its connections (a
    relay in front of SeaweedFS): every chunk still round-trips byte-equal. NIXL OBJ fails a GET the store
    throttled even where the AWS SDK's own retry then got the object (seen here: every such GET), so the store
    sends it again after a jittered backoff (``s3_requests_retried``); resets the SDK rides out itself."""
    from dualpath_dev.s3_relay import S3Relay

    with S3Relay(seaweedfs.endpoint, seaweedfs.access_key, seaweedfs.secret_key, throttle_fraction=0.2,
                 reset_fraction=0.1, seed=38) as relay:  # fmt: skip
        # Each attempt fails with p <= 0.3: a chunk failing 1 + 6 in a row is 2e-4, for the 24 here 5e-3.
        section = {**seaweedfs.store_config(bucket), "endpoint": relay.endpoint, "io_retries": 6}
        store = make_store(parse_store_config(section), LAYOUT, nixl_agent)
        pool = HostBufferPool(nixl_agent, FULL, POOL_SLOTS)
        try:
            rng = np.random.default_rng(92)
            keys = make_keys(rng, 12)
            fill_random(pool, list(range(12)), rng)
            write_all(store, pool, keys, list(range(12)))
            poison(pool, list(range(12, 24)))
            assert store.read(keys, addrs(pool, list(range(12, 24)))) == [True] * 12
            assert_slots_equal(pool, list(range(12)), list(range(12, 24)))
            assert relay.throttled >= 1 and relay.resets >= 1  # the faults happened
            assert store.metrics().counters["s3_requests_retried"] >= 1
        finally:
            pool.close()
            store.close()


@pytest.mark.parametrize("backend", ["s3"])  # the relay speaks plain HTTP to its store
def test_an_abandoned_reads_slots_return_only_once_its_late_bytes_landed(seaweedfs, bucket, nixl_agent):
    """A store that stops answering (the relay holds its GETs): the read is abandoned at io_timeout_s, and its
    slots go to the reaper, not the pool. Once the store answers, the GETs still land in those slots, after
    the caller gave up on them (the control: a slot reused at the deadline would now hold the late object, not
    its new owner's bytes); only then do the slots return to the pool and the store's registration go."""
    from dualpath_dev.s3_relay import S3Relay
    from nixl_backends.abandoned import AbandonedTransfers
    from nixl_backends.nixl_io import TransferAbandoned

    with S3Relay(seaweedfs.endpoint, seaweedfs.access_key, seaweedfs.secret_key) as relay:
        section = {**seaweedfs.store_config(bucket), "endpoint": relay.endpoint, "io_timeout_s": 3.0, "io_retries": 0}
        store = make_store(parse_store_config(section), LAYOUT, nixl_agent)
        pool = HostBufferPool(nixl_agent, FULL, 8)
        reaper = AbandonedTransfers(poll_s=0.05)
        try:
            rng = np.random.default_rng(41)
            keys = make_keys(rng, 2)
            fill_random(pool, [0, 1], rng)
            write_all(store, pool, keys, [0, 1])  # the AWS SDK's first request takes a second (measured: 1.01 s)
            pool.acquire(2)  # slots 0 and 1 keep the reference bytes
            slots = pool.acquire(2)
            poison(pool, slots)
            relay.hold()
            try:
                with pytest.raises(TransferAbandoned) as abandoned:
                    store.read(keys, addrs(pool, slots))
                assert len(abandoned.value.handles) == 2 and abandoned.value.cleanups  # the registration's
                reaper.hold_abandoned(abandoned.value, lambda: pool.release(slots), label="test read")
                assert pool.free_slots == 4 and reaper.held == 1  # not back in the pool
                assert relay.held == 2
            finally:
                relay.release()
            poll(lambda: reaper.held, lambda held: held == 0, 60, "the abandoned GETs to end")
            assert pool.free_slots == 6
            assert_slots_equal(pool, [0, 1], slots)  # the late bytes landed where the caller had given up
        finally:
            relay.release()
            reaper.close()
            pool.close()
            store.close()
