"""The LMCache L2 adapter's contract (nixl_backends.lmcache_l2) on CPU memory objects, against a POSIX root
and the real SeaweedFS: store, lookup with partial hits, load into given buffers, missing, truncated and
corrupt objects, lock/unlock against delete, key isolation, bad adapter_params.

Every adapter is built the way ``lmcache server`` builds it: the ``--l2-adapter`` JSON through LMCache's
own argument parser and plugin loader.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lmcache")

import torch  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402
from lmcache.v1.platform import consume_fd  # noqa: E402

from nixl_backends.configuration import ConfigError  # noqa: E402
from nixl_backends.integrity import INTEGRITY_KEY_ENV, integrity_tag  # noqa: E402
from nixl_backends.lmcache_l2 import DualPathL2Adapter, store_key  # noqa: E402
from tests.conftest import TEST_INTEGRITY_KEY  # noqa: E402

# A KV_2LTD chunk object as LMCache's MP server holds one: [K/V, layers, tokens, hidden] in bfloat16.
SHAPE = torch.Size([2, 4, 16, 128])
OBJECT_BYTES = SHAPE.numel() * 2
LAYOUT = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[torch.bfloat16])
TIMEOUT_S = 60.0
# The adapter's integrity tag in its default mode (keyed) under the test session's secret: part of each name.
STORED_TAG = integrity_tag(TEST_INTEGRITY_KEY)


def spec(store: dict, **params) -> dict:
    return {"type": "plugin", "module_path": "nixl_backends.lmcache_l2", "class_name": "DualPathL2Adapter",
            "adapter_params": {"store": store, **params}}  # fmt: skip


def config_of(adapter_spec: dict):
    """The adapter's config as ``lmcache server --l2-adapter JSON`` parses it."""
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    return parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(adapter_spec)])).adapters[0]


def build(adapter_spec: dict) -> DualPathL2Adapter:
    """The adapter as ``lmcache server --l2-adapter JSON`` builds it."""
    return create_l2_adapter(config_of(adapter_spec))


def memory_objects(count: int, seed: int | None) -> list[TensorMemoryObj]:
    """bf16 objects of SHAPE, random (seed) or zero (seed None)."""
    generator = torch.Generator().manual_seed(seed or 0)
    objects = []
    for _ in range(count):
        data = (torch.randn(SHAPE, generator=generator) if seed is not None else torch.zeros(SHAPE)).to(torch.bfloat16)
        meta = MemoryObjMetadata(shape=SHAPE, dtype=torch.bfloat16, address=data.data_ptr(),
                                 phy_size=OBJECT_BYTES, ref_count=1, fmt=MemoryFormat.KV_2LTD)  # fmt: skip
        objects.append(TensorMemoryObj(raw_data=data, metadata=meta, parent_allocator=None))
    return objects


def keys(count: int, start: int = 0, **fields) -> list[ObjectKey]:
    fields = {"model_name": "org/tiny-llama", "kv_rank": 0, **fields}
    return [ObjectKey(chunk_hash=i.to_bytes(8, "big", signed=True), **fields) for i in range(start, start + count)]


def _wait(fd: int) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(TIMEOUT_S * 1000), "no completion signalled on the event fd"
    consume_fd(fd)


def store(adapter, ks, objs) -> int:
    """Run a store task to completion; its L2StoreResult."""
    task = adapter.submit_store_task(ks, objs)
    done: dict = {}
    while task not in done:
        _wait(adapter.get_store_event_fd())
        done.update(adapter.pop_completed_store_tasks())
    return done[task]


def lookup(adapter, ks, layouts=None) -> list[int]:
    task = adapter.submit_lookup_and_lock_task(ks, {0: LAYOUT} if layouts is None else layouts)
    while (bitmap := adapter.query_lookup_and_lock_result(task)) is None:
        _wait(adapter.get_lookup_and_lock_event_fd())
    assert adapter.query_lookup_and_lock_result(task) is None  # answered once
    return [int(bitmap.test(i)) for i in range(len(ks))]


def load(adapter, ks, objs) -> list[int]:
    task = adapter.submit_load_task(ks, objs)
    while (bitmap := adapter.query_load_result(task)) is None:
        _wait(adapter.get_load_event_fd())
    return [int(bitmap.test(i)) for i in range(len(ks))]


def same_bytes(a: TensorMemoryObj, b: TensorMemoryObj) -> bool:
    return bytes(a.byte_array) == bytes(b.byte_array)


# "s3-tls": the second S3 server, over TLS (its CA in ca_bundle).
@pytest.fixture(params=["posix", "s3", "s3-tls"])
def store_section(request, tmp_path, monkeypatch) -> dict:
    if request.param == "posix":
        return {"backend": "posix", "root": str(tmp_path / "l2")}
    server = request.getfixturevalue("versitygw" if request.param == "s3-tls" else "seaweedfs")
    # Credentials from the environment: adapter_params refuse a secret_key.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    return server.bucket_section(request.getfixturevalue("s3_bucket"))


@pytest.fixture
def section_server(store_section, request):
    """The S3 server behind ``store_section``; None for a POSIX one."""
    if store_section["backend"] == "posix":
        return None
    return request.getfixturevalue("versitygw" if "ca_bundle" in store_section else "seaweedfs")


@pytest.fixture
def adapter(store_section):
    made = build(spec(store_section))
    yield made
    made.close()


def test_round_trip_with_partial_hits(adapter):
    stored = memory_objects(5, seed=1)
    result = store(adapter, keys(5), stored)
    assert result.is_successful() and result.bytes_transferred() == 5 * OBJECT_BYTES

    # Every present key answers, not only a leading run (LMCache plans the prefix itself).
    probe = [*keys(2), *keys(1, start=99), *keys(3, start=2)]
    assert lookup(adapter, probe) == [1, 1, 0, 1, 1, 1]

    targets = memory_objects(6, seed=None)
    assert load(adapter, probe, targets) == [1, 1, 0, 1, 1, 1]
    for got, want in zip([targets[0], targets[1], *targets[3:]], stored):
        assert same_bytes(got, want)
    assert not targets[2].raw_data.any()  # the missing key's buffer is untouched
    adapter.submit_unlock(probe)

    # Storing again is skipped (already stored) and still succeeds.
    again = store(adapter, keys(5), stored)
    assert again.is_successful() and again.bytes_transferred() == 0
    assert adapter.get_usage().total_bytes_used == 5 * OBJECT_BYTES
    status = adapter.report_status()
    assert status["loaded_objects"] == 5 and status["missing_objects"] == 1 and status["is_healthy"]


def test_a_new_adapter_finds_what_another_stored(store_section):
    """The key mapping is deterministic: a restarted server (fresh L1) hits in what the last one stored."""
    first = build(spec(store_section))
    stored = memory_objects(3, seed=2)
    assert store(first, keys(3), stored).is_successful()
    first.close()
    # As `lmcache server` builds it for a bucket several servers share: the spec's own "shared" (LMCache's
    # setting, beside "type"), which LMCache hands to the adapter with its identity.
    # (No start-up scan: this test is about what a lookup finds; the next one is about the scan.)
    shared_config = config_of({**spec(store_section, adopt_stored_objects=False), "shared": True})
    assert shared_config.shared is True
    second = create_l2_adapter(shared_config)
    second.set_backend_identity("plugin", shared=shared_config.shared)
    try:
        assert second.get_usage().total_bytes_used == 0  # nothing of the bucket is known before a lookup
        assert lookup(second, keys(3)) == [1, 1, 1]
        # Found, so accounted: LMCache's usage and eviction see objects another server stored.
        assert second.get_usage().total_bytes_used == 3 * OBJECT_BYTES
        assert second.report_status()["adopted_objects"] == 3
        targets = memory_objects(3, seed=None)
        assert load(second, keys(3), targets) == [1, 1, 1]
        assert all(same_bytes(g, w) for g, w in zip(targets, stored))
        # Without the layout hint a fresh adapter knows no object size: a miss, never a guess.
        assert lookup(second, keys(1, start=50), layouts={}) == [0]
        # LMCache's eviction may now remove them (each lookup locked each key once; unlocked first).
        second.submit_unlock(keys(3))
        second.delete(keys(2))
        assert second.get_usage().total_bytes_used == OBJECT_BYTES
        assert lookup(second, keys(3)) == [0, 0, 1]
        second.submit_unlock(keys(3))
    finally:
        second.close()


def _scan_ended(adapter) -> dict:
    """The adapter's status once its start-up scan ended (awaited: it runs on its own thread)."""
    deadline = time.monotonic() + TIMEOUT_S
    while (status := adapter.report_status())["startup_scan"] == "running":
        assert time.monotonic() < deadline, "the start-up scan did not end"
        time.sleep(0.05)
    return status


def _listed(adapter, page_size: int, **options) -> tuple[list, int]:
    """Every entry of list_l2_keys, page after page; (entries, pages)."""
    entries, pages, cursor = [], 0, None
    while True:
        page = adapter.list_l2_keys(page_size=page_size, cursor=cursor, **options)
        assert len(page.entries) <= page_size
        entries.extend(page.entries)
        pages += 1
        if page.next_page_token is None:
            return entries, pages
        cursor = page.next_page_token


def test_list_l2_keys_gives_back_every_key_stored_under_the_prefix(adapter, store_section):
    eight = keys(5)  # LMCache's integer hashes: 8 bytes
    blake3 = [ObjectKey(chunk_hash=bytes([i]) * 32, model_name="org/b", kv_rank=3, object_group_id=1,
                        cache_salt="tenant-a") for i in range(3)]  # its blake3 hashes: 32 bytes
    too_long = [ObjectKey(chunk_hash=bytes([i]) * 40, model_name="org/tiny-llama", kv_rank=0) for i in range(2)]
    for batch in (eight, blake3, too_long):
        assert store(adapter, batch, memory_objects(len(batch), seed=8)).is_successful()
    expected = {key.to_encoded_object_key() for key in [*eight, *blake3]}  # a 40-byte hash cannot be named back

    entries, pages = _listed(adapter, page_size=3)
    assert {entry.key for entry in entries} == expected and len(entries) == len(expected) and pages == 3
    assert {entry.size_bytes for entry in entries} == {OBJECT_BYTES}
    only_b, _ = _listed(adapter, page_size=500, model_name="org/b")
    assert {entry.key for entry in only_b} == {key.to_encoded_object_key() for key in blake3}
    assert _listed(adapter, page_size=500, model_name="org/none") == ([], 1)
    # A listed key is the key: it loads.
    listed_key = ObjectKey(chunk_hash=bytes.fromhex(only_b[0].key.chunk_hash_hex), model_name="org/b", kv_rank=3,
                           object_group_id=1, cache_salt="tenant-a")  # fmt: skip
    assert load(adapter, [listed_key], memory_objects(1, seed=None)) == [1]

    # Another server on the same bucket lists the same keys (the family records are in the store).
    other = build(spec(store_section))
    try:
        assert {entry.key for entry in _listed(other, page_size=500)[0]} == expected
        # The start-up scan accounted all of them, so LMCache's eviction sees and may delete them.
        assert _scan_ended(other)["adopted_objects"] == len(expected)
        assert other.get_usage().total_bytes_used == len(expected) * OBJECT_BYTES
        other.delete(eight[:2])
        assert load(adapter, eight, memory_objects(5, seed=None)) == [0, 0, 1, 1, 1]
    finally:
        other.close()
    # Control: an adapter of another integrity mode lists none of them (it could not verify them).
    checksum = build(spec(store_section, integrity="checksum"))
    try:
        assert _listed(checksum, page_size=500) == ([], 1)
        assert _scan_ended(checksum)["adopted_objects"] == 0
    finally:
        checksum.close()

    for bad in ({"page_size": 0}, {"cursor": "lmcache/../x"}, {"cursor": "other/" + "0" * 32}):
        with pytest.raises(ValueError):
            adapter.list_l2_keys(**bad)


def test_a_missing_object_leaves_the_accounting_and_is_stored_again(adapter, store_section, section_server):
    stored = memory_objects(2, seed=9)
    assert store(adapter, keys(2), stored).is_successful()
    name = store_key("lmcache", keys(2)[1], OBJECT_BYTES, STORED_TAG)[0]
    if store_section["backend"] == "posix":
        (Path(store_section["root"]) / name).unlink()  # as `dualpath-kv gc` or another server's eviction
    else:
        section_server.client().delete_object(Bucket=store_section["bucket"], Key=name)
    assert load(adapter, keys(2), memory_objects(2, seed=None)) == [1, 0]
    assert adapter.get_usage().total_bytes_used == OBJECT_BYTES
    # Not skipped as "already stored": written again, and it loads.
    assert store(adapter, keys(2), stored).bytes_transferred() == OBJECT_BYTES
    again = memory_objects(2, seed=None)
    assert load(adapter, keys(2), again) == [1, 1] and same_bytes(again[1], stored[1])


def test_models_ranks_groups_salts_and_modes_never_collide(adapter, store_section, monkeypatch):
    assert store(adapter, keys(2), memory_objects(2, seed=3)).is_successful()
    for other in ({"model_name": "org/other"}, {"kv_rank": 1}, {"object_group_id": 1}, {"cache_salt": "tenant-b"}):
        layouts = {other.get("object_group_id", 0): LAYOUT}
        assert lookup(adapter, keys(2, **other), layouts) == [0, 0], other
    names = {store_key("lmcache", key, OBJECT_BYTES, STORED_TAG)[0]
             for key in [*keys(1), *keys(1, model_name="m2"), *keys(1, kv_rank=7), *keys(1, cache_salt="s")]}  # fmt: skip
    assert len(names) == 4
    # Another integrity mode is another namespace: checksum readers do not see keyed objects (the default).
    checksum = build(spec(store_section, integrity="checksum"))
    try:
        assert lookup(checksum, keys(2)) == [0, 0]
    finally:
        checksum.close()
    # Nor does another key.
    monkeypatch.setenv(INTEGRITY_KEY_ENV, "k" * 32)
    other_key = build(spec(store_section))
    try:
        assert lookup(other_key, keys(2)) == [0, 0]
    finally:
        other_key.close()


def _tamper(section: dict, server, key: ObjectKey, edit) -> None:
    """Rewrite the stored object of ``key`` as ``edit(bytes)`` (an attacker or bit rot below the adapter)."""
    name = store_key("lmcache", key, OBJECT_BYTES, STORED_TAG)[0]
    if section["backend"] == "posix":
        path = Path(section["root"]) / name
        path.write_bytes(edit(path.read_bytes()))
    else:
        client = server.client()
        body = client.get_object(Bucket=section["bucket"], Key=name)["Body"].read()
        client.put_object(Bucket=section["bucket"], Key=name, Body=edit(body))


def _flip(data: bytes) -> bytes:
    buf = bytearray(data)
    buf[len(buf) // 3] ^= 0x40
    return bytes(buf)


def test_corrupt_and_truncated_objects_are_failed_bits(adapter, store_section, section_server):
    stored = memory_objects(3, seed=4)
    assert store(adapter, keys(3), stored).is_successful()
    _tamper(store_section, section_server, keys(3)[1], _flip)
    _tamper(store_section, section_server, keys(3)[2], lambda data: data[:-100])

    # This adapter stored all three and remembers them as present; only the load finds out.
    assert lookup(adapter, keys(3)) == [1, 1, 1]
    targets = memory_objects(3, seed=None)
    assert load(adapter, keys(3), targets) == [1, 0, 0]
    assert same_bytes(targets[0], stored[0])
    assert not targets[1].raw_data.any() and not targets[2].raw_data.any()  # never wrong bytes
    status = adapter.report_status()
    assert status["corrupt_objects"] == 1 and status["missing_objects"] == 1  # the short one fails its read
    adapter.submit_unlock(keys(3))

    # Failed loads are forgotten: the store is asked again. The corrupt one was deleted, the short one is
    # not a complete object; a fresh adapter (nothing remembered) agrees.
    assert lookup(adapter, keys(3)) == [1, 0, 0]
    adapter.submit_unlock(keys(1))
    fresh = build(spec(store_section))
    try:
        assert lookup(fresh, keys(3)) == [1, 0, 0]
    finally:
        fresh.close()

    # The corrupt object was deleted, so the next store writes it again and it loads.
    assert lookup(adapter, keys(3)[1:2]) == [0]
    assert store(adapter, keys(3)[1:2], stored[1:2]).bytes_transferred() == OBJECT_BYTES
    again = memory_objects(1, seed=None)
    assert load(adapter, keys(3)[1:2], again) == [1] and same_bytes(again[0], stored[1])


def test_locked_keys_survive_delete_until_unlocked(adapter):
    assert store(adapter, keys(2), memory_objects(2, seed=5)).is_successful()
    assert lookup(adapter, keys(2)) == [1, 1]  # locks both
    assert lookup(adapter, keys(1)) == [1]  # a second lock on key 0
    adapter.delete(keys(2))
    assert lookup(adapter, keys(2)) == [1, 1]  # nothing deleted while locked (and locked once more)
    adapter.submit_unlock(keys(2))
    adapter.submit_unlock(keys(2))
    adapter.delete(keys(2))
    assert lookup(adapter, keys(2)) == [1, 0]  # key 1 unlocked and deleted; key 0 held one lock (now two)
    adapter.submit_unlock(keys(1))
    adapter.delete(keys(1))
    assert lookup(adapter, keys(1)) == [1]  # one lock left: still there (now two again)
    adapter.submit_unlock(keys(1))
    adapter.submit_unlock(keys(1))
    adapter.delete(keys(1))
    assert lookup(adapter, keys(2)) == [0, 0]
    assert adapter.get_usage().total_bytes_used == 0
    assert adapter.report_status()["locked_keys"] == 0


def test_event_fds_are_distinct(adapter):
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()}
    assert len(fds) == 3


def test_staging_rounds_and_two_sizes(tmp_path):
    """More objects than staging slots run in rounds; a second object size gets its own namespace."""
    adapter = build(spec({"backend": "posix", "root": str(tmp_path)}, staging_buffer_bytes=2 * OBJECT_BYTES))
    try:
        stored = memory_objects(5, seed=6)
        assert store(adapter, keys(5), stored).bytes_transferred() == 5 * OBJECT_BYTES
        targets = memory_objects(5, seed=None)
        assert load(adapter, keys(5), targets) == [1] * 5
        assert all(same_bytes(g, w) for g, w in zip(targets, stored))
        small = torch.ones(64, dtype=torch.uint8)
        meta = MemoryObjMetadata(shape=torch.Size([64]), dtype=torch.uint8, address=small.data_ptr(),
                                 phy_size=64, ref_count=1, fmt=MemoryFormat.KV_2LTD)  # fmt: skip
        small_obj = TensorMemoryObj(raw_data=small, metadata=meta, parent_allocator=None)
        assert store(adapter, keys(1, start=100), [small_obj]).is_successful()
        assert lookup(adapter, keys(1, start=100)) == [0]  # the layout says OBJECT_BYTES: another namespace
        assert adapter.report_status()["object_sizes"] == [64, OBJECT_BYTES]
    finally:
        adapter.close()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"store": {"backend": "posix", "root": "/tmp/x"}, "stagng_buffer_bytes": 1}, "unknown key adapter_params.'stagng_buffer_bytes'"),
        ({}, "missing required key adapter_params.'store'"),
        ({"store": {"backend": "nfs"}}, "bad value for adapter_params.store.'backend'"),
        ({"store": {"backend": "posix"}}, "missing required key adapter_params.store.'root'"),
        ({"store": {"backend": "posix", "root": "/tmp/x", "io_engin": "aio"}}, "unknown key adapter_params.store.'io_engin'"),
        ({"store": {"backend": "s3", "bucket": "kvb", "access_key": "a", "secret_key": "s3cr3t-value"}}, "adapter_params.store.secret_key would be written"),
        ({"store": {"backend": "tiered", "tiers": [{"backend": "posix", "root": "/tmp/x"},
                                                   {"backend": "s3", "bucket": "kvb", "secret_key": "s3cr3t-value"}]}},
         "adapter_params.store.tiers[1].secret_key would be written"),
        ({"store": {"backend": "posix", "root": "/tmp/x"}, "staging_buffer_bytes": 0}, "adapter_params.staging_buffer_bytes must be positive"),
        ({"store": {"backend": "posix", "root": "/tmp/x"}, "lookup_cache_ttl_s": 0}, "adapter_params.lookup_cache_ttl_s must be positive"),
        ({"store": {"backend": "posix", "root": "/tmp/x"}, "integrity": "md5"}, "bad value for adapter_params.'integrity'"),
        ({"store": {"backend": "posix", "root": "/tmp/x"}, "integrity": "keyed"}, INTEGRITY_KEY_ENV),
        ({"store": {"backend": "posix", "root": "/tmp/x"}}, INTEGRITY_KEY_ENV),  # keyed is the default
    ],
)  # fmt: skip
def test_bad_adapter_params_name_the_key(params, message, monkeypatch):
    if message == INTEGRITY_KEY_ENV:  # keyed without the deployment's secret
        monkeypatch.delenv(INTEGRITY_KEY_ENV, raising=False)
    adapter_spec = {"type": "plugin", "module_path": "nixl_backends.lmcache_l2",
                    "class_name": "DualPathL2Adapter", "adapter_params": params}  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        build(adapter_spec)
    assert message in str(caught.value)
    assert "s3cr3t-value" not in str(caught.value)  # never the secret itself


def test_unreachable_s3_stops_start_up(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    with pytest.raises(Exception):
        build(spec({"backend": "s3", "endpoint": "http://127.0.0.1:9", "bucket": "nowhere"}))


def test_layering_lmcache_is_imported_by_this_module_only():
    root = Path(__file__).resolve().parents[2]
    importers = [
        str(path.relative_to(root))
        for package in ("nixl_backends", "dualpath_connector", "dualpath_router", "s3agg_gateway_ext", "dualpath_bench")
        for path in (root / package).rglob("*.py")
        if "import lmcache" in (text := path.read_text()) or "from lmcache" in text
    ]
    assert importers == [os.path.join("nixl_backends", "lmcache_l2.py")]


def test_object_bytes_rule_matches_lmcache():
    obj = memory_objects(1, seed=7)[0]
    assert obj.get_size() == OBJECT_BYTES == np.prod(SHAPE) * 2


@pytest.mark.parametrize("backend", ["dualblade", "tiered"])
def test_local_tiers_round_trip(backend, tmp_path):
    """A Dual-Blade tier alone and in front of a POSIX root: the same contract; a second object size cannot
    share the tier's extents (its writer lock is held), so that store task fails and nothing else does."""
    local = {"backend": "dualblade", "root": str(tmp_path / "local"), "capacity_bytes": 16 << 20}
    section = local if backend == "dualblade" else {"backend": "tiered",
                                                    "tiers": [local, {"backend": "posix", "root": str(tmp_path / "shared")}]}  # fmt: skip
    adapter = build(spec(section))
    try:
        stored = memory_objects(4, seed=8)
        assert store(adapter, keys(4), stored).bytes_transferred() == 4 * OBJECT_BYTES
        assert lookup(adapter, [*keys(1, start=40), *keys(4)]) == [0, 1, 1, 1, 1]
        targets = memory_objects(4, seed=None)
        assert load(adapter, keys(4), targets) == [1, 1, 1, 1]
        assert all(same_bytes(g, w) for g, w in zip(targets, stored))
        adapter.submit_unlock(keys(4))
        small = torch.ones(4096, dtype=torch.uint8)
        meta = MemoryObjMetadata(shape=torch.Size([4096]), dtype=torch.uint8, address=small.data_ptr(),
                                 phy_size=4096, ref_count=1, fmt=MemoryFormat.KV_2LTD)  # fmt: skip
        assert not store(adapter, keys(1, start=200), [TensorMemoryObj(small, meta, None)]).is_successful()
        assert load(adapter, keys(1), memory_objects(1, seed=None)) == [1]
    finally:
        adapter.close()
