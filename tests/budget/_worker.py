"""A separate gateway-side process for the multi-replica tests: runs N concurrent requests through the real
BudgetStage against a shared store and prints a JSON summary. Usage: python -m tests.budget._worker CFG_JSON"""
from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import yaml

from gateway.budget.service import BudgetService
from gateway.budget.stage import BudgetStage
from gateway.config import parse_config
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.types import BudgetSpec, Decision, Principal, Usage


async def main(spec: dict) -> dict:
    base = Path(spec["dir"])
    cfg = parse_config(yaml.safe_dump({"budgets": spec["budgets"]}), "worker.yaml", base_dir=base)
    svc = BudgetService(cfg)
    await svc.start()
    stage = BudgetStage(svc)
    p = Principal(id="key:k", kind="api_key", tenant="acme", team="t", key_id=spec.get("key", "k"))
    budgets = tuple(BudgetSpec(**b) for b in spec["limits"])
    rnd = random.Random(spec["seed"])
    go = asyncio.Event()
    out = {"ok": 0, "rate": 0, "quota": 0, "unavailable": 0, "settled_tokens": 0, "settled_cost": 0.0,
           "worst": 0, "ids": []}

    async def one(i: int) -> None:
        ctx = RequestContext(request_id=f"{spec['name']}-{i}", endpoint="chat", headers={}, body={}, model="m1",
                             model_chain=("m1",), max_tokens=spec["max_tokens"], prompt_tokens_est=spec["prompt"],
                             principal=p, decision=Decision(budgets=budgets))
        await go.wait()
        await asyncio.sleep(rnd.random() * spec.get("spread_s", 0.05))
        try:
            await stage.run(ctx)
        except GatewayError as e:
            key = {"rate_limit_exceeded": "rate", "insufficient_quota": "quota"}.get(e.code, "unavailable")
            out[key] += 1
            return
        out["ok"] += 1
        await asyncio.sleep(rnd.random() * spec.get("hold_s", 0.05))  # the engine works
        ctx.backend = "sim"
        ctx.usage = Usage(spec["prompt"], rnd.randint(0, spec["max_tokens"]))
        await stage.finish(ctx)
        out["settled_tokens"] += ctx.usage.total_tokens
        out["settled_cost"] += ctx.evidence["cost"]["amount"]
        out["ids"].append(ctx.request_id)

    tasks = [asyncio.create_task(one(i)) for i in range(spec["n"])]
    await asyncio.sleep(0.2)
    go.set()
    await asyncio.gather(*tasks)
    await svc.close()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
