"""CLI: `python -m backends.vllm serve --model DIR --port P --kv-port K --replay-port R [...]`.

Starts one real vLLM engine (child process, .venv-vllm's python), waits until /health answers, prints the
startup time and the matching gateway backend YAML, then stays in the foreground until Ctrl-C / SIGTERM,
which stops the engine's whole process group. `model OUTDIR` generates the tiny offline model.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

from backends.vllm import launcher


def _serve(args: argparse.Namespace) -> int:
    served = args.served_model_name or launcher.served_name_for(args.model)
    cmd = launcher.build_command(
        args.model, args.port, args.kv_port, args.replay_port, python=args.python, host=args.host,
        served_model_name=served, block_size=args.block_size, num_gpu_blocks_override=args.num_gpu_blocks_override,
        max_model_len=args.max_model_len, priority_scheduling=args.priority, enforce_eager=not args.no_enforce_eager,
        device=args.device, extra_args=args.extra)
    env = launcher.build_env(kvcache_gib=args.kvcache_gib, omp_threads_bind=args.omp_threads_bind,
                             device=args.device)
    print("starting:", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = launcher.launch(cmd, env, args.log)

    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        launcher.wait_ready(f"http://{args.host}:{args.port}", args.ready_timeout, proc)
        print(f"# vLLM ready in {time.monotonic() - t0:.1f} s (pid {proc.pid})", flush=True)
        cfg = launcher.backend_config(args.name, args.port, args.kv_port, args.replay_port, served,
                                      country=args.country, host=args.host, priority_scheduling=args.priority,
                                      context_window=args.max_model_len)
        print(launcher.render_backend_yaml(cfg), end="", flush=True)
        if args.exit_when_ready:
            return 0
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    except (TimeoutError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        launcher.stop(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backends.vllm")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start one vLLM engine with KV events and print its gateway backend config")
    s.add_argument("--model", required=True, help="model directory (python -m backends.vllm model DIR makes one)")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--kv-port", type=int, required=True)
    s.add_argument("--replay-port", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--name", default="vllm-local", help="gateway backend name")
    s.add_argument("--country", default="SE", help="ISO country for the backend's location")
    s.add_argument("--served-model-name")
    s.add_argument("--block-size", type=int)
    s.add_argument("--num-gpu-blocks-override", type=int)
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--priority", action="store_true", help="--scheduling-policy priority")
    s.add_argument("--no-enforce-eager", action="store_true")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: GPU build of vllm (no CPU-only env vars; any block size)")
    s.add_argument("--kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    s.add_argument("--omp-threads-bind", help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0 or 1 to pin one core")
    s.add_argument("--python", help="interpreter with vllm-cpu installed (default .venv-vllm/bin/python)")
    s.add_argument("--log", help="write engine output here instead of this terminal")
    s.add_argument("--ready-timeout", type=float, default=300.0)
    s.add_argument("--exit-when-ready", action="store_true", help="stop the engine once ready (smoke test)")
    s.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more vllm serve flags")
    m = sub.add_parser("model", help="generate the tiny offline model (run with .venv-vllm's python)")
    m.add_argument("outdir")
    m.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "model":
        from backends.vllm import model

        return model.main([args.outdir, "--seed", str(args.seed)])
    if args.extra and args.extra[0] == "--":
        args.extra = args.extra[1:]
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
