"""The posix-backed gateway's S3 edges: key paths and unsigned aws-chunked PUT bodies (the AWS C++ SDK's)."""

from __future__ import annotations

import base64

import pytest
from awscrt import checksums

from s3agg_gateway_ext.backing_posix import safe_path
from s3agg_gateway_ext.descriptor import DescriptorError
from s3agg_gateway_ext.s3_api import decode_aws_chunked

PAYLOAD = bytes(range(256)) * 300


def chunked(data: bytes, size: int, trailer: str, value: str) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size]) for i in range(0, len(data), size))
    return out + b"0\r\n" + f"{trailer}:{value}\r\n\r\n".encode()


def crc64(data: bytes) -> str:
    return base64.b64encode(checksums.crc64nvme(data).to_bytes(8, "big")).decode()


HEADERS = {"x-amz-trailer": "x-amz-checksum-crc64nvme", "x-amz-decoded-content-length": str(len(PAYLOAD))}


def test_unsigned_chunks_decode_to_the_payload_and_the_trailer_is_checked():
    body = chunked(PAYLOAD, 8192, "x-amz-checksum-crc64nvme", crc64(PAYLOAD))
    assert decode_aws_chunked(body, HEADERS) == PAYLOAD


@pytest.mark.parametrize(("mangle", "headers", "code"), [
    (lambda b: b.replace(crc64(PAYLOAD).encode(), crc64(PAYLOAD[1:]).encode()), HEADERS, "BadDigest"),
    (lambda b: b[:5000] + b[5001:], HEADERS, "IncompleteBody"),  # a chunk one byte short
    (lambda b: b"zz\r\n" + b, HEADERS, "IncompleteBody"),
    (lambda b: b, {**HEADERS, "x-amz-decoded-content-length": "5"}, "IncompleteBody"),
    (lambda b: b, {**HEADERS, "x-amz-trailer": "x-amz-checksum-md9"}, "IncompleteBody"),  # announced, absent
])
def test_bad_bodies_are_refused(mangle, headers, code):
    body = mangle(chunked(PAYLOAD, 8192, "x-amz-checksum-crc64nvme", crc64(PAYLOAD)))
    with pytest.raises(DescriptorError) as refused:
        decode_aws_chunked(body, headers)
    assert refused.value.code == code and refused.value.status == 400


# Each of these looped for ever or read past the body before sizes were checked (a negative size walks back).
@pytest.mark.parametrize("body", [b"1\r\nA\r\n-6\r\n", b"-1\r\n\r\n", b"+1\r\nA\r\n0\r\n\r\n",
                                  b"0x1\r\nA\r\n0\r\n\r\n", b"1_0\r\n" + b"A" * 16 + b"\r\n0\r\n\r\n",
                                  b" 1\r\nA\r\n0\r\n\r\n", b"\r\n", b"ffffffffffffffff\r\nA\r\n",
                                  b"1" * 17 + b"\r\n"])  # fmt: skip
def test_chunk_sizes_other_than_hex_digits_within_the_body_are_refused(body):
    with pytest.raises(DescriptorError) as refused:
        decode_aws_chunked(body, {})
    assert refused.value.code == "IncompleteBody" and refused.value.status == 400


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "a/./b", "a\0b", "x" * 1025])
def test_keys_that_leave_the_root_are_refused(key):
    with pytest.raises(DescriptorError) as refused:
        safe_path("/data/kv", key)
    assert refused.value.status == 400


def test_a_chunk_key_maps_where_posix_store_puts_it():
    assert safe_path("/data/kv", "dualpath/ns/ab/cdef") == "/data/kv/dualpath/ns/ab/cdef"
