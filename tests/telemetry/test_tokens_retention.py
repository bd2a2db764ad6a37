"""Zero retention and the token cache: token ids decode back to the prompt, so TokenSource must not keep those
of a zero-retention request (`retain=False`: tokenized, used, dropped); an ordinary request is cached. Checked on
TokenSource itself and through the gateway's request path (the routing stage passes the request's retention)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.sim.fleet import start_fleet
from gateway.telemetry.tokens import TokenSource
from tests.observability.conftest import KEY, ZR_KEY, fleet, open_stack  # noqa: F401 - fleet is a fixture


def body(text: str, model: str = "m") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}]}


async def test_retain_false_never_touches_the_cache():
    ts = TokenSource("approx")
    secret, _ = await ts.tokens(None, body("zero-retention secret " * 20), retain=False)
    assert secret and len(ts._cache) == 0 and ts.uncached == 1 and ts.hits == ts.misses == 0
    plain, src = await ts.tokens(None, body("ordinary prompt " * 20))
    assert src == "approx" and len(ts._cache) == 1 and ts.misses == 1
    assert [v[0] for v in ts._cache.values()] == [plain]
    # the same text under zero retention neither reads nor refreshes the entry, nor adds one
    again, _ = await ts.tokens(None, body("ordinary prompt " * 20), retain=False)
    assert again == plain and len(ts._cache) == 1 and ts.hits == 0 and ts.uncached == 2
    assert ts.by_source == {"approx": 3}


async def test_retain_false_via_the_engine_tokenizer():
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        root = fleet[0].root
        ts = TokenSource("engine")
        try:
            toks, src = await ts.tokens(root, body("zero-retention secret", "sim-model"), retain=False)
            assert src == "engine" and toks and not ts._cache
            _, src = await ts.tokens(root, body("ordinary", "sim-model"))
            assert src == "engine" and len(ts._cache) == 1
        finally:
            await ts.close()


async def test_zero_retention_request_leaves_no_token_cache_entry(tmp_path: Path, fleet) -> None:
    async for st in open_stack(tmp_path, fleet):
        ts = st.gw.telemetry.tokens
        r = await st.chat("zero-retention canary 9d1e " * 8, key=ZR_KEY)  # tenant labelled residency: eea
        assert r.status_code == 200, r.text
        assert len(ts._cache) == 0 and ts.uncached == 1 and ts.misses == 0
        r = await st.chat("ordinary prompt " * 8, key=KEY)
        assert r.status_code == 200, r.text
        assert len(ts._cache) == 1 and ts.misses == 1 and ts.uncached == 1
        assert st.gw.telemetry.fleet_snapshot()["tokens"]["uncached"] == 1
