"""The fault matrix (issue 12): what a 1P1D stack meets in production, each fault asserting the request's
outcome, the tokens, the engines' health afterwards and that nothing leaked.

The stack: SeaweedFS behind a :class:`StoreRelay` (the engines and the router know one store endpoint, which
the test can point at a restarted server, or at one that knows other credentials), a PE and a DE
(``configs/pe.json``, ``de.json``), ``dualpath-router`` (read side ``pe``), and a single engine whose POSIX
root is a small tmpfs. Every engine runs with ``max_num_batched_tokens`` = one chunk: prefill is chunked
at chunk boundaries, so a request that loads k chunks computes the others in the very steps a cold run
does, and any hit (whole, shortened or none) must give the cold run's tokens exactly. The reference of a
prompt is its cold answer through the same stack (nothing stored: the run without the cache);
``test_pd_e2e`` shows that such a run equals an engine without the connector.

After each case: the engines answer /health, a probe prompt answers its reference, and every engine is
idle (no request running or waiting, no KV block in use, no store read queued; a PE's blocks held for a DE
are freed within ``pd_lease_s``). Every process started here is stopped and checked gone.

Cases covered elsewhere and not repeated here:
- bad token ids (past the vocabulary, negative, not integers) through the router, the PE healthy after:
  ``test_pd_e2e.test_bad_token_id_through_router_is_refused_and_the_pe_stays_healthy``;
- a truncated or corrupted chunk on a single engine, and the forged-checksum negative control there:
  ``test_engine_e2e`` (here: the same faults on the PD read paths, the PE's and the DE's for its PE);
- the tokens and the fallback counter of a DE that dies during a DE-side read:
  ``test_pd_e2e.test_de_killed_during_de_side_read_falls_back`` (here: what the PE holds afterwards).

Order matters: cases that leave the stack as they found it come first; then those that replace a part
(the store's credentials, the store, the router); the DE's death is last.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from dualpath_connector.protocol import PrefillRequest, counter_total_name, metric_totals
from dualpath_dev.engines import ClusterKeys, RouterProcess, VLLMServer, cached_tokens
from dualpath_dev.processes import ServiceProcess, start_all
from dualpath_dev.seaweedfs import SeaweedFS
from dualpath_dev.tiny_model import TINY_LLAMA
from nixl_backends.configuration import ConfigError
from nixl_backends.integrity import chunk_hash_of
from nixl_backends.layout import BlockLayout
from nixl_backends.lookup import wait_stored
from nixl_backends.registry import make_store, parse_store_config
from tests.conftest import poll, post, resealed

pytestmark = pytest.mark.engine

CHUNK = 32  # vLLM's block size on CPU, and the connector's chunk
PROMPT_TOKENS = 6 * CHUNK + 1  # six claimable chunks; the last token is always computed
HIT_TOKENS = 6 * CHUNK
OUTPUT_TOKENS = 16
LONG_OUTPUT_TOKENS = 2000  # a request still decoding when the fault strikes
BUCKET = "dualpath-faults"
# Short PD deadlines, so that a lease (which must outlive both) ends within a test.
LEASE_S = 20.0
PD_SETTINGS = {"pd_lease_s": LEASE_S, "de_read_timeout_s": 5.0, "pd_transfer_timeout_s": 10.0}
ENGINE_OPTIONS = {"max_num_batched_tokens": CHUNK, "max_model_len": 4096}
# A store read still in flight after this is abandoned (the hit recomputed):
# what a load on a dead store costs, kept short here.
STORE_TIMEOUT_S = 10.0
FREEZE_S = 4.0  # well under STORE_TIMEOUT_S: the load must survive it
REQUEST_TIMEOUT_S = 300.0
SETTLE_TIMEOUT_S = LEASE_S + 30.0
TMPFS_BYTES = 2 << 20  # room for ~30 chunk objects of the tiny model (64 KiB + trailer each)

IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "dualpath_kv:read_queue_tokens")  # fmt: skip


def prompt(name: str) -> list[int]:
    rng = random.Random(f"faults/{name}")
    return [rng.randrange(TINY_LLAMA["vocab_size"]) for _ in range(PROMPT_TOKENS)]


# -- the store behind a relay ------------------------------------------------------------


def _cut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    sock.close()


def _pump(src: socket.socket, dst: socket.socket, relayed: Callable[[int], None] = lambda n: None) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
            relayed(len(data))
    except OSError:
        pass
    finally:
        _cut(src)
        _cut(dst)


class StoreRelay:
    """A TCP relay on 127.0.0.1 in front of the S3 server: the one store endpoint the stack knows.

    ``point_to`` moves it to another server (the store restarted, or one that
    knows other credentials) and cuts every relayed connection, so clients
    reconnect there, as they would to a store back at the same address. While
    the target is down a connection is accepted and closed at once.
    """

    def __init__(self, target: str) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._target = self._address(target)
        self._open: set[socket.socket] = set()
        # Bytes relayed toward the store: requests reach a frozen store's socket too (the kernel accepts them).
        self._sent = 0
        self._sent_changed = threading.Condition(self._lock)
        self._acceptor = threading.Thread(target=self._accept, name="store-relay", daemon=True)
        self._acceptor.start()

    @staticmethod
    def _address(endpoint: str) -> tuple[str, int]:
        host, port = endpoint.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    @property
    def sent_bytes(self) -> int:
        with self._lock:
            return self._sent

    def wait_sent_past(self, mark: int, timeout_s: float) -> None:
        """Wait until more than ``mark`` bytes went toward the store; AssertionError after ``timeout_s``."""
        with self._sent_changed:
            assert self._sent_changed.wait_for(lambda: self._sent > mark, timeout_s), "nothing reached the store"

    def _count_sent(self, nbytes: int) -> None:
        with self._sent_changed:
            self._sent += nbytes
            self._sent_changed.notify_all()

    def point_to(self, target: str) -> None:
        with self._lock:
            self._target = self._address(target)
            cut, self._open = self._open, set()
        for sock in cut:
            _cut(sock)

    def close(self) -> None:
        _cut(self._listener)  # accept() fails: the acceptor ends
        self._acceptor.join(timeout=10)
        with self._lock:
            cut, self._open = self._open, set()
        for sock in cut:
            _cut(sock)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with self._lock:
            target = self._target
        try:
            upstream = socket.create_connection(target, timeout=5)
        except OSError:
            _cut(client)
            return
        upstream.settimeout(None)
        with self._lock:
            if self._target != target:  # moved meanwhile
                _cut(client)
                _cut(upstream)
                return
            self._open.update((client, upstream))
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        _pump(client, upstream, self._count_sent)
        with self._lock:
            self._open.difference_update((client, upstream))


class RelayedStore:
    """The stack's S3 store: SeaweedFS reached through a :class:`StoreRelay`, credentials fixed at start.

    Stands in for :class:`SeaweedFS` where ``VLLMServer`` and ``RouterProcess``
    take one (``endpoint``, ``access_key``, ``secret_key``, ``lookup_store``).
    """

    def __init__(self) -> None:
        self.server = SeaweedFS().start()
        self.relay = StoreRelay(self.server.endpoint)
        self.endpoint = self.relay.endpoint
        self.access_key, self.secret_key = self.server.access_key, self.server.secret_key

    def lookup_store(self, section: dict, layout: BlockLayout):
        return self.server.lookup_store(section, layout)

    def client(self):
        return self.server.client()

    def signal(self, signum: int) -> None:
        os.killpg(self.server.proc.pid, signum)

    def restart(self) -> None:
        """A new, empty server where the relay now leads, with the stack's bucket (the engines made it at start-up).

        Empty, because dualpath_dev's SeaweedFS cannot start again on a used
        data directory (its readiness probe creates a bucket that exists).
        """
        self.server.stop()
        self.server = SeaweedFS().start()
        self.server.client().create_bucket(Bucket=BUCKET)
        self.relay.point_to(self.server.endpoint)

    def close(self) -> None:
        self.relay.close()
        self.server.stop()


# -- requests, metrics, polling ----------------------------------------------------------


def completion(model: Path, tokens: list[int], max_tokens: int = OUTPUT_TOKENS, **extra: object) -> dict:
    return {"model": str(model), "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip


def ask(router: RouterProcess, model: Path, tokens: list[int]) -> tuple[list[int], dict[str, str]]:
    """A greedy completion through the router that must succeed: (output token ids, x-dualpath-* headers)."""
    status, answer, headers = post(f"{router.url}/v1/completions", completion(model, tokens),
                                   timeout_s=REQUEST_TIMEOUT_S)  # fmt: skip
    assert status == 200, f"router answered {status}: {answer}"
    return answer["choices"][0]["token_ids"], headers


def totals(service: VLLMServer | RouterProcess) -> dict[str, float]:
    url = service.base_url if isinstance(service, VLLMServer) else service.url
    return metric_totals(urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode())


def counter(engine: VLLMServer, name: str) -> float:
    return engine.metric_total(counter_total_name(name))


def idle(engine: VLLMServer, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Nothing left in the engine: no request running or waiting, no KV block in use, no store read queued.

    Each gauge must be exported (KeyError otherwise): one missing would read as idle.
    """
    poll(lambda: {name: totals(engine)[name] for name in IDLE_GAUGES},
         lambda gauges: not any(gauges.values()), timeout_s, f"{engine.log_path.stem} not idle")  # fmt: skip


def counted(engines: list[VLLMServer], name: str, at_least: float, timeout_s: float = 30.0) -> float:
    """Poll a counter summed over ``engines`` until it reaches ``at_least`` (stats travel with engine steps)."""
    return poll(lambda: sum(counter(e, name) for e in engines), lambda v: v >= at_least, timeout_s,
                f"{name} on {[e.log_path.stem for e in engines]} below {at_least}")  # fmt: skip


def store_read_queued(engine: VLLMServer) -> None:
    """Wait until a store read is queued or in flight in ``engine`` (a load under way)."""
    poll(lambda: totals(engine)["dualpath_kv:read_queue_tokens"], lambda queued: queued > 0, 60,
         f"{engine.log_path.stem}'s store read queue")  # fmt: skip


def in_background(call: Callable[..., object], *args: object) -> Future:
    """``call(*args)`` in a thread of its own: its Future (what it returned, or what it raised)."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(call, *args)
    pool.shutdown(wait=False)
    return future


def healthy(service: ServiceProcess) -> bool:
    try:
        return urllib.request.urlopen(service.health_url, timeout=10).status == 200
    except OSError:
        return False


def _live_members(group: int) -> list[int]:
    """Processes of a process group that are not zombies (PID 1 here may reap late)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group and fields[0] != "Z":
                members.append(int(stat.parent.name))
    return members


def stop_checked(services: list[ServiceProcess]) -> None:
    """Stop each service and check that nothing of its process group is left running."""
    groups = [s.proc.pid for s in services if s.proc is not None]
    for service in services:
        service.stop()
    for group in groups:
        poll(lambda: _live_members(group), lambda members: not members, 30, f"processes of group {group}")


# -- the stack ----------------------------------------------------------------------------


@dataclass
class Stack:
    store: RelayedStore
    pe: VLLMServer
    de: VLLMServer
    router: RouterProcess
    workdir: Path
    model: Path
    references: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    probe: list[int] = field(default_factory=lambda: prompt("probe"))

    def start_router(self, **overrides: object) -> RouterProcess:
        return RouterProcess([self.pe], [self.de], self.store, self.workdir, **overrides).start()

    def reference(self, tokens: list[int]) -> list[int]:
        """The prompt's cold answer (asked once, a miss), its chunks then stored by the DE."""
        key = tuple(tokens)
        if key not in self.references:
            output, headers = ask(self.router, self.model, tokens)
            assert headers["x-dualpath-hit-tokens"] == "0", "a reference must be computed without the cache"
            self.de.wait_stored(tokens + output[:-1])
            self.references[key] = output
        return self.references[key]

    def keys(self, tokens: list[int]) -> list[str]:
        """Store keys of the prompt's claimable chunks."""
        return self.pe.key_space().claimable_keys(tokens)

    def assert_healthy(self) -> None:
        """Every part answers /health, the probe answers its reference, and the engines are idle again."""
        for service in (self.pe, self.de, self.router):
            # Awaited: the router answers 503 until its next scrape of an engine whose /metrics timed out under
            # load (engines are marked unhealthy per failed scrape, healthy again at the next good one).
            poll(lambda: healthy(service), bool, 60, f"{service.log_path.name}: /health 200")
        expected = self.reference(self.probe)
        assert ask(self.router, self.model, self.probe)[0] == expected
        idle(self.pe)
        idle(self.de)


@dataclass
class PosixEngine:
    engine: VLLMServer
    root: Path
    section: dict

    def store(self, layout: BlockLayout):
        return make_store(parse_store_config(self.section), layout)


@pytest.fixture(scope="module")
def store():
    relayed = RelayedStore()
    yield relayed
    relayed.close()


@pytest.fixture(scope="module")
def small_root(tmp_path_factory):
    """``(root, "")``: a tmpfs of TMPFS_BYTES, unmounted at the end; ``(None, why)`` where mounting is not permitted."""
    root = tmp_path_factory.mktemp("faults-tmpfs")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(root)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        yield None, f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}"
        return
    try:
        yield root, ""
    finally:
        subprocess.run(["umount", str(root)], check=True)


@pytest.fixture(scope="module")
def engines(tiny_model, store, small_root, tmp_path_factory):
    """PE, DE and the POSIX engine, started side by side; the router in front of the PE and DE."""
    logs = tmp_path_factory.mktemp("faults-logs")
    keys = ClusterKeys.generate()
    section = {"backend": "s3", "endpoint": store.endpoint, "bucket": BUCKET, "addressing_style": "path",
               "io_timeout_s": STORE_TIMEOUT_S}  # fmt: skip
    pd = {"extra": {**PD_SETTINGS, "store": section}, "keys": keys, **ENGINE_OPTIONS}
    pe = VLLMServer(tiny_model, store, logs / "pe.log", config="pe.json", **pd)
    de = VLLMServer(tiny_model, store, logs / "de.log", config="de.json", **pd)
    services: list[ServiceProcess] = [pe, de]
    root, _ = small_root
    posix = None
    if root is not None:
        posix_section = {"backend": "posix", "root": str(root / "kv")}
        posix = PosixEngine(VLLMServer(tiny_model, store, logs / "posix.log", config="single.json",
                                       extra={"store": posix_section}, **ENGINE_OPTIONS), root, posix_section)  # fmt: skip
        services.append(posix.engine)
    stack = Stack(store, pe, de, RouterProcess([pe], [de], store, logs, read_side="pe"), logs, tiny_model)
    try:
        start_all(services)
        stack.router.start()
        yield stack, posix
    finally:
        # The router of the moment: a case may have replaced it.
        stop_checked([*services, stack.router])


@pytest.fixture
def stack(engines) -> Stack:
    return engines[0]


# -- the cases ------------------------------------------------------------------------------


def test_wrong_credentials_at_startup_name_the_store(store, monkeypatch):
    """A store that refuses the credentials stops start-up with the endpoint and bucket named, no secret shown.

    Checked where every S3 user opens the store (the connector, the router's
    lookup, the bench): the store's construction, against SeaweedFS with auth.
    """
    server = store.server
    layout = BlockLayout(TINY_LLAMA["num_hidden_layers"], 16384)
    section = {"backend": "s3", "endpoint": server.endpoint, "bucket": BUCKET}
    wrong_secret = f"wrong-{secrets.token_hex(8)}"

    def refusal(config: dict) -> str:
        with pytest.raises(ConfigError) as refused:
            make_store(parse_store_config(config), layout)
        # Not chained: a traceback shows nothing but this message.
        assert refused.value.__cause__ is None and refused.value.__suppress_context__
        return str(refused.value)

    cases = {
        "wrong secret in the config": {**section, "access_key": server.access_key, "secret_key": wrong_secret},
        "unknown access key": {**section, "access_key": f"nobody-{secrets.token_hex(4)}", "secret_key": server.secret_key},
    }  # fmt: skip
    # What the engines use: the AWS variables.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong_secret)
    cases["wrong secret in AWS_SECRET_ACCESS_KEY"] = section
    for what, config in cases.items():
        message = refusal(config)
        assert f"S3 store {server.endpoint}, bucket '{BUCKET}'" in message, what
        assert "refused the credentials" in message, what
        assert wrong_secret not in message and server.secret_key not in message, what
    # Negative control: the same construction with the right secret opens the store.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    make_store(parse_store_config(section), layout).close()


def test_client_disconnecting_mid_stream_aborts_the_request(stack):
    """A streaming client that goes away after the first chunk: the DE aborts its request, nothing stays booked."""
    import httpx

    tokens = prompt("disconnect")
    generated_before = totals(stack.de).get("vllm:generation_tokens_total", 0.0)
    body = completion(stack.model, tokens, LONG_OUTPUT_TOKENS, stream=True)
    with httpx.stream("POST", f"{stack.router.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["token_ids"]
    # Leaving the block closed the connection: the DE stops before max_tokens. With ignore_eos it decodes every
    # one of them unless the request was aborted; how soon the abort comes is the machine's (with the suite on
    # two cores it came after 1616 of 2000 tokens once, so "before half" was a timing claim).
    idle(stack.de)
    idle(stack.pe)
    generated = totals(stack.de)["vllm:generation_tokens_total"] - generated_before
    assert generated < LONG_OUTPUT_TOKENS, f"the DE decoded all {generated} tokens: the request was not aborted"
    poll(lambda: totals(stack.router).get("dualpath_router_engine_unfinished_requests"), lambda n: n == 0, 30,
         "requests the router counts against its engines")  # fmt: skip
    stack.assert_healthy()


def test_store_frozen_mid_load_then_resumed(stack):
    """SIGSTOP the store while the PE reads a hit, SIGCONT it: the load finishes, the tokens are right."""
    tokens = prompt("freeze")
    expected = stack.reference(tokens)
    # A first hit: the router and the PE remember the chunks as present, so
    # with the store frozen the request goes straight to the load. Its load
    # counted first: what follows counts the frozen load alone.
    before = _hit(stack, stack.router, tokens, expected)
    mark = stack.store.relay.sent_bytes
    stack.store.signal(signal.SIGSTOP)
    try:
        answer = in_background(ask, stack.router, stack.model, tokens)
        # The load's requests reached the frozen store: seen at the relay at once, where the PE's read-queue
        # gauge (one /metrics scrape of a busy engine) can take long enough to outlast STORE_TIMEOUT_S.
        stack.store.relay.wait_sent_past(mark, 60)
        # The fault's length, not a synchronisation: the request must not be answered while the store is frozen.
        assert not wait([answer], FREEZE_S).done, "answered while the store was frozen"
    finally:
        stack.store.signal(signal.SIGCONT)
    assert answer.result(REQUEST_TIMEOUT_S)[0] == expected
    loaded = counted([stack.pe], "loaded_tokens", before["loaded_tokens"] + HIT_TOKENS) - before["loaded_tokens"]
    assert loaded == HIT_TOKENS and counter(stack.pe, "load_failed_tokens") == before["load_failed_tokens"]
    stack.assert_healthy()


def _noise(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _hit(stack: Stack, router: RouterProcess, tokens: list[int], expected: list[int]) -> dict[str, float]:
    """A whole hit (so the PE remembers every chunk as present); the PE's load counters once it is counted."""
    before = counter(stack.pe, "loaded_tokens")
    output, headers = ask(router, stack.model, tokens)
    assert output == expected and headers["x-dualpath-hit-tokens"] == str(HIT_TOKENS)
    counted([stack.pe], "loaded_tokens", before + HIT_TOKENS)
    return {name: counter(stack.pe, name) for name in ("loaded_tokens", "load_failed_tokens")}


def _load_outcome(stack: Stack, before: dict[str, float]) -> tuple[float, float]:
    """(loaded, failed) hit tokens of the one load since ``before``: the PE counts both when the load ends."""
    poll(lambda: sum(counter(stack.pe, name) - before[name] for name in before), lambda n: n >= HIT_TOKENS, 30,
         "the load's tokens on the PE")  # fmt: skip
    return tuple(counter(stack.pe, name) - before[name] for name in ("loaded_tokens", "load_failed_tokens"))


def test_corrupted_or_truncated_chunk_shortens_the_hit_on_either_read_side(stack):
    """A stored chunk overwritten with noise of its size, truncated, or replaced by another chunk's KV resealed
    without the key (a writer of the bucket who computes the checksum trailer), after the PE saw it present:
    the reader (the PE, or the DE for its PE) ends the hit before it, vLLM recomputes, the tokens are the cold
    ones; the noise and the forgery count as corrupt chunks. The engines run ``integrity: keyed`` (configs/).

    Negative control: the same forgery sealed with the deployment's key (what only a keyholder can make) is
    served as a hit and changes the answer.
    """
    tokens = prompt("corrupt")
    expected = stack.reference(tokens)
    keys = stack.keys(tokens)
    s3 = stack.store.client()
    originals = {key: s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() for key in keys}
    both = [stack.pe, stack.de]
    de_router = stack.start_router(read_side="de")
    try:
        layers = stack.pe.key_space().num_layers
        for side, router, damage, chunk in (("pe", stack.router, "noise", 3), ("de", de_router, "noise", 0),
                                            ("de", de_router, "truncated", 2), ("pe", stack.router, "unkeyed", 1)):  # fmt: skip
            what = f"{damage} chunk {chunk}, read side {side}"
            before = _hit(stack, router, tokens, expected)
            corrupt_before = sum(counter(e, "corrupt_chunks") for e in both)
            key = keys[chunk]
            body = {
                "noise": lambda: _noise(len(originals[key]), 0),
                "truncated": lambda: originals[key][: len(originals[key]) // 2],
                "unkeyed": lambda: resealed(originals[keys[chunk + 1]], chunk_hash_of(key), layers, key=None),
            }[damage]()
            s3.put_object(Bucket=BUCKET, Key=key, Body=body)
            try:
                output, headers = ask(router, stack.model, tokens)
            finally:
                s3.put_object(Bucket=BUCKET, Key=key, Body=originals[key])
            assert headers["x-dualpath-read-side"] == side, what
            assert output == expected, what
            # The hit ended before the bad chunk: it and the rest were recomputed.
            assert _load_outcome(stack, before) == (chunk * CHUNK, HIT_TOKENS - chunk * CHUNK), what
            damaged = damage in ("noise", "unkeyed")
            corrupt = counted(both, "corrupt_chunks", corrupt_before + damaged) - corrupt_before
            assert corrupt == damaged, what
        # Negative control.
        before = _hit(stack, stack.router, tokens, expected)
        corrupt_before = sum(counter(e, "corrupt_chunks") for e in both)
        forged = resealed(originals[keys[1]], chunk_hash_of(keys[0]), layers, stack.pe.keys.integrity_key())
        assert forged != originals[keys[0]] and len(forged) == len(originals[keys[0]])
        s3.put_object(Bucket=BUCKET, Key=keys[0], Body=forged)
        try:
            output, _ = ask(stack.router, stack.model, tokens)
        finally:
            s3.put_object(Bucket=BUCKET, Key=keys[0], Body=originals[keys[0]])
        assert _load_outcome(stack, before) == (HIT_TOKENS, 0)  # the forged chunk was served
        assert sum(counter(e, "corrupt_chunks") for e in both) == corrupt_before
        assert output != expected, "a hit on forged KV gave the cold tokens: the comparison cannot see wrong KV"
    finally:
        de_router.stop()
    stack.assert_healthy()


def _fill(root: Path) -> Path:
    """Write a file until the file system is full; the file, to delete."""
    filler = root / "filler"
    with open(filler, "wb", buffering=0) as out:  # unbuffered: ENOSPC surfaces here, not at close
        try:
            while True:
                out.write(b"\0" * (1 << 16))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def test_posix_root_filling_up_skips_saves_and_keeps_loading(engines, small_root):
    """A full POSIX root: new chunks are not saved (counted), stored ones still load, nothing crashes."""
    _, posix = engines
    if posix is None:
        pytest.skip(small_root[1])
    engine = posix.engine
    key_space = engine.key_space()
    lookup = posix.store(key_space.layout)
    stored, fresh = prompt("posix-stored"), prompt("posix-fresh")
    _, expected, usage = engine.complete(stored, OUTPUT_TOKENS)
    assert cached_tokens(usage) == 0
    output_keys = key_space.chunk_keys(stored + expected[:-1])
    wait_stored(lookup, output_keys, 60)
    filler = _fill(posix.root)
    try:
        skipped_before = counter(engine, "save_skipped_chunks")
        # Loads go on.
        _, output, usage = engine.complete(stored, OUTPUT_TOKENS)
        assert output == expected and cached_tokens(usage) == HIT_TOKENS
        # Saves are skipped: nothing of the fresh prompt lands, not even a temporary file.
        _, fresh_expected, usage = engine.complete(fresh, OUTPUT_TOKENS)
        assert cached_tokens(usage) == 0
        fresh_keys = key_space.chunk_keys(fresh + fresh_expected[:-1])
        counted([engine], "save_skipped_chunks", skipped_before + len(fresh_keys))
        assert lookup.lookup(fresh_keys) == 0
        assert not list(posix.root.rglob("*.tmp"))
        # Asked again it is a miss (nothing half-written is loaded), answered alike.
        _, output, usage = engine.complete(fresh, OUTPUT_TOKENS)
        assert output == fresh_expected and cached_tokens(usage) == 0
        assert healthy(engine)
    finally:
        filler.unlink()
    # Room again: saves resume.
    _, output, _ = engine.complete(fresh, OUTPUT_TOKENS)
    assert output == fresh_expected
    wait_stored(lookup, fresh_keys, 60)
    idle(engine)
    lookup.close()


def test_wrong_credentials_mid_run_turn_hits_into_misses(stack, tmp_path):
    """The store starts refusing the engines' credentials (rotated): requests still answer right, as misses.

    A remembered hit's load is refused (the PE recomputes), a new prompt's
    lookups are refused (a miss) and so are its saves (counted as skipped: the
    PE saves the prompt chunks it computed, the DE those decoding completes).
    """
    stored, fresh = prompt("creds-stored"), prompt("creds-fresh")
    expected = stack.reference(stored)
    loads = _hit(stack, stack.router, stored, expected)  # remembered as present from now on
    impostor = SeaweedFS(tmp_path / "rotated")
    impostor.secret_key = f"rotated-{secrets.token_hex(8)}"
    impostor.start()
    savers = [stack.pe, stack.de]
    before = {"skipped": sum(counter(e, "save_skipped_chunks") for e in savers), "failed": loads["load_failed_tokens"]}
    stack.store.relay.point_to(impostor.endpoint)
    try:
        output, headers = ask(stack.router, stack.model, stored)
        assert output == expected and headers["x-dualpath-hit-tokens"] == str(HIT_TOKENS)
        counted([stack.pe], "load_failed_tokens", before["failed"] + HIT_TOKENS)
        fresh_output, headers = ask(stack.router, stack.model, fresh)
        assert headers["x-dualpath-hit-tokens"] == "0"
        counted(savers, "save_skipped_chunks", before["skipped"] + 1)
        for service in (stack.pe, stack.de, stack.router):
            assert healthy(service)
    finally:
        stack.store.relay.point_to(stack.store.server.endpoint)
        impostor.stop()
    # The refused saves stored nothing: the fresh prompt is still a miss, answered alike.
    output, headers = ask(stack.router, stack.model, fresh)
    assert output == fresh_output and headers["x-dualpath-hit-tokens"] == "0"
    logs = "".join(p.read_text(errors="replace") for p in (stack.pe.log_path, stack.de.log_path, stack.router.log_path))
    assert stack.store.secret_key not in logs and impostor.secret_key not in logs
    stack.assert_healthy()


def test_store_killed_mid_run_turns_hits_into_misses(stack):
    """SIGKILL the store during a hit load and keep serving: right tokens, engines alive; then it comes back."""
    tokens = prompt("kill-store")
    expected = stack.reference(tokens)
    # A first hit: the router and the PE remember the chunks as present, so the next request loads them.
    before = _hit(stack, stack.router, tokens, expected)
    stack.store.signal(signal.SIGSTOP)
    try:
        answer = in_background(ask, stack.router, stack.model, tokens)
        store_read_queued(stack.pe)
    finally:
        stack.store.signal(signal.SIGKILL)
    assert answer.result(REQUEST_TIMEOUT_S)[0] == expected
    counted([stack.pe], "load_failed_tokens", before["load_failed_tokens"] + HIT_TOKENS)
    # The store stays dead: hits are misses, answers right, engines alive.
    for again in (tokens, stack.probe):
        assert ask(stack.router, stack.model, again)[0] == stack.reference(again)
    for service in (stack.pe, stack.de, stack.router):
        assert healthy(service)
    idle(stack.pe)
    idle(stack.de)
    stack.store.restart()
    stack.assert_healthy()


def test_router_restarted_with_requests_in_flight(stack):
    """SIGKILL the router while two requests decode on the DE and one waits in the PE for a (frozen) store read.

    Each client gets an error; no engine keeps state past its lease; a new router serves.
    """
    stuck = prompt("router-stuck")
    stuck_expected = stack.reference(stuck)
    assert ask(stack.router, stack.model, stuck)[0] == stuck_expected  # remembered as present: a load, not a lookup

    def client(tokens: list[int], max_tokens: int) -> tuple[int, dict, dict[str, str]]:
        return post(f"{stack.router.url}/v1/completions", completion(stack.model, tokens, max_tokens),
                    timeout_s=REQUEST_TIMEOUT_S)  # fmt: skip

    clients = [in_background(client, prompt(f"router-long-{i}"), LONG_OUTPUT_TOKENS) for i in range(2)]
    poll(lambda: totals(stack.de).get("vllm:num_requests_running", 0.0), lambda n: n >= 2, 120,
         "requests decoding on the DE")  # fmt: skip
    stack.store.signal(signal.SIGSTOP)
    try:
        clients.append(in_background(client, stuck, OUTPUT_TOKENS))
        store_read_queued(stack.pe)
        os.killpg(stack.router.proc.pid, signal.SIGKILL)
        stack.router.stop()
    finally:
        stack.store.signal(signal.SIGCONT)
    # Not an answer (an HTTP status) but a broken connection: what a client of a dead router sees.
    outcomes = [c.exception(REQUEST_TIMEOUT_S) for c in clients]
    assert all(isinstance(o, (OSError, ValueError)) for o in outcomes), [c.exception() or c.result() for c in clients]
    idle(stack.de)
    idle(stack.pe)
    stack.router = stack.start_router(read_side="pe")
    assert ask(stack.router, stack.model, stuck)[0] == stuck_expected
    stack.assert_healthy()


def test_de_killed_during_de_side_read_then_the_pe_frees_the_prefill_it_held(stack):
    """The DE freezes and dies while the PE waits on its DE-side read; the PE reads the hit itself, prefills,
    and holds the prompt's blocks for a pull that never comes: they are freed within the lease.

    The router's part is played here (a PrefillRequest straight to the PE), as in test_pd_e2e. Last: the DE
    does not come back.
    """
    tokens = prompt("de-killed")
    expected = stack.reference(tokens)
    body = completion(stack.model, tokens, 1, kv_transfer_params=PrefillRequest("de", stack.de.side_channel).to_dict())
    os.killpg(stack.de.proc.pid, signal.SIGSTOP)
    try:
        answer = in_background(post, f"{stack.pe.base_url}/v1/completions", body, stack.pe.keys.auth_headers(),
                               REQUEST_TIMEOUT_S)  # fmt: skip
        poll(lambda: sum(totals(stack.pe).get(g, 0.0) for g in ("vllm:num_requests_running", "vllm:num_requests_waiting")),
             lambda n: n >= 1, 60, "the request in the PE")  # fmt: skip
    finally:
        os.killpg(stack.de.proc.pid, signal.SIGKILL)
    status, prefilled, _ = answer.result(REQUEST_TIMEOUT_S)
    handed_off = time.monotonic()
    assert status == 200, prefilled
    assert prefilled["choices"][0]["token_ids"] == expected[:1]
    assert prefilled["kv_transfer_params"]["do_remote_prefill"]
    # Held for the DE's pull...
    poll(lambda: totals(stack.pe)["vllm:kv_cache_usage_perc"], lambda used: used > 0, 10, "the PE's held blocks")
    # ...which never comes: freed when the lease ends.
    idle(stack.pe, LEASE_S + 30)
    assert time.monotonic() - handed_off > LEASE_S / 2, "freed long before the lease ended"
    assert "no DE pulled its KV within the lease; blocks released" in stack.pe.log_path.read_text()
    # The PE alone still answers right (a plain request: it decodes itself).
    assert healthy(stack.pe)
    status, answer_body, _ = post(f"{stack.pe.base_url}/v1/completions", completion(stack.model, tokens),
                                  stack.pe.keys.auth_headers(), REQUEST_TIMEOUT_S)  # fmt: skip
    assert status == 200 and answer_body["choices"][0]["token_ids"] == expected
    idle(stack.pe)
