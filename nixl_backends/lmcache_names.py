"""How the LMCache L2 adapter names objects, and how a listing gives LMCache's keys back.

An ``ObjectKey``'s fields that make two objects' bytes incompatible (model,
KV rank, object group, cache salt), with the object's size, the integrity tag
and the chunk hash's length, form a :class:`Family`. A family's namespace is
the digest of its canonical record, and the record itself is stored once at
``<key_prefix>/families/<namespace>``: the record names the namespace and the
namespace checks the record, so a record that was edited is refused, never
believed.

Inside a namespace an object is named by its chunk hash itself, zero-padded
to a chunk key's 64 hex digits (hashes of up to 32 bytes: LMCache's blake3
and integer hashes), so a listing of the namespace gives every key back; a
longer hash is named by its digest and cannot be listed. The trailer is
sealed with ``sha256(namespace / chunk hash)``, not with the name: an object
copied into another family fails its check.

No LMCache import here (the adapter converts to and from ``ObjectKey``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from nixl_backends.gc import ChunkObjects, KeyPattern
from nixl_backends.layout import HASH_HEX_CHARS, chunk_key

__all__ = ["FORMAT", "Family", "FamilyRecords", "KeyListing", "ListedKey", "family_key", "listed_key", "object_name"]

logger = logging.getLogger(__name__)

# Part of every namespace: a change of the stored format starts a new (cold) key space.
FORMAT = "dualpath-kv lmcache-l2 v2"
_FAMILIES = "families"
# Family records written at once, and the S3 connections the adapter's small-object client keeps for them.
RECORD_WINDOW = 16
# Longest chunk hash that names its object (and so can be listed).
NAMED_HASH_BYTES = HASH_HEX_CHARS // 2
# A family record is a few hundred bytes; anything longer is not one.
_RECORD_MAX_BYTES = 4096
_NAMESPACE_HEX = 32


@dataclass(frozen=True)
class Family:
    """The fields that decide which objects may share a namespace."""

    model_name: str
    kv_rank: int
    object_group_id: int
    cache_salt: str
    object_bytes: int
    tag: str
    hash_bytes: int

    def record(self) -> bytes:
        return json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True, separators=(",", ":")).encode()

    @property
    def namespace(self) -> str:
        return _namespace_of(self)

    @property
    def listable(self) -> bool:
        return self.hash_bytes <= NAMED_HASH_BYTES

    @classmethod
    def from_record(cls, data: bytes, namespace: str) -> Family:
        """The family stored as ``namespace``'s record; ValueError for anything but a record of that namespace."""
        try:
            fields = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(fields, dict) or fields.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT!r} family record")
        types = {"model_name": str, "kv_rank": int, "object_group_id": int, "cache_salt": str, "object_bytes": int,
                 "tag": str, "hash_bytes": int}  # fmt: skip
        if fields.keys() != types.keys() or any(type(fields[name]) is not kind for name, kind in types.items()):
            raise ValueError(f"fields must be exactly {sorted(types)} with their types")
        family = cls(**fields)
        if family.namespace != namespace:
            raise ValueError(f"the record is of namespace {family.namespace}, stored as {namespace}")
        return family


@functools.lru_cache(maxsize=4096)
def _namespace_of(family: Family) -> str:
    return hashlib.sha256(family.record()).hexdigest()[:_NAMESPACE_HEX]


def object_name(prefix: str, family: Family, chunk_hash: bytes) -> tuple[str, str]:
    """(store key, sealing hash) of the object of ``family`` whose LMCache chunk hash is ``chunk_hash``."""
    namespace = family.namespace
    seal = hashlib.sha256(namespace.encode() + b"/" + chunk_hash).hexdigest()
    name = chunk_hash.hex().ljust(HASH_HEX_CHARS, "0") if family.listable else seal
    return chunk_key(prefix, namespace, name), seal


def family_key(prefix: str, namespace: str) -> str:
    return f"{prefix}/{_FAMILIES}/{namespace}"


class FamilyRecords:
    """Writes each family's record once (per process) before its first object.

    A store round's new families are written concurrently (``window`` at once): keys of many families (a rank,
    group or salt each) would otherwise cost a store round trip each before any object is written.
    """

    def __init__(self, objects: ChunkObjects, prefix: str, window: int = RECORD_WINDOW) -> None:
        self._objects = objects
        self._prefix = prefix
        self._written: set[str] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(window, thread_name_prefix="l2-records")

    def ensure(self, families: Iterable[Family]) -> None:
        """Store the records of ``families`` this process did not; failures are logged (a later store tries
        again). Returns once every record was written or failed."""
        with self._lock:
            new = {f.namespace: f for f in families if f.namespace not in self._written}
        for namespace, written in zip(new, self._pool.map(self._put, new.values())):
            if written:
                with self._lock:
                    self._written.add(namespace)

    def _put(self, family: Family) -> bool:
        try:
            self._objects.put(family_key(self._prefix, family.namespace), family.record())
        except Exception as exc:
            logger.warning("dualpath L2 adapter: storing the record of namespace %s failed (its objects cannot be "
                           "listed until a later store writes it): %s", family.namespace, exc)  # fmt: skip
            return False
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class ListedKey:
    family: Family
    chunk_hash: bytes
    store_key: str

    @property
    def seal(self) -> str:
        """The hash its trailer is sealed with."""
        return object_name(store_prefix(self.store_key), self.family, self.chunk_hash)[1]


def store_prefix(store_key: str) -> str:
    """``<prefix>`` of ``<prefix>/<namespace>/<hh>/<name>``."""
    return store_key.rsplit("/", 3)[0]


def listed_key(family: Family, store_key: str) -> ListedKey | None:
    """The key ``store_key`` names in ``family``; None where it is not a name the adapter writes."""
    chunk_hash = bytes.fromhex(store_key.rsplit("/", 1)[-1])[: family.hash_bytes]
    if not family.listable or object_name(store_prefix(store_key), family, chunk_hash)[0] != store_key:
        return None  # a digest name, or padding that is not zeros
    return ListedKey(family, chunk_hash, store_key)


class KeyListing:
    """LMCache's keys back from the store: family records, then each family's objects in key order."""

    def __init__(self, objects: ChunkObjects, prefix: str, tag: str) -> None:
        self._objects = objects
        self._prefix = prefix
        self._tag = tag
        self._known: dict[str, Family] = {}  # namespace -> family (records never change)
        self._refused: set[str] = set()  # namespaces whose record was refused (logged once)
        self._lock = threading.Lock()  # a listing and the start-up scan may read records at once

    def families(self, model_name: str | None = None) -> dict[str, Family]:
        """The listable families of this integrity tag (and model), by namespace."""
        head = f"{self._prefix}/{_FAMILIES}/"
        with self._lock:
            self._read_records(head)
            known = dict(self._known)
        return {ns: family for ns, family in known.items()
                if family.tag == self._tag and family.listable
                and (model_name is None or family.model_name == model_name)}  # fmt: skip

    def _read_records(self, head: str) -> None:
        for key in self._objects.list_keys(head):
            namespace = key[len(head):]
            if namespace in self._known or namespace in self._refused:
                continue
            try:
                if len(namespace) != _NAMESPACE_HEX or namespace.strip("0123456789abcdef"):
                    raise ValueError("not a namespace")
                data = self._objects.get(key, _RECORD_MAX_BYTES)
                if data is None:
                    continue  # deleted since the listing
                if len(data) > _RECORD_MAX_BYTES:
                    raise ValueError(f"longer than {_RECORD_MAX_BYTES} bytes")
                self._known[namespace] = Family.from_record(data, namespace)
            except ValueError as exc:
                self._refused.add(namespace)
                logger.warning("dualpath L2 adapter: ignoring the family record %s: %s", key, exc)

    def check_cursor(self, cursor: str) -> None:
        """ValueError unless ``cursor`` is a key this listing could have returned."""
        if not isinstance(cursor, str) or KeyPattern(self._prefix, None).parse(cursor) is None:
            raise ValueError(f"malformed cursor {cursor!r}")

    def keys(self, families: dict[str, Family], start_after: str | None = None) -> Iterator[ListedKey]:
        """Every object of ``families`` in key order, after ``start_after`` (a key, or None)."""
        if not families:
            return
        for obj in self._objects.selecting(sorted(families)).scan(start_after):
            listed = listed_key(families[obj.namespace], obj.key)
            if listed is not None:
                yield listed
