"""End to end, placement under load (the simulated fleet, a real gateway process, the openai SDK): a cold adapter
lives on one engine; a hot one spreads to a second engine when its queue on the first is predicted to take longer
than loading it elsewhere; under max_loras pressure an adapter with a stream in flight is never unloaded (a
further adapter is refused with a retryable 503 until a stream ends, and every stream completes).

Two sim engines with vLLM's default scheduler budget (profile vllm-default: ~6k prompt tokens/s each), runtime
LoRA with `--max-loras 2` and a 100 ms load; the gateway declares them `lora: {dynamic: true, max_loras: 2}`.
The engines are modelled from the first request (`routing.model_validity.min_observations: 0`), so the predicted
TTFT (with the load where the adapter is not resident) decides the choice; a base-model warm-up teaches the
predictor each engine's speed first.
"""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import time

import httpx
import openai
import pytest

from tests.e2e.test_adapter_placement_e2e import admin, resident
from tests.support.lora_stack import lora_stack
from tests.support.procs import audit_record

pytestmark = pytest.mark.e2e

ADMIN = "placement-admin-key-0123456789"  # the key admin() of the placement e2e sends
_words = itertools.count()


def prompt(tokens: int) -> list[dict]:
    """A prompt of about `tokens` tokens no earlier request shares (no prefix cache reuse)."""
    n = next(_words)
    return [{"role": "user", "content": f"r{n} " + " ".join(f"w{n}x{i}" for i in range(tokens // 3))}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with lora_stack(tmp_path_factory.mktemp("adapter-load"), ADMIN, profile="vllm-default", load_ms=100,
                    config={"routing": {"model_validity": {"min_observations": 0}}}) as st:
        base = st["base"]
        assert admin(base, "POST", "/admin/tenants", {"id": "alpha"}).status_code == 201
        assert admin(base, "PUT", "/admin/tenants/alpha/adapter_sources",
                     {"prefixes": ["/w/alpha/"]}).status_code == 200
        for n in ("cold", "hot", "s1", "s2", "s3", "s4", "s5"):
            r = admin(base, "POST", "/admin/adapters", {"name": n, "base_model": "base",
                                                        "source": f"/w/alpha/{n}", "owner": {"tenant": "alpha"}})
            assert r.status_code == 201, r.text
        key = admin(base, "POST", "/admin/keys", {"tenant": "alpha"}).json()["key"]
        c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)
        for _ in range(6):  # warm-up: each engine's speed learned from base-model requests
            c.chat.completions.create(model="base", messages=prompt(600), max_tokens=1)
        yield {**st, "client": c}


def evidence(base: str, raw) -> dict:
    """The request's evidence, with the audit record's candidates (lifted to the record's top level)."""
    rec = audit_record(base, raw.headers["x-request-id"], ADMIN)
    return {**rec["evidence"], "candidates": rec["candidates"]}


def unload_all(engines: dict[str, str]) -> None:
    """Start each case from empty engines (the gateway re-reads after the 404s this causes: tested elsewhere)."""
    for root in engines.values():
        for n in resident(root):
            httpx.post(root + "/v1/unload_lora_adapter", json={"lora_name": n}, timeout=5)


def test_a_cold_adapter_lives_on_one_engine(stack):
    base, c = stack["base"], stack["client"]
    seen = []
    for _ in range(6):  # one at a time: no queue anywhere, the resident engine always beats a load elsewhere
        raw = c.chat.completions.with_raw_response.create(model="cold", messages=prompt(300), max_tokens=1)
        assert raw.parse().choices[0].message.content is not None
        ad = evidence(base, raw)["adapter"]
        seen.append((ad["engine"], ad["loaded"]))
    assert len({e for e, _ in seen}) == 1, seen
    assert [ld for _, ld in seen] == [True] + [False] * 5
    assert sum("cold" in resident(u) for u in stack["engines"].values()) == 1


def test_a_hot_adapter_spreads_when_loading_elsewhere_beats_its_queue(stack):
    base, c, engines = stack["base"], stack["client"], stack["engines"]
    first = c.chat.completions.with_raw_response.create(model="hot", messages=prompt(300), max_tokens=1)
    home = evidence(base, first)["adapter"]["engine"]

    def one(_: int) -> dict:
        raw = c.chat.completions.with_raw_response.create(model="hot", messages=prompt(4000), max_tokens=1)
        assert raw.parse().choices[0].message.content is not None
        return evidence(base, raw)

    # 12 prompts of ~4k tokens: ~0.7 s of prefill each on one engine, so its queue soon outgrows a 100 ms load
    with cf.ThreadPoolExecutor(12) as pool:
        evs = list(pool.map(one, range(12)))
    engines_used = {e["adapter"]["engine"] for e in evs}
    assert engines_used == set(engines), [e["adapter"] for e in evs]
    loads_away = [e for e in evs if e["adapter"]["engine"] != home and e["adapter"]["loaded"]]
    assert len(loads_away) == 1  # loaded once on the second engine, then resident there too
    # the prediction the choice was made on counted the load where the adapter was not resident
    cand = {x["backend"]: x for x in loads_away[0]["candidates"]}
    assert cand[loads_away[0]["adapter"]["engine"]]["adapter_load_ms"] > 0
    assert "adapter_load_ms" not in cand[home]
    assert all("hot" in resident(u) for u in engines.values())


def test_under_max_loras_pressure_an_adapter_with_a_stream_in_flight_is_never_unloaded(stack):
    base, c, engines = stack["base"], stack["client"], stack["engines"]
    unload_all(engines)
    time.sleep(0.2)

    def stream(model: str) -> str:
        out = []
        for ch in c.chat.completions.create(model=model, messages=prompt(50), max_tokens=120, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                out.append(ch.choices[0].delta.content)
        return "".join(out)

    with cf.ThreadPoolExecutor(4) as pool:  # four streams fill the four slots (2 engines x max_loras 2)
        futs = [pool.submit(stream, m) for m in ("s1", "s2", "s3", "s4")]
        deadline = time.monotonic() + 20
        while sum(len(resident(u)) for u in engines.values()) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = {e: resident(u) for e, u in engines.items()}
        assert sorted(n for s in held.values() for n in s) == ["s1", "s2", "s3", "s4"]
        with pytest.raises(openai.APIStatusError) as e:  # every slot has a stream in flight: nothing unloaded
            c.chat.completions.create(model="s5", messages=prompt(50), max_tokens=1)
        assert e.value.status_code == 503 and e.value.body["code"] == "adapter_slots_busy"  # type: ignore[index]
        assert e.value.response.headers.get("retry-after")
        assert {e: resident(u) for e, u in engines.items()} == held
        texts = [f.result(timeout=60) for f in futs]
    assert all(texts), "every stream completed"
    raw = c.chat.completions.with_raw_response.create(model="s5", messages=prompt(50), max_tokens=1)
    ad = evidence(base, raw)["adapter"]
    assert ad["loaded"] is True  # once a stream ended, its idle adapter made room
    assert sum(len(resident(u)) for u in engines.values()) == 4
