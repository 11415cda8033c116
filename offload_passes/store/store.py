"""KVStore: a request's KV chunks kept in tiers (RAM, disk, a shared store) under chained, fingerprinted keys,
so that a later request with the same prefix reloads them instead of recomputing them.

A tier that keeps chunks as tensors (``keeps_chunks``: the RAM tier) gets the verified tensors, not bytes, so
a hit there costs no deserialisation and no checksum: a chunk is verified when it enters the process (checked
tensors from ``put``, a blob from disk or the shared store that passes its checksums), not at every hit. Byte
tiers get the encoded chunk, made once per chunk and reused for every byte tier it goes to.

Faults of a tier never reach the caller: the store logs one warning per outage, counts it in
``stats.tier_faults`` and skips the tier for ``retry_after_s`` seconds. A chunk that fails to verify is
counted in ``stats.chunks_rejected``, its copy is deleted from the tier, and the loaded prefix ends before it.

With a :class:`ReuseRule` (``rule=``), each load first finds the stored prefix (existence only), prices its
reload at the slowest tier among its chunks, and loads nothing when recomputing it is predicted faster (the
caller then recomputes); each decision is counted in ``stats`` (docs/store.md, "Reload or recompute").

Chunk extras (``chunk_extras`` in the fingerprint: whole tensors some chunks hold, e.g. a model state at the
chunk's end) belong to the chunk's end: a chunk a ``limit`` cuts short loses them, and ``load(..., ends_with=)``
loads only a prefix whose last chunk holds the named extras.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch

from .chunk import ChunkError, HeldChunk, check_chunk_tensors, chunk_extras, decode_chunk, encode_chunk
from .keys import Fingerprint, chain_keys, check_token_ids, next_key
from .rule import ReuseRule
from .stats import Lookup, StoreStats
from .tiers.base import Tier, TierFault

__all__ = ["KVStore"]

log = logging.getLogger("offload_passes.store")

_TIER_METHODS = ("put", "get", "exists", "delete", "used_bytes", "name")


def _positive_int(call: str, arg: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{call}: {arg} must be a positive int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{call}: {arg} must be a positive int (>= 1), got {value}")
    return value


def _check_tiers(tiers: Any) -> list:
    if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence) or not tiers:
        raise ValueError(f"KVStore: tiers must be a non-empty list of tiers, got {tiers!r}")
    names = set()
    for i, t in enumerate(tiers):
        missing = [m for m in _TIER_METHODS if not hasattr(t, m)]
        if missing:
            raise TypeError(f"KVStore: tiers[{i}] ({type(t).__name__}) lacks {missing} of the Tier interface")
        if t.name in names:
            raise ValueError(f"KVStore: tiers[{i}] repeats the tier name {t.name!r}; names must be unique")
        names.add(t.name)
    return list(tiers)


def _check_rule(rule: Any, tiers: list) -> None:
    if rule is None:
        return
    if not isinstance(rule, ReuseRule):
        raise TypeError(f"KVStore: rule must be None or a ReuseRule, got {type(rule).__name__}")
    missing = [t.name for t in tiers if t.name not in rule.tiers]
    if missing:
        raise ValueError(f"KVStore: rule has no TierCost for tier(s) {missing}; it prices {sorted(rule.tiers)}")


def _keeps_chunks(tier: Any) -> bool:
    return bool(getattr(tier, "keeps_chunks", False))


def _last_holder(chunks: list[dict], names: Sequence[str]) -> int:
    """The index of the last chunk holding every extra in ``names`` (-1: none does)."""
    return next((j for j in range(len(chunks) - 1, -1, -1) if all(x in chunks[j] for x in names)), -1)


class _Entry:
    """One chunk on its way into tiers, in the form each tier keeps: verified tensors (:class:`HeldChunk`) or
    the encoded bytes, each made at most once. From ``put`` it holds the caller's tensors (cloned for a tier
    that keeps them: the caller may change its own afterwards); from a tier, that tier's item."""

    __slots__ = ("fp", "key", "_n", "_tensors", "_blob", "_held")

    def __init__(self, fp: Fingerprint, key: str, item: Any = None, tensors: Optional[Mapping] = None,
                 n_tokens: int = 0, held: Optional[HeldChunk] = None) -> None:
        self.fp, self.key, self._n, self._tensors = fp, key, n_tokens, tensors
        self._held = item if isinstance(item, HeldChunk) else held
        self._blob = item if isinstance(item, (bytes, bytearray, memoryview)) else None

    def blob(self) -> bytes:
        if self._blob is None:
            h = self._held
            self._blob = (encode_chunk(self.fp, self.key, h.n_tokens, h.tensors) if h is not None
                          else encode_chunk(self.fp, self.key, self._n, self._tensors))
        return self._blob

    def held(self) -> HeldChunk:
        """The verified tensors (a blob is decoded and checked here: ChunkError when it fails)."""
        if self._held is None:
            if self._tensors is not None:
                self._held = HeldChunk.own(self._n, self._tensors, copy=True)
            else:
                n, tensors = decode_chunk(self.fp, self.key, self._blob)
                self._held = HeldChunk.own(n, tensors, copy=False)
        return self._held

    def for_tier(self, tier: Any) -> Any:
        return self.held() if _keeps_chunks(tier) else self.blob()


class KVStore:
    """Chunks of ``chunk_tokens`` tokens of KV, keyed by the token prefix and ``fp``, in ``tiers`` (top first)."""

    def __init__(self, fp: Fingerprint, chunk_tokens: int, tiers: Sequence[Tier], block_size: int = 1,
                 vocab_size: Optional[int] = None, write_through: bool = True, retry_after_s: float = 30.0,
                 rule: Optional[ReuseRule] = None) -> None:
        if not isinstance(fp, Fingerprint):
            raise TypeError(f"KVStore: fp must be a Fingerprint (Fingerprint.of(fields)), got {type(fp).__name__}")
        block_size = _positive_int("KVStore", "block_size", block_size)
        chunk_tokens = _positive_int("KVStore", "chunk_tokens", chunk_tokens)
        if chunk_tokens % block_size:
            raise ValueError(f"KVStore: chunk_tokens {chunk_tokens} must be a multiple of block_size {block_size}")
        fp_chunk = fp.fields.get("chunk_tokens")
        if fp_chunk is not None and fp_chunk != chunk_tokens:
            raise ValueError(f"KVStore: chunk_tokens {chunk_tokens} differs from the fingerprint's chunk_tokens "
                             f"{fp_chunk}")
        if vocab_size is not None:
            vocab_size = _positive_int("KVStore", "vocab_size", vocab_size)
        if isinstance(retry_after_s, bool) or not isinstance(retry_after_s, (int, float)) or not retry_after_s >= 0:
            raise ValueError(f"KVStore: retry_after_s must be a number >= 0, got {retry_after_s!r}")
        if not isinstance(write_through, bool):
            raise TypeError(f"KVStore: write_through must be a bool, got {write_through!r}")
        tiers = _check_tiers(tiers)
        _check_rule(rule, tiers)
        self._extras = chunk_extras(fp, "KVStore")
        self.tiers = tiers
        self.rule = rule
        self.fp = fp
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.write_through = write_through
        self.retry_after_s = float(retry_after_s)
        self._stats = StoreStats()
        self._down: dict[str, float] = {}  # tier name -> when its outage began (monotonic)
        self._lock = threading.RLock()
        self._closed = False

    # ---- keys -----------------------------------------------------------------------------------------
    def chunk_keys(self, token_ids: Any) -> list[str]:
        """One key per chunk of ``token_ids`` (the partial last chunk too), chained over all tokens before it."""
        ids = check_token_ids("KVStore.chunk_keys", token_ids, self.vocab_size)
        return chain_keys(self.fp.digest, ids, self.chunk_tokens)

    def _spans(self, n: int) -> list[tuple[int, int]]:
        return [(s, min(n, s + self.chunk_tokens)) for s in range(0, n, self.chunk_tokens)]

    # ---- tier calls -------------------------------------------------------------------------------------
    def _up(self, tier: Tier) -> bool:
        began = self._down.get(tier.name)
        return began is None or time.monotonic() - began >= self.retry_after_s

    def _call(self, tier: Tier, op: str, default: Any, fn: Callable[[], Any]) -> Any:
        """Run one tier call; a fault is counted, warned about once per outage, and answered with ``default``."""
        if not self._up(tier):
            return default
        try:
            out = fn()
        except (TierFault, OSError, RuntimeError, ValueError) as exc:  # the tier's medium or service, not ours
            self._stats.count("tier_faults", tier.name)
            if tier.name not in self._down:
                log.warning("KV store: tier %r failed (%s: %s: %s); going on without it for %.0f s, a miss costs "
                            "a recompute only", tier.name, op, type(exc).__name__, exc, self.retry_after_s)
            self._down[tier.name] = time.monotonic()
            return default
        if tier.name in self._down:
            del self._down[tier.name]
            log.info("KV store: tier %r answers again (%s)", tier.name, op)
        return out

    def _store_in(self, index: int, entry: _Entry, counter: str) -> bool:
        """Put ``entry`` into tiers[index] in the form it keeps, spilling what it evicts down the tiers; True
        when stored."""
        tier = self.tiers[index]
        try:
            item = entry.for_tier(tier)
        except ChunkError as exc:  # a blob spilled from a byte tier into a tensor tier that fails to verify
            log.warning("KV store: chunk %s… not moved into tier %r (%s)", entry.key[:12], tier.name, exc)
            return False
        evicted = self._call(tier, "put", None, lambda: tier.put(entry.key, item))
        if evicted is None:
            return False
        self._stats.count(counter, tier.name)
        for k, b in evicted:
            self._spill(index + 1, _Entry(self.fp, k, item=b))
        return True

    def _spill(self, index: int, entry: _Entry) -> None:
        if index >= len(self.tiers):
            return  # evicted from the bottom tier: gone
        tier = self.tiers[index]
        if self._call(tier, "exists", True, lambda: tier.exists(entry.key)):
            return
        self._store_in(index, entry, "chunks_spilled")

    # ---- lookup / load ------------------------------------------------------------------------------
    def _find(self, key: str) -> Optional[Tier]:
        for tier in self.tiers:
            if self._call(tier, "exists", False, lambda: tier.exists(key)):
                return tier
        return None

    def _exists_many(self, tier: Tier, keys: list[str]) -> list[bool]:
        many = getattr(tier, "exists_many", None)  # optional: one round trip for a shared tier
        return list(many(keys)) if many is not None else [tier.exists(k) for k in keys]

    def _tail(self, ids: list[int], start: int, prev: Optional[str]) -> Optional[tuple[str, int, Tier]]:
        """The longest stored partial chunk at ``start`` (a request that ended there), as (key, n_tokens, tier).

        A sequence's last chunk is stored under the key of its own tokens; a longer sequence with that prefix
        finds it only by trying each shorter length, longest first (one batch of existence checks per tier)."""
        room = min(self.chunk_tokens, len(ids) - start)
        if room <= 1:
            return None
        raw = bytes.fromhex(prev or self.fp.digest)
        cands = [(n, next_key(raw, ids[start:start + n]).hex()) for n in range(room - 1, 0, -1)]
        keys = [k for _, k in cands]
        best = None
        for tier in self.tiers:
            hits = self._call(tier, "exists", [False] * len(keys), lambda: self._exists_many(tier, keys))
            n, key = next(((n, k) for (n, k), hit in zip(cands, hits) if hit), (0, None))
            if key is not None and (best is None or n > best[1]):
                best = (key, n, tier)
        return best

    def lookup(self, token_ids: Any) -> Lookup:
        """The longest prefix whose chunks some tier holds (existence only: nothing is read or verified)."""
        with self._lock:
            ids = check_token_ids("KVStore.lookup", token_ids, self.vocab_size)
            self._stats.lookups += 1
            found = self._found(ids)
            return Lookup(tokens=sum(c[2] for c in found), chunks=found)

    def _found(self, ids: list[int]) -> list[tuple[str, str, int]]:
        """(key, tier name, n_tokens) of each chunk of the longest prefix some tier holds (existence only)."""
        found: list[tuple[str, str, int]] = []
        prev = None
        for key, (s, e) in zip(chain_keys(self.fp.digest, ids, self.chunk_tokens), self._spans(len(ids))):
            tier = self._find(key)
            if tier is None:
                tail = self._tail(ids, s, prev)
                if tail is not None:
                    found.append((tail[0], tail[2].name, tail[1]))
                break
            found.append((key, tier.name, e - s))
            prev = key
        return found

    def _rule_allows(self, ids: list[int], limit: Optional[int]) -> bool:
        """Whether the rule (if any) lets this load reload the found prefix, capped at ``limit``; the decision
        is counted. Nothing found: nothing to decide (the load finds nothing either)."""
        if self.rule is None:
            return True
        n, tiers = 0, []
        for _, tier, k in self._found(ids):
            if limit is not None and n >= limit:
                break
            n, tiers = n + k, tiers + [tier]
        n = n if limit is None else min(n, limit)
        if n == 0:
            return True
        d = self.rule.decide(n, tiers, self.fp.bytes_per_token())
        self._stats.last_decision = d
        if d.reload:
            self._stats.decisions_reload += 1
        else:
            self._stats.decisions_recompute += 1
            log.debug("KV store: recomputing %d tokens (reload from %r %.3g s >= recompute %.3g s)", n, d.tier,
                      d.reload_s, d.recompute_s)
        return d.reload

    def _check_limit(self, limit: Any) -> Optional[int]:
        if limit is None:
            return None
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"KVStore.load: limit must be None or an int >= 0, got {limit!r}")
        return limit

    def _load_one(self, key: str, n_expected: int) -> tuple[Optional[dict], bool]:
        """(tensors, rejected): tensors of the top-most copy that verifies; None on a miss or a rejected copy.
        A tensor tier's chunk was verified when it entered the process; a blob is decoded and verified here."""
        for index, tier in enumerate(self.tiers):
            item = self._call(tier, "get", None, lambda: tier.get(key))
            if item is None:
                continue
            entry = _Entry(self.fp, key, item=item)
            try:
                held = entry.held()
                if held.n_tokens != n_expected:
                    raise ChunkError(f"holds {held.n_tokens} tokens where its key covers {n_expected}")
            except ChunkError as exc:
                self._stats.chunks_rejected += 1
                log.warning("KV store: chunk %s… in tier %r rejected (%s); recomputing from there", key[:12],
                            tier.name, exc)
                self._call(tier, "delete", None, lambda: tier.delete(key))
                return None, True
            self._stats.count("chunks_loaded", tier.name)
            self._stats.count("bytes_loaded", tier.name, held.nbytes if item is held else len(item))
            for upper in range(index):
                self._store_in(upper, entry, "chunks_promoted")
            return held.tensors, False
        return None, False

    def load(self, token_ids: Any, limit: Optional[int] = None, copy: bool = True,
             ends_with: Sequence[str] = ()) -> tuple[int, list[dict[str, torch.Tensor]]]:
        """(n_tokens, chunks): the longest prefix of ``token_ids`` that loads and verifies, capped at ``limit``
        tokens; chunk i holds CPU tensors [n_i, *shape] for tokens [i*C, i*C + n_i). ``copy=False`` hands out
        the tensor tier's own tensors, read-only by contract: for a caller that copies them into its cache at
        once (``PagedStore.reload``, ``reload_hf``), so a RAM hit is copied exactly once. ``ends_with``: chunk
        extras the prefix's last chunk must hold (a state known only at some chunks' ends): the prefix ends at
        the last loaded chunk that holds them all, 0 tokens when none does."""
        n, chunks, _ = self.load_keyed(token_ids, limit, copy, ends_with)
        return n, chunks

    def _check_ends_with(self, ends_with: Any) -> tuple[str, ...]:
        if isinstance(ends_with, (str, bytes)) or not isinstance(ends_with, Sequence):
            raise TypeError(f"KVStore.load: ends_with must be a sequence of chunk extra names, got {ends_with!r}")
        unknown = sorted(set(ends_with) - set(self._extras))
        if unknown:
            raise ValueError(f"KVStore.load: ends_with names {unknown}, not chunk extras of the fingerprint "
                             f"(it has {sorted(self._extras)})")
        return tuple(ends_with)

    def load_keyed(self, token_ids: Any, limit: Optional[int] = None, copy: bool = True,
                   ends_with: Sequence[str] = ()) -> tuple[int, list[dict[str, torch.Tensor]], list[str]]:
        """:meth:`load` and the key of each chunk it returned (a partial last chunk has its own key)."""
        if not isinstance(copy, bool):
            raise TypeError(f"KVStore.load: copy must be a bool, got {copy!r}")
        with self._lock:
            ids = check_token_ids("KVStore.load", token_ids, self.vocab_size)
            limit = self._check_limit(limit)
            ends_with = self._check_ends_with(ends_with)
            self._stats.loads += 1
            out: list[dict[str, torch.Tensor]] = []
            keys: list[str] = []
            ends: list[int] = []
            n = 0
            if not self._rule_allows(ids, limit):
                return 0, out, keys
            for key, (s, e) in zip(chain_keys(self.fp.digest, ids, self.chunk_tokens), self._spans(len(ids))):
                if limit is not None and s >= limit:
                    break
                tensors, rejected = self._load_one(key, e - s)
                last = tensors is None  # a miss: a shorter chunk stored here (an earlier request's end) may load
                if last and not rejected:
                    tail = self._tail(ids, s, keys[-1] if keys else None)
                    if tail is not None:
                        key, e = tail[0], s + tail[1]
                        tensors, _ = self._load_one(key, tail[1])
                if tensors is None:
                    break
                if limit is not None and e > limit:  # cut short: its extras describe its end, not this one
                    tensors = {k: v[: limit - s] for k, v in tensors.items() if k in self.fp.caches}
                    e = limit
                out.append(tensors)
                keys.append(key)
                ends.append(e)
                n = e
                if last:
                    break
            if ends_with:
                j = _last_holder(out, ends_with)
                out, keys, n = out[:j + 1], keys[:j + 1], ends[j] if j >= 0 else 0
            self._stats.tokens_loaded += n
            if copy:
                out = [{k: v.clone() for k, v in ch.items()} for ch in out]
            return n, out, keys

    # ---- put --------------------------------------------------------------------------------------------
    def _check_put(self, ids: list[int], chunks: Any) -> list[tuple[str, int, Mapping[str, torch.Tensor]]]:
        if isinstance(chunks, Mapping) or not isinstance(chunks, Sequence):
            raise TypeError(f"KVStore.put: chunks must be a list of dicts name -> tensor, got {type(chunks).__name__}")
        spans = self._spans(len(ids))
        if len(chunks) > len(spans):
            raise ValueError(f"KVStore.put: {len(chunks)} chunks for {len(ids)} tokens; at most {len(spans)} "
                             f"chunks of chunk_tokens {self.chunk_tokens}")
        plan = []
        for i, ch in enumerate(chunks):
            first = ch.get(next(iter(self.fp.caches))) if isinstance(ch, Mapping) else None
            n = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else -1
            s, e = spans[i]
            last = i == len(chunks) - 1
            if not (n == e - s or (last and 0 < n <= e - s)):
                raise ValueError(f"KVStore.put: chunks[{i}] holds {n} tokens; tokens [{s}, {e}) need "
                                 f"{e - s}{' (the last chunk may hold fewer, >= 1)' if last else ''}")
            check_chunk_tensors(f"KVStore.put: chunks[{i}]", self.fp, ch, n)
            plan.append((s, n, ch))
        keys = chain_keys(self.fp.digest, ids[: plan[-1][0] + plan[-1][1]], self.chunk_tokens) if plan else []
        return [(k, n, ch) for k, (_, n, ch) in zip(keys, plan)]

    def put(self, token_ids: Any, chunks: Sequence[Mapping[str, torch.Tensor]]) -> int:
        """Store ``chunks`` (chunk i: tokens [i*C, i*C + n_i), only the last partial); returns how many chunks
        were written to some tier. Chunks every target tier already holds are skipped (counted)."""
        with self._lock:
            ids = check_token_ids("KVStore.put", token_ids, self.vocab_size)
            plan = self._check_put(ids, chunks)  # refuses before anything is written
            self._stats.puts += 1
            written = 0
            targets = range(len(self.tiers)) if self.write_through else range(1)
            for key, n, tensors in plan:
                entry = _Entry(self.fp, key, tensors=tensors, n_tokens=n)
                stored = tried = False
                for index in targets:
                    tier = self.tiers[index]
                    if self._call(tier, "exists", False, lambda: tier.exists(key)):
                        continue
                    tried = True
                    stored |= self._store_in(index, entry, "chunks_stored")
                if not tried:
                    self._stats.chunks_skipped += 1
                written += stored
            return written

    # ---- state --------------------------------------------------------------------------------------------
    @property
    def stats(self) -> StoreStats:
        """The counters, with ``bytes`` read from the tiers now."""
        for tier in self.tiers:
            self._stats.bytes[tier.name] = self._call(tier, "used_bytes", self._stats.bytes.get(tier.name, 0),
                                                      lambda: tier.used_bytes)
        return self._stats

    def close(self) -> None:
        """Close every tier (a shared tier's objects stay in the shared store)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for tier in self.tiers:
                close = getattr(tier, "close", None)
                if close is not None:
                    self._call(tier, "close", None, close)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KVStore(fp={self.fp.digest[:12]}…, chunk_tokens={self.chunk_tokens}, "
                f"tiers={[t.name for t in self.tiers]})")
