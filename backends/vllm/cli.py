"""`gateway engine vllm ...`: start a real vLLM engine with the flags the gateway relies on, print its config.

The same launcher as `python -m backends.vllm serve` (backends/vllm/__main__.py): prefix caching, KV events
with replay, prompt token details, optional `--priority` (scheduling policy), then the matching `backends:`
entry. `gateway engine vllm model DIR` generates the tiny offline model instead (needs .venv-vllm's python).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

EPILOG = """examples:
  gateway engine vllm --model var/tiny-llama --port 8011 --kv-port 5571 --replay-port 5572
  gateway engine vllm --model /models/qwen --device cuda --port 8011 --kv-port 5571 --replay-port 5572 -- --gpu-memory-utilization 0.5
  gateway engine vllm model var/tiny-llama
options: see `gateway engine vllm --help` (same as python -m backends.vllm serve)."""


def _run(args: argparse.Namespace) -> int:
    rest = list(args.engine_args)
    if rest and rest[0] == "model":
        from backends.vllm import launcher, model

        # the model generator needs torch/transformers: run it with the vLLM venv's interpreter, by file path
        # (model.py imports only the standard library at the top), so neither this environment's packages nor
        # a source checkout have to be on that interpreter's path
        py = launcher.default_python()
        return subprocess.call([py, str(Path(model.__file__).resolve()), *rest[1:]])
    from backends.vllm.__main__ import main as vllm_main

    if not rest or rest[0] in ("-h", "--help"):
        print(EPILOG, file=sys.stderr)
    return vllm_main(["serve", *rest])


def add_engine_command(subparsers: Any) -> None:
    """Register `gateway engine vllm ...` (called by gateway/cli.py's subsystem hook)."""
    eng = subparsers.add_parser("engine", help="start a real inference engine wired for the gateway")
    esub = eng.add_subparsers(dest="engine_kind", required=True)
    # prefix_chars="+": every option after `vllm` belongs to the launcher (python -m backends.vllm serve)
    v = esub.add_parser("vllm", add_help=False, prefix_chars="+", help="start vLLM with KV events + replay, print the backend config",
                        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("engine_args", nargs=argparse.REMAINDER)
    v.set_defaults(func=_run)
