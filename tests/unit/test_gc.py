"""``dualpath-kv gc`` without a store: which chunks go for a budget or an age, sizes and durations, argument errors;
and the lookup cache forgetting a remembered chunk after its ``ttl_s``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dualpath_connector.cli import main, parse_duration, parse_size
from nixl_backends.gc import Cutoff, GcPolicy, KeyPattern, Selection, StoredObject, plan_cutoff, run_gc
from nixl_backends.lookup import PresentChunks

S = 1_000_000_000  # ns per second
NOW = 1_800_000_000 * S
NS = "ab" * 16


def obj(name: str, size: int, age_s: float, *, partial: bool = False) -> StoredObject:
    return StoredObject(name, NS, size, NOW - int(age_s * S), partial)


def chosen(objects: list[StoredObject], policy: GcPolicy) -> list[str]:
    """The names gc would delete from this listing (both passes over the same listing)."""
    chunks = [o for o in objects if not o.partial]
    used = np.array([o.used_ns for o in chunks], dtype=np.int64)
    sizes = np.array([o.size for o in chunks], dtype=np.int64)
    selection = Selection(plan_cutoff(used, sizes, policy, NOW), NOW - int(policy.partial_max_age_s * S))
    return [o.key for o in objects if selection.takes(o)]


# Listing order is not age order, as in a directory listing.
OBJECTS = [obj("c", 100, 30), obj("a", 100, 50), obj("d", 100, 20), obj("b", 100, 40), obj("e", 100, 10)]


# --- planning ------------------------------------------------------------------------------------


def test_budget_deletes_the_least_recently_used_until_it_fits():
    assert sorted(chosen(OBJECTS, GcPolicy(max_bytes=300))) == ["a", "b"]
    assert sorted(chosen(OBJECTS, GcPolicy(max_bytes=250))) == ["a", "b", "c"]  # 300 is still over
    assert chosen(OBJECTS, GcPolicy(max_bytes=500)) == []  # exactly at the budget: nothing goes
    assert sorted(chosen(OBJECTS, GcPolicy(max_bytes=0))) == ["a", "b", "c", "d", "e"]


def test_budget_counts_sizes_not_objects():
    objects = [obj("big-old", 400, 50), obj("small-new", 10, 5), obj("mid", 100, 20)]
    assert chosen(objects, GcPolicy(max_bytes=110)) == ["big-old"]


def test_age_deletes_what_was_unused_for_longer():
    assert sorted(chosen(OBJECTS, GcPolicy(max_age_s=35))) == ["a", "b"]
    assert chosen(OBJECTS, GcPolicy(max_age_s=50)) == []  # exactly 50 s old is not older than 50 s
    assert chosen(OBJECTS, GcPolicy(max_age_s=3600)) == []


def test_budget_and_age_together_delete_whichever_is_more():
    assert sorted(chosen(OBJECTS, GcPolicy(max_bytes=400, max_age_s=25))) == ["a", "b", "c"]  # age wins
    assert sorted(chosen(OBJECTS, GcPolicy(max_bytes=200, max_age_s=45))) == ["a", "b", "c"]  # budget wins


def test_equal_timestamps_are_split_to_just_meet_the_budget():
    # S3's LastModified has seconds: many chunks share one.
    objects = [obj(f"t{i}", 100, 30) for i in range(4)] + [obj("old", 100, 60), obj("new", 100, 1)]
    assert chosen(objects, GcPolicy(max_bytes=400)) == ["t0", "old"]  # old first, then one of the tie
    assert plan_cutoff(np.array([NOW - 30 * S] * 4 + [NOW - 60 * S, NOW - S]), np.full(6, 100),
                       GcPolicy(max_bytes=400), NOW) == Cutoff(NOW - 30 * S, 100)  # fmt: skip


def test_a_chunk_used_after_the_planning_pass_stays():
    # Planned on one listing, selected on a later one in which "a" was read meanwhile.
    used = np.array([o.used_ns for o in OBJECTS], dtype=np.int64)
    sizes = np.array([o.size for o in OBJECTS], dtype=np.int64)
    selection = Selection(plan_cutoff(used, sizes, GcPolicy(max_bytes=300), NOW), 0)
    relisted = [obj("a", 100, 0) if o.key == "a" else o for o in OBJECTS]
    assert [o.key for o in relisted if selection.takes(o)] == ["b"]


def test_interrupted_writes_go_by_their_own_age_whatever_the_budget():
    objects = OBJECTS + [obj("stale.tmp", 999, 7200, partial=True), obj("writing.tmp", 999, 5, partial=True)]
    assert chosen(objects, GcPolicy(max_bytes=10_000)) == ["stale.tmp"]
    assert sorted(chosen(objects, GcPolicy(max_bytes=300))) == ["a", "b", "stale.tmp"]  # temps are not chunks


def test_policy_needs_a_limit_and_refuses_negatives():
    with pytest.raises(ValueError, match="max_bytes and/or max_age_s"):
        GcPolicy()
    with pytest.raises(ValueError, match="max_age_s"):
        GcPolicy(max_age_s=-1)


class ListedChunks:
    """A store as gc sees it, in memory; ``delete`` refuses the keys in ``refuse``."""

    def __init__(self, objects: list[StoredObject], refuse: frozenset[str] = frozenset()) -> None:
        self.objects = {o.key: o for o in objects}
        self.refuse = refuse
        self.delete_calls: list[int] = []

    def scan(self):
        return iter(list(self.objects.values()))

    def delete(self, batch):
        self.delete_calls.append(len(batch))
        done = [o for o in batch if o.key not in self.refuse]
        for o in done:
            del self.objects[o.key]
        return done

    def describe(self) -> str:
        return "memory"


def test_run_gc_reports_before_deleted_after_and_batches_deletes():
    objects = [obj(f"k{i:04d}", 10, 10_000 - i) for i in range(2500)]  # k0000 is the oldest
    chunks = ListedChunks(objects)
    report = run_gc(chunks, GcPolicy(max_bytes=10 * 300), now_ns=NOW)
    assert (report.before.objects, report.before.bytes) == (2500, 25_000)
    assert (report.deleted.objects, report.after.objects, report.after.bytes) == (2200, 300, 3000)
    assert chunks.delete_calls == [1000, 1000, 200]
    assert sorted(chunks.objects) == [f"k{i:04d}" for i in range(2200, 2500)]  # the newest 300 stay
    assert report.before_by_namespace == {NS: report.before}


def test_run_gc_dry_run_deletes_nothing_and_counts_refusals():
    chunks = ListedChunks(list(OBJECTS))
    seen = []
    report = run_gc(chunks, GcPolicy(max_bytes=300), dry_run=True, now_ns=NOW, on_selected=seen.append)
    assert sorted(o.key for o in seen) == ["a", "b"] and report.deleted.objects == 2
    assert chunks.delete_calls == [] and len(chunks.objects) == 5
    refused = run_gc(ListedChunks(list(OBJECTS), frozenset({"a"})), GcPolicy(max_bytes=300), now_ns=NOW)
    assert (refused.failed, refused.deleted.objects, refused.after.objects) == (1, 1, 4)


def test_key_pattern_takes_only_chunk_keys_of_the_chosen_namespaces():
    other = "cd" * 16
    chunk_hash = "5f" + "0" * 62
    keys = KeyPattern("/dualpath/", [NS])
    assert keys.parse(f"dualpath/{NS}/5f/{chunk_hash}") == (NS, False)
    assert keys.parse(f"dualpath/{NS}/5f/{chunk_hash}.{'e' * 32}.tmp") == (NS, True)
    assert keys.parse(f"dualpath/{other}/5f/{chunk_hash}") is None  # not asked for
    assert keys.parse(f"dualpath/{NS}/00/{chunk_hash}") is None  # fan-out does not match the hash
    assert keys.parse(f"dualpath/{NS}/5f/{chunk_hash}.bak") is None
    assert keys.parse(f"dualpath/{NS}/5f/{chunk_hash[:-1]}") is None  # not a chunk hash's length
    assert keys.parse(f"dualpath/{NS}/5f/{chunk_hash}0") is None
    assert keys.parse(f"other/{NS}/5f/{chunk_hash}") is None
    assert keys.list_prefixes() == [f"dualpath/{NS}/"]
    everything = KeyPattern("", None)
    assert everything.parse(f"{other}/5f/{chunk_hash}") == (other, False)
    assert everything.list_prefixes() == [""]


# --- sizes, durations, arguments -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("10GiB", 10 * 2**30), ("10gib", 10 * 2**30), ("500G", 500 * 10**9), ("2TB", 2 * 10**12),
     ("1.5 MiB", 3 * 2**19), ("4096", 4096), ("0", 0), ("7KiB", 7168), ("3k", 3000)],
)  # fmt: skip
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text, expected", [("7d", 7 * 86400), ("12h", 43200), ("30m", 1800), ("45s", 45), ("2w", 14 * 86400),
                       ("90", 90), ("1.5h", 5400)]
)  # fmt: skip
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


POSIX = json.dumps({"backend": "posix", "root": "/nonexistent-but-never-opened"})


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--store", POSIX, "--all-namespaces", "--max-bytes", "10XB"], "--max-bytes"),
        (["--store", POSIX, "--all-namespaces", "--max-bytes", "-5GiB"], "--max-bytes"),
        (["--store", POSIX, "--all-namespaces", "--max-age", "7 days"], "--max-age"),
        (["--store", POSIX, "--all-namespaces", "--max-age", "1d", "--tmp-max-age", "soon"], "--tmp-max-age"),
        (["--store", POSIX, "--namespace", "NotHex", "--max-age", "1d"], "--namespace"),
        (["--store", POSIX, "--all-namespaces", "--key-prefix", "a/../b", "--max-age", "1d"], "--key-prefix"),
        (["--store", POSIX, "--all-namespaces"], "--max-bytes and/or --max-age"),
        (["--store", POSIX, "--max-age", "1d"], "--namespace --all-namespaces"),  # one is required
        (["--all-namespaces", "--max-age", "1d"], "--store --store-file"),
        (["--store", "{not json", "--all-namespaces", "--max-age", "1d"], "--store: not JSON"),
        (["--store", '{"backend": "posix", "rot": "/x"}', "--all-namespaces", "--max-age", "1d"], "'rot'"),
        (["--store", '{"backend": "tape"}', "--all-namespaces", "--max-age", "1d"], "'backend'"),
        (["--store-file", "/nonexistent/store.json", "--all-namespaces", "--max-age", "1d"], "--store-file"),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["gc", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert option in err, err


def test_a_missing_posix_root_is_an_argument_error(tmp_path, capsys):
    store = json.dumps({"backend": "posix", "root": str(tmp_path / "typo")})
    with pytest.raises(SystemExit) as exited:
        main(["gc", "--store", store, "--all-namespaces", "--max-age", "1d"])
    assert exited.value.code == 2
    assert "--store: store.root: no such directory" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()  # gc never creates a store


@pytest.mark.parametrize("section", [
    {"backend": "s3", "bucket": "kv-bucket", "access_key": "AKIAEXAMPLE", "secret_key": "hunter2-secret"},
    {"backend": "s3agg", "gateway": "http://127.0.0.1:9100",
     "s3": {"bucket": "kv-bucket", "access_key": "AKIAEXAMPLE", "secret_key": "hunter2-secret"}},
])  # fmt: skip
def test_credentials_on_the_command_line_are_refused_without_echoing_them(section, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["gc", "--store", json.dumps(section), "--all-namespaces", "--max-age", "1d"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "access_key is not accepted" in err and "AWS_ACCESS_KEY_ID" in err
    assert "hunter2" not in err


# --- the lookup cache forgets after ttl_s --------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingStore:
    def __init__(self, present: set[str]) -> None:
        self.present = present
        self.calls = 0

    def lookup(self, keys) -> int:
        self.calls += 1
        run = 0
        while run < len(keys) and keys[run] in self.present:
            run += 1
        return run


KEYS = ["k0", "k1", "k2"]


def test_present_chunks_ttl_expires_remembered_answers():
    clock = Clock()
    cache = PresentChunks(100, ttl_s=60, clock=clock)
    store = CountingStore(set(KEYS))
    assert cache.leading_present(store, KEYS) == 3 and store.calls == 1
    clock.now += 59
    assert cache.known_run(KEYS) == 3  # still fresh: no store round trip
    assert cache.leading_present(store, KEYS) == 3 and store.calls == 1
    store.present.discard("k1")  # gc deleted it
    clock.now += 1  # 60 s after the store's answer: expired, although it was used meanwhile
    assert cache.known_run(KEYS) == 0
    assert cache.leading_present(store, KEYS) == 1 and store.calls == 2


def test_present_chunks_ttl_counts_from_the_latest_store_answer():
    clock = Clock()
    cache = PresentChunks(100, ttl_s=10, clock=clock)
    cache.remember(KEYS[:1])
    clock.now += 8
    cache.remember(KEYS)  # the store confirmed all three again
    clock.now += 8
    assert cache.known_run(KEYS) == 3
    clock.now += 2
    assert cache.known_run(KEYS) == 0


def test_present_chunks_without_ttl_never_expires():
    # Negative control for the two tests above: the same clock jumps change nothing.
    clock = Clock()
    cache = PresentChunks(100, clock=clock)
    cache.remember(KEYS)
    clock.now += 10**9
    assert cache.known_run(KEYS) == 3
    with pytest.raises(ValueError, match="ttl_s"):
        PresentChunks(100, ttl_s=0)
