"""Tests for omnidraft.shared.vocab.ngram_cache."""

from __future__ import annotations

import contextlib
import os
import random

import pytest

from omnidraft.proto import ngram_cache_pb2
from omnidraft.shared.vocab.ngram_cache import Entry, NgramCache, NgramCacheError, seed_from_tokenizers


def keys(cache: NgramCache) -> list[tuple[int, ...]]:
    return [e.draft_ids for e in cache.entries()]


def trie_keys(cache: NgramCache) -> set[tuple[int, ...]]:
    """Keys reachable in the trie; asserts that no empty node was left behind."""
    found: set[tuple[int, ...]] = set()

    def walk(node: dict, prefix: tuple[int, ...]) -> None:
        assert node, f"empty trie node left at {prefix}"
        for token, child in node.items():
            if isinstance(token, int):
                walk(child, (*prefix, token))
            else:
                found.add(prefix)

    if cache._root:
        walk(cache._root, ())
    return found


# --- matching -------------------------------------------------------------------------------


def test_longest_match_with_nested_keys() -> None:
    c = NgramCache()
    c.add([1, 2], 100)
    c.add([1, 2, 3], 200)
    c.add([1, 2, 3, 4, 5], 300)
    assert c.match([1, 2, 3, 4], 0) == (3, 200)  # (1,2,3,4,5) does not fit
    assert c.match([1, 2, 3, 4, 5, 6], 0) == (5, 300)
    assert c.match([1, 2, 9], 0) == (2, 100)
    assert c.match([9, 1, 2, 3], 1) == (3, 200)
    assert c.match([9, 1, 2, 3], 0) is None
    assert c.match([1, 3], 0) is None


def test_match_respects_end() -> None:
    c = NgramCache()
    c.add([1, 2], 100)
    c.add([1, 2, 3], 200)
    block = [7, 1, 2, 3, 8]
    assert c.match(block, 1) == (3, 200)
    assert c.match(block, 1, end=4) == (3, 200)
    assert c.match(block, 1, end=3) == (2, 100)
    assert c.match(block, 1, end=2) is None
    assert c.match(block, 1, end=99) == (3, 200)
    assert c.match(block, 5) is None
    with pytest.raises(ValueError):
        c.match(block, -1)


def test_single_ids_never_match() -> None:
    c = NgramCache()
    c.add([4, 5], 100)
    assert c.match([4], 0) is None
    assert c.match([4, 5], 1) is None
    assert c.match([4, 6], 0) is None
    assert c.match([4, -1, 5], 0) is None  # padding-like ids are just misses


def test_match_is_pure() -> None:
    c = NgramCache(policy="lfu")
    c.add([1, 2], 100)
    before = list(c.entries()), c.to_bytes()
    for _ in range(3):
        assert c.match([1, 2], 0) == (2, 100)
    assert (list(c.entries()), c.to_bytes()) == before


# --- add / conflicts / lookups ----------------------------------------------------------------


def test_add_recount_get_contains_len() -> None:
    c = NgramCache()
    assert c.add([1, 2], 100) is True
    assert c.add([1, 2], 100, count=4) is False
    assert c.add((3, 4, 5), 101) is True
    assert len(c) == 2
    assert c.get([1, 2]) == 100 and c.get((3, 4, 5)) == 101 and c.get([3, 4]) is None
    assert [1, 2] in c and (3, 4, 5) in c and (3, 4) not in c and 7 not in c
    [e12] = [e for e in c.entries() if e.draft_ids == (1, 2)]
    assert e12 == Entry((1, 2), 100, 5, 0, 2)  # count 1 + 4; last_used = clock of the re-add


def test_conflicting_target_keeps_majority() -> None:
    c = NgramCache()
    c.add([1, 2], 100, count=3)
    c.record_hit([1, 2])
    c.add([1, 2], 200, count=2)  # 3 vs 2: keep 100, net count 1
    assert c.get([1, 2]) == 100 and next(c.entries()).count == 1
    c.add([1, 2], 200)  # 3 vs 3: tie keeps the stored target, net count 0
    assert c.get([1, 2]) == 100 and next(c.entries()).count == 0
    c.add([1, 2], 200)  # 3 vs 4: switch
    e = next(c.entries())
    assert (e.target_id, e.count, e.hits) == (200, 1, 1)  # hits survive the switch
    assert c.match([1, 2], 0) == (2, 200)
    c.add([1, 2], 300, count=5)  # one big conflicting observation wins outright
    assert c.get([1, 2]) == 300 and next(c.entries()).count == 4


@pytest.mark.parametrize(
    "args",
    [
        ([1], 5),
        ([], 5),
        ([1, -2], 5),
        ([1, 2], -1),
        ([1, 2], 2**32),
        ([1, 2**32], 0),
        ([1, 2], 5, 0),
    ],
)
def test_bad_add_raises_value_error(args: tuple) -> None:
    c = NgramCache()
    with pytest.raises(ValueError):
        c.add(*args)
    assert len(c) == 0


@pytest.mark.parametrize("kwargs", [{"policy": "fifo"}, {"policy": "LRU"}, {"max_entries": 0}, {"max_bytes": 1}])
def test_bad_constructor_raises_value_error(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        NgramCache(**kwargs)


def test_record_hit_of_missing_key_is_ignored() -> None:
    c = NgramCache()
    c.add([1, 2], 100)
    before = list(c.entries())
    c.record_hit([2, 3])
    assert list(c.entries()) == before


# --- eviction ---------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used() -> None:
    c = NgramCache(max_entries=3, policy="lru")
    for k in ([1, 1], [2, 2], [3, 3]):
        c.add(k, 9)
    c.record_hit([1, 1])  # order now (2,2) (3,3) (1,1)
    c.add([4, 4], 9)
    assert keys(c) == [(3, 3), (1, 1), (4, 4)]
    c.add([3, 3], 9)  # a re-add is a use too
    c.add([5, 5], 9)
    assert keys(c) == [(4, 4), (3, 3), (5, 5)]
    assert c.match([1, 1], 0) is None


def test_lfu_evicts_fewest_hits_then_least_recent() -> None:
    c = NgramCache(max_entries=3, policy="lfu")
    for k in ([1, 1], [2, 2], [3, 3]):
        c.add(k, 9)
    for _ in range(2):
        c.record_hit([1, 1])
    c.record_hit([2, 2])
    c.add([4, 4], 9)  # (3,3) has 0 hits; the new entry itself is never the victim
    assert sorted(keys(c)) == [(1, 1), (2, 2), (4, 4)]
    c.add([5, 5], 9)  # (4,4) 0 hits is the only 0-hit old entry
    assert sorted(keys(c)) == [(1, 1), (2, 2), (5, 5)]
    c.record_hit([5, 5])
    c.record_hit([1, 1])  # hits: (1,1)=3, (2,2)=1, (5,5)=1; (2,2) is less recent than (5,5)
    c.add([6, 6], 9)
    assert sorted(keys(c)) == [(1, 1), (5, 5), (6, 6)]


class _Reference:
    """Brute-force model of the eviction policies, for a randomized comparison."""

    def __init__(self, max_entries: int, policy: str) -> None:
        self.max_entries, self.policy = max_entries, policy
        self.d: dict[tuple[int, ...], list[int]] = {}  # key -> [hits, last_used]
        self.clock = 0

    def use(self, key: tuple[int, ...], hit: bool) -> None:
        if key not in self.d and hit:
            return
        self.clock += 1
        if key in self.d:
            self.d[key][0] += hit
            self.d[key][1] = self.clock
            return
        if len(self.d) == self.max_entries:
            rank = (lambda k: self.d[k][1]) if self.policy == "lru" else (lambda k: tuple(self.d[k]))
            del self.d[min(self.d, key=rank)]
        self.d[key] = [0, self.clock]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_matches_reference_model(policy: str) -> None:
    rng = random.Random(7)
    c, ref = NgramCache(max_entries=16, policy=policy), _Reference(16, policy)
    for _ in range(3000):
        key = tuple(rng.randrange(6) for _ in range(rng.choice([2, 2, 3])))
        hit = rng.random() < 0.5
        c.record_hit(key) if hit else c.add(key, 1)
        ref.use(key, hit)
    assert {e.draft_ids: [e.hits, e.last_used] for e in c.entries()} == ref.d
    assert trie_keys(c) == set(ref.d)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_max_bytes_is_respected_and_nbytes_exact(policy: str) -> None:
    rng = random.Random(3)
    c = NgramCache(max_bytes=300, policy=policy, drafter="small", target="big")
    for step in range(2000):
        key = [rng.randrange(50_000) for _ in range(rng.randrange(2, 6))]
        if step % 3 == 2 and len(c):
            c.record_hit(rng.choice(keys(c)))
        else:
            c.add(key, rng.randrange(150_000), count=rng.randrange(1, 1000))
        assert c.nbytes <= 300
        if step % 97 == 0:
            assert c.nbytes == len(c.to_bytes())
    assert c.nbytes == len(c.to_bytes())
    assert 5 < len(c) < 40
    assert trie_keys(c) == set(keys(c))


def test_entry_larger_than_max_bytes_is_not_stored() -> None:
    c = NgramCache(max_bytes=20)
    c.add([1, 2], 3)
    assert c.add(list(range(2**20, 2**20 + 8)), 1) is False
    assert keys(c) == [(1, 2)]


def test_evicting_prefix_key_keeps_longer_key_and_prunes_trie() -> None:
    c = NgramCache(max_entries=2)
    c.add([1, 2], 100)
    c.add([1, 2, 3, 4], 200)
    c.add([7, 8], 300)  # evicts (1,2)
    assert keys(c) == [(1, 2, 3, 4), (7, 8)]
    assert c.match([1, 2, 3, 4], 0) == (4, 200)
    assert c.match([1, 2, 3], 0) is None
    assert trie_keys(c) == {(1, 2, 3, 4), (7, 8)}
    c.add([9, 9], 400)  # evicts (1,2,3,4): its whole branch goes
    c.add([5, 5], 500)
    assert set(c._root) == {9, 5}
    assert trie_keys(c) == {(9, 9), (5, 5)}


# --- serialization ----------------------------------------------------------------------------


def _sample(**kwargs) -> NgramCache:
    c = NgramCache(drafter="drafter-0.5b", target="target-7b", **kwargs)
    c.add([1, 2], 100, count=3)
    c.add([1, 2, 3], 2**32 - 1)
    c.add([300, 70_000, 5], 0)
    c.record_hit([1, 2, 3])
    c.record_hit([1, 2])
    return c


def test_round_trip_preserves_everything() -> None:
    c = _sample()
    data = c.to_bytes()
    assert len(data) == c.nbytes
    r = NgramCache.from_bytes(data)
    assert list(r.entries()) == list(c.entries())
    assert (r.drafter, r.target) == ("drafter-0.5b", "target-7b")
    assert r.to_bytes() == data and r.nbytes == c.nbytes
    r.add([8, 8], 1)  # the clock resumes after the largest last_used
    assert list(r.entries())[-1].last_used == 6
    msg = ngram_cache_pb2.NgramCache.FromString(data)
    assert msg.version == 1 and list(msg.entries[0].draft_ids) == [300, 70_000, 5]


def test_from_bytes_applies_new_capacity() -> None:
    r = NgramCache.from_bytes(_sample().to_bytes(), max_entries=2, policy="lfu")
    assert r.policy == "lfu" and r.max_entries == 2
    assert keys(r) == [(1, 2, 3), (1, 2)]  # (300,70000,5) had no hits


def test_save_is_atomic_and_replaces(tmp_path) -> None:
    path = tmp_path / "cache.pb"
    path.write_bytes(b"old contents")
    c = _sample()
    c.save(path)
    assert os.listdir(tmp_path) == ["cache.pb"]
    assert path.read_bytes() == c.to_bytes()
    assert list(NgramCache.load(path).entries()) == list(c.entries())


@pytest.mark.parametrize("cut", [0, 1, 7, 30, -3, -2, -1])
def test_load_truncated_file_raises(tmp_path, cut: int) -> None:
    data = _sample().to_bytes()
    path = tmp_path / "cache.pb"
    path.write_bytes(data[:cut])
    with pytest.raises(NgramCacheError) as info:
        NgramCache.load(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize(
    "data",
    [b"\xff" * 40, b"garbage, not a protobuf", bytes(range(256)), b"\x0a\x02\x0a\x00\x20\x01"],
)
def test_load_garbage_raises(tmp_path, data: bytes) -> None:
    path = tmp_path / "cache.pb"
    path.write_bytes(data)
    with pytest.raises(NgramCacheError):
        NgramCache.load(path)


def test_duplicate_key_in_data_raises() -> None:
    msg = ngram_cache_pb2.NgramCache(version=1)
    for _ in range(2):
        msg.entries.add(draft_ids=[1, 2], target_id=3)
    with pytest.raises(NgramCacheError, match="duplicate"):
        NgramCache.from_bytes(msg.SerializeToString())


# --- seeding ----------------------------------------------------------------------------------


def test_seed_from_tokenizers_toy_vocab() -> None:
    drafter_vocab = {"f": 0, "la": 1, "ke": 2, "fl": 3, "a": 4, " ": 5, "é": 6}

    def encode(text: str) -> list[int]:  # greedy longest-first over the toy drafter vocabulary
        ids, i = [], 0
        while i < len(text):
            piece = next(p for p in (text[i : i + 2], text[i]) if p in drafter_vocab)
            ids.append(drafter_vocab[piece])
            i += len(piece)
        return ids

    target = [b"flake", b"f", None, b"la", b"\xff\xfe", b" a", b"la la", b"\xc3\xa9a", b"fla"]
    direct = {1, 3, 8}  # "f", "la" and (by fiat) "fla" map one-to-one already
    calls: list[list[str]] = []

    def batch(texts: list[str]) -> list[list[int]]:
        calls.append(texts)
        return [encode(t) for t in texts]

    c = NgramCache()
    assert seed_from_tokenizers(c, target, encode, direct) == 4
    assert {e.draft_ids: e.target_id for e in c.entries()} == {
        (3, 4, 2): 0,  # "fl" "a" "ke" -> flake
        (5, 4): 5,
        (1, 5, 1): 6,
        (6, 4): 7,
    }
    assert c.match([9, 3, 4, 2], 1) == (3, 0)

    c2 = NgramCache()
    assert seed_from_tokenizers(c2, target, lambda _: pytest.fail("batch preferred"), direct, batch) == 4
    assert calls == [["flake", " a", "la la", "éa"]]
    assert list(c2.entries()) == list(c.entries())


def test_seed_keeps_the_lowest_target_ids_when_the_cache_is_too_small() -> None:
    """Low ids are a BPE vocabulary's frequent tokens: a full cache keeps them, and they are
    the most recently used, so online entries evict the rarest seeded ones first."""
    target = [bytes([97 + i]) * 2 for i in range(6)]  # "aa", "bb", ... each spelled by 2 drafter ids

    def encode(text: str) -> list[int]:
        return [ord(ch) for ch in text]

    c = NgramCache(max_entries=3)
    assert seed_from_tokenizers(c, target, encode, set()) == 3
    assert sorted(e.target_id for e in c.entries()) == [0, 1, 2]
    c.add([1, 2], 99)  # a learned entry evicts the least recently used seeded one: id 2
    assert sorted(e.target_id for e in c.entries()) == [0, 1, 99]


def test_merge_adds_every_entry_as_add_would() -> None:
    ours, theirs = NgramCache(), NgramCache()
    ours.add([1, 2], 10, 3)
    theirs.add([1, 2], 11, 1)  # outvoted by our 3 observations: count drops to 2
    theirs.add([3, 4, 5], 12, 4)
    theirs.add([6, 7], 13)
    expected = NgramCache()
    for e in [*ours.entries(), *theirs.entries()]:
        expected.add(e.draft_ids, e.target_id, e.count)
    assert ours.merge(theirs) == 2
    assert [(e.draft_ids, e.target_id, e.count) for e in ours.entries()] == [
        (e.draft_ids, e.target_id, e.count) for e in expected.entries()
    ]
    assert ours.nbytes == len(ours.to_bytes())


def test_seeding_from_a_bridge_encodes_every_target_token_as_the_tokenizer_does(
    drafter_tokenizer, qwen_bridge, gemma_bridge
) -> None:
    """``seed_cache_from_bridge`` encodes the target tokens' texts with the Rust tokenizer's batch
    call: the same ids as calling the tokenizer, for every token text of two real vocabularies."""
    from omnidraft.shared.engine.pair import _batch_encoder

    assert getattr(drafter_tokenizer, "backend_tokenizer", None) is not None  # else the check is moot
    for bridge in (qwen_bridge, gemma_bridge):
        texts = []
        for raw in bridge.target_bytes[: bridge.target_vocab_size]:
            with contextlib.suppress(AttributeError, UnicodeDecodeError):
                texts.append(raw.decode("utf-8"))
        assert len(texts) > 100_000
        assert (
            _batch_encoder(drafter_tokenizer)(texts) == drafter_tokenizer(texts, add_special_tokens=False)["input_ids"]
        )
