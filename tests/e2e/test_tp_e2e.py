"""Tensor parallelism (TP = 2) on vLLM's CPU build (gloo, the mp executor): one engine, and a PE/DE pair.

Each rank saves and loads its own shard of every chunk (its KV heads) under its own namespace; chunk hashes
chain from rank 0's namespace (the engine's), and rank 1 keys its shard under the hash chained once more with
its own namespace; a chunk is a hit when both shards are stored. In PD, rank r serves its side channel at
``side_channel_port + r`` and pulls from, reads for and hands hits to rank r of the other engine.

Every output must equal, token for token and logprob for logprob, an engine's without the connector at the
same TP. Negative controls: rank 1's shard of one chunk replaced by its shard of another chunk, resealed with
a valid checksum trailer: the loaded set of keys and values changes on one rank only, and the answer must
change (so rank 1's shard is really loaded, and the comparison can fail).

The PD pair's store is the second S3 server, versitygw over TLS (``ca_bundle``), not SeaweedFS: under the
suite's load SeaweedFS's all-in-one server lost its own volume server (its log: gRPC keepalive pings unanswered,
"Removing Volume ... from the dead volume server", then "all filers failed" on every GET for minutes), or stopped
serving chunk reads for about 30 s, in most runs. A turn whose hit the store then failed is recomputed, which is
right but not bit for bit the hit path the baseline follows, so this module failed on the store, not on TP.
versitygw serves objects from plain files in one process.
"""

from __future__ import annotations

import random

import pytest

from dualpath_connector.protocol import StoreKeySpace, counter_total_name
from dualpath_dev.engines import ClusterKeys
from dualpath_dev.tiny_model import TINY_LLAMA
from nixl_backends.layout import chunk_hashes, chunk_key, shard_chunk_hash
from tests.conftest import PLAIN_ENGINE_BATCH_TOKENS, NixlStyleProxy, pd_pair, poll, resealed, same
from tests.vllm_engine import Engine

pytestmark = pytest.mark.engine

TP = 2
CHUNK = 32
LAYERS = TINY_LLAMA["num_hidden_layers"]
MAX_TOKENS = 24
_rng = random.Random(2024)
P = [_rng.randrange(1024) for _ in range(1500)]
A = P + [_rng.randrange(1024) for _ in range(40)]
HIT = len(P) // CHUNK * CHUNK

# PD: one session of five turns through a P/D proxy in NixlConnector's convention; each turn after the
# first hits the chunks of the turns before it. Per turn, the proxy's flags and who reads the hit: the first
# turn misses; "pe": the proxy names no DE (the PE reads); "de": it names the DE with read side "de";
# "split": it names the DE with read side "pe", and the PE, its read rate measured by then, reads the hit's
# head and the DE its tail; "forged": a PE read with rank 1's shard of one chunk forged (the control).
OUTPUT_TOKENS = 2 * CHUNK
SPLIT_READ_MIN_TOKENS = 8 * CHUNK
BUCKET = "dualpath-tp"
TURNS = ("miss", "pe", "de", "split", "forged")
_session = random.Random(404)
APPENDS = [[_session.randrange(1024) for _ in range(24 * CHUNK + 1)]]
APPENDS += [[_session.randrange(1024) for _ in range(8 * CHUNK)] for _ in TURNS[1:]]


def dualpath(root) -> dict:
    return {
        "kv_connector": "DualPathConnector",
        "kv_connector_module_path": "dualpath_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": {"backend": "posix", "root": str(root)}},
    }


@pytest.fixture(scope="module")
def baseline(tiny_model) -> dict:
    """An engine without the connector at the same TP, stopped before the engines under test start.

    ``"A"``: A after P (its own prefix-cache hit of P's chunks). ``"session"``, per turn: the prompt and the
    output, served as the PE and the DE serve it: a DE gets every prompt block from its PE and recomputes
    only the last prompt token, so the turn is replayed with ``max_tokens=1`` first and then served with a
    prefix-cache hit of all but its last token.
    """
    with Engine(tiny_model, tensor_parallel_size=TP, max_num_batched_tokens=PLAIN_ENGINE_BATCH_TOKENS) as plain:
        plain.generate([P], MAX_TOKENS)
        out = {"A": plain.generate([A], MAX_TOKENS, reset_prefix_cache=False)[0]}
        assert out["A"]["num_cached_tokens"] == HIT
        history: list[int] = []
        out["session"] = []
        for turn, append in enumerate(APPENDS):
            prompt = history + append
            plain.generate([prompt], 1, reset_prefix_cache=turn == 0)
            result = plain.generate([prompt], OUTPUT_TOKENS, reset_prefix_cache=False)[0]
            assert result["num_cached_tokens"] == len(prompt) - 1
            out["session"].append({"prompt": prompt, **result})
            history = prompt + result["tokens"]
    return out


def test_kv_both_each_rank_stores_and_loads_its_shard_and_the_answer_matches(tiny_model, tmp_path, baseline):
    config = dualpath(tmp_path)
    with Engine(tiny_model, config, tensor_parallel_size=TP, max_num_batched_tokens=PLAIN_ENGINE_BATCH_TOKENS) as engine:
        namespaces, prefix = engine.ready["namespaces"], engine.ready["key_prefix"]
        assert len(set(namespaces)) == TP  # a namespace per rank: no rank writes another's object

        def object_hash(rank: int, chunk: int) -> str:
            engine_hash = chunk_hashes(namespaces[0], P, CHUNK)[chunk]
            return shard_chunk_hash(namespaces[rank], engine_hash) if rank else engine_hash

        def path(rank: int, chunk: int):
            return tmp_path / chunk_key(prefix, namespaces[rank], object_hash(rank, chunk))

        engine.generate([P], MAX_TOKENS)
        chunks = len(P) // CHUNK
        poll(lambda: sum(path(r, c).exists() for r in range(TP) for c in range(chunks)),
             lambda n: n == TP * chunks, 120, "every rank's chunks of P")  # fmt: skip

        out = engine.generate([A], MAX_TOKENS)[0]  # the prefix cache is reset: the hit comes from the store
        assert out["num_cached_tokens"] == HIT
        assert same(out, baseline["A"]), "KV loaded shard by shard changed the output"

        original = path(1, 5).read_bytes()
        path(1, 5).write_bytes(resealed(path(1, 4).read_bytes(), object_hash(1, 5), LAYERS))
        try:
            wrong = engine.generate([A], MAX_TOKENS)[0]
        finally:
            path(1, 5).write_bytes(original)
        assert wrong["num_cached_tokens"] > 6 * CHUNK  # the forged shard (chunk 5) was served
        assert not same(wrong, baseline["A"]), "rank 1's forged shard went unnoticed: the comparison cannot fail"


@pytest.fixture(scope="module")
def cluster(baseline, tiny_model, versitygw, tmp_path_factory):
    """A PE and a DE, each at TP = 2 (after the baseline engine stopped: four workers on this machine's cores)."""
    logs = tmp_path_factory.mktemp("tp-pd-logs")
    options = {"bucket": BUCKET, "max_num_batched_tokens": PLAIN_ENGINE_BATCH_TOKENS, "keys": ClusterKeys.generate(),
               # Two TP=2 engines share two cores with the rest of the suite: a rank's side channel can wait its
               # turn for tens of seconds. The deadlines are set so that the behaviour each turn claims must
               # happen, not may: a DE read or a split's tail is never given up as late (de_read_timeout_s, and
               # moved_read_min_deadline_s for the split's estimate), and a hold outlasts them (pd_lease_s).
               "extra": {"split_read_min_tokens": SPLIT_READ_MIN_TOKENS, "de_read_timeout_s": DE_DEADLINE_S,
                         "moved_read_min_deadline_s": DE_DEADLINE_S, "pd_lease_s": 2 * DE_DEADLINE_S,
                         "retries_within_recompute": False},
               # The store's GETs get STORE_IO_TIMEOUT_S (30 s by default): in one CI run both PE ranks' first
               # GETs ended 40 and 50 s after they were sent; abandoned at 30 s, the turn was recomputed. In two
               # suite runs a DE rank's GETs went unanswered for 105-112 s (in the second, versitygw's access log
               # shows each answered at once when it arrived, the SDK sending them again): below DE_DEADLINE_S, the DE's store gives
               # up first and says so, a fallback the test tells apart from a late DE (or, where the DE's read began
               # late, gives up after the PE's deadline: the DE's log says so). A GET that failed is sent
               # again however long the recompute would take (retries_within_recompute).
               "store_options": {"io_timeout_s": STORE_IO_TIMEOUT_S},
               "tensor_parallel_size": TP}  # fmt: skip
    with pd_pair(tiny_model, versitygw, logs, **options) as pair:
        yield pair


def _grown(counters, before: dict[str, float]) -> set[str]:
    """The counters that grew, after one more step of each engine (vLLM exports connector stats with steps)."""
    for engine in {id(e): e for e, _ in counters}.values():
        engine.post("/v1/completions", {"model": str(engine.model), "prompt": [1, 2, 3], "max_tokens": 1})
    return {name for e, name in counters if e.metric_total(counter_total_name(name)) > before[name]}


def _forge_rank_1_shard(de, store, prompt: list[int]) -> None:
    """Rank 1's shard of chunk 5 of ``prompt`` becomes its shard of chunk 4, under a trailer that verifies: sealed
    with the deployment's integrity key (configs/ run integrity: keyed), as only a keyholder could."""
    shards = StoreKeySpace.from_metrics(de.metrics_text()).shards
    assert len(shards) == TP
    hashes = chunk_hashes(shards[1].chain_digest, prompt, CHUNK)
    s3 = store.client()
    body = s3.get_object(Bucket=BUCKET, Key=shards[1].key(hashes[4]))["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=shards[1].key(hashes[5]),
                  Body=resealed(body, shards[1].object_hash(hashes[5]), LAYERS, de.keys.integrity_key()))


# Per turn: the counters that must grow, the sides that read the hit and the DE's copy of the prompt.
# Split: the PE reads the head, each DE rank the tail of its shard. The DE's prompt arrives pulled from the PE
# or kept from its own read for the PE.
READ_BY = {"pe": {"bytes_read"}, "de": {"bytes_read_for_peer"}, "forged": {"bytes_read"},
           "split": {"bytes_read", "split_read_tail_tokens", "bytes_read_for_peer"}}  # fmt: skip
PROMPT_ARRIVED = {"pulled_tokens", "kept_tokens"}
# What must not grow in any turn: a DE read declined (the PE would read it itself, which the output cannot tell
# apart) and a failed pull (the DE would recompute the prompt). A fallback (de_read_fallbacks) is allowed only
# where the DE's store failed the read: then the PE names that refusal in its log.
NEVER = {"de_reads_declined", "pull_failed_tokens"}
GAVE_UP = {"de_read_fallbacks", "load_failed_tokens", *NEVER}
STORE_REFUSAL = "refused 'read': store read"
DE_STORE_ABANDON = "a read for a peer: store transfer abandoned"
DE_DEADLINE_S = 90.0
STORE_IO_TIMEOUT_S = 60.0


def _log_lines(engine, line: str) -> int:
    """How often ``line`` is in the engine's log: STORE_REFUSAL in the PE's (one per DE read it fell back from
    because the DE's own store read failed), DE_STORE_ABANDON in the DE's (one per rank's read for the PE that its
    store gave up, answered in time or not)."""
    return engine.log_path.read_text(errors="replace").count(line)


def _turn_counters_grew(turn: str, names: set[str]) -> bool:
    """Whether the turn's work is counted, or a give-up that would replace it is."""
    return bool(names & GAVE_UP) or (READ_BY[turn] <= names and (turn == "forged" or bool(names & PROMPT_ARRIVED)))


def test_pd_pair_at_tp2_hands_off_reads_on_either_side_and_splits(cluster, baseline, versitygw, tmp_path):
    pe, de = cluster
    named = ["--de-side-channel", de.side_channel]
    flags = {"miss": [], "pe": [], "forged": [], "de": [*named, "--read-side", "de"], "split": [*named, "--read-side", "pe"]}
    counters = [(pe, "bytes_read"), (de, "bytes_read_for_peer"), (de, "pulled_tokens"), (de, "kept_tokens"),
                (de, "pull_failed_tokens"), (pe, "split_read_tail_tokens"), (pe, "de_read_fallbacks"),
                (de, "de_reads_declined"), (pe, "corrupt_chunks"), (pe, "load_failed_tokens")]  # fmt: skip
    read_by_de = []  # the turns whose hit the DE read (not excused by a store failure)
    for turn, expected in zip(TURNS, baseline["session"]):
        before = {name: e.metric_total(counter_total_name(name)) for e, name in counters}
        store_refusals, de_abandons = _log_lines(pe, STORE_REFUSAL), _log_lines(de, DE_STORE_ABANDON)
        if turn == "forged":
            _forge_rank_1_shard(de, versitygw, expected["prompt"])
        proxy = NixlStyleProxy(pe, de, tmp_path / f"proxy-{turn}.log", *flags[turn]).start(timeout_s=120)
        try:
            out = proxy.complete(expected["prompt"], OUTPUT_TOKENS)
        finally:
            proxy.stop()
        if turn == "forged":
            assert not same(out, expected), "rank 1's forged shard went unnoticed: the comparison cannot fail"
        else:
            assert same(out, expected), (f"turn {turn!r} differs from the engine without the connector; warnings:\n"
                                         f"PE: {pe.warning_lines()}\nDE: {de.warning_lines()}")  # fmt: skip
            de.wait_stored(expected["prompt"] + out["tokens"][:-1])  # every rank's shard, for the next turn's hit
        if turn in READ_BY:
            grown = poll(lambda: _grown(counters, before), lambda names: _turn_counters_grew(turn, names),
                         60, f"the counters of the {turn!r} turn")  # fmt: skip
            assert not grown & NEVER, f"turn {turn!r} declined a DE read or failed a pull: {sorted(grown)}"
            # A DE read may fall back only where the DE's store failed it (its S3 GET hung past the store's
            # io_timeout_s: seen on an idle machine too), never for being late or declined.
            fallbacks = pe.metric_total(counter_total_name("de_read_fallbacks")) - before["de_read_fallbacks"]
            assert fallbacks >= _log_lines(pe, STORE_REFUSAL) - store_refusals
            if fallbacks:
                # The DE's store failed them: in time (the PE names each refusal), or after the PE's deadline (a
                # DE read that began late on the loaded machine, the suite at 5579def: the DE's log names each,
                # within the store's io_timeout_s of the read's start).
                poll(lambda: max(_log_lines(pe, STORE_REFUSAL) - store_refusals,
                                 _log_lines(de, DE_STORE_ABANDON) - de_abandons),
                     lambda failed: failed >= fallbacks, STORE_IO_TIMEOUT_S + 30,
                     f"turn {turn!r}: DE store failures behind {fallbacks} DE read fallbacks; PE: "
                     f"{pe.warning_lines()}\nDE: {de.warning_lines()}")  # fmt: skip
            # The PE's own store read can hang the same way (its load fails and the PE recomputes: counted).
            store_failed = bool(fallbacks) or "load_failed_tokens" in grown
            if not store_failed:
                assert READ_BY[turn] <= grown and (turn == "forged" or grown & PROMPT_ARRIVED), sorted(grown)
                read_by_de += [turn] if "bytes_read_for_peer" in READ_BY[turn] else []
            assert "corrupt_chunks" not in grown  # the forged shard verified: its KV, not a recompute, changed the answer
            if turn == "pe":
                # The DE was not named: nothing asked of it. This turn is also the split's control: with no DE
                # to give a tail to, the counters the split turn requires stay flat.
                assert not grown & {"bytes_read_for_peer", "split_read_tail_tokens"}
                assert not READ_BY["split"] <= grown
            if turn == "de" and not store_failed:
                # Every DE rank read its shard: a PE rank left without one would have read it itself.
                assert "bytes_read" not in grown and "split_read_tail_tokens" not in grown
    # A store failure excuses one turn, not the path: the DE read a hit for the PE in a turn that claims it
    # (de, split), or the test would pass with every DE read falling back to the PE.
    assert read_by_de, "no turn's hit was read by the DE: every DE read fell back on a store failure"
