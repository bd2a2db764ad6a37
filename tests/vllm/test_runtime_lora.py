"""A real vLLM CPU engine loads a tiny PEFT adapter at run time (issue 38): VLLM_ALLOW_RUNTIME_LORA_UPDATING=True,
--enable-lora --max-loras 2 --max-lora-rank 8. It serves the adapter, lists it, exports vllm:lora_requests_info,
unloads it, and its KV events carry the adapter's name, so the gateway's KV index keys those blocks by lora_name
(a lookup with the adapter finds them, one without does not). The answers pinned here are the ones the simulator
gives (backends/sim/lora.py, tests/backends/sim/test_lora.py), so this test also keeps the simulator honest.
The adapter is generated locally for the tiny model (backends/vllm/lora.py)."""
from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.vllm import launcher
from gateway.telemetry.index import KVIndex
from gateway.telemetry.subscriber import KVEventSubscriber
from tests.vllm.stack import MODEL_DIR, ROOT, VENV_PY, Engine, SetupError, engine_ports, failure_excerpt

ADAPTER = "tiny-ad"


@pytest.fixture(scope="module")
def lora_engine(vllm_env: Path) -> Iterator[tuple[Engine, Path, str]]:
    work = vllm_env
    adapter_dir = work / "tiny-lora"
    r = subprocess.run([str(VENV_PY), "-m", "backends.vllm.lora", str(MODEL_DIR), str(adapter_dir)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SetupError(f"adapter generation failed:\n{(r.stdout + r.stderr)[-3000:]}")
    served = launcher.served_name_for(MODEL_DIR)
    port, kv, rp = engine_ports(3)
    cmd = launcher.build_command(MODEL_DIR, port, kv, rp, served_model_name=served, block_size=32,
                                 num_gpu_blocks_override=96,
                                 extra_args=("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"))
    env = launcher.build_env() | {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    log = work / "engine-lora.log"
    e = Engine("vllm-lora", port, kv, rp, launcher.launch(cmd, env, log_path=log), log)
    try:
        t0 = time.monotonic()
        try:
            launcher.wait_ready(e.url, 600.0, e.proc)
        except (RuntimeError, TimeoutError) as exc:
            raise SetupError(f"{exc}\n{failure_excerpt(log.read_text(errors='replace'))}") from None
        e.startup_s = time.monotonic() - t0
        yield e, adapter_dir, served
    finally:
        launcher.stop(e.proc)


def lora_info(text: str) -> dict[str, str]:
    """The labels of the newest vllm:lora_requests_info sample (vLLM keeps one per label set it has seen)."""
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:lora_requests_info" and fam.samples:
            return dict(max(fam.samples, key=lambda s: s.value).labels)
    raise AssertionError("no vllm:lora_requests_info sample")


def complete(e: Engine, model: str, prompt: str) -> httpx.Response:
    return httpx.post(e.url + "/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                    "temperature": 0}, timeout=120)


async def _served_and_indexed(e: Engine, adapter_dir: Path, served: str) -> dict[str, Any]:
    index = KVIndex()
    sub = KVEventSubscriber(e.name, e.kv, e.replay, "", index, replay_timeout_s=5.0)
    await sub.start()
    await asyncio.sleep(0.3)  # ZMQ slow joiner
    try:
        prompt = " ".join(f"adapter{i} block{i % 7} token{i % 3}" for i in range(60))
        r = await asyncio.to_thread(complete, e, ADAPTER, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == ADAPTER
        toks = httpx.post(e.root + "/tokenize", json={"model": ADAPTER, "prompt": prompt}, timeout=30).json()["tokens"]
        found = {}
        for _ in range(50):
            found = index.lookup([e.name], toks, lora=ADAPTER)
            if found.get(e.name) and found[e.name].tokens:
                break
            await asyncio.sleep(0.1)
        base = index.lookup([e.name], toks)
        return {"adapter_tokens": found[e.name].tokens if e.name in found else 0,
                "base_tokens": base[e.name].tokens if e.name in base else 0, "prompt_tokens": len(toks)}
    finally:
        await sub.close()


def test_runtime_lora_load_serve_unload_and_kv_keys(lora_engine: tuple[Engine, Path, str]) -> None:
    e, adapter_dir, served = lora_engine
    r = complete(e, ADAPTER, "hello")
    assert r.status_code == 404 and r.json()["error"]["message"] == f"The model `{ADAPTER}` does not exist. Valid aliases: {served}."

    r = httpx.post(e.url + "/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(adapter_dir)},
                   timeout=120)
    assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{ADAPTER}' added successfully.", r.text
    models = {m["id"]: m for m in httpx.get(e.url + "/models", timeout=10).json()["data"]}
    assert models[ADAPTER]["root"] == str(adapter_dir) and models[ADAPTER]["parent"] == served
    r = httpx.post(e.url + "/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(adapter_dir)},
                   timeout=60)
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]

    got = asyncio.run(_served_and_indexed(e, adapter_dir, served))
    print(f"\nruntime LoRA on the CPU engine: {got}, engine start {e.startup_s:.1f} s")
    assert got["adapter_tokens"] > 0 and got["base_tokens"] == 0, got  # blocks keyed by the adapter's name
    info = lora_info(httpx.get(e.root + "/metrics", timeout=10).text)  # samples only once a step ran
    assert info["max_lora"] == "2" and set(info) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}

    r = httpx.post(e.url + "/unload_lora_adapter", json={"lora_name": ADAPTER}, timeout=60)
    assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{ADAPTER}' removed successfully.", r.text
    assert complete(e, ADAPTER, "hello").status_code == 404
    r = httpx.post(e.url + "/unload_lora_adapter", json={"lora_name": ADAPTER}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["message"] == f"The lora adapter '{ADAPTER}' cannot be found."
