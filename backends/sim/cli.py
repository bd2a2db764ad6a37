"""`gateway sim` / `python -m backends.sim`: run a fleet of simulated vLLM engines and write a manifest.

The gateway CLI exposes this by calling `add_arguments(subparser)` and then `main(argv)` or `await run(args)`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any, Sequence

from backends.sim.engine import Faults
from backends.sim.fleet import build_fleet
from backends.sim.lora import LoraConfig
from backends.sim.profiles import PROFILES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=2, help="number of engines (default 2)")
    p.add_argument("--profile", default="vllm-default",
                   help=f"profile name, or a comma list cycled over engines ({', '.join(sorted(PROFILES))})")
    p.add_argument("--base-port", type=int, default=8100,
                   help="engine i: HTTP base+3i, KV events base+3i+1, replay base+3i+2 (0: random ports)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--manifest", default=None, help="write the fleet manifest (JSON) here once all engines are up")
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--name-prefix", default="sim")
    p.add_argument("--locations", default="", help="comma list cycled over engines, e.g. DE:eu-central,US:us-east")
    p.add_argument("--lora-modules", nargs="*", default=[], help="LoRA adapter names served as models")
    p.add_argument("--enable-lora", action="store_true",
                   help="vLLM's --enable-lora with runtime loading (/v1/load_lora_adapter, /v1/unload_lora_adapter)")
    p.add_argument("--max-loras", type=int, default=1, help="distinct adapters one batch runs (vLLM's default 1)")
    p.add_argument("--lora-load-ms", type=float, default=500.0, help="modelled time to load one adapter")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters whose weights stay in memory (vLLM's default: --max-loras); a step running one "
                        "outside them reads it first (--lora-load-ms)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="override KV capacity in blocks")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--stream-interval-ms", type=float, default=None, help="coarse chunk interval after the first")
    p.add_argument("--topic", default="", help="KV-event topic (default \"\", vLLM's KVEventsConfig.topic default)")
    p.add_argument("--kv-batch-form", choices=["array", "map"], default="array",
                   help="msgpack form of KVEventBatch (events are always tagged maps)")
    p.add_argument("--present-as", choices=["vllm", "sglang"], default="vllm",
                   help="answer as vLLM 0.32 (default) or as SGLang 0.5.23: KV-event wire, /metrics names, error "
                        "shape, priority order, /tokenize, LoRA as <base>:<adapter> (gateway kind sim / sglang)")
    # faults
    p.add_argument("--event-delay-ms", type=float, default=0.0)
    p.add_argument("--event-loss", type=float, default=0.0, help="probability a batch is dropped from PUB")
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--error-rate", type=float, default=0.0, help="probability of HTTP 500 per request")
    p.add_argument("--hang", action="store_true", help="start hung (clear with POST /sim/faults {\"hang\": false})")
    p.add_argument("--crash-after-s", type=float, default=None,
                   help="every engine crashes this long after start (sockets closed, cache and seq lost)")
    p.add_argument("--restart-after-s", type=float, default=3.0,
                   help="a crashed engine comes back after this long (default 3; negative: stays down)")
    p.add_argument("--log-level", default="warning")


def _fleet_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    overrides = {"block_size": args.block_size, "num_gpu_blocks": args.num_gpu_blocks,
                 "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                 "stream_interval_s": args.stream_interval_ms / 1000.0 if args.stream_interval_ms else None}
    faults = Faults(event_delay_ms=args.event_delay_ms, event_loss=args.event_loss, slow_factor=args.slow_factor,
                    error_rate=args.error_rate, hang=args.hang)
    locations = [x for x in args.locations.split(",") if x] or [None]
    return build_fleet(args.engines, args.base_port, profiles=[x for x in args.profile.split(",") if x],
                       locations=locations, host=args.host, model=args.model, name_prefix=args.name_prefix,
                       lora_modules=args.lora_modules, priority_policy=args.scheduling_policy == "priority",
                       enable_prefix_caching=not args.no_prefix_caching, faults=faults, topic=args.topic,
                       batch_form=args.kv_batch_form, log_level=args.log_level, overrides=overrides,
                       present_as=args.present_as,
                       lora=LoraConfig(max_loras=args.max_loras, load_s=args.lora_load_ms / 1000.0,
                                       max_cpu_loras=args.max_cpu_loras)
                       if args.enable_lora else None)


async def run(args: argparse.Namespace) -> int:
    """Start the fleet, write the manifest, serve until SIGINT/SIGTERM."""
    fleet = _fleet_from_args(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    async with fleet:
        if args.manifest:
            fleet.write_manifest(args.manifest)
        for e in fleet.manifest()["engines"]:
            print(f"{e['name']}: {e['url']} kv_events={e['kv_events']} replay={e['replay']} "
                  f"profile={e['profile']} location={e['location']}", file=sys.stderr, flush=True)
        if args.crash_after_s is not None:  # the same fault as POST /sim/faults {"crash": true, ...}
            back = None if args.restart_after_s < 0 else args.restart_after_s
            def crash(srv: Any) -> None:
                loop.create_task(srv.crash(back))

            for srv in fleet.servers:
                loop.call_later(args.crash_after_s, crash, srv)
        await stop.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gateway sim", description="Run simulated vLLM (or SGLang) engines.")
    add_arguments(p)
    return _cmd(p.parse_args(argv))


def _cmd(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
        return uvloop.run(run(args))  # type: ignore[no-any-return]
    except ImportError:
        return asyncio.run(run(args))


def add_sim_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Hook that gateway/cli.py calls to register `gateway sim`."""
    p = sub.add_parser("sim", help="run a fleet of simulated vLLM engines and write a manifest")
    add_arguments(p)
    p.set_defaults(func=_cmd)
