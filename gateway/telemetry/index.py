"""The live KV index: which engine holds which prompt blocks, in which tier, keyed by the gateway's own hashes.

Own key of a block = xxh3_64(block token ids as uint32 bytes, seed = own key of the parent block); the first
block's seed folds in cache_salt and the LoRA name (what vLLM puts in the block's extra keys; SGLang sends the
salt as the event's `cache_salt`). Requests and events therefore meet in one key space that depends on neither
engine's hash function or seed (vLLM's uint64 or bytes hashes, SGLang's signed int64 namespaced ones).

Memory: no per-entry Python objects. One open-addressing table (numpy uint64 arrays) maps own key -> an
"any tier" engine bitmask (bit = engine slot, up to 64 engines), with per-tier masks added only once a
non-GPU medium shows up; each engine has its own table engine-hash -> own key so BlockRemoved can be applied.
See docs/kv-index.md for the measurements behind this layout.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import msgspec
import numpy as np
import xxhash

from gateway.telemetry.chunk_budget import ChunkBudgetLearner
from gateway.telemetry.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

M64 = (1 << 64) - 1
_GOLD = 0x9E3779B97F4A7C15
_ZERO_SUB = 0x5BD1E9955BD1E995  # stands in for a key of 0 (0 marks an empty slot)
TIERS = ("GPU", "CPU", "DISK", "SHARED")  # priority order: the tier an engine would load a block from
_MEDIUM_TIER = {None: 0, "GPU": 0, "CPU": 1, "CPU_PINNED": 1, "DISK": 2, "STORAGE": 2, "LOCAL_DISK": 2,
                "SHARED": 3, "REMOTE": 3, "LMCACHE": 3, "EXTERNAL": 3}  # SGLang's StorageMedium: GPU, CPU_PINNED,
# DISK, EXTERNAL (a shared / remote pool such as Mooncake)
MAX_ENGINES = 64
_WIN = np.arange(8, dtype=np.intp)  # slots probed per key in one vectorised gather
_NO_SLOTS = np.zeros(0, dtype=np.intp)
_h64 = xxhash.xxh3_64_intdigest
_NO_SEED = _h64(b"gateway-kv-root")


def tier_of(medium: str | None) -> int:
    """Map an event's `medium` string (vLLM's or SGLang's) to a tier index (unknown media count as shared/remote
    storage)."""
    t = _MEDIUM_TIER.get(medium if medium is None else medium.upper())
    return 3 if t is None else t


def root_seed(salt: str | None, lora: str | None) -> int:
    """Seed of a chain's first block: cache_salt and LoRA name separate caches exactly as in vLLM."""
    if not salt and not lora:
        return _NO_SEED
    return _h64(b"salt\x00" + (salt or "").encode() + b"\x00lora\x00" + (lora or "").encode())


def own_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None, lora: str | None = None,
             parent: int | None = None) -> list[int]:
    """Own keys of every full block of `token_ids` (continuing from `parent` when given)."""
    buf = memoryview(array("I", token_ids).tobytes())
    step = block_size * 4
    seed = root_seed(salt, lora) if parent is None else parent
    out: list[int] = []
    append = out.append
    for off in range(0, (len(token_ids) // block_size) * step, step):
        seed = _h64(buf[off:off + step], seed) or _ZERO_SUB
        append(seed)
    return out


def _norm_hash(h: Any) -> int:
    """Engine block hash as a non-zero uint64 (bytes hashes are folded with xxh3)."""
    if isinstance(h, int):
        h &= M64
    else:
        h = _h64(bytes(h))
    return h or _ZERO_SUB


class _Table:
    """Linear-probing hash table uint64 key -> several uint64 values, in numpy arrays (key 0 = empty)."""

    __slots__ = ("cap", "shift", "n", "keys", "vals", "_k", "_v", "mix", "load_num", "load_den")

    def __init__(self, nvals: int, cap: int = 1024, mix: int = _GOLD) -> None:
        # max load 3/4 for engine tables; 1/2 for the global table, whose lookups are vectorised per probe round
        self.load_num, self.load_den = (3, 4) if mix != 1 else (1, 2)
        self.mix = mix  # 1 for keys that are already uniform hashes (own keys): slot = top bits of the key
        self.cap = cap
        self.shift = 64 - (cap.bit_length() - 1)
        self.n = 0
        self.keys = np.zeros(cap, dtype=np.uint64)
        self.vals = [np.zeros(cap, dtype=np.uint64) for _ in range(nvals)]
        self._views()

    def _views(self) -> None:
        self._k = self.keys.data.cast("B").cast("Q")  # ndarray.data: the array's buffer as a memoryview
        self._v = [v.data.cast("B").cast("Q") for v in self.vals]

    def add_values(self, init: np.ndarray | None = None) -> int:
        self.vals.append(init.copy() if init is not None else np.zeros(self.cap, dtype=np.uint64))
        self._views()
        return len(self.vals) - 1

    def slot(self, key: int) -> int:
        """Slot holding `key`, or -1."""
        k = self._k
        mask = self.cap - 1
        s = ((key * self.mix) & M64) >> self.shift
        while True:
            v = k[s]
            if v == key:
                return s
            if v == 0:
                return -1
            s = (s + 1) & mask

    def insert(self, key: int) -> int:
        """Slot of `key`, inserting it (values 0) if absent."""
        if (self.n + 1) * self.load_den > self.cap * self.load_num:
            self._grow()
        k = self._k
        mask = self.cap - 1
        s = ((key * self.mix) & M64) >> self.shift
        while True:
            v = k[s]
            if v == key:
                return s
            if v == 0:
                k[s] = key
                self.n += 1
                return s
            s = (s + 1) & mask

    def delete_slot(self, s: int) -> None:
        """Remove the entry at slot s (backward-shift deletion keeps probe chains intact)."""
        k, vs, mask, sh, mix = self._k, self._v, self.cap - 1, self.shift, self.mix
        j = s
        while True:
            j = (j + 1) & mask
            kj = k[j]
            if kj == 0:
                break
            home = ((kj * mix) & M64) >> sh
            # move j back to s if its home is not cyclically within (s, j]
            if (j > s and (home <= s or home > j)) or (j < s and (home <= s and home > j)):
                k[s] = kj
                for v in vs:
                    v[s] = v[j]
                s = j
        k[s] = 0
        for v in vs:
            v[s] = 0
        self.n -= 1

    def _grow(self) -> None:
        live = self.keys != 0
        keys = self.keys[live]
        vals = [v[live] for v in self.vals]
        cap = self.cap * 2
        self.__init__(len(vals), cap, self.mix)  # type: ignore[misc]
        self._bulk_place(keys, vals)

    def home_slots(self, keys: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((keys * np.uint64(self.mix)) >> np.uint64(self.shift)).astype(np.intp)

    def _bulk_place(self, keys: np.ndarray, vals: list[np.ndarray]) -> None:
        """Vectorised insert of distinct keys into an empty table (rounds of conflict-free placement)."""
        mask = self.cap - 1
        slots = self.home_slots(keys)
        pending = np.arange(keys.size)
        while pending.size:
            s = slots[pending]
            free = self.keys[s] == 0
            cand, cs = pending[free], s[free]
            _, first = np.unique(cs, return_index=True)
            win, ws = cand[first], cs[first]
            self.keys[ws] = keys[win]
            for dst, src in zip(self.vals, vals):
                dst[ws] = src[win]
            placed = np.zeros(keys.size, dtype=bool)
            placed[win] = True
            pending = pending[~placed[pending]]
            slots[pending] = (slots[pending] + 1) & mask
        self.n = int(keys.size)

    def nbytes(self) -> int:
        return int(self.keys.nbytes + sum(v.nbytes for v in self.vals))


@dataclass
class CachedPrefix:
    """What one engine holds of a request: the longest cached prefix in tokens, split by tier."""

    tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    blocks: int = 0


@dataclass
class _Group:
    """One non-zero KV-cache group of a hybrid model (plain dicts: such groups are few and bounded by the
    engine's block pool, and only the sliding-window ones change a prediction)."""

    kind: str | None = None
    window: int | None = None
    held: dict[int, int] = field(default_factory=dict)  # own key -> resident copies
    keys: dict[int, int] = field(default_factory=dict)  # engine hash -> own key


@dataclass
class _Engine:
    slot: int
    table: _Table
    block_size: int | None = None
    dups: dict[tuple[int, int], int] = field(default_factory=dict)  # (engine hash, tier) -> extra copies
    stored: int = 0
    removed: int = 0
    orphans: int = 0  # stored blocks whose parent hash was unknown (after a loss)
    skipped: int = 0  # events not indexed (other KV groups, malformed)
    clears: int = 0
    # KV-cache groups other than 0 (hybrid models), by group index: own key -> resident copies, engine hash ->
    # own key, and the group's spec (kind, sliding window in tokens) as the events state it.
    groups: dict[int, "_Group"] = field(default_factory=dict)
    fields_seen: set[str] = field(default_factory=set)  # event fields this engine has sent with a value
    report_full: bool = False  # requests carry kv_cache_report_mode="full": reused blocks are re-announced
    reannounced: int = 0  # BlockStored events taken as re-announcements of resident blocks (not new copies)
    chunks: ChunkBudgetLearner = field(default_factory=ChunkBudgetLearner)  # survives resets: an engine fact


class KVIndex:
    """Per-engine, per-tier index of cached blocks; `apply` ingests vLLM event batches, `lookup` answers requests."""

    def __init__(self, initial_capacity: int = 1 << 12) -> None:
        self._g = _Table(1, initial_capacity, mix=1)  # value 0: any-tier engine mask
        self._tier_vals: list[int] | None = None  # value indices of per-tier masks once a non-GPU tier is seen
        self._engines: dict[str, _Engine] = {}
        self._free_slots = list(range(MAX_ENGINES - 1, -1, -1))

    # ----------------------------------------------------------------------------------- engines
    def _engine(self, name: str) -> _Engine:
        e = self._engines.get(name)
        if e is None:
            if not self._free_slots:
                raise ValueError(f"KVIndex tracks at most {MAX_ENGINES} engines")
            e = self._engines[name] = _Engine(self._free_slots.pop(), _Table(1, 1024))
        return e

    def block_size(self, engine: str) -> int | None:
        e = self._engines.get(engine)
        return e.block_size if e else None

    def set_block_size(self, engine: str, block_size: int) -> None:
        """Learned from events, or from vllm:cache_config_info before the first event arrives."""
        e = self._engine(engine)
        if e.block_size != block_size:
            if e.block_size is not None:
                self.reset(engine)
            e.block_size = block_size

    def set_report_full(self, engine: str, full: bool) -> None:
        """The gateway sends this engine's requests with kv_cache_report_mode="full" (vLLM 0.32
        `KVCacheManager.get_computed_blocks` then emits a BlockStored, parent None, from block 0 for every
        group's reused blocks: copies already counted, and in a sliding-window group also the positions outside
        the window, which are not resident). Such re-announcements are recognised and add nothing."""
        self._engine(engine).report_full = full

    def engines(self) -> list[str]:
        return list(self._engines)

    def reset(self, engine: str) -> None:
        """Forget everything about one engine (AllBlocksCleared, restart, unrecoverable gap)."""
        e = self._engines.get(engine)
        if e is None:
            return
        bit = 1 << e.slot
        nbit = M64 ^ bit
        g = self._g
        live = np.flatnonzero((g.vals[0] & np.uint64(bit)) != 0)
        if live.size:
            for v in g.vals:
                v[live] &= np.uint64(nbit)
            empty = live[g.vals[0][live] == 0]
            if empty.size:  # rebuild without the now-empty entries (vectorised; cheaper than many deletes)
                keep = g.keys != 0
                keep[empty] = False
                keys = g.keys[keep]
                vals = [v[keep] for v in g.vals]
                cap = g.cap
                while cap > 1024 and keys.size * 4 < cap:
                    cap //= 2
                g.__init__(len(vals), cap, 1)  # type: ignore[misc]
                g._bulk_place(keys, vals)
        e.table = _Table(1, 1024)
        e.dups.clear()
        e.groups.clear()
        e.clears += 1

    def remove_engine(self, engine: str) -> None:
        if engine in self._engines:
            self.reset(engine)
            self._free_slots.append(self._engines.pop(engine).slot)

    # ----------------------------------------------------------------------------------- ingest
    def _ensure_tiers(self) -> list[int]:
        if self._tier_vals is None:
            g = self._g
            gpu = g.add_values(g.vals[0])  # everything seen so far was GPU
            self._tier_vals = [gpu] + [g.add_values() for _ in TIERS[1:]]
        return self._tier_vals

    def apply(self, engine: str, batch: KVEventBatch) -> int:
        """Apply one batch in order; returns the number of block events applied."""
        e = self._engine(engine)
        n = 0
        chunks: list[tuple[int | None, int, int, int]] = []  # one engine step's stored chunks (budget learner)
        seen = e.fields_seen
        for ev in batch.events:
            for f, v in zip(ev.__struct_fields__, msgspec.structs.astuple(ev)):
                if v is not None and f not in seen:
                    seen.add(f)
            if isinstance(ev, BlockStored):
                n += self._stored(e, ev)
                hs = ev.block_hashes
                if len(hs) >= 2 and ev.group_idx in (None, 0):
                    p = ev.parent_block_hash
                    chunks.append((None if p is None else _norm_hash(p), _norm_hash(hs[-1]), len(hs), ev.block_size))
            elif isinstance(ev, BlockRemoved):
                n += self._removed(e, ev)
            elif isinstance(ev, AllBlocksCleared):
                self.reset(engine)
        e.chunks.observe(chunks)
        return n

    def chunk_budget(self, engine: str) -> int | None:
        """The engine's chunked-prefill budget per step as learned from its KV events (None: not yet seen)."""
        e = self._engines.get(engine)
        return e.chunks.budget if e else None

    def _stored_group(self, e: _Engine, ev: BlockStored) -> int:
        """A BlockStored of a non-zero KV-cache group: kept per group (own key -> copies) so that a lookup can
        apply vLLM's rule that every group must serve the prefix (a sliding-window group only its window)."""
        assert ev.group_idx is not None
        bs = ev.block_size
        hashes = ev.block_hashes
        if bs <= 0 or len(ev.token_ids) != len(hashes) * bs or (e.block_size is not None and bs != e.block_size):
            e.skipped += 1  # a group with another block size is not modelled
            return 0
        gr = e.groups.get(ev.group_idx)
        if gr is None:
            gr = e.groups[ev.group_idx] = _Group()
        if ev.kv_cache_spec_kind is not None:
            gr.kind = ev.kv_cache_spec_kind
        if ev.kv_cache_spec_sliding_window is not None:
            gr.window = ev.kv_cache_spec_sliding_window
        if e.report_full and ev.parent_block_hash is None and _norm_hash(hashes[-1]) in gr.keys:
            e.reannounced += 1  # a reused prefix re-announced (its window's blocks are resident, known)
            return 0
        lora = ev.lora_name
        extras = ev.extra_keys
        parent = ev.parent_block_hash
        seed: int | None = None
        if parent is not None:
            pk = gr.keys.get(_norm_hash(parent))
            if pk is None:
                pk = e.table.slot(_norm_hash(parent))  # same block hashes as group 0 when block sizes agree
                pk = int(e.table._v[0][pk]) if pk >= 0 else None
            seed = pk if pk is not None else _h64(b"orphan", _norm_hash(parent))
        buf = memoryview(array("I", ev.token_ids).tobytes())
        step = bs * 4
        for i, h in enumerate(hashes):
            x = extras[i] if extras is not None and i < len(extras) else None
            if seed is None:
                salt, poison = _split_extra(x, lora, first=True)
                seed = root_seed(salt or ev.cache_salt, lora)  # vLLM: the salt in extra_keys; SGLang: cache_salt
            elif x is not None:
                _, poison = _split_extra(x, lora, first=False)
            else:
                poison = None
            if poison is not None:
                seed = _h64(poison, seed)
            key = _h64(buf[i * step:(i + 1) * step], seed) or _ZERO_SUB
            seed = key
            gr.keys[_norm_hash(h)] = key
            gr.held[key] = gr.held.get(key, 0) + 1
        e.stored += len(hashes)
        return len(hashes)

    def _removed_group(self, e: _Engine, ev: BlockRemoved) -> int:
        """One BlockRemoved in a non-zero group drops one copy (vLLM may hold several copies of one hash)."""
        assert ev.group_idx is not None
        gr = e.groups.get(ev.group_idx)
        if gr is None:
            return 0
        n = 0
        for h in ev.block_hashes:
            hh = _norm_hash(h)
            key = gr.keys.get(hh)
            if key is None:
                continue
            c = gr.held.get(key, 0) - 1
            if c > 0:
                gr.held[key] = c
            else:
                gr.held.pop(key, None)
                del gr.keys[hh]
            n += 1
        e.removed += n
        return n

    def _group_limit(self, e: _Engine, keys: list[int], nb: int, bs: int) -> int:
        """Blocks of a `nb`-block group-0 hit that every other group can also serve.

        vLLM 0.32 (`HybridKVCacheCoordinator`, `SlidingWindowManager.find_longest_cache_hit`, read for the rule;
        not copied): a full-attention group needs every block of the prefix; a sliding-window group of window
        `w` needs the last ceil((w - 1) / bs) blocks before the hit point, scanning down from the longest
        candidate; if no such run exists the hit is the run of resident blocks from block 0 (all of it, when
        that run is shorter than the window). The hit is the shortest over the groups."""
        while True:  # like the coordinator: until no group shortens the hit any further
            before = nb
            for gr in e.groups.values():
                nb = _group_hit(gr, keys, nb, bs)
            if nb == before or nb == 0:
                return nb

    def _stored(self, e: _Engine, ev: BlockStored) -> int:
        if ev.group_idx not in (None, 0):
            return self._stored_group(e, ev)
        bs = ev.block_size
        hashes = ev.block_hashes
        toks = ev.token_ids
        if bs <= 0 or len(toks) != len(hashes) * bs:
            e.skipped += 1
            return 0
        if e.block_size != bs:
            if e.block_size is not None:
                self.reset_keep(e)
            e.block_size = bs
        if e.report_full and ev.parent_block_hash is None and e.table.slot(_norm_hash(hashes[-1])) >= 0:
            e.reannounced += 1  # a reused prefix re-announced: the same physical copies, not new ones
            return 0
        tier = tier_of(ev.medium)
        lora = ev.lora_name
        extras = ev.extra_keys
        parent = ev.parent_block_hash
        if parent is None:
            seed = None
        else:
            ps = e.table.slot(_norm_hash(parent))
            if ps < 0:
                e.orphans += len(hashes)
                seed = _h64(b"orphan", _norm_hash(parent))  # a chain no request key can reach
            else:
                seed = e.table._v[0][ps]
        buf = memoryview(array("I", toks).tobytes())
        step = bs * 4
        g = self._g
        bit = 1 << e.slot
        tv = self._tier_vals if tier == 0 else self._ensure_tiers()
        et = e.table
        for i, h in enumerate(hashes):
            x = extras[i] if extras is not None and i < len(extras) else None
            if seed is None:
                salt, poison = _split_extra(x, lora, first=True)
                seed = root_seed(salt or ev.cache_salt, lora)  # vLLM: the salt in extra_keys; SGLang: cache_salt
            elif x is not None:
                _, poison = _split_extra(x, lora, first=False)
            else:
                poison = None
            if poison is not None:
                seed = _h64(poison, seed)
            key = _h64(buf[i * step:(i + 1) * step], seed) or _ZERO_SUB
            seed = key
            hh = _norm_hash(h)
            es = et.insert(hh)
            et._v[0][es] = key
            gs = g.insert(key)
            gv = g._v
            if tv is None:
                if gv[0][gs] & bit:
                    e.dups[(hh, 0)] = e.dups.get((hh, 0), 0) + 1
                gv[0][gs] |= bit
            else:
                t = gv[tv[tier]]
                if t[gs] & bit:
                    e.dups[(hh, tier)] = e.dups.get((hh, tier), 0) + 1
                t[gs] |= bit
                gv[0][gs] |= bit
        e.stored += len(hashes)
        return len(hashes)

    def reset_keep(self, e: _Engine) -> None:
        for name, x in self._engines.items():
            if x is e:
                self.reset(name)
                return

    def _removed(self, e: _Engine, ev: BlockRemoved) -> int:
        if ev.group_idx not in (None, 0):
            return self._removed_group(e, ev)
        tier = tier_of(ev.medium)
        g = self._g
        bit = 1 << e.slot
        nbit = M64 ^ bit
        et = e.table
        n = 0
        for h in ev.block_hashes:
            hh = _norm_hash(h)
            es = et.slot(hh)
            if es < 0:
                continue
            if e.dups:
                d = e.dups.get((hh, tier))
                if d:
                    if d == 1:
                        del e.dups[(hh, tier)]
                    else:
                        e.dups[(hh, tier)] = d - 1
                    n += 1
                    continue
            key = et._v[0][es]
            gs = g.slot(key)
            still = False
            if gs >= 0:
                gv = g._v
                tv = self._tier_vals
                if tv is not None:
                    gv[tv[tier]][gs] &= nbit
                    still = any(gv[t][gs] & bit for t in tv)
                if not still:
                    m = gv[0][gs] & nbit
                    gv[0][gs] = m
                    if m == 0:
                        g.delete_slot(gs)
            if not still:
                et.delete_slot(es)
            n += 1
        e.removed += n
        return n

    # ----------------------------------------------------------------------------------- lookup
    def lookup(self, engine_names: Iterable[str], token_ids: Sequence[int] | "RequestKeys",
               salt: str | None = None, lora: str | None = None) -> dict[str, CachedPrefix]:
        """Per engine, the longest cached prefix of the request (tokens the engine would reuse) and its tiers.

        One pass over the request's blocks per block size, stopping once no asked engine holds the next block.
        Tokens are capped like vLLM's scheduler (at most prompt_len - 1 tokens can come from cache).
        """
        rk = token_ids if isinstance(token_ids, RequestKeys) else RequestKeys(token_ids, salt, lora)
        out: dict[str, CachedPrefix] = {}
        by_bs: dict[int, list[tuple[str, _Engine]]] = {}
        for name in engine_names:
            e = self._engines.get(name)
            if e is None or e.block_size is None:
                out[name] = CachedPrefix()
            else:
                by_bs.setdefault(e.block_size, []).append((name, e))
        tv = self._tier_vals
        for bs, engs in by_bs.items():
            ka = rk.keys_np(bs)
            nblk = min(int(ka.size), max(0, (rk.n_tokens - 1) // bs))  # vLLM reuses at most prompt_len - 1
            if nblk == 0:
                for name, _ in engs:
                    out[name] = CachedPrefix()
                continue
            ka = ka[:nblk]
            want = 0
            for _, e in engs:
                want |= 1 << e.slot
            ends, sl = self._prefix_ends(rk, bs, ka, want)
            for _, e in engs:
                nb0 = ends.get(1 << e.slot, 0)
                if e.groups and nb0:
                    nb1 = self._group_limit(e, rk.keys(bs), nb0, bs)
                    if nb1:
                        ends[1 << e.slot] = nb1
                    else:
                        del ends[1 << e.slot]
            if not ends:
                for name, _ in engs:
                    out[name] = CachedPrefix()
                continue
            if tv is None:
                for name, e in engs:
                    nb = ends.get(1 << e.slot, 0)
                    out[name] = CachedPrefix(nb * bs, {"GPU": nb * bs}, nb) if nb else CachedPrefix()
            else:
                self._by_tier(out, engs, ends, sl, bs)
        return out

    def _leading_slots(self, rk: "RequestKeys", bs: int, ka: np.ndarray) -> np.ndarray:
        """Slots of the request's leading keys that are in the global table (stops at the first absent key).

        Blocks after an absent key cannot be in anyone's prefix, so they need no probing. The result is cached
        on the RequestKeys and re-validated with one gather (keys never move except on growth or deletion, and
        a moved key just fails validation), so repeated lookups of one request skip the probing.
        """
        g = self._g
        c = rk._slots.get(bs)
        if c is not None and c[0] is g.keys:
            sl = c[1]
            n = sl.size
            if (n == 0 or bool((g.keys.take(sl) == ka[:n]).all())) and (n == ka.size or g.slot(int(ka[n])) < 0):
                return sl
        n = ka.size
        # probe a window of _WIN.size slots from each key's home in one gather; laid out (window, key) so that
        # numpy's inner loops run along the 100s of keys rather than the 8 window positions
        win = _WIN[:, None] + (ka >> np.uint64(g.shift)).astype(np.intp)  # global table: slot = top bits
        np.bitwise_and(win, g.cap - 1, out=win)
        p = np.flatnonzero(g.keys.take(win) == ka)  # keys are unique in the table: at most one match per key
        col = p % n
        slots = np.empty(n, dtype=np.intp)
        slots[col] = win.ravel().take(p)
        length = n
        if p.size != n:
            found = np.zeros(n, dtype=bool)
            found[col] = True
            for i in np.flatnonzero(~found).tolist():
                s = g.slot(int(ka[i]))  # beyond the window (rare) or absent
                if s < 0:
                    length = i
                    break
                slots[i] = s
        sl = slots[:length]
        rk._slots[bs] = (g.keys, sl)
        return sl

    def _prefix_ends(self, rk: "RequestKeys", bs: int, ka: np.ndarray,
                     want: int) -> tuple[dict[int, int], np.ndarray]:
        """Engine bit -> number of leading blocks that engine holds (engines holding none are left out),
        and the slots of those blocks."""
        g = self._g
        s0 = g.slot(int(ka[0]))
        if s0 < 0 or not g._v[0][s0] & want:  # early exit: nobody asked holds the first block
            return {}, _NO_SLOTS
        sl = self._leading_slots(rk, bs, ka)
        acc = np.bitwise_and.accumulate(g.vals[0].take(sl) & np.uint64(want))
        ends: dict[int, int] = {}
        prev = want
        ch = np.flatnonzero(acc[1:] != acc[:-1])
        first = int(acc[0])
        if first != prev:
            _drop(ends, prev ^ first, 0)
            prev = first
        if ch.size:
            for c, cur in zip((ch + 1).tolist(), acc.take(ch + 1).tolist()):
                _drop(ends, prev ^ cur, c)
                prev = cur
        _drop(ends, prev, sl.size)
        for b in [b for b, v in ends.items() if v == 0]:
            del ends[b]
        return ends, sl

    def _by_tier(self, out: dict[str, CachedPrefix], engs: list[tuple[str, "_Engine"]], ends: dict[int, int],
                 sl: np.ndarray, bs: int) -> None:
        """Split every engine's prefix by the best tier it holds each block in, for all engines at once."""
        g = self._g
        tv = self._tier_vals
        assert tv is not None
        nmax = max(ends.values())
        t = np.stack([g.vals[v].take(sl[:nmax]) for v in tv])  # (tiers, blocks) engine masks
        better = np.bitwise_or.accumulate(t, axis=0)
        t[1:] &= ~better[:-1]  # a block counts in the best tier the engine holds it in
        held = [(name, e.slot, ends.get(1 << e.slot, 0)) for name, e in engs]
        live = [h for h in held if h[2]]
        pos = np.array([h[1] for h in live], dtype=np.uint64)
        nbs = np.array([h[2] for h in live], dtype=np.intp)
        bits = (t[:, :, None] >> pos) & np.uint64(1)  # (tiers, blocks, engines)
        bits &= (np.arange(nmax)[:, None] < nbs).astype(np.uint64)
        counts = bits.sum(axis=1).T.tolist()  # (engines, tiers)
        for name, _, nb in held:
            if not nb:
                out[name] = CachedPrefix()
        for (name, _, nb), cs in zip(live, counts):
            out[name] = CachedPrefix(nb * bs, {TIERS[i]: c * bs for i, c in enumerate(cs) if c}, nb)

    def holds(self, engine: str, key: int) -> bool:
        e = self._engines.get(engine)
        if e is None:
            return False
        s = self._g.slot(key)
        return s >= 0 and bool(self._g._v[0][s] & (1 << e.slot))

    # ----------------------------------------------------------------------------------- repair
    def forget_from(self, engine: str, keys: Sequence[int]) -> None:
        """Clear `engine`'s bit for these own keys (used when the engine reports less cache than predicted)."""
        e = self._engines.get(engine)
        if e is None:
            return
        nbit = M64 ^ (1 << e.slot)
        g = self._g
        for key in keys:
            s = g.slot(key)
            if s >= 0:
                for v in g._v:
                    v[s] &= nbit
                if g._v[0][s] == 0:
                    g.delete_slot(s)

    # ----------------------------------------------------------------------------------- stats
    def engine_blocks(self, engine: str) -> dict[str, int]:
        """Blocks held by one engine, by tier (a full-table count: see block_count_snapshot for the off-loop way)."""
        e = self._engines.get(engine)
        if e is None:
            return {}
        return self.count_blocks(([(engine, e.slot)], list(self._g.vals), self._tier_vals))[engine]

    def block_count_snapshot(self) -> tuple[list[tuple[str, int]], list[np.ndarray], list[int] | None]:
        """What `count_blocks` reads, taken on the event loop in O(engines): the engines' slots and the current
        mask arrays. Counting then runs in a worker thread (numpy releases the GIL): at millions of slots a
        count is tens of ms per engine and tier, which would otherwise stall every request on the loop for each
        /metrics scrape. Arrays grown meanwhile are new objects; in-place bit flips meanwhile make the counts
        at most a few events old."""
        return [(name, e.slot) for name, e in self._engines.items()], list(self._g.vals), self._tier_vals

    @staticmethod
    def count_blocks(snap: tuple[list[tuple[str, int]], list[np.ndarray], list[int] | None]
                     ) -> dict[str, dict[str, int]]:
        """Blocks held per engine and tier, from a block_count_snapshot (safe to run in a thread)."""
        engines, vals, tier_vals = snap
        out: dict[str, dict[str, int]] = {}
        for name, slot in engines:
            b = np.uint64(1 << slot)
            if tier_vals is None:
                out[name] = {"GPU": int(np.count_nonzero(vals[0] & b))}
            else:
                out[name] = {TIERS[i]: int(np.count_nonzero(vals[t] & b)) for i, t in enumerate(tier_vals)}
        return out

    def memory_bytes(self) -> int:
        return self._g.nbytes() + sum(e.table.nbytes() for e in self._engines.values())

    def stats(self) -> dict[str, Any]:
        """Sizes and counters for /admin/fleet and the benchmark."""
        entries = sum(e.table.n for e in self._engines.values())
        mem = self.memory_bytes()
        return {
            "distinct_blocks": self._g.n,
            "block_engine_entries": entries,
            "memory_bytes": mem,
            "bytes_per_entry": round(mem / entries, 1) if entries else None,
            "engines": {name: {"slot": e.slot, "block_size": e.block_size, "entries": e.table.n,
                               "stored": e.stored, "removed": e.removed, "orphans": e.orphans,
                               "skipped": e.skipped, "resets": e.clears, "chunk_budget": e.chunks.budget,
                               "budget_limited_steps": e.chunks.limited_steps,
                               "kv_groups": {str(i): {"kind": g.kind, "sliding_window": g.window,
                                                      "blocks": len(g.held)} for i, g in e.groups.items()},
                               "event_fields": sorted(e.fields_seen), "report_full": e.report_full,
                               "reannounced": e.reannounced}
                        for name, e in self._engines.items()},
        }


def _split_extra(x: Any, lora: str | None, first: bool) -> tuple[str | None, bytes | None]:
    """Split one block's extra keys into (cache_salt, poison). vLLM orders them LoRA name, multimodal keys,
    cache_salt (first block only), prompt-embedding hashes. Anything but the LoRA name and the salt makes the
    block unreachable from text requests, which is right: we cannot predict reuse of such blocks."""
    if not x:
        return None, None
    rest = list(x)
    if lora and rest and rest[0] == lora:
        rest = rest[1:]
    if not rest:
        return None, None
    if first and len(rest) == 1 and isinstance(rest[0], str):
        return rest[0], None
    return None, repr(rest).encode()


_PREFIX_KINDS = ("full_attention", "mla_attention", "sink_full_attention")


def _group_hit(gr: _Group, keys: list[int], nb: int, bs: int) -> int:
    """Blocks of an `nb`-block hit that one non-zero group can serve (vLLM 0.32's rule, see _group_limit).
    A group whose kind is neither a sliding window nor full attention (mamba, unknown...) is not modelled
    and does not shorten the hit."""
    held = gr.held
    kind = (gr.kind or "").lower()
    if gr.window and (not kind or "sliding" in kind):
        need = max(1, -(-(gr.window - 1) // bs))  # blocks covering the window's last window-1 tokens
        run = 0
        for i in range(nb - 1, -1, -1):
            if keys[i] in held:
                run += 1
                if run >= need:
                    return i + run
            else:
                run = 0
        return run  # no full window anywhere: only the resident run from block 0
    if kind in _PREFIX_KINDS:
        i = 0
        while i < nb and keys[i] in held:
            i += 1
        return i
    return nb


def _drop(ends: dict[int, int], bits: int, at: int) -> None:
    while bits:
        low = bits & -bits
        ends[low] = at
        bits ^= low


class RequestKeys:
    """A request's own keys per block size, computed once and reused across candidates and retries."""

    __slots__ = ("token_ids", "salt", "lora", "n_tokens", "_by_bs", "_np", "_slots")

    def __init__(self, token_ids: Sequence[int], salt: str | None = None, lora: str | None = None) -> None:
        self.token_ids = token_ids
        self.salt = salt
        self.lora = lora
        self.n_tokens = len(token_ids)
        self._by_bs: dict[int, list[int]] = {}
        self._np: dict[int, np.ndarray] = {}
        self._slots: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # block size -> (table keys array, slots)

    def keys(self, block_size: int) -> list[int]:
        k = self._by_bs.get(block_size)
        if k is None:
            k = self._by_bs[block_size] = own_keys(self.token_ids, block_size, self.salt, self.lora)
        return k

    def keys_np(self, block_size: int) -> np.ndarray:
        a = self._np.get(block_size)
        if a is None:
            a = self._np[block_size] = np.array(self.keys(block_size), dtype=np.uint64)
        return a
