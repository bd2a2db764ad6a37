"""`gateway` command line: serve, config check, demo, and the subsystems' commands (sim, keys, policy, report...)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys

from gateway.config import ConfigError, load_config


def _setup_logging(level: str = "info", json_logs: bool = True) -> None:
    from gateway.observability.logs import configure_logging

    configure_logging(level, json_logs)


def tune_gc(threshold: tuple[int, int, int] | None) -> None:
    """Once the server is up: move everything allocated so far (modules, config, policy, tokenizers) out of
    the cyclic collector's reach, so its full collections scan only what requests leave behind, not the whole
    startup heap (docs/benchmarks.md, "Hot path choices"); optionally set the thresholds (`server.gc_threshold`)."""
    import gc

    gc.collect()
    gc.freeze()
    if threshold is not None:
        gc.set_threshold(*threshold)


ACCEPT_SETTLE_S = 0.25  # see _Server.shutdown


async def serve_async(config_path: str, host: str | None = None, port: int | None = None,
                      ready: asyncio.Event | None = None, sock: socket.socket | None = None) -> None:
    """One gateway process; `sock`: a worker of `gateway serve --workers N` accepting on the supervisor's socket."""
    import uvicorn

    from gateway.app import Gateway, build_app
    from gateway.wiring import wire

    cfg = load_config(config_path)
    _setup_logging(cfg.raw.observability.log_level, cfg.raw.observability.json_logs)
    gw = Gateway(cfg)
    wire(gw)
    app = build_app(gw)
    from gateway.server_protocol import protocol_class

    http = protocol_class(cfg.server.max_header_bytes, cfg.server.max_headers, cfg.server.header_timeout_s)
    loop = asyncio.get_running_loop()

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # type: ignore[no-untyped-def]
            if not self.should_exit:  # the first SIGTERM/SIGINT starts the drain clock
                loop.call_soon_threadsafe(gw.begin_drain)
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
            await super().startup(sockets)
            tune_gc(cfg.server.gc_threshold)
            if sock is not None and self.started:
                from gateway.workers import notify_ready

                notify_ready()

        async def shutdown(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
            # Stop accepting, then let connections accepted a moment ago deliver their first request before
            # uvicorn closes every connection without one as idle: else a client that connected just before the
            # drain (a rolling restart, a load balancer's last pick) gets "disconnected without a response"
            for s in self.servers:
                s.close()
            await asyncio.sleep(ACCEPT_SETTLE_S)
            await super().shutdown(sockets)

    server = _Server(uvicorn.Config(
        app, host=host or cfg.server.host, port=port if port is not None else cfg.server.port,
        loop="uvloop", http=http, lifespan="on", access_log=cfg.server.access_log, log_config=None,
        timeout_graceful_shutdown=int(cfg.server.graceful_shutdown_s), server_header=False, date_header=False,
        h11_max_incomplete_event_size=cfg.server.max_header_bytes, backlog=4096,
        # X-Forwarded-For names the client only when it comes from a configured proxy (uvicorn's default trusts
        # 127.0.0.1, so any local client could pick its own address and dodge the auth-failure limiter)
        proxy_headers=bool(cfg.server.trusted_proxies),
        forwarded_allow_ips=list(cfg.server.trusted_proxies) or None))

    def on_hup() -> None:
        async def go() -> None:
            try:
                await gw.reload()
            except ConfigError as e:
                logging.getLogger("gateway").error("reload refused, previous config keeps serving: %s", e)
        loop.create_task(go())

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    await server.serve(sockets=[sock] if sock is not None else None)


def cmd_serve(args: argparse.Namespace) -> int:
    sock = None
    if args.worker_fd is not None:  # a worker started by the supervisor below
        from gateway.workers import worker_socket

        sock = worker_socket(args.worker_fd)
    else:
        try:
            cfg = load_config(args.config)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        n = args.workers if args.workers is not None else cfg.server.workers
        if n < 1:
            print("error: --workers: must be at least 1", file=sys.stderr)
            return 2
        if n > 1:
            from gateway.workers import supervise, workers_problems

            problems = workers_problems(cfg, n)
            for why in problems:
                print(f"error: {n} workers: {why}", file=sys.stderr)
            if problems:
                return 2
            return supervise(args.config, n, args.host or cfg.server.host,
                             args.port if args.port is not None else cfg.server.port, cfg.server.graceful_shutdown_s)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve_async(args.config, args.host, args.port, sock=sock))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.file)
        from gateway.wiring import check_config

        check_config(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.file}: ok ({len(cfg.backends)} backends, {len(cfg.models)} models, {len(cfg.aliases)} aliases)")
    _print_discovery(cfg)
    if args.probe:
        return _probe_kv_events(cfg, args.probe_timeout)
    return 0


def _print_discovery(cfg) -> None:  # type: ignore[no-untyped-def]
    """What each discovery backend resolves to from here (the server resolves again at start and on refresh)."""
    from gateway import discovery

    for t, d in discovery.watched(str(cfg.path) if cfg.path is not None else None):
        addrs = discovery.resolve_a(d.dns)
        found = ", ".join(discovery.backend_name(t.name, a) for a in addrs) if addrs else "no address yet"
        print(f"discovery: {t.name}: {d.dns} -> {found}")


def _probe_kv_events(cfg, timeout_s: float) -> int:  # type: ignore[no-untyped-def]
    """--probe: wait (bounded) for one decodable KV batch per kv-events backend, or say why none came."""
    from gateway.telemetry.probe import probe_config

    if timeout_s <= 0:
        print("error: --probe-timeout must be > 0 seconds", file=sys.stderr)
        return 2
    results = asyncio.run(probe_config(cfg, timeout_s))
    if not results:
        print("probe: no backend publishes KV events (kind vllm/sim/sglang with kv_events, telemetry.kv_events on)")
        return 0
    for r in results:
        print(r.line())
    bad = [r for r in results if not r.ok]
    if bad:
        print(f"probe: {len(bad)} of {len(results)} KV-event stream(s) not usable", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    return run_demo(args)


def package_version() -> str:
    """The installed distribution's version (pyproject.toml `version`), as pip recorded it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("policy-gateway")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gateway", description="Policy-engine LLM gateway")
    p.add_argument("--version", action="version", version=f"gateway {package_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the gateway")
    s.add_argument("--config", "-c", required=True)
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--workers", type=int, metavar="N",
                   help="worker processes sharing the port (default: server.workers); N > 1 needs shared stores")
    s.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)  # set by the supervisor for its workers
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("config", help="config tools")
    csub = c.add_subparsers(dest="config_command", required=True)
    cc = csub.add_parser("check", help="validate a config file without starting")
    cc.add_argument("file")
    cc.add_argument("--probe", action="store_true",
                    help="also connect to every backend's KV-event stream and wait for one decodable batch")
    cc.add_argument("--probe-timeout", type=float, default=5.0, metavar="S",
                    help="how long --probe waits per stream (default 5 s; all streams are probed at once)")
    cc.set_defaults(func=cmd_config_check)

    d = sub.add_parser("demo", help="run the gateway with an example config and a simulated vLLM fleet")
    d.add_argument("--port", type=int, default=8080)
    d.add_argument("--engines", type=int, default=4)
    d.add_argument("--sim-base-port", type=int, default=18100)
    d.add_argument("--dir", default="var/demo", help="where the demo writes its config, manifest and state")
    d.add_argument("--policy", help="policy file (default: the packaged example, a copy of policies/tenants.yaml)")
    d.set_defaults(func=cmd_demo)

    for register in _subsystem_commands():
        register(sub)
    return p


def _subsystem_commands():
    """Commands contributed by subsystems (sim, keys, policy, engine); each registers its own parsers."""
    from backends.sim.cli import add_sim_command
    from backends.vllm.cli import add_engine_command
    from gateway.cost.report import add_report_command
    from gateway.identity.cli import add_keys_commands
    from gateway.policy.cli import add_policy_commands

    return [add_sim_command, add_keys_commands, add_policy_commands, add_engine_command, add_report_command]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
