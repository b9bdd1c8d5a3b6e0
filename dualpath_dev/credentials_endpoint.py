"""Temporary S3 credentials that rotate, served as a container credentials endpoint (ECS task roles, EKS Pod
Identity): what an engine in a pod gets from ``AWS_CONTAINER_CREDENTIALS_FULL_URI``.

Every ``rotate_s`` a new key pair and session token are issued; each expires
``expiry_s`` after it was issued (``expiry_s > rotate_s``, so the pair a
client fetched is still valid for a while after the next one appears, as
with AWS's own roles). Clients authenticate with
``AWS_CONTAINER_AUTHORIZATION_TOKEN``. :meth:`RotatingCredentials.secret_for`
answers which requests a store should accept: signed by a pair that is known,
unexpired, and presented with its own token. Runs on a thread of the calling
process, on a free port, until :meth:`stop`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler

from dualpath_dev.threaded_http import ThreadedHTTPService


@dataclasses.dataclass(frozen=True)
class TemporaryCredentials:
    access_key: str
    secret_key: str
    token: str
    expires_at: float  # time.time()

    def to_json(self) -> bytes:
        expiration = dt.datetime.fromtimestamp(self.expires_at, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return json.dumps({"AccessKeyId": self.access_key, "SecretAccessKey": self.secret_key, "Token": self.token,
                           "Expiration": expiration}).encode()  # fmt: skip


class RotatingCredentials(ThreadedHTTPService):
    name = "credentials-endpoint"

    def __init__(self, rotate_s: float = 30.0, expiry_s: float = 45.0) -> None:
        super().__init__()
        if not 0 < rotate_s < expiry_s:
            raise ValueError(f"need 0 < rotate_s < expiry_s, got {rotate_s} and {expiry_s}")
        self.rotate_s, self.expiry_s = rotate_s, expiry_s
        self.authorization = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._issued: dict[str, TemporaryCredentials] = {}
        self._current: TemporaryCredentials | None = None
        self.fetches = 0  # answered requests for credentials

    # -- what the store accepts --------------------------------------------------------------

    def current(self) -> TemporaryCredentials:
        """The pair handed out now; a new one once ``rotate_s`` passed since the last was issued."""
        now = time.time()
        with self._lock:
            if self._current is None or now >= self._current.expires_at - self.expiry_s + self.rotate_s:
                self._current = TemporaryCredentials(f"ASIA{secrets.token_hex(8).upper()}", secrets.token_hex(20),
                                                     secrets.token_hex(32), now + self.expiry_s)  # fmt: skip
                self._issued[self._current.access_key] = self._current
            return self._current

    @property
    def issued(self) -> int:
        """Key pairs issued so far."""
        with self._lock:
            return len(self._issued)

    def secret_for(self, access_key: str, token: str | None) -> str | None:
        """The secret of a request's key pair if the store should accept it (issued here, unexpired, with its
        token); None otherwise."""
        with self._lock:
            pair = self._issued.get(access_key)
        if pair is None or token != pair.token or time.time() >= pair.expires_at:
            return None
        return pair.secret_key

    # -- the endpoint ----------------------------------------------------------------------------

    def handler(self) -> type[BaseHTTPRequestHandler]:
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.headers.get("Authorization") != issuer.authorization:
                    self.send_error(401, "wrong AWS_CONTAINER_AUTHORIZATION_TOKEN")
                    return
                body = issuer.current().to_json()
                with issuer._lock:
                    issuer.fetches += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        return Handler

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to fetch credentials here (the AWS SDKs' container provider)."""
        return {"AWS_CONTAINER_CREDENTIALS_FULL_URI": f"http://127.0.0.1:{self.port}/credentials",
                "AWS_CONTAINER_AUTHORIZATION_TOKEN": self.authorization}  # fmt: skip
