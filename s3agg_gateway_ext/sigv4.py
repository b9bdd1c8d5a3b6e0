"""AWS Signature Version 4 verification (header form), as S3 servers do it, and S3's XML error shape.

Clients sign with any SigV4 implementation (botocore's ``S3SigV4Auth`` in this
project); the gateway recomputes the signature from the request and its
configured secret and compares in constant time.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
from collections.abc import Mapping
from urllib.parse import quote, unquote
from xml.sax.saxutils import escape

from s3agg_gateway_ext.descriptor import DescriptorError

_ALGORITHM = "AWS4-HMAC-SHA256"
_AUTH = re.compile(
    r"^AWS4-HMAC-SHA256\s+Credential=([^/,\s]+)/(\d{8})/([^/,\s]+)/([^/,\s]+)/aws4_request,\s*"
    r"SignedHeaders=([a-z0-9;\-]+),\s*Signature=([0-9a-f]{64})$"
)
_MAX_SKEW = dt.timedelta(minutes=15)  # what AWS S3 allows
UNSIGNED = "UNSIGNED-PAYLOAD"
# aws-chunked body, chunks unsigned, a checksum trailer (the AWS C++ SDK's PUT, hence NIXL OBJ's):
# the signature covers the headers only; the body is decoded and its trailer checked by the handler.
STREAMING_UNSIGNED_TRAILER = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"


def _denied(code: str, message: str) -> DescriptorError:
    return DescriptorError(403, code, message)


def _canonical_query(raw_query: str) -> str:
    pairs = []
    for part in raw_query.split("&") if raw_query else []:
        name, _, value = part.partition("=")
        pairs.append((quote(unquote(name), safe="-_.~"), quote(unquote(value), safe="-_.~")))
    return "&".join(f"{n}={v}" for n, v in sorted(pairs))


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def verify_headers(
    method: str,
    raw_path: str,
    raw_query: str,
    headers: Mapping[str, str],
    access_key: str,
    secret_key: str,
    *,
    payloads: tuple[str, ...] = ("signed", UNSIGNED, STREAMING_UNSIGNED_TRAILER),
    now: dt.datetime | None = None,
) -> str:
    """Raise a 403 :class:`DescriptorError` unless the request's headers carry a valid signature by
    ``access_key``; the declared payload hash, which :func:`verify_payload` checks once the body is read.

    Checked before a byte of the body is read: a request nobody signed costs the gateway its headers only.
    ``payloads``: the ``x-amz-content-sha256`` forms accepted ("signed": the body's SHA-256, so the signature
    covers the body; a captured request cannot be replayed with another).
    """
    match = _AUTH.match(headers.get("authorization", ""))
    if match is None:
        raise _denied("AccessDenied", "missing or malformed AWS4-HMAC-SHA256 Authorization header")
    key_id, date, region, service, signed, signature = match.groups()
    # As bytes: a non-ASCII key id is an unknown one, not a TypeError.
    if not hmac.compare_digest(key_id.encode(), access_key.encode()):
        raise _denied("InvalidAccessKeyId", "the access key id is not known to this gateway")
    amz_date = headers.get("x-amz-date", "")
    try:
        when = dt.datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        raise _denied("AccessDenied", "missing or malformed x-amz-date") from None
    if abs((now or dt.datetime.now(dt.timezone.utc)) - when) > _MAX_SKEW or not amz_date.startswith(date):
        raise _denied("RequestTimeTooSkewed", "request time differs from the gateway's by more than 15 minutes")
    payload_hash = headers.get("x-amz-content-sha256", "")
    form = "signed" if _SHA256_HEX.match(payload_hash) else payload_hash
    if form not in payloads:
        wanted = " or ".join("the body's SHA-256" if p == "signed" else p for p in payloads)
        raise _denied("AccessDenied", f"{method} here needs x-amz-content-sha256: {wanted}")
    names = signed.split(";")
    if "host" not in names or any(name not in headers for name in names):
        raise _denied("AccessDenied", "signed headers must include host and be present")
    expected = _signature(method, raw_path, raw_query, headers, names, payload_hash, secret_key,
                          f"{date}/{region}/{service}/aws4_request", amz_date)  # fmt: skip
    if not hmac.compare_digest(expected, signature):
        raise _denied("SignatureDoesNotMatch", "the request signature does not match the one computed")
    return payload_hash


def _signature(method: str, raw_path: str, raw_query: str, headers: Mapping[str, str], names: list[str],
               payload_hash: str, secret_key: str, scope: str, amz_date: str) -> str:  # fmt: skip
    """The SigV4 signature of a request over its headers ``names`` (lower case, in order), hex."""
    canonical_headers = "".join(f"{n}:{' '.join(headers[n].split())}\n" for n in names)
    canonical = "\n".join(
        [method, raw_path or "/", _canonical_query(raw_query), canonical_headers, ";".join(names), payload_hash])
    to_sign = "\n".join([_ALGORITHM, amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    date, region, service, _ = scope.split("/")
    key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret_key}".encode(), date), region), service), "aws4_request")
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()


def sign(method: str, raw_path: str, raw_query: str, headers: Mapping[str, str], access_key: str, secret_key: str,
         region: str, now: dt.datetime | None = None) -> dict[str, str]:  # fmt: skip
    """The ``x-amz-date`` and ``authorization`` headers that sign a request (lower-case ``headers``, with
    ``host`` and ``x-amz-content-sha256``) for S3 by ``access_key``, over host and every ``x-amz-*`` header
    (S3 servers refuse a request with an unsigned one)."""
    amz_date = (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    scope = f"{amz_date[:8]}/{region}/s3/aws4_request"
    signed = {**headers, "x-amz-date": amz_date}
    names = sorted(["host", *(name for name in signed if name.startswith("x-amz-"))])
    signature = _signature(method, raw_path, raw_query, signed, names, headers["x-amz-content-sha256"], secret_key,
                           scope, amz_date)  # fmt: skip
    return {"x-amz-date": amz_date, "authorization": f"{_ALGORITHM} Credential={access_key}/{scope}, "
                                                     f"SignedHeaders={';'.join(names)}, Signature={signature}"}


def verify_payload(payload_hash: str, body: bytes) -> None:
    """A signed payload hash must be the body's (the unsigned forms leave the body to the handler)."""
    if _SHA256_HEX.match(payload_hash) and not hmac.compare_digest(payload_hash, hashlib.sha256(body).hexdigest()):
        raise _denied("XAmzContentSHA256Mismatch", "x-amz-content-sha256 does not match the body")



def error_xml(code: str, message: str, resource: str, request_id: str) -> str:
    """S3's error body."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(resource)}</Resource><RequestId>{escape(request_id)}</RequestId></Error>"
    )
