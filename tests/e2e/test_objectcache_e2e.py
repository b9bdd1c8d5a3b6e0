"""ObjectCache on the serving path, end to end on vLLM's CPU build: hits through a real ``s3agg-gateway``.

The connector's store is ``s3agg`` (the gateway in front of a SeaweedFS
bucket) in ``layerwise`` mode, so a hit arrives layer by layer: it is reported
once layer 0 landed and verified, and the forward waits for each later layer
(the gateway is paced at 1 MB/s, so the layers of a ~3 MB hit really arrive
while the forward runs). Outputs must equal an engine's without the connector
(see ``test_engine_e2e`` for why the baselines replay the same chunking); a
layer whose digest is bad fails its chunks mid-forward and vLLM recomputes
them; a gateway killed mid-load leaves the rest to plain S3 reads. A 1P1D
cluster with s3agg stores serves a session with the read side on the PE
(layer arrival next to the PD side channel, one NIXL notification reader) and
on the DE (the DE reads through the gateway into its own buffer). Who read the
hit, and through what, is counted: the reader's bytes on its side, none on the
other, and every chunk of it delivered by the gateway (``s3agg_delivered_bytes_total``),
so a read that went around the gateway (its fallback to plain S3) fails the
check; each read side's session is the other's control.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import urllib.request

import pytest

from dualpath_connector.protocol import counter_total_name, metric_samples
from dualpath_dev.engines import ClusterKeys, RouterProcess
from dualpath_dev.gateway import GatewayProcess, gateway_config
from nixl_backends.layout import DIGEST_BYTES, BlockLayout, chunk_hashes, chunk_key
from tests.conftest import PLAIN_ENGINE_BATCH_TOKENS, pd_pair, poll, resealed, same, through_router
from tests.vllm_engine import Engine

pytestmark = pytest.mark.engine

CHUNK = 32
MAX_TOKENS = 24
BATCH_TOKENS = PLAIN_ENGINE_BATCH_TOKENS  # the baseline's step: every engine here chunks prefill alike
BUCKET = "dualpath-objcache"
NUM_LAYERS = 4  # the tiny Llama's

_rng = random.Random(4321)
P = [_rng.randrange(1024) for _ in range(1500)]
A = P + [_rng.randrange(1024) for _ in range(40)]
# For the gateway-kill test: after the failure test, A's own chunks past P are stored too.
B = P + [_rng.randrange(1024) for _ in range(40)]
# A hit reported whole, then failed from this chunk on mid-forward: vLLM recomputes from token 512, which is
# how a cold run chunks its prefill (max_num_batched_tokens), so the output equals the cold run's.
BOUNDARY_CHUNK = BATCH_TOKENS // CHUNK
# PD: a session of two turns per read side; each prompt 1 token past a block boundary (see test_pd_e2e).
PD_SIDES = ("pe", "de")
PD_OUTPUT_TOKENS = 2 * CHUNK


def pd_session(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(16 * CHUNK + 1)], [rng.randrange(1024) for _ in range(4 * CHUNK)]]


PD_SESSIONS = {side: pd_session(100 + i) for i, side in enumerate(PD_SIDES)}


def s3agg_store(seaweedfs, gateway: GatewayProcess) -> dict:
    """The connector's store section: the gateway in front of the bucket (keys from the AWS variables)."""
    return {"backend": "s3agg", "gateway": gateway.url,
            "s3": {"backend": "s3", "endpoint": seaweedfs.endpoint, "bucket": BUCKET, "addressing_style": "path"}}


def kv_config(store: dict) -> dict:
    return {
        "kv_connector": "DualPathConnector",
        "kv_connector_module_path": "dualpath_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": store, "load_mode": "layerwise"},
    }


def gateway_metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    """A series of the gateway's /metrics, summed over the label sets that match ``labels``."""
    text = urllib.request.urlopen(f"{gateway.url}/metrics", timeout=10).read().decode()
    return sum(value for sample, got, value in metric_samples(text)
               if sample == name and all(got.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def gateways(seaweedfs, tmp_path_factory):
    """A gateway paced at 1 MB/s (layers arrive during the forward) and an unpaced one, stopped at the end."""
    client = seaweedfs.client()
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET)
    workdir = tmp_path_factory.mktemp("objcache-gateways")
    base = gateway_config(seaweedfs, BUCKET, seaweedfs.access_key, seaweedfs.secret_key,
                          theta_bytes=1, io_threads=4, io_timeout_s=30.0)  # theta 1 byte: always layerwise
    paced = GatewayProcess({**base, "bandwidth_cap_bytes_s": 1e6, "policy": "equal", "epoch_s": 0.01}, workdir / "paced")
    plain = GatewayProcess(base, workdir / "plain")
    try:
        paced.start()
        plain.start()
        yield {"paced": paced, "plain": plain}
    finally:
        paced.stop()
        plain.stop()


@pytest.fixture(scope="module")
def baseline(plain_engine):
    """Outputs of an engine without the connector: A after P (its own prefix-cache hit), A cold, PD sessions."""
    engine = plain_engine
    out: dict = {}
    engine.generate([P], MAX_TOKENS)
    out["A_after_P"] = engine.generate([A], MAX_TOKENS, reset_prefix_cache=False)[0]
    assert out["A_after_P"]["num_cached_tokens"] == len(P) // CHUNK * CHUNK
    out["B_after_P"] = engine.generate([B], MAX_TOKENS, reset_prefix_cache=False)[0]
    assert out["B_after_P"]["num_cached_tokens"] == len(P) // CHUNK * CHUNK
    out["A"] = engine.generate([A], MAX_TOKENS)[0]
    for side, appends in PD_SESSIONS.items():
        history: list[int] = []
        turns = []
        for turn, append in enumerate(appends):
            prompt = history + append
            engine.generate([prompt], 1, reset_prefix_cache=turn == 0)  # the PE's prefill
            result = engine.generate([prompt], PD_OUTPUT_TOKENS, reset_prefix_cache=False)[0]
            turns.append({"prompt": prompt, **result})
            history = prompt + result["tokens"]
        out[side] = turns
    return out


@pytest.fixture(scope="module")
def engine(tiny_model, seaweedfs, gateways, baseline):
    """One engine on the paced gateway, which first stores P's chunks itself (saves go to the bucket directly;
    each generate resets vLLM's prefix cache, so later hits come from the store)."""
    config = kv_config(s3agg_store(seaweedfs, gateways["paced"]))
    with Engine(tiny_model, config, s3=seaweedfs, max_num_batched_tokens=BATCH_TOKENS) as served:
        namespace, prefix = served.ready["namespace"], served.ready["key_prefix"]
        served.keys = [chunk_key(prefix, namespace, h) for h in chunk_hashes(namespace, P, CHUNK)]
        served.generate([P], MAX_TOKENS)
        s3 = seaweedfs.client()
        poll(lambda: sum(_stored(s3, key) for key in served.keys), lambda n: n == len(served.keys), 120,
             "P's chunks in the bucket")
        yield served


def _stored(s3, key: str) -> bool:
    try:
        s3.head_object(Bucket=BUCKET, Key=key)
        return True
    except s3.exceptions.ClientError:
        return False


def test_hit_arrives_layer_by_layer_and_matches(engine, seaweedfs, gateways, baseline):
    paced = gateways["paced"]
    before = gateway_metric(paced, "s3agg_requests_total", mode="layerwise", outcome="ok")
    out = engine.generate([A], MAX_TOKENS)[0]
    assert out["num_cached_tokens"] == len(P) // CHUNK * CHUNK
    assert same(out, baseline["A_after_P"])
    # The hit came through the gateway, layer by layer, in one request.
    assert gateway_metric(paced, "s3agg_requests_total", mode="layerwise", outcome="ok") == before + 1
    # Negative control: the comparison sees wrong KV that came the same way. The request above saved A's own
    # chunks past P; once they landed, A is served again (its whole claimable prompt a hit) as the reference,
    # then with chunk 4's KV resealed under a valid checksum trailer for chunk 5 (what the checksum mode cannot
    # catch): the loaded set holds chunk 4 twice and chunk 5 not at all, everything else as in the reference,
    # so the answer must change. (Not a cold run of A: on hosts whose CPU attention uses AMX, a cold prefill
    # computes bit-identical KV in any chunking.)
    s3 = seaweedfs.client()
    a_keys = [chunk_key(engine.ready["key_prefix"], engine.ready["namespace"], h)
              for h in chunk_hashes(engine.ready["namespace"], A[: (len(A) - 1) // CHUNK * CHUNK], CHUNK)]  # fmt: skip
    poll(lambda: sum(_stored(s3, key) for key in a_keys), lambda n: n == len(a_keys), 120, "A's chunks in the bucket")
    reference = engine.generate([A], MAX_TOKENS)[0]
    assert reference["num_cached_tokens"] == len(a_keys) * CHUNK
    original = s3.get_object(Bucket=BUCKET, Key=engine.keys[5])["Body"].read()
    forged = resealed(s3.get_object(Bucket=BUCKET, Key=engine.keys[4])["Body"].read(),
                      engine.keys[5].rsplit("/", 1)[1], NUM_LAYERS)  # fmt: skip
    s3.put_object(Bucket=BUCKET, Key=engine.keys[5], Body=forged)
    try:
        wrong = engine.generate([A], MAX_TOKENS)[0]
    finally:
        s3.put_object(Bucket=BUCKET, Key=engine.keys[5], Body=original)
    assert wrong["num_cached_tokens"] == reference["num_cached_tokens"]  # the forged chunk was served
    assert not same(wrong, reference), "forged KV through the gateway went unnoticed"


def test_layer_failing_its_check_mid_forward_is_recomputed(engine, seaweedfs, baseline):
    """Layer 2's digest of one chunk is bad: layer 0 verifies, the hit is reported, the forward fails the chunk
    at layer 2, and vLLM recomputes from it."""
    s3 = seaweedfs.client()
    key = engine.keys[BOUNDARY_CHUNK]
    original = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    layout = BlockLayout(NUM_LAYERS, len(original) // NUM_LAYERS - DIGEST_BYTES)
    assert layout.object_bytes == len(original)
    broken = bytearray(original)
    broken[layout.digest_range(2)[0]] ^= 0xFF
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(broken))
    try:
        out = engine.generate([A], MAX_TOKENS)[0]
    finally:
        # The reader deleted the bad chunk; the next test needs the whole hit back.
        s3.put_object(Bucket=BUCKET, Key=key, Body=original)
    assert same(out, baseline["A"])
    log = engine.log_text()
    assert f"store chunk {key} failed its integrity check" in log and "did not land intact" in log


def test_gateway_killed_mid_load_falls_back_to_plain_s3(engine, gateways, baseline):
    """Runs last against the paced gateway: it does not come back. The layers not yet delivered are read by
    plain ranged GETs, and the output is still the stored KV's."""
    paced = gateways["paced"]
    result: dict = {}
    request = threading.Thread(target=lambda: result.update(out=engine.generate([B], MAX_TOKENS)[0]))
    request.start()
    try:
        poll(lambda: gateway_metric(paced, "s3agg_active_requests"), lambda v: v >= 1, 120, "a gateway request")
    finally:
        os.killpg(paced.proc.pid, signal.SIGKILL)
        paced.proc.wait()
        request.join()
    assert "falls back to plain S3 range reads" in engine.log_text()
    assert result["out"]["num_cached_tokens"] == len(P) // CHUNK * CHUNK
    assert same(result["out"], baseline["B_after_P"])


@pytest.fixture(scope="module")
def cluster(tiny_model, seaweedfs, gateways, tmp_path_factory):
    """A PE and a DE whose store is s3agg (the unpaced gateway)."""
    logs = tmp_path_factory.mktemp("objcache-pd")
    options = {"bucket": BUCKET, "max_num_batched_tokens": BATCH_TOKENS, "keys": ClusterKeys.generate(),
               "extra": {"store": s3agg_store(seaweedfs, gateways["plain"])}}
    with pd_pair(tiny_model, seaweedfs, logs, **options) as pair:
        yield pair


@dataclasses.dataclass(frozen=True)
class HitReads:
    """Chunks a PD session's hits counted: read by the PE from its store (``bytes_read``), read by the DE for the
    PE (``bytes_read_for_peer``), and the gateway's successful reads and the chunks it delivered."""

    pe_chunks: int
    de_chunks: int
    gateway_requests: int
    gateway_chunks: int


def read_through_gateway(reads: HitReads, side: str) -> bool:
    """``side`` alone read the hits, every chunk of them delivered by the gateway (none read around it)."""
    mine, other = (reads.de_chunks, reads.pe_chunks) if side == "de" else (reads.pe_chunks, reads.de_chunks)
    return mine > 0 and other == 0 and reads.gateway_requests > 0 and reads.gateway_chunks == mine


def hit_read_totals(pe, de, gateway: GatewayProcess) -> HitReads:
    """The counters of :class:`HitReads` now, after an engine step on each engine (vLLM exports connector stats
    with steps)."""
    layout = pe.key_space().layout
    for server in (pe, de):
        server.post("/v1/completions", {"model": str(server.model), "prompt": [1, 2, 3], "max_tokens": 1})
    return HitReads(
        int(pe.metric_total(counter_total_name("bytes_read"))) // layout.full_block_bytes,
        int(de.metric_total(counter_total_name("bytes_read_for_peer"))) // layout.full_block_bytes,
        int(gateway_metric(gateway, "s3agg_requests_total", outcome="ok")),
        int(gateway_metric(gateway, "s3agg_delivered_bytes_total")) // layout.object_bytes,
    )


def test_the_gateway_verdict_refuses_a_read_around_it():
    """A DE read of 18 chunks through the gateway passes; the same read served by plain S3 after a gateway
    failure (nothing delivered), one the PE shared, or the PE's read do not."""
    assert read_through_gateway(HitReads(0, 18, 1, 18), "de")
    assert not read_through_gateway(HitReads(0, 18, 0, 0), "de")
    assert not read_through_gateway(HitReads(18, 18, 2, 36), "de")
    assert not read_through_gateway(HitReads(18, 0, 1, 18), "de")


@pytest.mark.parametrize("read_side", PD_SIDES)
def test_pd_session_with_s3agg_store(read_side, cluster, gateways, seaweedfs, baseline, tmp_path):
    pe, de = cluster
    plain = gateways["plain"]
    before = hit_read_totals(pe, de, plain)
    hit_tokens = 0
    router = RouterProcess([pe], [de], seaweedfs, tmp_path, read_side=read_side).start()
    try:
        for turn, expected in enumerate(baseline[read_side]):
            out, headers = through_router(router, expected["prompt"], PD_OUTPUT_TOKENS)
            assert same(out, expected), f"turn {turn} differs from the engine without the connector"
            de.wait_stored(expected["prompt"] + out["tokens"][:-1])
            assert headers["x-dualpath-read-side"] == read_side
            hit_tokens += int(headers["x-dualpath-hit-tokens"])
            if turn:
                assert int(headers["x-dualpath-hit-tokens"]) > 0
    finally:
        router.stop()

    def grown() -> HitReads:
        now = hit_read_totals(pe, de, plain)
        return HitReads(*(getattr(now, f.name) - getattr(before, f.name) for f in dataclasses.fields(HitReads)))

    # The second turn's hit was read by the side asked for and by it alone, through the gateway: layerwise into
    # the PE's pool, or into the DE's buffer, which the PE then READs; every hit chunk delivered by the gateway.
    # The control: the other side's session, where the same verdict for this side must be false.
    hit_chunks = hit_tokens // CHUNK
    reads = poll(grown, lambda r: r.pe_chunks + r.de_chunks >= hit_chunks, 60, f"the reads of {hit_chunks} hit chunks")
    assert read_through_gateway(reads, read_side), reads
    assert not read_through_gateway(reads, "pe" if read_side == "de" else "de"), reads
    assert reads.gateway_chunks == hit_chunks, reads
    for server in (pe, de):
        assert "NIXL notification for no registered owner" not in server.log_path.read_text(errors="replace")
