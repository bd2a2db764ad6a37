"""Capture golden wire bytes from a running real vLLM engine (KV events, replay, metrics, OpenAI responses).

Why: the gateway's KV-event decoder, metrics scraper and response parsers are tested against bytes that a
real engine produced, not against our reading of vLLM's source. Needs only pyzmq + httpx (either venv).

    python -m backends.vllm.capture_golden --url http://127.0.0.1:8011 --kv tcp://127.0.0.1:5571 \
        --replay tcp://127.0.0.1:5572 --out tests/data

Writes (under --out):
  vllm_kv_events/pub.jsonl         every PUB multipart message, in arrival order
  vllm_kv_events/replay_from_0.jsonl  ROUTER reply to a DEALER request [b"", seq 0], terminator included
  vllm_kv_events/replay_from_mid.jsonl  same, starting at the seq of the first eviction batch
  vllm_metrics.txt, vllm_responses/*.json|*.sse, vllm_timings.json
JSON-lines format: {"i": n, "step": "<request that caused it>", "frames": ["<hex>", ...]}.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import zmq

TOPIC = b"kv"
END_SEQ = b"\xff" * 8


class Recorder:
    """SUB socket on the engine's PUB endpoint; drain() pulls whatever arrived, tagging it with a step label."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sock.connect(endpoint)
        self.messages: list[dict[str, Any]] = []

    def drain(self, step: str, quiet_s: float = 0.6, max_s: float = 10.0) -> int:
        """Receive until no message for quiet_s (engine steps publish asynchronously after the HTTP reply)."""
        n0 = len(self.messages)
        t_end = time.monotonic() + max_s
        while time.monotonic() < t_end:
            if not self.sock.poll(int(quiet_s * 1000)):
                break
            frames = self.sock.recv_multipart()
            self.messages.append({"i": len(self.messages), "step": step, "frames": [f.hex() for f in frames]})
        return len(self.messages) - n0


def replay(ctx: zmq.Context, endpoint: str, start_seq: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    """DEALER request [b"", start_seq BE8] to the ROUTER; returns every reply up to the [.., 0xff*8, b""] end."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sock.poll(int((deadline - time.monotonic()) * 1000) + 1):
                break
            frames = sock.recv_multipart()
            out.append(frames)
            if len(frames) >= 3 and frames[-2] == END_SEQ:
                return out
        raise TimeoutError(f"replay from {start_seq}: no terminator after {len(out)} messages")
    finally:
        sock.close()


def words(rng: random.Random, n: int) -> str:
    """Deterministic filler text in the tiny tokenizer's training style."""
    syll = ["ka", "lo", "mi", "ne", "ra", "su", "ti", "vo", "ze", "pa", "qui", "bri", "dan", "fel", "gor"]
    common = ["the", "cache", "block", "token", "engine", "gateway", "request", "prefix", "policy", "budget"]
    return " ".join(rng.choice(common) if rng.random() < 0.4 else "".join(rng.choice(syll) for _ in range(2))
                    for _ in range(n))


def fit_prompt(client: httpx.Client, model: str, rng: random.Random, target_tokens: int) -> str:
    """A user message whose chat-templated prompt is close to target_tokens (sized with /tokenize)."""
    text = words(rng, target_tokens)
    for _ in range(6):
        n = client.post("/tokenize", json={"model": model, "messages": [{"role": "user", "content": text}],
                                           "add_generation_prompt": True}).json()["count"]
        if abs(n - target_tokens) <= 8:
            break
        parts = text.split(" ")
        keep = max(1, int(len(parts) * target_tokens / n))
        text = " ".join(parts[:keep]) if keep <= len(parts) else text + " " + words(rng, keep - len(parts))
    return text


def chat(client: httpx.Client, model: str, content: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0.0, **extra}
    r = client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r


def ttft(client: httpx.Client, model: str, content: str) -> tuple[float, int]:
    """Seconds to the first streamed content chunk, and the cached prompt tokens reported in usage."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    cached = -1
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if first is None and obj.get("choices"):
                first = time.perf_counter() - t0
            if obj.get("usage"):
                cached = ((obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return (first if first is not None else time.perf_counter() - t0), cached


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backends.vllm.capture_golden")
    ap.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8011")
    ap.add_argument("--kv", required=True, help="PUB endpoint, e.g. tcp://127.0.0.1:5571")
    ap.add_argument("--replay", required=True, help="ROUTER endpoint, e.g. tcp://127.0.0.1:5572")
    ap.add_argument("--out", type=Path, default=Path("tests/data"))
    ap.add_argument("--evict-prompts", type=int, default=6, help="distinct ~600-token prompts (evictions)")
    ap.add_argument("--ttft-tokens", type=int, default=1000)
    ap.add_argument("--ttft-rounds", type=int, default=3)
    args = ap.parse_args(argv)

    kv_dir = args.out / "vllm_kv_events"
    resp_dir = args.out / "vllm_responses"
    kv_dir.mkdir(parents=True, exist_ok=True)
    resp_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(20240601)
    ctx = zmq.Context()
    rec = Recorder(ctx, args.kv)
    client = httpx.Client(base_url=args.url, timeout=120)
    log: list[dict[str, Any]] = []

    def note(step: str, **info: Any) -> None:
        n = rec.drain(step)
        log.append({"step": step, "pub_messages": n, **info})
        print(f"{step}: {n} PUB messages {info}", flush=True)

    try:
        model = _capture_api(client, resp_dir)
        _capture_chats(client, model, rng, resp_dir, note, args.evict_prompts)
        timings = _capture_ttft(client, model, rng, note, args.ttft_tokens, args.ttft_rounds)
        (args.out / "vllm_timings.json").write_text(json.dumps(timings, indent=2) + "\n")
        (args.out / "vllm_metrics.txt").write_text(client.get("/metrics").text)
        time.sleep(0.5)
        rec.drain("final drain")
        write_jsonl(kv_dir / "pub.jsonl", rec.messages)
        counts = _capture_replay(ctx, args.replay, rec, kv_dir, log)
        print(json.dumps({**counts, "ttft": timings}, indent=2))
    finally:
        client.close()
        rec.sock.close(linger=0)
        ctx.term()
    return 0


def _dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _capture_api(client: httpx.Client, resp_dir: Path) -> str:
    """/v1/models, /kv_event_sources and /tokenize's two forms; the served model's id."""
    models = client.get("/v1/models").json()
    model: str = models["data"][0]["id"]
    _dump(resp_dir / "models.json", models)
    src = client.get("/kv_event_sources")
    if src.status_code == 200:
        _dump(resp_dir / "kv_event_sources.json", src.json())
    time.sleep(1.0)  # ZMQ slow joiner: let the SUB subscription reach the PUB before the first step
    tok_p = client.post("/tokenize", json={"model": model, "prompt": "the cache block token engine",
                                           "add_special_tokens": True})
    _dump(resp_dir / "tokenize_prompt.json", tok_p.json())
    tok_m = client.post("/tokenize", json={"model": model, "messages": [{"role": "user", "content": "hello"}],
                                           "add_generation_prompt": True})
    _dump(resp_dir / "tokenize_messages.json", tok_m.json())
    return model


def _capture_chats(client: httpx.Client, model: str, rng: random.Random, resp_dir: Path,
                   note: Callable[..., None], evict_prompts: int) -> None:
    """A chat cold, repeated (prefix hit), streamed with usage, salted; distinct prompts until evictions; the
    prefix cache reset."""
    prompt_a = fit_prompt(client, model, rng, 200)
    note("sizing /tokenize")
    r1 = chat(client, model, prompt_a)
    _dump(resp_dir / "chat_cold.json", r1.json())
    note("chat A (~200 tokens, cold)", usage=r1.json()["usage"])
    r2 = chat(client, model, prompt_a)
    _dump(resp_dir / "chat_cached.json", r2.json())
    note("chat A repeated (prefix hit)", usage=r2.json()["usage"])
    body = {"model": model, "messages": [{"role": "user", "content": prompt_a}], "max_tokens": 4,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        raw = b"".join(r.iter_raw())
    (resp_dir / "chat_stream_usage.sse").write_bytes(raw)
    note("chat A streamed with include_usage")
    r3 = chat(client, model, prompt_a, cache_salt="tenant-a")
    _dump(resp_dir / "chat_salted.json", r3.json())
    note("chat A with cache_salt=tenant-a", usage=r3.json()["usage"])
    for k in range(evict_prompts):
        p = fit_prompt(client, model, rng, 600)
        r = chat(client, model, p)
        note(f"distinct prompt {k} (~600 tokens)", usage=r.json()["usage"])
    rr = client.post("/reset_prefix_cache")
    note("POST /reset_prefix_cache", status=rr.status_code)


def _capture_ttft(client: httpx.Client, model: str, rng: random.Random, note: Callable[..., None], tokens: int,
                  rounds: int) -> dict[str, Any]:
    """TTFT cold vs cached for a ~`tokens`-token prompt (stream; first chunk with choices)."""
    cold, warm = [], []
    for k in range(rounds):
        p = fit_prompt(client, model, rng, tokens)
        c, cc = ttft(client, model, p)
        w, wc = ttft(client, model, p)
        cold.append(c)
        warm.append(w)
        note(f"ttft round {k}", cold_s=round(c, 4), cached_s=round(w, 4), cached_tokens=wc, cold_cached=cc)
    return {"prompt_tokens": tokens, "cold_ttft_s": cold, "cached_ttft_s": warm,
            "cold_median_s": statistics.median(cold), "cached_median_s": statistics.median(warm)}


def _capture_replay(ctx: Any, endpoint: str, rec: Recorder, kv_dir: Path, log: list[dict[str, Any]]) -> dict[str, int]:
    """The replay socket from seq 0 and from the middle of what was published, and the capture log."""
    rep0 = replay(ctx, endpoint, 0)
    write_jsonl(kv_dir / "replay_from_0.jsonl",
                [{"i": i, "step": "replay from seq 0", "frames": [f.hex() for f in m]} for i, m in enumerate(rep0)])
    mid = len(rec.messages) // 2
    mid_seq = int.from_bytes(bytes.fromhex(rec.messages[mid]["frames"][1]), "big") if rec.messages else 0
    repm = replay(ctx, endpoint, mid_seq)
    write_jsonl(kv_dir / "replay_from_mid.jsonl",
                [{"i": i, "step": f"replay from seq {mid_seq}", "frames": [f.hex() for f in m]}
                 for i, m in enumerate(repm)])
    _dump(kv_dir / "capture_log.json", {"steps": log, "pub_total": len(rec.messages), "replay_from_0": len(rep0),
                                        "replay_mid_start_seq": mid_seq, "replay_from_mid": len(repm)})
    return {"pub": len(rec.messages), "replay0": len(rep0), "replay_mid": len(repm)}


if __name__ == "__main__":
    raise SystemExit(main())
