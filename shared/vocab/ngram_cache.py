"""Online n-gram cache: runs of drafter token ids that merge into one target token id.

A key is a run of >= 2 drafter token ids (e.g. ``f`` ``la`` ``ke``); its value is one target
token id (``flake``). The decoder scans a block of drafted ids left to right and, at each
position, asks :meth:`NgramCache.match` for the longest cached key starting there. Lookups never
mutate the cache; after a round the decoder calls :meth:`NgramCache.record_hit` for the keys it
used and :meth:`NgramCache.add` for mappings learned from what the target committed.

Recency is a logical clock (one tick per ``add`` or ``record_hit``), never wall time, so the
cache behaves deterministically. Capacity is bounded in entries and, optionally, in bytes of
the serialized protobuf (``omnidraft.v1.NgramCache`` in proto/ngram_cache.proto); the byte
size is kept exact incrementally from protobuf varint sizes, without re-serializing.
"""

from __future__ import annotations

import gc
import heapq
import operator
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from omnidraft.proto import ngram_cache_pb2
from omnidraft.shared.util.atomic_io import write_bytes_atomic

FORMAT_VERSION = 1
POLICIES = ("lru", "lfu")
_U32 = 1 << 32
_END: Any = object()  # trie key of the _Record for the key ending at a node; equals no id

Key = tuple[int, ...]


class NgramCacheError(Exception):
    """A cache file or blob that cannot be read, with a one-line message meant for the user."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A snapshot of one cache entry.

    ``count`` is the net number of observations of the mapping (see :meth:`NgramCache.add`),
    ``hits`` the number of times the decoder used it, ``last_used`` the logical clock value of
    its last ``add`` or ``record_hit``.
    """

    draft_ids: Key
    target_id: int
    count: int
    hits: int
    last_used: int


@dataclass(slots=True, eq=False)
class _Record:
    """Mutable state of one entry; ``key_bytes``/``nbytes`` are its serialized sizes."""

    target_id: int
    count: int
    hits: int
    last_used: int
    key_bytes: int  # the packed draft_ids field: tag + length varint + payload
    nbytes: int = 0  # the whole Entry inside NgramCache.entries: tag + length varint + body


def _varint_bytes(value: int) -> int:
    """Bytes of ``value`` as a protobuf varint (value >= 0)."""
    return _VARINT_TABLE[value] if value < _TABLE_SIZE else (value.bit_length() + 6) // 7


_TABLE_SIZE = 1 << 16
_VARINT_TABLE = bytes((i.bit_length() + 6) // 7 or 1 for i in range(_TABLE_SIZE))  # sizes of small values


def _scalar_field_bytes(value: int) -> int:
    """Bytes of a proto3 scalar field numbered < 16 (omitted when zero)."""
    return 1 + _varint_bytes(value) if value else 0


def _len_field_bytes(length: int) -> int:
    """Bytes of a length-delimited field numbered < 16 carrying ``length`` payload bytes."""
    return 1 + _varint_bytes(length) + length


def _key_field_bytes(key: Key) -> int:
    """Bytes of the packed ``draft_ids`` field holding ``key`` (a table lookup per id: this
    runs for every entry a cache loads)."""
    if max(key) < _TABLE_SIZE:
        payload = sum(map(_VARINT_TABLE.__getitem__, key))
    else:
        payload = sum(map(_varint_bytes, key))
    return _len_field_bytes(payload)


def _entry_bytes(rec: _Record) -> int:
    """Bytes of one Entry inside ``NgramCache.entries`` (tag + length varint + body)."""
    body = (
        rec.key_bytes
        + _scalar_field_bytes(rec.target_id)
        + _scalar_field_bytes(rec.count)
        + _scalar_field_bytes(rec.hits)
        + _scalar_field_bytes(rec.last_used)
    )
    return _len_field_bytes(body)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector while a cache is built in bulk."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _check_id(value: Any, what: str) -> int:
    value = operator.index(value)
    if not 0 <= value < _U32:
        raise ValueError(f"{what} must be in [0, 2**32), got {value}")
    return value


class NgramCache:
    """Maps runs of >= 2 drafter token ids to one target token id, with bounded capacity.

    ``policy`` picks the victim when the cache is full: ``"lru"`` evicts the least recently
    used entry, ``"lfu"`` the entry with the fewest hits (ties: least recently used). An add or
    a hit counts as a use. ``max_entries`` bounds the number of entries, ``max_bytes`` (if
    given) the size of :meth:`to_bytes` in bytes. ``drafter`` and ``target`` are model names
    stored as metadata.
    """

    def __init__(
        self,
        max_entries: int = 65536,
        max_bytes: int | None = None,
        policy: str = "lru",
        *,
        drafter: str = "",
        target: str = "",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._header_bytes = (
            (_len_field_bytes(len(drafter.encode())) if drafter else 0)
            + (_len_field_bytes(len(target.encode())) if target else 0)
            + _scalar_field_bytes(FORMAT_VERSION)
        )
        if max_bytes is not None and max_bytes < self._header_bytes:
            raise ValueError(f"max_bytes={max_bytes} is below the {self._header_bytes} bytes of an empty cache")
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._policy = policy
        self._drafter = drafter
        self._target = target
        self._root: dict[int, Any] = {}  # trie: drafter id -> child node; _END -> _Record
        self._records: OrderedDict[Key, _Record] = OrderedDict()  # least recently used first
        self._heap: list[tuple[int, int, Key]] = []  # lfu: (hits, last_used, key), lazily pruned
        self._bytes = self._header_bytes
        self._clock = 0

    @property
    def max_entries(self) -> int:
        """Capacity in entries."""
        return self._max_entries

    @property
    def max_bytes(self) -> int | None:
        """Capacity in bytes of :meth:`to_bytes`, or None for no byte bound."""
        return self._max_bytes

    @property
    def policy(self) -> str:
        """Eviction policy, ``"lru"`` or ``"lfu"``."""
        return self._policy

    @property
    def drafter(self) -> str:
        """Drafter model name (metadata)."""
        return self._drafter

    @property
    def target(self) -> str:
        """Target model name (metadata)."""
        return self._target

    @property
    def nbytes(self) -> int:
        """Exact size of :meth:`to_bytes` in bytes, maintained incrementally."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, draft_ids: object) -> bool:
        try:
            return tuple(draft_ids) in self._records  # type: ignore[arg-type]
        except TypeError:
            return False

    def get(self, draft_ids: Sequence[int]) -> int | None:
        """Target token id cached for exactly this run of drafter ids, or None. Pure."""
        rec = self._records.get(tuple(draft_ids))
        return None if rec is None else rec.target_id

    def match(self, draft_ids: Sequence[int], start: int, end: int | None = None) -> tuple[int, int] | None:
        """Longest cached key equal to ``draft_ids[start:start + n]`` with ``start + n <= end``.

        ``draft_ids`` holds Python (or numpy) ints, not tensor elements. ``end`` defaults to
        (and is clamped to) ``len(draft_ids)``. Returns ``(n, target_id)`` with n >= 2 tokens,
        or None. Pure: does not touch recency or hit counts.
        """
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        limit = len(draft_ids)
        if end is not None and end < limit:
            limit = end
        node = self._root
        best = None
        i = start
        while i < limit:
            node = node.get(draft_ids[i])
            if node is None:
                break
            i += 1
            rec = node.get(_END)
            if rec is not None:
                best = (i - start, rec.target_id)
        return best

    def add(self, draft_ids: Sequence[int], target_id: int, count: int = 1) -> bool:
        """Record ``count`` observations of drafter run ``draft_ids`` -> ``target_id``.

        Returns True if a new entry was created. Re-adding a key with the same target adds
        ``count`` to its count. A different target is resolved by majority vote, which keeps
        the target with more observations using one counter: if ``count`` exceeds the stored
        count, the new target replaces it and the count becomes the difference; otherwise the
        stored count drops by ``count`` (ties keep the stored target). Hits are kept either way.
        Either case counts as a use and may evict other entries. A new entry too large to fit
        in ``max_bytes`` even alone is not stored (returns False).
        """
        key = tuple(_check_id(i, "draft id") for i in draft_ids)
        if len(key) < 2:
            raise ValueError(f"an n-gram key needs >= 2 drafter ids, got {len(key)}")
        target_id = _check_id(target_id, "target id")
        if operator.index(count) < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        return self._add(key, target_id, count)

    def merge(self, other: NgramCache) -> int:
        """``add`` every entry of ``other`` with its count (at least 1), its least recently used
        first; returns the number of entries created."""
        with _gc_paused():
            return sum(self._add(key, rec.target_id, max(1, rec.count)) for key, rec in list(other._records.items()))

    def _add(self, key: Key, target_id: int, count: int) -> bool:
        """``add`` for a checked key, target and count."""
        rec = self._records.get(key)
        if rec is not None:
            if target_id == rec.target_id:
                rec.count += count
            elif count > rec.count:
                rec.target_id, rec.count = target_id, count - rec.count
            else:
                rec.count -= count
            self._touch(key, rec)
            return False
        rec = _Record(target_id, count, 0, self._clock + 1, _key_field_bytes(key))
        if self._max_bytes is not None and self._header_bytes + _entry_bytes(rec) > self._max_bytes:
            return False
        self._clock += 1
        self._insert(key, rec)
        self._shrink(protect=key)
        return True

    def record_hit(self, draft_ids: Sequence[int]) -> None:
        """Count one use of a cached key by the decoder (hits + 1, most recent use).

        A key no longer cached (e.g. evicted by an ``add`` since the round) is ignored.
        """
        key = tuple(draft_ids)
        rec = self._records.get(key)
        if rec is not None:
            rec.hits += 1
            self._touch(key, rec)

    def entries(self) -> Iterator[Entry]:
        """Snapshots of all entries, least recently used first."""
        for key, rec in self._records.items():
            yield Entry(key, rec.target_id, rec.count, rec.hits, rec.last_used)

    def to_bytes(self) -> bytes:
        """The cache as a serialized ``omnidraft.v1.NgramCache`` message."""
        msg = ngram_cache_pb2.NgramCache(drafter=self._drafter, target=self._target, version=FORMAT_VERSION)
        for key, rec in self._records.items():
            msg.entries.add(
                draft_ids=key,
                target_id=rec.target_id,
                count=rec.count,
                hits=rec.hits,
                last_used=rec.last_used,
            )
        return msg.SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes, **capacity_kwargs: Any) -> NgramCache:
        """Rebuild a cache from :meth:`to_bytes` output; raises NgramCacheError if invalid.

        ``capacity_kwargs`` (max_entries, max_bytes, policy) apply to the new cache; entries
        beyond its capacity are evicted by its policy. ``version`` is field 4, serialized after
        every entry and name, so data cut short anywhere lacks it and is rejected.
        """
        msg = ngram_cache_pb2.NgramCache()
        try:
            msg.ParseFromString(data)
        except DecodeError as exc:
            raise NgramCacheError(f"not a valid n-gram cache ({exc})") from None
        if msg.version != FORMAT_VERSION:
            raise NgramCacheError(
                f"n-gram cache format version {msg.version}, expected {FORMAT_VERSION} (truncated or foreign data)"
            )
        cache = cls(**capacity_kwargs, drafter=msg.drafter, target=msg.target)
        with _gc_paused():  # tens of thousands of small objects: the cyclic GC would run often
            for e in sorted(msg.entries, key=operator.attrgetter("last_used")):
                key = tuple(e.draft_ids)
                if len(key) < 2 or key in cache._records:
                    raise NgramCacheError(f"n-gram cache has a {'duplicate' if len(key) >= 2 else 'short'} key {key}")
                cache._insert(key, _Record(e.target_id, e.count, e.hits, e.last_used, _key_field_bytes(key)))
                cache._clock = max(cache._clock, e.last_used)
        cache._shrink(protect=None)
        return cache

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_bytes` to ``path`` atomically: temp file in its dir, fsync, rename."""
        write_bytes_atomic(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike[str], **capacity_kwargs: Any) -> NgramCache:
        """Read a file written by :meth:`save`; NgramCacheError if its contents are invalid."""
        data = Path(path).read_bytes()
        try:
            return cls.from_bytes(data, **capacity_kwargs)
        except NgramCacheError as exc:
            raise NgramCacheError(f"{path}: {exc}") from None

    def _insert(self, key: Key, rec: _Record) -> None:
        node = self._root
        for token in key:
            node = node.setdefault(token, {})
        node[_END] = rec
        self._records[key] = rec
        rec.nbytes = _entry_bytes(rec)
        self._bytes += rec.nbytes
        self._push(key, rec)

    def _remove(self, key: Key) -> None:
        """Drop ``key`` from the records and the trie, pruning trie nodes left empty."""
        self._bytes -= self._records.pop(key).nbytes
        path = []
        node = self._root
        for token in key:
            path.append((node, token))
            node = node[token]
        del node[_END]
        for parent, token in reversed(path):
            if parent[token]:
                break
            del parent[token]

    def _touch(self, key: Key, rec: _Record) -> None:
        """Make ``rec`` the most recent use, refresh its byte size, then enforce capacity."""
        self._clock += 1
        rec.last_used = self._clock
        self._records.move_to_end(key)
        size = _entry_bytes(rec)
        self._bytes += size - rec.nbytes
        rec.nbytes = size
        self._push(key, rec)
        self._shrink(protect=key)

    def _push(self, key: Key, rec: _Record) -> None:
        """LFU only: queue ``rec``'s current (hits, last_used); rebuild once mostly stale."""
        if self._policy != "lfu":
            return
        heapq.heappush(self._heap, (rec.hits, rec.last_used, key))
        if len(self._heap) > 2 * len(self._records) + 64:
            self._heap = [(r.hits, r.last_used, k) for k, r in self._records.items()]
            heapq.heapify(self._heap)

    def _over_capacity(self) -> bool:
        return len(self._records) > self._max_entries or (self._max_bytes is not None and self._bytes > self._max_bytes)

    def _shrink(self, protect: Key | None) -> None:
        """Evict by policy until within capacity; ``protect`` goes only if it is the last entry."""
        while self._over_capacity():
            self._remove(self._victim(protect) or protect)  # type: ignore[arg-type]

    def _victim(self, protect: Key | None) -> Key | None:
        """The entry the policy evicts next, other than ``protect``; None if there is none."""
        if self._policy == "lru":
            return next((k for k in self._records if k != protect), None)
        spared = None
        while self._heap:
            item = heapq.heappop(self._heap)
            hits, last_used, key = item
            rec = self._records.get(key)
            if rec is None or rec.hits != hits or rec.last_used != last_used:
                continue  # stale: the entry was evicted or used since this item was pushed
            if key != protect:
                if spared is not None:
                    heapq.heappush(self._heap, spared)
                return key
            spared = item
        if spared is not None:
            heapq.heappush(self._heap, spared)
        return None


def seed_from_tokenizers(
    cache: NgramCache,
    target_token_bytes: Sequence[bytes | None],
    encode_draft: Callable[[str], list[int]],
    direct_target_ids: set[int] | frozenset[int],
    encode_draft_batch: Callable[[list[str]], list[list[int]]] | None = None,
) -> int:
    """Warm-start ``cache`` from the two vocabularies alone.

    ``target_token_bytes[t]`` is the byte string of target token t (None for tokens without
    one, e.g. specials). Every target token not in ``direct_target_ids`` (those a single
    drafter token already maps to) whose bytes are valid UTF-8 is encoded with the drafter
    tokenizer (no special tokens); when that yields >= 2 drafter ids, ``ids -> t`` is a
    candidate. ``encode_draft_batch`` (one call for all texts) is used instead of
    ``encode_draft`` when given.

    When there are more candidates than ``cache.max_entries``, the lowest target ids are kept:
    BPE and SentencePiece vocabularies number their tokens by merge order or score, so low ids
    are the frequent ones (keeping the last ones added would keep the rarest). They are added
    highest id first, so the most frequent tokens are the most recently used, the last an LRU
    cache evicts. Returns the number of entries created.
    """
    target_ids: list[int] = []
    texts: list[str] = []
    for target_id, raw in enumerate(target_token_bytes):
        if raw is None or target_id in direct_target_ids:
            continue
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        target_ids.append(target_id)
    if not texts:  # every target token has a drafter token of its own (a tokenizer may refuse no texts)
        return 0
    encoded = encode_draft_batch(texts) if encode_draft_batch is not None else map(encode_draft, texts)
    candidates = [(target_id, ids) for target_id, ids in zip(target_ids, encoded, strict=True) if len(ids) >= 2]
    kept = candidates[: cache.max_entries]
    with _gc_paused():  # ~110,000 entries for SmolLM2 -> Qwen2.5
        return sum(cache.add(ids, target_id) for target_id, ids in reversed(kept))
