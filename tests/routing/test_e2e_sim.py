"""End to end: a real gateway process in front of a simulated fleet (backends/sim subprocess, KV events on).

Pins: a repeated long prompt goes to the engine that holds it (predicted cached == engine's cached tokens),
overload is refused at once with 429 ttft_slo_unattainable and its headers, and the audit record carries the
candidates with predicted TTFT, the predicted and the actual TTFT.

Every test runs twice: against the fleet presenting as vLLM (backends of kind `sim`) and as SGLang (kind
`sglang`: SGLang's KV-event wire, `sglang:*` metrics, /tokenize, priority order and LoRA as `<base>:<adapter>`).
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from backends.sim.fleet import FleetProcess
from tests.support.procs import audit_record, free_port, start_gateway
from tests.support.wait import wait_until

KEY = "route-e2e-key-0123456789"
ADMIN = "route-e2e-admin-0123456789"
H = {"authorization": f"Bearer {KEY}"}
pytestmark = pytest.mark.e2e


# the LoRA adapter as each kind selects it: vLLM by its name, SGLang as `<base>:<adapter>`
LORA = {"vllm": "sim-lora", "sglang": "sim-model:sim-lora"}


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def stack(request, tmp_path_factory):
    present_as = request.param
    tmp = tmp_path_factory.mktemp("route")
    fleet = FleetProcess(["--engines", "3", "--profile", "h200-8b,l40s-8b", "--base-port", "0",
                          "--lora-modules", "sim-lora", "--present-as", present_as], tmp / "fleet.json")
    man = fleet.start()
    try:
        port = free_port()
        lora = LORA[present_as]
        backends = [{"name": e["name"], "kind": e["kind"], "url": e["url"], "models": ["sim-model", "sim-lora"],
                     "model_map": {"sim-lora": lora}, "lora_adapters": [lora],
                     "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                     "location": {"country": "DE"}} for e in man["engines"]]
        assert {b["kind"] for b in backends} == {"sim" if present_as == "vllm" else "sglang"}
        cfg = tmp / "gateway.yaml"
        cfg.write_text(json.dumps({"server": {"host": "127.0.0.1", "port": port}, "backends": backends,
                                   "keys": [{"key": KEY, "tenant": "t1"}], "admin": {"key": ADMIN},
                                   "telemetry": {"scrape_interval_s": 0.2},
                                   # the prior counts as the engines' model: the overload test pins admission
                                   # on modelled engines from the first requests (gateway/routing/mode.py)
                                   "routing": {"model_validity": {"min_observations": 0}},
                                   "observability": {"log_level": "warning"}}))
        gw, _ = start_gateway(cfg)
        try:
            yield {"base": f"http://127.0.0.1:{port}", "engines": man["engines"]}
        finally:
            gw.stop()
    finally:
        fleet.stop()


def _body(content: str, stream: bool = True) -> dict:
    b = {"model": "sim-model", "max_tokens": 4, "stream": stream, "messages": [{"role": "user", "content": content}]}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


def _stream(base: str, body: dict, headers: dict) -> tuple[int, dict, dict | None]:
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers={**H, **headers}, timeout=30) as r:
        usage = None
        if r.status_code == 200:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    obj = json.loads(line[6:])
                    usage = obj.get("usage") or usage
        else:
            r.read()
        return r.status_code, dict(r.headers), usage


def _decision(base: str, rid: str) -> dict:
    return audit_record(base, rid, ADMIN, tries=50)


def _indexed_blocks(base: str) -> dict[str, int]:
    """GPU blocks the gateway's KV index holds per engine (/admin/fleet counts them on each read)."""
    fleet = httpx.get(base + "/admin/fleet", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10).json()
    return {n: e["cached_blocks"].get("GPU", 0) for n, e in fleet["engines"]["engines"].items()}


def _wait_for_kv_events(base: str, engine: str, before: dict[str, int], prompt_tokens: int) -> None:
    """Until the KV events of a new prompt of `prompt_tokens` reached the gateway's index: `engine` holds its full
    blocks (16 tokens each, the sim's block size) on top of what it held `before`."""
    wait_until(lambda: _indexed_blocks(base)[engine] - before.get(engine, 0) >= prompt_tokens // 16,
               what=f"the KV events of {engine} in the gateway's index")


def test_repeated_long_prompt_goes_to_the_engine_that_holds_it(stack):
    base = stack["base"]
    prompt = "Policy manual section. " + " ".join(f"clause{i} applies" for i in range(1500))
    before = _indexed_blocks(base)
    st, h, warm = _stream(base, _body(prompt + " first question"), {"x-request-id": "warm-1"})
    assert st == 200 and warm is not None
    holder = h["x-gateway-backend"]
    _wait_for_kv_events(base, holder, before, warm["prompt_tokens"])
    for i in range(4):
        st, h, usage = _stream(base, _body(prompt + f" question {i}"), {"x-request-id": f"rep-{i}"})
        assert st == 200 and h["x-gateway-backend"] == holder
        assert usage["prompt_tokens_details"]["cached_tokens"] > 2500
    rec = _decision(base, "rep-3")
    assert rec["backend"] == holder
    assert rec["cached_tokens"]["predicted"] == rec["cached_tokens"]["actual"] > 2500
    cands = {c["backend"]: c for c in rec["candidates"]}
    assert len(cands) == 3 and all(c["predicted_ttft_ms"] is not None for c in cands.values())
    assert cands[holder]["predicted_ttft_ms"] < min(c["predicted_ttft_ms"] for n, c in cands.items() if n != holder)
    assert rec["ttft_ms"]["predicted"] is not None and rec["ttft_ms"]["actual"] is not None
    assert rec["evidence"]["actual_ttft_ms"] is not None


def test_lora_requests_are_predicted_with_the_adapters_own_blocks(stack):
    """A LoRA adapter's KV blocks are keyed by its name: a request to the adapter is predicted from the
    adapter's blocks only (exact against the engine), and the base model does not reuse them, nor they its."""
    base = stack["base"]
    prompt = "Adapter handbook. " + " ".join(f"rule{i} holds" for i in range(1200))
    before = _indexed_blocks(base)
    st, h, warm = _stream(base, {**_body(prompt + " warm"), "model": "sim-lora"}, {"x-request-id": "lora-warm"})
    assert st == 200 and warm is not None
    holder = h["x-gateway-backend"]
    _wait_for_kv_events(base, holder, before, warm["prompt_tokens"])
    st, h, usage = _stream(base, {**_body(prompt + " again"), "model": "sim-lora"}, {"x-request-id": "lora-rep"})
    assert st == 200 and h["x-gateway-backend"] == holder
    rec = _decision(base, "lora-rep")
    assert rec["cached_tokens"]["predicted"] == rec["cached_tokens"]["actual"] > 1500
    # the same prompt on the base model: nothing of the adapter's cache applies, and none is predicted
    st, h, usage = _stream(base, _body(prompt + " base"), {"x-request-id": "lora-base"})
    rec = _decision(base, "lora-base")
    assert rec["cached_tokens"]["predicted"] == rec["cached_tokens"]["actual"] == 0


async def test_overload_is_refused_early_with_headers(stack):
    base = stack["base"]
    # a long unique prompt with an impossible target on an otherwise busy fleet: refused at once
    async with httpx.AsyncClient(timeout=60) as c:
        async def busy(i: int) -> None:
            await c.post(base + "/v1/chat/completions", headers=H,
                         json=_body(f"busy {i} " + " ".join(f"w{i}x{j}" for j in range(6000)), stream=False))
        load = [asyncio.create_task(busy(i)) for i in range(6)]
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        r = await c.post(base + "/v1/chat/completions", json=_body("x " * 3000),
                         headers={**H, "x-ttft-slo-ms": "20", "x-request-id": "shed-1"})
        elapsed_ms = (time.perf_counter() - t0) * 1000
        await asyncio.gather(*load)
    assert r.status_code == 429
    err = r.json()["error"]
    assert err["code"] == "ttft_slo_unattainable" and err["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) >= 1 and int(r.headers["retry-after-ms"]) > 0
    assert float(r.headers["x-predicted-ttft-ms"]) > 20 and r.headers["x-ttft-slo-ms"] == "20"
    assert elapsed_ms < 500  # answered at once, not after queueing (the 5 ms decision is in the record)
    rec = _decision(base, "shed-1")
    assert rec["status"] == 429 and rec["route"]["admission"] == "reject"
    assert rec["route"]["decided_us"] < 50_000


def test_admin_routing_shows_each_engines_learned_chunk_budget_and_prediction_quality(stack):
    """Issue 17a/d: the gateway is told no chunk budget; /admin/routing shows each engine's as learned from its
    KV events (h200-8b 8192, l40s-8b 4096 in the sim's profiles), with the guard state, MdARE and calibration."""
    base = stack["base"]
    budgets = {"h200-8b": 8192, "l40s-8b": 4096}
    with httpx.Client(timeout=60) as c:  # a prompt of several chunks straight to each engine
        for e in stack["engines"]:
            r = c.post(e["url"] + "/completions", json={"model": "sim-model", "max_tokens": 1,
                                                         "prompt": " ".join(f"c{j}" for j in range(12000))})
            assert r.status_code == 200
    want = {e["name"]: budgets[e["profile"]] for e in stack["engines"]}
    for _ in range(50):
        snap = httpx.get(base + "/admin/routing", headers={"authorization": f"Bearer {ADMIN}"}).json()
        facts = {n: snap["engines"].get(n, {}).get("facts", {}) for n in want}
        if all(f.get("chunk_budget_source") == "learned" for f in facts.values()):
            break
        time.sleep(0.1)
    assert {n: (f["chunk_budget"], f["chunk_budget_source"]) for n, f in facts.items()} == \
        {n: (b, "learned") for n, b in want.items()}
    assert all(f["block_size"] == 16 and f["kv_capacity_blocks"] for f in facts.values())
    assert {f["mean_uncached_prompt_source"] for n, f in facts.items() if snap["engines"][n].get("samples")} \
        <= {"observed"}
    served = [e for e in snap["engines"].values() if e.get("samples")]
    assert served and all("mdare" in e and "calibration" in e and e["calibration_target"] == 0.9
                          and "resets" in e["guard"] for e in served)


DASHBOARD_ENGINE_KEYS = {
    "name", "kind", "country", "retention", "circuit", "running", "waiting", "kv_usage", "cached_blocks", "stale",
    "stale_reason", "stale_detail", "inflight", "kv_agreement", "prefill_tokens_per_s", "overhead_ms", "mape",
    "samples", "mdare", "calibration", "calibration_target", "chunk_budget", "chunk_budget_source", "guard_resets",
    "predicted_ttft_ms", "mode", "mode_reason", "holding_with_room"}


def test_admin_fleet_and_the_dashboard_show_each_engine_in_one_shape(stack):
    """An SGLang engine appears in /admin/fleet and on the dashboard exactly as a vLLM one does: its load from its
    own metrics, its KV index, agreement and mode."""
    base, admin = stack["base"], {"authorization": f"Bearer {ADMIN}"}
    st, _, _ = _stream(base, _body("fleet view " + "words " * 200), {"x-request-id": "fleet-view"})
    assert st == 200

    def fleet_view() -> dict:
        return httpx.get(base + "/admin/fleet", headers=admin, timeout=10).json()["engines"]["engines"]

    wait_until(lambda: sum(e["cached_blocks"].get("GPU", 0) for e in fleet_view().values()) > 0,
               what="the request's KV events in /admin/fleet")
    fleet = fleet_view()
    kinds = {e["name"]: e["kind"] for e in stack["engines"]}
    for name in kinds:
        e = fleet[name]
        assert set(e) == {"block_size", "cached_blocks", "kv_events", "stale", "stale_reason", "stale_detail",
                          "load", "inflight", "agreement", "kv_event_fields", "kv_groups"}
        assert e["load"]["healthy"] and e["load"]["block_size"] == 16 and e["load"]["num_gpu_blocks"] > 0
        assert e["block_size"] == 16 and not e["stale"]
    assert sum(e["cached_blocks"].get("GPU", 0) for e in fleet.values()) > 0
    ui = httpx.get(base + "/admin/ui/data", headers=admin, timeout=10).json()
    rows = {r["name"]: r for r in ui["engines"]}
    for name, kind in kinds.items():
        assert set(rows[name]) == DASHBOARD_ENGINE_KEYS and rows[name]["kind"] == kind
        assert rows[name]["mode"] in ("modelled", "pass_through") and rows[name]["running"] is not None
