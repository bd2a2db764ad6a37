"""KV index lookups pinned against a brute-force reference on random chains, stores, removals and tiers."""
from hypothesis import given, settings, strategies as st

from gateway.telemetry.index import TIERS, KVIndex, RequestKeys, own_keys
from gateway.telemetry.kv_events import BlockRemoved, BlockStored, KVEventBatch

BS = 4
MEDIA = ("GPU", "CPU", "DISK")
ENGINES = ("a", "b", "c")


def _tree(seed: int, n_nodes: int) -> list[tuple[int | None, list[int]]]:
    """A prefix tree of blocks: node i = (parent node or None, its BS tokens)."""
    nodes: list[tuple[int | None, list[int]]] = []
    for i in range(n_nodes):
        parent = None if i == 0 or (seed * (i + 3)) % 5 == 0 else (seed * 7 + i * 13) % i
        nodes.append((parent, [(seed * 31 + i * 17 + j) % 997 + 1 for j in range(BS)]))
    return nodes


def _path(nodes, i: int) -> list[int]:
    out = []
    while i is not None:
        out.append(i)
        i = nodes[i][0]
    return out[::-1]


op = st.tuples(st.sampled_from(["store", "remove", "clear"]), st.sampled_from(ENGINES), st.integers(0, 10**6),
               st.sampled_from(MEDIA))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(1, 10**6), n_nodes=st.integers(2, 40), ops=st.lists(op, max_size=40),
       queries=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 2 * BS)), min_size=1, max_size=6),
       cap=st.sampled_from([16, 1024]))
def test_lookup_matches_brute_force(seed, n_nodes, ops, queries, cap):
    nodes = _tree(seed, n_nodes)
    idx = KVIndex(initial_capacity=cap)
    held = {e: {} for e in ENGINES}  # engine -> node -> {tier: copies}
    for kind, eng, r, medium in ops:
        node = r % n_nodes
        if kind == "store":  # a chain segment ending at `node`, whose parent the engine holds (or from the root)
            path = _path(nodes, node)
            start = len(path) - 1 - r % len(path)
            while start > 0 and path[start - 1] not in held[eng]:
                start -= 1
            seg = path[start:]
            parent = path[start - 1] if start else None
            toks = [t for n in seg for t in nodes[n][1]]
            idx.apply(eng, KVEventBatch(0.0, [BlockStored(list(seg), parent, toks, BS, None, medium, None)], 0))
            for n in seg:
                c = held[eng].setdefault(n, {})
                c[medium] = c.get(medium, 0) + 1
        elif kind == "remove":
            if node in held[eng]:  # vLLM removes a copy it has (in one of the tiers it holds the block in)
                media = sorted(held[eng][node])
                medium = media[r % len(media)]
            idx.apply(eng, KVEventBatch(0.0, [BlockRemoved([node], medium)], 0))
            c = held[eng].get(node)
            if c and c.get(medium):
                c[medium] -= 1
                if not c[medium]:
                    del c[medium]
                if not c:
                    del held[eng][node]
        elif r % 7 == 0:
            idx.reset(eng)
            held[eng].clear()
    for r, extra in queries:
        path = _path(nodes, r % n_nodes)
        toks = [t for n in path for t in nodes[n][1]] + [1000 + j for j in range(extra)]
        nblk = min(len(path), max(0, (len(toks) - 1) // BS))
        rk = RequestKeys(toks)
        for _ in range(2):  # cold, then with the request's cached slots
            got = idx.lookup(list(ENGINES) + ["unknown"], rk)
            assert got["unknown"].tokens == 0
            for e in ENGINES:
                nb = 0
                by: dict[str, int] = {}
                while nb < nblk and path[nb] in held[e]:
                    best = min(TIERS.index(m) for m in held[e][path[nb]])
                    by[TIERS[best]] = by.get(TIERS[best], 0) + BS
                    nb += 1
                assert (got[e].tokens, got[e].blocks) == (nb * BS, nb), (e, path, held[e])
                assert got[e].by_tier == by, (e, got[e], by)


def test_long_probe_chains_are_followed():
    """Keys pushed far from their home slot (beyond the vectorised probe window) are still found."""
    idx = KVIndex(initial_capacity=1 << 12)
    toks = list(range(1, 1 + 6 * BS))
    keys = own_keys(toks, BS)
    g = idx._g
    for k in keys[:3]:  # crowd the home slots of the first blocks with 20 fillers each
        home = k >> g.shift
        for j in range(1, 21):
            f = (home << g.shift) | (j * 0x9E3779B97F4A7C1 & ((1 << g.shift) - 1))
            g.vals[0][g.insert(f)] = 1 << 63  # held by an engine slot nobody asks about
    idx.apply("a", KVEventBatch(0.0, [BlockStored(list(range(6)), None, toks, BS, None, "GPU", None)], 0))
    assert idx.lookup(["a"], toks + [7])["a"].tokens == 6 * BS
    idx.apply("a", KVEventBatch(0.0, [BlockRemoved([2], "GPU")], 0))
    rk = RequestKeys(toks + [7])
    assert idx.lookup(["a"], rk)["a"].tokens == 2 * BS
    idx.apply("a", KVEventBatch(0.0, [BlockStored([2], 1, toks[2 * BS:3 * BS], BS, None, "GPU", None)], 0))
    assert idx.lookup(["a"], rk)["a"].tokens == 6 * BS  # cached slots re-validated after the re-store
