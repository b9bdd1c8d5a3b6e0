"""``dualpath-kv gc`` against a real POSIX root and a real S3 server (SeaweedFS on 127.0.0.1).

Chunks are written as the stores name them (``chunk_key``); gc runs as the
command (``main``, and once as a child process), with S3 credentials from the
environment as in production. Lookups after gc go through the stores' own
``lookup``, so "a deleted chunk is a miss" is checked the way engines see it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
import zlib
from pathlib import Path

import numpy as np
import pytest
from botocore.exceptions import ClientError

from nixl_backends.buffers import HostBufferPool
from dualpath_connector.cli import main
from nixl_backends.integrity import ChunkIntegrity, chunk_hash_of
from nixl_backends.layout import BlockLayout, chunk_key
from nixl_backends.gc import open_chunks
from nixl_backends.registry import make_store, parse_store_config
from nixl_backends.removals import RECORDS_DIR, RemovalLog

from tests.conftest import REPO_ROOT

LAYOUT = BlockLayout(num_layers=2, layer_block_bytes=4096)
SIZE = LAYOUT.object_bytes
PREFIX = "kv-gc"
NS_A = "a" * 32
NS_B = "b" * 32


def make_keys(namespace: str, count: int, tag: str = "") -> list[str]:
    return [chunk_key(PREFIX, namespace, uuid.uuid5(uuid.NAMESPACE_OID, f"{tag}{i}").hex * 2) for i in range(count)]


def payload(key: str) -> bytes:
    return np.random.default_rng(zlib.crc32(key.encode())).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


class PosixKV:
    """A POSIX root; generations of chunks get mtimes 100 s apart, the oldest first."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.section = {"backend": "posix", "root": str(root)}

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def write_generations(self, generations: list[list[str]]) -> None:
        now = time.time_ns()
        for age, keys in enumerate(reversed(generations), start=1):
            for key in keys:
                self.put(key, payload(key))
                os.utime(self.root / key, ns=(now - age * 100 * 10**9,) * 2)

    def keys(self) -> set[str]:
        return chunk_keys_only({p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()})

    def lookup_store(self):
        return make_store(parse_store_config(self.section), LAYOUT)


def chunk_keys_only(keys: set[str]) -> set[str]:
    """Without gc's removal records (test_gc_records_exactly_the_deleted_chunks checks those)."""
    return {key for key in keys if f"/{RECORDS_DIR}/" not in key}


class S3KV:
    """A fresh bucket; generations of chunks are written in distinct seconds (LastModified has seconds)."""

    def __init__(self, seaweedfs) -> None:
        self.seaweedfs = seaweedfs
        self.client = seaweedfs.client()
        self.bucket = f"t-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=self.bucket)
        section = seaweedfs.store_config(self.bucket)
        # Credentials come from the environment, as gc takes them.
        self.section = {k: v for k, v in section.items() if k not in ("access_key", "secret_key")}

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def _last_modified(self, key: str):
        return self.client.head_object(Bucket=self.bucket, Key=key)["LastModified"]

    def _next_second(self, after) -> None:
        """Poll until the server stamps a new write later than ``after``."""
        deadline = time.monotonic() + 10
        while self._last_modified(self._probe()) <= after:
            assert time.monotonic() < deadline, "the S3 server's clock did not advance"
            time.sleep(0.05)

    def _probe(self) -> str:
        key = f"{PREFIX}/not-a-chunk"  # gc must leave it alone
        self.put(key, b"probe")
        return key

    def write_generations(self, generations: list[list[str]]) -> None:
        for i, keys in enumerate(generations):
            for key in keys:
                self.put(key, payload(key))
            if i + 1 < len(generations):
                self._next_second(max(self._last_modified(key) for key in keys))

    def keys(self) -> set[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        listed = {item["Key"] for page in pages for item in page.get("Contents", ())}
        return chunk_keys_only(listed) - {f"{PREFIX}/not-a-chunk"}

    def lookup_store(self):
        return self.seaweedfs.lookup_store({**self.section, "create_bucket": False}, LAYOUT)

    def remove(self) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        for key in {item["Key"] for page in pages for item in page.get("Contents", ())}:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        self.client.delete_bucket(Bucket=self.bucket)


@pytest.fixture(params=["posix", "s3"])
def kv(request, tmp_path, monkeypatch):
    if request.param == "posix":
        yield PosixKV(tmp_path / "store")
        return
    seaweedfs = request.getfixturevalue("seaweedfs")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    store = S3KV(seaweedfs)
    # Every SeaweedFS bucket takes volumes and the dev server has few: empty and drop it.
    request.addfinalizer(store.remove)
    yield store


def gc(capsys, section: dict, *args: str) -> tuple[int, str]:
    code = main(["gc", "--store", json.dumps(section), "--key-prefix", PREFIX, *args])
    return code, capsys.readouterr().out


def said(out: str, text: str) -> bool:
    """``text`` is in the summary, whatever the column alignment."""
    return text in " ".join(out.split())


def test_budget_keeps_the_most_recently_used(kv, capsys):
    old, new = make_keys(NS_A, 5, "old"), make_keys(NS_A, 3, "new")
    kv.write_generations([old, new])
    assert kv.lookup_store().lookup(old + new) == 8  # positive control

    code, out = gc(capsys, kv.section, "--namespace", NS_A, "--max-bytes", str(4 * SIZE))
    assert code == 0, out
    assert kv.keys() == set(new) | (kv.keys() & set(old))
    assert len(kv.keys() & set(old)) == 1 and len(kv.keys()) == 4  # the budget, exactly, from the old end
    assert said(out, f"before: 8 objects, {8 * SIZE} bytes")
    assert said(out, f"deleted: 4 objects, {4 * SIZE} bytes")
    assert said(out, f"after: 4 objects, {4 * SIZE} bytes")
    assert kv.lookup_store().lookup(new) == 3

    code, out = gc(capsys, kv.section, "--namespace", NS_A, "--max-bytes", "1MiB")  # already fits
    assert code == 0 and said(out, "deleted: 0 objects") and len(kv.keys()) == 4


def _recorded(kv, namespace: str) -> tuple[list[str], set[str]]:
    """gc's removal records of ``namespace``: their keys and the chunk keys they name."""
    log = RemovalLog(open_chunks(parse_store_config(kv.section), PREFIX, [namespace]), PREFIX)
    keys = log.keys(namespace)
    return keys, {chunk_key(PREFIX, namespace, h) for key in keys for h in log.read(key, namespace).chunk_hashes}


def test_gc_records_exactly_the_deleted_chunks(kv, capsys):
    """Engines announce gc's deletions (vLLM KV events) from these records: they must name what went, only that."""
    old, new = make_keys(NS_A, 3, "old"), make_keys(NS_A, 2, "new")
    kv.write_generations([old, new])
    code, out = gc(capsys, kv.section, "--namespace", NS_A, "--max-bytes", str(2 * SIZE), "--dry-run")
    assert code == 0, out
    assert _recorded(kv, NS_A) == ([], set())  # a dry run deletes nothing, so it records nothing
    code, out = gc(capsys, kv.section, "--namespace", NS_A, "--max-bytes", str(2 * SIZE))
    assert code == 0, out
    assert kv.keys() == set(new)
    records, named = _recorded(kv, NS_A)
    assert len(records) == 1 and named == set(old)
    assert _recorded(kv, NS_B) == ([], set())
    # Nothing left to delete: no new record; --record-max-age 0 prunes the old one.
    code, out = gc(capsys, kv.section, "--namespace", NS_A, "--max-bytes", str(2 * SIZE), "--record-max-age", "0")
    assert code == 0, out
    assert _recorded(kv, NS_A) == ([], set()) and kv.keys() == set(new)


def test_other_namespaces_are_untouched_unless_asked(kv, capsys):
    a_old, b_mid, a_new = make_keys(NS_A, 3, "a-old"), make_keys(NS_B, 3, "b"), make_keys(NS_A, 2, "a-new")
    kv.write_generations([a_old, b_mid, a_new])

    code, out = gc(capsys, kv.section, "--namespace", NS_A, "--max-bytes", "0")
    assert code == 0, out
    assert kv.keys() == set(b_mid)

    kv.write_generations([a_new])  # a_new is now the most recent
    code, out = gc(capsys, kv.section, "--all-namespaces", "--max-bytes", str(3 * SIZE))
    assert code == 0, out
    assert f"namespace {NS_A}" in out and f"namespace {NS_B}" in out
    assert kv.keys() == set(a_new) | (set(b_mid) & kv.keys()) and len(kv.keys()) == 3  # B, older, paid


def test_max_age_deletes_what_was_not_used_since(tmp_path, capsys):
    kv = PosixKV(tmp_path / "store")
    old, mid, new = make_keys(NS_A, 2, "old"), make_keys(NS_A, 2, "mid"), make_keys(NS_A, 2, "new")
    kv.write_generations([old, mid, new])  # 300 s, 200 s and 100 s ago
    code, out = gc(capsys, kv.section, "--namespace", NS_A, "--max-age", "150s")
    assert code == 0, out
    assert kv.keys() == set(new)


def test_s3_max_age_counts_from_last_modified(seaweedfs, monkeypatch, capsys, request):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    kv = S3KV(seaweedfs)
    request.addfinalizer(kv.remove)
    kv.write_generations([make_keys(NS_A, 3)])
    code, out = gc(capsys, kv.section, "--namespace", NS_A, "--max-age", "1h")
    assert code == 0 and len(kv.keys()) == 3  # written just now
    code, out = gc(capsys, kv.section, "--namespace", NS_A, "--max-age", "0s")
    assert code == 0 and kv.keys() == set()


def test_dry_run_deletes_nothing(kv, capsys):
    old, new = make_keys(NS_A, 3, "old"), make_keys(NS_A, 2, "new")
    kv.write_generations([old, new])
    code, out = gc(capsys, kv.section, "--namespace", NS_A, "--max-bytes", str(2 * SIZE), "--dry-run")
    assert code == 0, out
    assert kv.keys() == set(old + new)
    assert {line.split()[2] for line in out.splitlines() if line.startswith("would delete ")} == set(old)
    assert said(out, f"would delete: 3 objects, {3 * SIZE} bytes")
    assert said(out, f"after: 2 objects, {2 * SIZE} bytes")


def test_a_deleted_chunk_is_a_miss_for_later_lookups_and_reads(kv, capsys):
    keys = make_keys(NS_A, 2)
    kv.write_generations([keys])
    store = kv.lookup_store()
    assert store.lookup(keys) == 2
    code, _ = gc(capsys, kv.section, "--namespace", NS_A, "--max-bytes", "0")
    assert code == 0
    assert store.lookup(keys) == 0
    if isinstance(kv, S3KV):
        with pytest.raises(ClientError) as missing:
            kv.client.get_object(Bucket=kv.bucket, Key=keys[0])
        assert missing.value.response["Error"]["Code"] == "NoSuchKey"


def test_a_reader_holding_a_chunk_open_keeps_its_bytes(tmp_path, capsys):
    kv = PosixKV(tmp_path / "store")
    keys = make_keys(NS_A, 3)
    kv.write_generations([keys])
    store = kv.lookup_store()
    assert store.lookup(keys[:1]) == 1
    with open(kv.root / keys[0], "rb") as reader:
        head = reader.read(100)  # a read in progress
        code, _ = gc(capsys, kv.section, "--namespace", NS_A, "--max-bytes", "0")
        assert code == 0 and kv.keys() == set()
        assert head + reader.read() == payload(keys[0])  # every byte, as written
    assert store.lookup(keys[:1]) == 0  # a later lookup is a miss
    with pytest.raises(FileNotFoundError):
        open(kv.root / keys[0], "rb")


def test_a_chunk_read_through_the_store_counts_as_recently_used(tmp_path, capsys, nixl_agent):
    kv = PosixKV(tmp_path / "store")
    old, new = make_keys(NS_A, 3, "old"), make_keys(NS_A, 3, "new")
    kv.write_generations([old, new])
    store = make_store(parse_store_config(kv.section), LAYOUT, nixl_agent)
    pool = HostBufferPool(nixl_agent, SIZE, 1)
    try:
        assert store.read(old[:1], [pool.slot_addr(0)]) == [True]
        assert pool.slot_view(0).tobytes() == payload(old[0])
    finally:
        pool.close()
        store.close()
    code, out = gc(capsys, kv.section, "--namespace", NS_A, "--max-bytes", str(3 * SIZE))
    assert code == 0, out
    # The read one outlives its unread peers and even one of the newer, unread chunks.
    assert old[0] in kv.keys() and len(kv.keys() & set(new)) == 2 and len(kv.keys()) == 3


def test_interrupted_writes_are_removed_once_stale_and_strangers_never(tmp_path, capsys):
    kv = PosixKV(tmp_path / "store")
    keys = make_keys(NS_A, 2)
    kv.write_generations([keys])
    stale, fresh = f"{keys[0]}.{uuid.uuid4().hex}.tmp", f"{keys[1]}.{uuid.uuid4().hex}.tmp"
    strangers = [f"{PREFIX}/README", f"{PREFIX}/{NS_A}/notes.tmp", f"{keys[0]}.bak", f"{PREFIX}/{NS_A}/zz/x"]
    for name in (stale, fresh, *strangers):
        kv.put(name, b"partial")
    two_hours_ago = time.time_ns() - 7200 * 10**9
    os.utime(kv.root / stale, ns=(two_hours_ago, two_hours_ago))

    code, out = gc(capsys, kv.section, "--all-namespaces", "--max-bytes", "0")
    assert code == 0, out
    assert kv.keys() == {fresh, *strangers}
    assert "removed 1 interrupted writes (*.tmp)" in out
    assert said(out, "before: 2 objects")  # temporary files are not chunks


def test_an_s3agg_store_is_collected_through_its_bucket(seaweedfs, monkeypatch, capsys, request):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    kv = S3KV(seaweedfs)
    request.addfinalizer(kv.remove)
    old, new = make_keys(NS_A, 2, "old"), make_keys(NS_A, 2, "new")
    kv.write_generations([old, new])
    # No gateway listens there: gc never needs it.
    section = {"backend": "s3agg", "gateway": "http://127.0.0.1:9", "s3": kv.section}
    code, out = gc(capsys, section, "--namespace", NS_A, "--max-bytes", str(2 * SIZE))
    assert code == 0, out
    assert kv.keys() == set(new)


def test_the_command_runs_as_a_process_with_credentials_from_the_environment(seaweedfs, tmp_path, request):
    kv = S3KV(seaweedfs)
    request.addfinalizer(kv.remove)
    keys = make_keys(NS_A, 3)
    kv.write_generations([keys])
    store_file = tmp_path / "store.json"
    store_file.write_text(json.dumps(kv.section))
    argv = [sys.executable, "-m", "dualpath_connector.cli", "gc", "--store-file", str(store_file),
            "--key-prefix", PREFIX, "--all-namespaces", "--max-bytes", str(SIZE)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="wrong", AWS_SECRET_ACCESS_KEY="wrong-secret-value", AWS_EC2_METADATA_DISABLED="true")
    refused = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "wrong-secret-value" not in refused.stderr + refused.stdout
    assert len(kv.keys()) == 3  # negative control: without the right credentials nothing goes

    env.update(AWS_ACCESS_KEY_ID=seaweedfs.access_key, AWS_SECRET_ACCESS_KEY=seaweedfs.secret_key)
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert said(done.stdout, f"deleted: 2 objects, {2 * SIZE} bytes")
    assert len(kv.keys()) == 1


def test_gc_running_during_reads_never_yields_wrong_bytes(kv, nixl_agent):
    """Readers get a chunk whole, verified and equal to what was written, or a miss; never a mix.

    gc deletes what was not used (budget 0) in a loop while the chunks are
    written again now and then and read back through the store, alternating
    halves, as engines re-save and load them. Each round waits for one more
    collection, so rounds and collections interleave.
    """
    keys = make_keys(NS_A, 8, "busy")
    integrity = ChunkIntegrity(LAYOUT)
    store = make_store(parse_store_config(kv.section), LAYOUT, nixl_agent)
    sources = HostBufferPool(nixl_agent, SIZE, len(keys))
    targets = HostBufferPool(nixl_agent, SIZE, len(keys))
    for slot, key in enumerate(keys):
        sources.slot_view(slot)[:] = np.frombuffer(payload(key), dtype=np.uint8)
        integrity.seal(chunk_hash_of(key), sources.slot_view(slot))
    written = {key: sources.slot_view(slot).tobytes() for slot, key in enumerate(keys)}
    stop = threading.Event()
    done = threading.Condition()
    collections: list[int] = []

    def collect() -> None:
        while not stop.is_set():
            code = main(["gc", "--store", json.dumps(kv.section), "--key-prefix", PREFIX, "--namespace", NS_A,
                         "--max-bytes", "0"])  # fmt: skip
            with done:
                collections.append(code)
                done.notify_all()

    collector = threading.Thread(target=collect, name="gc-loop")
    outcomes = {"read": 0, "miss": 0}
    collector.start()
    try:
        for round_ in range(12):
            if round_ % 3 == 0:
                assert store.write(keys, [sources.slot_addr(s) for s in range(len(keys))]) == [True] * len(keys)
            half = list(range(round_ % 2, len(keys), 2))
            for slot in half:
                targets.slot_view(slot)[:] = 0xA5
            ok = store.read([keys[s] for s in half], [targets.slot_addr(s) for s in half])
            for slot, read in zip(half, ok):
                if read:
                    got = targets.slot_view(slot)
                    assert integrity.verify(chunk_hash_of(keys[slot]), got) and got.tobytes() == written[keys[slot]]
                outcomes["read" if read else "miss"] += 1
            with done:
                seen = len(collections)
                assert done.wait_for(lambda: len(collections) > seen, timeout=60), "gc made no progress"
    finally:
        stop.set()
        collector.join()
        sources.close()
        targets.close()
        store.close()
    assert set(collections) == {0}
    # Both outcomes happened, so the reads really raced the deletions.
    assert outcomes["read"] > 0 and outcomes["miss"] > 0, outcomes
