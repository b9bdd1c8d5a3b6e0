"""gc's removal records: which chunks ``dualpath-kv gc`` deleted, for engines to announce (KV events).

Engines publish a vLLM ``BlockStored`` event (medium ``STORAGE``) for every
chunk they store; gc runs in another process, so it leaves a small record per
deleted batch in the namespace's own key space, and each engine's scheduler
reads the records it has not seen yet and announces ``BlockRemoved`` for the
chunks it had announced (:mod:`dualpath_connector.metrics.kv_events`).

**Keys.** ``<prefix>/<namespace>/gc-removed/<written_ns:020d>-<nonce>.json``,
beside the chunks (``<prefix>/<namespace>/<hh>/<hash>``) but never matching a
chunk key, so gc never collects a record as a chunk; gc prunes records older
than its ``--record-max-age`` itself.

**Format (version 1).** UTF-8 JSON, at most :data:`MAX_RECORD_BYTES`::

    {"format": "dualpath-kv.gc-removed", "version": 1, "namespace": "<hex>",
     "written_ns": <int>, "chunk_hashes": ["<64 hex>", ...], "checksum": "<32 hex>"}

``checksum`` is XXH3-128 of the canonical JSON (sorted keys, no spaces) of
the other fields. A record is a stored object like any other: anything that
fails a check (size, JSON, fields, version, namespace, checksum) is rejected
with :class:`RecordError`, and readers count and skip it. Even a well-formed
record is only a hint: an engine announces a removal only after its own
lookup finds the chunk gone (chunks are content-addressed and may be stored
again after gc deleted them).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from nixl_backends.gc import ChunkObjects, StoredObject
from nixl_backends.layout import HASH_HEX_CHARS

RECORD_FORMAT = "dualpath-kv.gc-removed"
RECORD_VERSION = 1
RECORDS_DIR = "gc-removed"
# One record per gc delete batch (nixl_backends.gc.DELETE_BATCH chunks).
MAX_RECORD_CHUNKS = 1000
MAX_RECORD_BYTES = 128 * 1024
_FIELDS = {"format", "version", "namespace", "written_ns", "chunk_hashes", "checksum"}
_HASH = re.compile(rf"[0-9a-f]{{{HASH_HEX_CHARS}}}")
logger = logging.getLogger(__name__)
_NAME = re.compile(r"(?P<written_ns>[0-9]{20})-[0-9a-f]{16}\.json")


class RecordError(ValueError):
    """A stored removal record that must not be trusted (the message says which check failed)."""


def _checksum(body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_128_hexdigest(canonical)


@dataclass(frozen=True)
class RemovalRecord:
    namespace: str
    written_ns: int
    chunk_hashes: tuple[str, ...]

    def encode(self) -> bytes:
        body = {
            "format": RECORD_FORMAT,
            "version": RECORD_VERSION,
            "namespace": self.namespace,
            "written_ns": self.written_ns,
            "chunk_hashes": list(self.chunk_hashes),
        }
        return json.dumps({**body, "checksum": _checksum(body)}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, namespace: str) -> RemovalRecord:
        """The record in ``data``, which must belong to ``namespace``; :class:`RecordError` otherwise."""
        if len(data) > MAX_RECORD_BYTES:
            raise RecordError(f"longer than {MAX_RECORD_BYTES} bytes")
        try:
            message = json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise RecordError(f"not JSON: {exc}") from None
        if not isinstance(message, dict) or set(message) != _FIELDS:
            raise RecordError(f"not an object with exactly the fields {sorted(_FIELDS)}")
        if message["format"] != RECORD_FORMAT:
            raise RecordError(f"format {message['format']!r} is not {RECORD_FORMAT!r}")
        if message["version"] != RECORD_VERSION:
            raise RecordError(f"version {message['version']!r} is not {RECORD_VERSION}")
        if message["namespace"] != namespace:
            raise RecordError(f"namespace {message['namespace']!r} is not {namespace!r}")
        written_ns = message["written_ns"]
        if not isinstance(written_ns, int) or isinstance(written_ns, bool) or written_ns < 0:
            raise RecordError(f"written_ns must be a non-negative integer, got {written_ns!r}")
        hashes = message["chunk_hashes"]
        if not isinstance(hashes, list) or not 0 < len(hashes) <= MAX_RECORD_CHUNKS:
            raise RecordError(f"chunk_hashes must be a list of 1 to {MAX_RECORD_CHUNKS} chunk hashes")
        if not all(isinstance(h, str) and _HASH.fullmatch(h) for h in hashes):
            raise RecordError(f"chunk_hashes must hold {HASH_HEX_CHARS}-character lowercase hex hashes")
        checksum = message.pop("checksum")
        if checksum != _checksum(message):
            raise RecordError("checksum does not match the record")
        return cls(namespace, written_ns, tuple(hashes))


def records_prefix(key_prefix: str, namespace: str) -> str:
    head = f"{key_prefix.strip('/')}/" if key_prefix.strip("/") else ""
    return f"{head}{namespace}/{RECORDS_DIR}/"


def record_written_ns(key: str) -> int | None:
    """When the record named ``key`` was written (from its name); None for a name gc never writes."""
    match = _NAME.fullmatch(key.rsplit("/", 1)[-1])
    return int(match["written_ns"]) if match else None


class RemovalLog:
    """Writes, lists, reads and prunes the removal records of one key prefix in one store."""

    def __init__(self, objects: ChunkObjects, key_prefix: str) -> None:
        self.objects = objects
        self.key_prefix = key_prefix

    def record(self, deleted: Sequence[StoredObject]) -> None:
        """gc's ``on_deleted``: one record per namespace of a deleted batch."""
        by_namespace: dict[str, list[str]] = {}
        for obj in deleted:
            by_namespace.setdefault(obj.namespace, []).append(obj.key.rsplit("/", 1)[-1])
        for namespace, hashes in by_namespace.items():
            for start in range(0, len(hashes), MAX_RECORD_CHUNKS):
                batch = tuple(hashes[start : start + MAX_RECORD_CHUNKS])
                try:
                    self.write(RemovalRecord(namespace, time.time_ns(), batch))
                except Exception as exc:  # the chunks are gone all the same; only the announcement is lost
                    logger.warning("gc: could not write a removal record for %d chunks: %s", len(batch), exc)

    def write(self, record: RemovalRecord) -> str:
        key = f"{records_prefix(self.key_prefix, record.namespace)}{record.written_ns:020d}-{os.urandom(8).hex()}.json"
        self.objects.put(key, record.encode())
        return key

    def keys(self, namespace: str) -> list[str]:
        """The namespace's record keys, oldest first; other names under the records prefix are left out."""
        listed = self.objects.list_keys(records_prefix(self.key_prefix, namespace))
        return sorted(k for k in listed if record_written_ns(k) is not None)

    def read(self, key: str, namespace: str) -> RemovalRecord | None:
        """The record under ``key``; None if it is gone (pruned); :class:`RecordError` if it is bad."""
        data = self.objects.get(key, MAX_RECORD_BYTES)
        return None if data is None else RemovalRecord.decode(data, namespace)

    def prune(self, namespaces: Sequence[str], max_age_s: float, now_ns: int | None = None) -> int:
        """Delete the namespaces' records written more than ``max_age_s`` ago; how many went."""
        cutoff = (time.time_ns() if now_ns is None else now_ns) - int(max_age_s * 1e9)
        old = [k for ns in namespaces for k in self.keys(ns) if record_written_ns(k) < cutoff]
        self.objects.delete_keys(old)
        return len(old)
