"""GPU check: real vLLM engine(s) on a local model behind the gateway, the real-engine e2e checks, the routing
benchmark, one table. Run through bench/gpu_check.sh (sets up the gateway venv); usage:

    python -m bench.gpu_check /path/to/model [--engines 2] [--gpu-memory-utilization 0.35] [--num-blocks N]
                              [--vllm-python PY] [--device cuda|cpu] [--bench-seconds 4] [--no-bench]

The checks are tests/vllm/checks.py, the same ones the CPU suite (tests/vllm) runs in CI. `--device cpu`
runs the whole thing on the CPU build (how it is exercised on machines without a GPU).
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.vllm import checks  # noqa: E402
from tests.vllm.stack import VllmStack, start_stack  # noqa: E402

CHECKS: list[tuple[str, Callable[..., Any]]] = [
    ("openai sdk (stream + non-stream)", checks.check_openai_sdk),
    ("kv events decoded + indexed", checks.check_kv_events_indexed),
    ("/metrics parsed", checks.check_metrics),
    ("predicted == actual cached tokens", checks.check_agreement),
    ("repeat long prompt -> same engine", checks.check_routing_repeat),
    ("ttft learned from real timings", checks.check_ttft_learned),
    ("replay after forced gap", checks.check_replay_gap),
    ("evictions (BlockRemoved)", checks.check_evictions),
    ("cache_salt isolation", checks.check_cache_salt),
]


def _short(v: Any, width: int = 110) -> str:
    s = json.dumps(v, default=str, separators=(",", ":")) if not isinstance(v, str) else v
    s = s.replace("|", "/").replace("\n", " ")
    return s if len(s) <= width else s[: width - 3] + "..."


def run_checks(stack: VllmStack) -> list[tuple[str, str, float, str]]:
    rows = []
    routing_row = None
    for name, fn in CHECKS:
        t0 = time.monotonic()
        try:
            if fn is checks.check_ttft_learned:
                res = fn(stack, routing_row)
            else:
                res = fn(stack)
            if inspect.iscoroutine(res):
                res = asyncio.run(res)
            if fn is checks.check_routing_repeat:
                routing_row = res
                res = {k: v for k, v in res.items() if k != "candidates"}
            status = "SKIP" if isinstance(res, dict) and "skipped" in res else "PASS"
            detail = _short(res)
        except AssertionError as e:
            status, detail = "FAIL", _short(str(e))
        except Exception as e:  # an error in one check must not hide the others
            status, detail = "ERROR", _short(f"{type(e).__name__}: {e}")
        rows.append((name, status, time.monotonic() - t0, detail))
    return rows


def routing_bench(seconds: float) -> list[tuple[str, str, float, str]]:
    """bench/routing.py (simulated fleet: strategy comparison) when present; its table rows become ours."""
    if not (ROOT / "bench" / "routing.py").is_file():
        return [("routing benchmark", "SKIP", 0.0, "bench/routing.py not present in this checkout")]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "bench.routing", "--seconds", str(seconds),
                        "--workloads", "shared_prefix"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    dt = time.monotonic() - t0
    if r.returncode != 0:
        return [("routing benchmark", "ERROR", dt, _short((r.stdout + r.stderr)[-400:]))]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("|") and not re.match(r"^\|[-| ]+\|$", ln)]
    if len(lines) < 2:
        return [("routing benchmark", "ERROR", dt, _short(r.stdout[-400:]))]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    out = []
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        label = " / ".join(cells[:2])
        out.append((f"routing bench: {label}", "INFO", dt / max(1, len(lines) - 1),
                    _short(", ".join(f"{h}={c}" for h, c in zip(header[2:], cells[2:])))))
    return out


def print_table(rows: list[tuple[str, str, float, str]], header: str) -> None:
    print(header)
    print("| check | result | seconds | measured |")
    print("|---|---|---|---|")
    for name, status, dt, detail in rows:
        print(f"| {name} | {status} | {dt:.1f} | {detail} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="local model directory (config.json, weights, tokenizer)")
    ap.add_argument("--engines", type=int, default=2, help="engines on this machine (same GPU unless --gpus)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="per engine (cuda)")
    ap.add_argument("--block-size", type=int, help="default: vLLM's (16 on GPU); 32 on cpu")
    ap.add_argument("--num-blocks", type=int, help="--num-gpu-blocks-override (small: forces evictions)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--vllm-python", help="interpreter with vllm installed (default .venv-vllm/bin/python, "
                                          "else python3 on PATH)")
    ap.add_argument("--bench-seconds", type=float, default=4.0)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, configs)")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"error: {args.model} has no config.json (need a local model directory)", file=sys.stderr)
        return 2
    py = args.vllm_python or (str(ROOT / ".venv-vllm/bin/python") if (ROOT / ".venv-vllm/bin/python").exists()
                              else shutil.which("python3") or sys.executable)
    extra: tuple[str, ...] = ()
    block = args.block_size
    if args.device == "cuda":
        extra = ("--gpu-memory-utilization", str(args.gpu_memory_utilization))
    else:  # the CPU suite's shape: block 32 (CPU attention) and a small cache so evictions are checked
        block = block or 32
        args.num_blocks = args.num_blocks or 96
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    t0 = time.monotonic()
    rows: list[tuple[str, str, float, str]] = []
    stack = None
    try:
        try:
            stack = start_stack(work, args.model.resolve(), engines=args.engines, device=args.device,
                                block_size=block, num_blocks=args.num_blocks, python=py, extra_args=extra)
            rows.append(("engines + gateway up", "PASS", time.monotonic() - t0,
                         _short({k: round(v, 1) for k, v in stack.timings.items()})))
        except Exception as e:
            rows.append(("engines + gateway up", "FAIL", time.monotonic() - t0, _short(f"{type(e).__name__}: {e}")))
        if stack is not None:
            rows += run_checks(stack)
    finally:
        if stack is not None:
            stack.close()
    if not args.no_bench:
        rows += routing_bench(args.bench_seconds)
    gpu = "cpu"
    if args.device == "cuda" and shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        gpu = q.stdout.strip().replace("\n", "; ") or "cuda"
    print_table(rows, f"# gpu_check: model {args.model} on {gpu}, {args.engines} engine(s), "
                      f"{time.monotonic() - t0:.0f} s; work dir {work}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r[1] in ("PASS", "SKIP", "INFO") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
