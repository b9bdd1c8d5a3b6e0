"""Plain S3 requests on a POSIX-backed bucket: the gateway serves the store root as an S3 endpoint.

Enough of the S3 API for boto3 and NIXL's OBJ plugin (the AWS C++ SDK) to
use the gateway as their endpoint, path-style: ``GET`` (with ``Range``) and
``HEAD`` of an object, ``PUT`` (written as ``PosixStore`` writes: a temporary
file, fsync, rename into place, so a reader never sees half a chunk),
``DELETE``, ``HEAD`` of the bucket and ``ListObjectsV2`` (``prefix``,
``max-keys``, ``continuation-token``/``start-after``). Requests are
SigV4-verified by the caller before they get here. A key that would leave
the root is a 400 (:func:`~s3agg_gateway_ext.backing_posix.safe_path`).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import os
import uuid
from collections.abc import Iterator
from urllib.parse import parse_qs
from xml.sax.saxutils import escape

from awscrt import checksums
from starlette.concurrency import run_in_threadpool
from starlette.responses import FileResponse, Response

from s3agg_gateway_ext.backing_posix import PosixBacking
from s3agg_gateway_ext.descriptor import DescriptorError
from s3agg_gateway_ext.sigv4 import STREAMING_UNSIGNED_TRAILER

MAX_LIST_KEYS = 1000
_TEMP_SUFFIX = ".tmp"  # PosixStore's in-progress writes (and ours): never listed or served
_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"


def _not_found(key: str) -> DescriptorError:
    return DescriptorError(404, "NoSuchKey", f"object {key[:200]} does not exist")


class PosixBucketAPI:
    def __init__(self, backing: PosixBacking) -> None:
        self.backing = backing

    async def handle(self, method: str, key: str, query: str, headers, body: bytes) -> Response:
        if not key:
            if method == "HEAD":
                return Response(status_code=200)
            if method == "GET":
                return await run_in_threadpool(self._list, parse_qs(query, keep_blank_values=True))
        elif method in ("GET", "HEAD"):
            return self._get(key)
        elif method == "PUT":
            return await run_in_threadpool(self._put, key, body, headers)
        elif method == "DELETE":
            return await run_in_threadpool(self._delete, key)
        raise DescriptorError(501, "NotImplemented", f"{method} {'/' + key if key else 'on the bucket'} is not "
                                                     "supported by this gateway")

    def _get(self, key: str) -> Response:
        path = self.backing.path(key)
        if key.endswith(_TEMP_SUFFIX) or not os.path.isfile(path):
            raise _not_found(key)
        # FileResponse answers HEAD without a body, and a Range with a 206, itself.
        stat = os.stat(path)
        return FileResponse(path, media_type="application/octet-stream", stat_result=stat,
                            headers={"etag": _etag(stat)})

    def _put(self, key: str, body: bytes, headers) -> Response:
        path = self.backing.path(key)
        if key.endswith(_TEMP_SUFFIX):
            raise DescriptorError(400, "InvalidObjectName", f"object keys must not end in {_TEMP_SUFFIX}")
        if headers.get("x-amz-content-sha256") == STREAMING_UNSIGNED_TRAILER:
            body = decode_aws_chunked(body, headers)
        elif "aws-chunked" in headers.get("content-encoding", ""):
            raise DescriptorError(501, "NotImplemented", "signed aws-chunked uploads are not supported; send "
                                                         "UNSIGNED-PAYLOAD, the body's SHA-256, or unsigned chunks")
        expected_md5 = headers.get("content-md5")
        if expected_md5 is not None and base64.b64encode(hashlib.md5(body).digest()).decode() != expected_md5:
            raise DescriptorError(400, "BadDigest", "Content-MD5 does not match the body")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = f"{path}.{uuid.uuid4().hex}{_TEMP_SUFFIX}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(body)
                while view:  # os.write may write less than asked
                    view = view[os.write(fd, view):]
                os.fsync(fd)  # durable before it is visible under its final name
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        return Response(status_code=200, headers={"etag": _etag(os.stat(path))})

    def _delete(self, key: str) -> Response:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.backing.path(key))
        return Response(status_code=204)

    def _list(self, query: dict[str, list[str]]) -> Response:
        if query.get("list-type", [""])[0] != "2":
            raise DescriptorError(501, "NotImplemented", "only ListObjectsV2 (list-type=2) is supported")
        prefix = query.get("prefix", [""])[0]
        try:
            max_keys = min(MAX_LIST_KEYS, int(query.get("max-keys", [str(MAX_LIST_KEYS)])[0]))
        except ValueError:
            raise DescriptorError(400, "InvalidArgument", "max-keys must be an integer") from None
        if max_keys < 0:
            raise DescriptorError(400, "InvalidArgument", "max-keys must not be negative")
        token = query.get("continuation-token", [""])[0]
        try:
            after = base64.urlsafe_b64decode(token.encode()).decode() if token else query.get("start-after", [""])[0]
        except (ValueError, UnicodeDecodeError):
            raise DescriptorError(400, "InvalidArgument", "continuation-token is not one this gateway gave") from None
        entries: list[tuple[str, os.stat_result]] = []
        truncated = False
        for key, stat in self._keys(prefix):
            if key <= after:
                continue
            if len(entries) == max_keys:
                truncated = True
                break
            entries.append((key, stat))
        contents = "".join(
            f"<Contents><Key>{escape(key)}</Key><LastModified>{_iso(stat.st_mtime)}</LastModified>"
            f"<ETag>{escape(_etag(stat))}</ETag><Size>{stat.st_size}</Size><StorageClass>STANDARD</StorageClass>"
            f"</Contents>"
            for key, stat in entries
        )
        next_token = ""
        if truncated and entries:
            next_token = ("<NextContinuationToken>" + base64.urlsafe_b64encode(entries[-1][0].encode()).decode()
                          + "</NextContinuationToken>")
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="{_XMLNS}">'
            f"<Name>{escape(self.backing.bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
            f"<KeyCount>{len(entries)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>"
            f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>{next_token}"
            + (f"<ContinuationToken>{escape(token)}</ContinuationToken>" if token else "")
            + f"{contents}</ListBucketResult>"
        )
        return Response(body, media_type="application/xml")

    def _keys(self, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
        """Every complete object under the root whose key starts with ``prefix``, in key order."""
        root = os.path.realpath(self.backing.root)
        if prefix.startswith("/") or "\0" in prefix or ".." in prefix.split("/"):
            return  # no key starts so (safe_path refuses them): and "/..." would walk from the file system's root
        # Only the directory the prefix names can hold matches: walk from there, not the whole root.
        start = os.path.realpath(os.path.join(root, os.path.dirname(prefix)))
        if os.path.commonpath([root, start]) != root or not os.path.isdir(start):
            return  # a symlink out of the bucket
        found = []
        for directory, _, files in os.walk(start):
            relative = os.path.relpath(directory, root)
            for name in files:
                key = name if relative == "." else f"{relative}/{name}".replace(os.sep, "/")
                if key.startswith(prefix) and not name.endswith(_TEMP_SUFFIX):
                    found.append(key)
        for key in sorted(found):
            with contextlib.suppress(FileNotFoundError):  # deleted while listing
                yield key, os.stat(os.path.join(root, key))


def _etag(stat: os.stat_result) -> str:
    # Objects are immutable once renamed into place: inode, size and mtime name a version.
    return '"' + hashlib.md5(f"{stat.st_ino}-{stat.st_size}-{stat.st_mtime_ns}".encode()).hexdigest() + '"'


def _iso(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


# Trailer checksums a PUT may carry, and how to compute them (native code: awscrt, hashlib).
_CHECKSUMS = {
    "x-amz-checksum-crc32": lambda data: checksums.crc32(data).to_bytes(4, "big"),
    "x-amz-checksum-crc32c": lambda data: checksums.crc32c(data).to_bytes(4, "big"),
    "x-amz-checksum-crc64nvme": lambda data: checksums.crc64nvme(data).to_bytes(8, "big"),
    "x-amz-checksum-sha1": lambda data: hashlib.sha1(data).digest(),
    "x-amz-checksum-sha256": lambda data: hashlib.sha256(data).digest(),
}


def decode_aws_chunked(body: bytes, headers) -> bytes:
    """The payload of an unsigned aws-chunked body (``<hex size>\\r\\n<data>\\r\\n`` ... ``0\\r\\n``, then
    trailer lines), checked against ``x-amz-decoded-content-length`` and its checksum trailer."""

    def bad(why: str) -> DescriptorError:
        return DescriptorError(400, "IncompleteBody", f"aws-chunked body: {why}")

    parts, at = [], 0
    while True:
        end = body.find(b"\r\n", at)
        if end < 0:
            raise bad("a chunk header is not terminated")
        # Hex digits only: int(..., 16) also takes a sign, "0x", spaces and "_", and a negative size would walk
        # the parser backwards for ever.
        digits = body[at:end].split(b";")[0]
        if not 0 < len(digits) <= 16 or digits.strip(b"0123456789abcdefABCDEF"):
            raise bad("a chunk size is not hexadecimal")
        size = int(digits, 16)
        at = end + 2
        if size == 0:
            break
        if size > len(body) - at or body[at + size : at + size + 2] != b"\r\n":
            raise bad("a chunk is shorter than its size")
        parts.append(memoryview(body)[at : at + size])
        at += size + 2
    data = b"".join(parts)
    declared = headers.get("x-amz-decoded-content-length")
    if declared is not None and declared != str(len(data)):
        raise bad(f"{len(data)} bytes decoded, x-amz-decoded-content-length says {declared}")
    trailers = {}
    for line in body[at:].split(b"\r\n"):
        name, sep, value = line.decode("latin-1").partition(":")
        if sep:
            trailers[name.strip().lower()] = value.strip()
    named = headers.get("x-amz-trailer", "").strip().lower()
    if named:
        if named not in trailers:
            raise bad(f"the trailer {named} the headers announce is missing")
        compute = _CHECKSUMS.get(named)
        if compute is None:
            raise DescriptorError(400, "InvalidRequest", f"checksum trailer {named[:64]} is not supported; use one "
                                                         f"of {sorted(_CHECKSUMS)}")
        if base64.b64encode(compute(data)).decode() != trailers[named]:
            raise DescriptorError(400, "BadDigest", f"the {named} trailer does not match the body")
    return data
