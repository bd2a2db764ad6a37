"""gateway/telemetry/scraper.py reads vLLM's vllm:lora_requests_info (--enable-lora): the newest sample's labels
(vLLM keeps one sample per label set it has seen; the value is when it was set) give the adapters with requests
running and waiting in the engine and its --max-loras; an engine without LoRA leaves them empty. Checked against
the simulated engine's real exposition too."""
from __future__ import annotations

import httpx

from backends.sim.fleet import start_fleet
from backends.sim.lora import LoraConfig
from gateway.telemetry.scraper import parse_metrics

TEXT = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7000001e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",waiting_lora_adapters=""} 1.6e9
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_the_newest_sample_gives_running_waiting_and_max_lora():
    ld = parse_metrics(TEXT)
    assert ld.lora_running == ("a", "b") and ld.lora_waiting == ("c",) and ld.max_lora == 4
    assert ld.running == 3.0


def test_an_engine_without_lora_reports_none():
    ld = parse_metrics('vllm:num_requests_running{engine="0",model_name="m"} 1.0\n')
    assert ld.lora_running == () and ld.lora_waiting == () and ld.max_lora is None


async def test_the_simulated_engines_exposition_parses():
    async with start_fleet(1, profiles=["tiny"], lora=LoraConfig(max_loras=3, load_s=0.0)) as fleet:
        e = fleet[0]
        async with httpx.AsyncClient() as c:
            await c.post(e.url + "/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 2})
            ld = parse_metrics((await c.get(e.root + "/metrics")).text)
    assert ld.max_lora == 3 and ld.lora_running == () and ld.lora_waiting == ()
