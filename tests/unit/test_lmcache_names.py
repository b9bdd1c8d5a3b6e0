"""How the LMCache adapter names objects (nixl_backends.lmcache_names) and how a listing names them back:
family records that check themselves, names that give the chunk hash back, a sorted scan that resumes after
a cursor. No LMCache here: these are plain fields, on a POSIX root.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading

import pytest

from nixl_backends.gc import KeyPattern, PosixChunks
from nixl_backends.lmcache_names import FORMAT, Family, FamilyRecords, KeyListing, family_key, object_name

PREFIX = "lmcache"
FAMILY = Family("org/tiny-llama", 0, 0, "", 4096, "keyed:abc", 8)


def _family(**fields) -> Family:
    return dataclasses.replace(FAMILY, **fields)


def test_a_short_hash_names_its_object_and_the_seal_binds_the_family():
    name, seal = object_name(PREFIX, FAMILY, bytes.fromhex("0102030405060708"))
    assert name == f"{PREFIX}/{FAMILY.namespace}/01/0102030405060708" + "0" * 48
    # The trailer's hash is not the name: the same chunk hash in another family seals differently.
    other_name, other_seal = object_name(PREFIX, _family(cache_salt="tenant-b"), bytes.fromhex("0102030405060708"))
    assert seal != other_seal and other_name != name and other_name.endswith(name.rsplit("/", 1)[-1])


def test_a_hash_longer_than_a_name_is_named_by_its_digest_and_not_listed():
    family = _family(hash_bytes=33)
    name, seal = object_name(PREFIX, family, bytes(range(33)))
    assert name.endswith(seal) and not family.listable


@pytest.mark.parametrize("field, value", [("model_name", "org/other"), ("kv_rank", 1), ("object_group_id", 1),
                                          ("cache_salt", "s"), ("object_bytes", 8192), ("tag", "checksum"),
                                          ("hash_bytes", 32)])  # fmt: skip
def test_every_field_makes_its_own_namespace(field, value):
    assert _family(**{field: value}).namespace != FAMILY.namespace


def test_a_record_reads_back_and_an_edited_one_is_refused():
    assert Family.from_record(FAMILY.record(), FAMILY.namespace) == FAMILY
    edited = json.loads(FAMILY.record())
    edited["model_name"] = "org/other"  # a record moved to another family's name
    for data, why in [
        (json.dumps(edited).encode(), "the record is of namespace"),
        (b"\xff\xfe", "not JSON"),
        (json.dumps({**edited, "format": "v0"}).encode(), "family record"),
        (json.dumps({**json.loads(FAMILY.record()), "kv_rank": "0"}).encode(), "with their types"),
        (json.dumps({**json.loads(FAMILY.record()), "extra": 1}).encode(), "fields must be exactly"),
    ]:
        with pytest.raises(ValueError, match=why):
            Family.from_record(data, FAMILY.namespace)
    assert json.loads(FAMILY.record())["format"] == FORMAT


def _put_object(root, name: str) -> None:
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as file:
        file.write(b"x")


def test_a_listing_gives_every_key_back_in_order_and_resumes_after_a_cursor(tmp_path):
    objects = PosixChunks(str(tmp_path), KeyPattern(PREFIX, None))
    records = FamilyRecords(objects, PREFIX)
    a, b = FAMILY, _family(model_name="org/b", hash_bytes=32)
    other_tag, unlisted = _family(tag="checksum"), _family(hash_bytes=40)
    hashes = {a: [i.to_bytes(8, "big") for i in (300, 5, 70000)], b: [bytes([i]) * 32 for i in (9, 1)],
              other_tag: [b"\x00" * 8], unlisted: [bytes(40)]}  # fmt: skip
    records.ensure(hashes)
    records.close()
    for family, chunk_hashes in hashes.items():
        for chunk_hash in chunk_hashes:
            _put_object(tmp_path, object_name(PREFIX, family, chunk_hash)[0])
    # Not listed: an object whose padding is not zeros (not a name the adapter writes), a record that lies.
    _put_object(tmp_path, f"{PREFIX}/{a.namespace}/ff/ff" + "1" * 62)
    with open(os.path.join(tmp_path, family_key(PREFIX, "0" * 32)), "wb") as file:
        file.write(a.record())

    listing = KeyListing(objects, PREFIX, FAMILY.tag)
    families = listing.families()
    assert families == {a.namespace: a, b.namespace: b}  # this tag's listable families only
    listed = list(listing.keys(families))
    assert sorted((k.family.namespace, k.chunk_hash) for k in listed) == sorted(
        (family.namespace, h) for family in (a, b) for h in hashes[family])  # fmt: skip
    assert [k.store_key for k in listed] == sorted(k.store_key for k in listed)
    # Resuming after each key gives exactly the rest.
    for i, key in enumerate(listed):
        assert [k.store_key for k in listing.keys(families, key.store_key)] == [k.store_key for k in listed[i + 1:]]
    assert listing.families("org/b") == {b.namespace: b}
    with pytest.raises(ValueError, match="malformed cursor"):
        listing.check_cursor("lmcache/../../etc/passwd")


class _GatedObjects:
    """ChunkObjects' put only: each put waits until ``together`` puts are in flight at once (or fails)."""

    def __init__(self, together: int, timeout_s: float = 10.0) -> None:
        self.barrier = threading.Barrier(together, timeout=timeout_s)
        self.failing: set[str] = set()
        self.puts: list[str] = []
        self.lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        with self.lock:
            self.puts.append(key)
        if self.barrier.parties > 1:
            self.barrier.wait()  # a sequential writer never gets past the first put: BrokenBarrierError
        if key in self.failing:
            raise OSError("refused")


def test_a_rounds_new_families_are_recorded_at_once_and_each_once():
    families = [_family(model_name=f"org/m{i}") for i in range(8)]
    objects = _GatedObjects(together=len(families))
    records = FamilyRecords(objects, PREFIX, window=len(families))
    try:
        records.ensure(families)
        assert sorted(objects.puts) == sorted(family_key(PREFIX, f.namespace) for f in families)
        objects.barrier = threading.Barrier(1)
        records.ensure(families)  # recorded already: nothing is written again
        assert len(objects.puts) == len(families)
    finally:
        records.close()


def test_control_one_at_a_time_the_gate_breaks_and_a_failed_record_is_written_again():
    families = [_family(model_name=f"org/m{i}") for i in range(2)]
    objects = _GatedObjects(together=2, timeout_s=0.5)
    records = FamilyRecords(objects, PREFIX, window=1)  # one at a time: the gate cannot fill
    try:
        records.ensure(families)  # the first put times out at the gate, the second finds it broken: both fail
        assert len(objects.puts) == 2
        objects.barrier = threading.Barrier(1)
        objects.failing = {family_key(PREFIX, families[0].namespace)}
        before = len(objects.puts)
        records.ensure(families)
        assert len(objects.puts) - before == 2  # both again: neither was written before
        records.ensure(families)
        assert objects.puts[-1] == family_key(PREFIX, families[0].namespace)  # only the one that failed again
    finally:
        records.close()
