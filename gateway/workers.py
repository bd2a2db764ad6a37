"""`gateway serve --workers N`: a pre-fork supervisor, so one host serves at N cores' rate.

The supervisor binds the listening socket once and starts N worker processes (`python -m gateway serve
--worker-fd ...`), each a whole gateway (its own event loop, pipeline, KV-event subscription) accepting from the
one shared socket, so the kernel spreads connections over them. It is small and keeps no request state:

* SIGTERM / SIGINT: every worker drains (`server.graceful_shutdown_s`), then the supervisor exits 0;
* SIGHUP: every worker that is up reloads its config (each validates it; a refused reload keeps the old one
  serving; one still starting reads the config as it is then);
* SIGUSR2: a rolling restart, one worker at a time (the new one is accepting before the old one drains), to
  pick up new code or a config change that needs a restart without refusing a connection;
* a worker that dies is started again (with a backoff when it keeps dying); the others' requests go on.

Each worker gets `GATEWAY_WORKER_ID`, `GATEWAY_WORKERS` and `GATEWAY_PEER_DIR` (a private directory for the
workers' peer bus and their Prometheus files). State that must be exact across workers must live in a shared
store (budgets: SQLite by default, or Redis): `workers_problems` says which configs cannot run with N > 1
(docs/scale_out.md).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

READY = b"R"  # what a worker writes to its ready pipe once it accepts
MAX_BACKOFF_S = 30.0


def workers_problems(cfg: Any, n: int) -> list[str]:
    """Why this config cannot run as `n` worker processes (empty: it can). Pure: decided from the config."""
    if n <= 1:
        return []
    out: list[str] = []
    if cfg.raw.budgets.store == "memory":  # named so; `auto` (the default) becomes sqlite with N > 1
        out.append("budgets.store: memory keeps budget counters (tokens, money, RPM/TPM, concurrency) inside one "
                   "process, so each worker would enforce every limit on its own; with server.workers > 1 use "
                   "budgets.store: sqlite (exact across the workers of this host; also what leaving budgets.store "
                   "out gives) or redis (exact across workers and replicas), or run one worker")
    return out


def worker_env(base: dict[str, str], wid: int, n: int, peer_dir: str, ready_fd: int) -> dict[str, str]:
    """The environment of worker `wid` of `n` (pure)."""
    return {**base, "GATEWAY_WORKER_ID": str(wid), "GATEWAY_WORKERS": str(n), "GATEWAY_PEER_DIR": peer_dir,
            "GATEWAY_READY_FD": str(ready_fd), "GATEWAY_SUPERVISOR_PID": str(os.getpid()),
            "PROMETHEUS_MULTIPROC_DIR": os.path.join(peer_dir, "metrics")}


def next_backoff(prev: float, lived_s: float) -> float:
    """Delay before restarting a worker that died after `lived_s`: none if it had been up a while (a crash),
    doubling from 0.5 s while it dies at start (a bad host or config), at most MAX_BACKOFF_S (pure)."""
    if lived_s >= 10.0:
        return 0.0
    return min(MAX_BACKOFF_S, max(0.5, prev * 2))


@dataclass
class Worker:
    wid: int
    proc: subprocess.Popen[bytes]
    ready_r: int
    started: float
    ready: bool = False


@dataclass
class Supervisor:
    config_path: str
    n: int
    sock: socket.socket
    peer_dir: str
    grace_s: float
    workers: dict[int, Worker] = field(default_factory=dict)
    retired: list[Worker] = field(default_factory=list)  # replaced by a rolling restart, draining: their exit is expected
    backoff: dict[int, float] = field(default_factory=dict)
    restart_at: dict[int, float] = field(default_factory=dict)
    stopping: bool = False
    rolling: bool = False
    restarts: int = 0

    def spawn(self, wid: int) -> Worker:
        r, w = os.pipe()
        env = worker_env(dict(os.environ), wid, self.n, self.peer_dir, w)
        fd = self.sock.fileno()
        args = [sys.executable, "-m", "gateway", "serve", "--config", self.config_path, "--worker-fd", str(fd)]
        # its own process group: a Ctrl-C at the terminal reaches the supervisor only, which drains each worker once
        p = subprocess.Popen(args, env=env, pass_fds=(fd, w), process_group=0)
        os.close(w)
        os.set_blocking(r, False)
        return Worker(wid, p, r, time.monotonic())

    def poll_ready(self, wk: Worker) -> bool:
        if not wk.ready:
            try:
                if os.read(wk.ready_r, 1) == READY:
                    wk.ready = True
                    self.backoff.pop(wk.wid, None)
            except BlockingIOError:
                pass
        return wk.ready

    def start(self, timeout_s: float) -> bool:
        """Start every worker; True once all accept. A worker that exits before it is ready fails the start."""
        for i in range(self.n):
            self.workers[i] = self.spawn(i)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(w.proc.poll() is not None for w in self.workers.values()):
                return False
            if all(self.poll_ready(w) for w in self.workers.values()):
                return True
            time.sleep(0.05)
        return False

    def signal_all(self, sig: int, ready_only: bool = False) -> None:
        """`ready_only`: skip workers still starting (SIGHUP's default action would kill one mid-import; it
        reads the config as it is now when it starts anyway)."""
        for w in [*self.workers.values(), *self.retired]:
            if w.proc.poll() is None and (w.ready or not ready_only):
                try:
                    w.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def reap(self, now: float) -> None:
        """Collect exited workers; schedule a restart for one that died while it should have been serving."""
        for w in list(self.retired):
            if w.proc.poll() is not None:
                self.retired.remove(w)
                self._gone(w)
        for wid, w in list(self.workers.items()):
            if w.proc.poll() is None:
                self.poll_ready(w)
                continue
            del self.workers[wid]
            self._gone(w)
            if self.stopping:
                continue
            lived = now - w.started
            delay = next_backoff(self.backoff.get(wid, 0.0), lived)
            self.backoff[wid] = delay
            self.restart_at[wid] = now + delay
            self.restarts += 1
            print(f"gateway supervisor: worker {wid} (pid {w.proc.pid}) exited with {w.proc.returncode} after "
                  f"{lived:.1f}s; restarting in {delay:.1f}s", file=sys.stderr, flush=True)
        for wid, at in list(self.restart_at.items()):
            if now >= at and not self.stopping:
                del self.restart_at[wid]
                self.workers[wid] = self.spawn(wid)

    def _gone(self, w: Worker) -> None:
        os.close(w.ready_r)
        _mark_dead(w.proc.pid, os.path.join(self.peer_dir, "metrics"))

    def roll(self, ready_timeout_s: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Replace each worker in turn: the new one accepts before the old one is asked to drain. `stop()`
        true (SIGTERM meanwhile) ends the roll; a new worker still starting is drained with the rest."""
        for wid in sorted(self.workers):
            if stop():
                return
            old = self.workers.get(wid)
            new = self.spawn(wid)
            deadline = time.monotonic() + ready_timeout_s
            while not self.poll_ready(new) and new.proc.poll() is None and time.monotonic() < deadline:
                if stop():
                    self.retired.append(new)
                    return
                time.sleep(0.05)
            if not new.ready:
                print(f"gateway supervisor: rolling restart stopped, the new worker {wid} did not start",
                      file=sys.stderr, flush=True)
                new.proc.kill()
                new.proc.wait()
                self._gone(new)
                return
            self.workers[wid] = new
            if old is not None and old.proc.poll() is None:
                old.proc.send_signal(signal.SIGTERM)
                self.retired.append(old)

    def stop(self) -> None:
        """Drain every worker; kill what is still running a little after the grace period."""
        self.stopping = True
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s + 5.0
        for w in [*self.workers.values(), *self.retired]:
            left = deadline - time.monotonic()
            try:
                w.proc.wait(timeout=max(0.1, left))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()


def _mark_dead(pid: int, metrics_dir: str) -> None:
    """Live gauges of a dead worker leave the merged /metrics (prometheus-client's multiprocess files)."""
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, metrics_dir)
    except Exception:  # noqa: BLE001 - a stale gauge file is not worth failing the supervisor for
        pass


def bind(host: str, port: int, backlog: int = 4096) -> socket.socket:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(backlog)
    s.set_inheritable(True)
    return s


def supervise(config_path: str, n: int, host: str, port: int, grace_s: float, start_timeout_s: float = 120.0) -> int:
    """Run `n` workers until SIGTERM/SIGINT; the exit status of `gateway serve --workers n`."""
    try:
        sock = bind(host, port)
    except OSError as e:
        print(f"error: cannot listen on {host}:{port}: {e.strerror}", file=sys.stderr)
        return 1
    peer_dir = tempfile.mkdtemp(prefix="gateway-workers-")
    os.makedirs(os.path.join(peer_dir, "metrics"))
    sup = Supervisor(config_path, n, sock, peer_dir, grace_s)
    flags = {"stop": False, "hup": False, "roll": False}

    def on(sig: int, _frame: Any) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT):
            flags["stop"] = True
        elif sig == signal.SIGHUP:
            flags["hup"] = True
        elif sig == signal.SIGUSR2:
            flags["roll"] = True

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(s, on)
    try:
        if not sup.start(start_timeout_s):
            print("error: a worker did not start (its log is above); stopping", file=sys.stderr, flush=True)
            sup.stop()
            return 2
        print(f"gateway supervisor: {n} workers accepting on {host}:{sock.getsockname()[1]}", file=sys.stderr,
              flush=True)
        while not flags["stop"]:
            if flags["hup"]:
                flags["hup"] = False
                sup.signal_all(signal.SIGHUP, ready_only=True)
            if flags["roll"]:
                flags["roll"] = False
                sup.roll(start_timeout_s, stop=lambda: flags["stop"])
            sup.reap(time.monotonic())
            time.sleep(0.1)
        sup.stop()
        return 0
    finally:
        sock.close()
        shutil.rmtree(peer_dir, ignore_errors=True)


def worker_socket(fd: int) -> socket.socket:
    """The supervisor's listening socket, inside a worker; the worker ends when the supervisor does."""
    _die_with_parent()
    return socket.socket(fileno=fd)


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: a worker whose supervisor was killed (-9) gets SIGTERM and drains, not orphaned."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    want = os.environ.get("GATEWAY_SUPERVISOR_PID")
    if want and os.getppid() != int(want):  # the supervisor died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def notify_ready() -> None:
    """Tell the supervisor this worker accepts (once; the pipe is closed after)."""
    fd = os.environ.pop("GATEWAY_READY_FD", None)
    if fd is None:
        return
    try:
        os.write(int(fd), READY)
        os.close(int(fd))
    except OSError:
        pass
