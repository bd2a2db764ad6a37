"""gateway/workers.py's decisions, driven directly: which configs may run as N workers, what each worker is
told, and how fast a dying worker is restarted."""
from __future__ import annotations

import os
import subprocess
import sys

from gateway.config import parse_config
from gateway.workers import MAX_BACKOFF_S, next_backoff, worker_env, workers_problems
from tests.support.procs import ROOT


def cfg(budgets: str = "{}"):
    return parse_config(f"server: {{port: 8080}}\nbudgets: {budgets}\n")


def test_memory_budgets_refuse_more_than_one_worker_and_say_what_to_use():
    """Counters in one process cannot be exact across N: a store named memory is refused, naming the ones that are."""
    problems = workers_problems(cfg("{store: memory}"), 2)
    assert len(problems) == 1 and "budgets.store: sqlite" in problems[0] and "redis" in problems[0]


def test_the_default_sqlite_or_redis_budgets_or_one_worker_are_fine():
    """The default (`auto`) runs any number of workers: it is the SQLite store shared by them when N > 1."""
    assert workers_problems(cfg(), 4) == []
    assert workers_problems(cfg("{store: sqlite}"), 4) == []
    assert workers_problems(cfg("{store: redis}"), 4) == []
    assert workers_problems(cfg("{store: memory}"), 1) == []


def test_auto_is_memory_in_one_process_and_sqlite_across_workers():
    from gateway.budget.config import effective_store

    assert cfg().raw.budgets.store == "auto"
    assert [effective_store(cfg().raw.budgets, n) for n in (1, 2, 4)] == ["memory", "sqlite", "sqlite"]
    for named in ("memory", "sqlite", "redis"):
        assert {effective_store(cfg(f"{{store: {named}}}").raw.budgets, n) for n in (1, 4)} == {named}


def test_each_worker_knows_its_place_and_where_its_peers_are():
    env = worker_env({"PATH": "/bin"}, 1, 3, "/run/gw", 7)
    assert env["PATH"] == "/bin"
    assert (env["GATEWAY_WORKER_ID"], env["GATEWAY_WORKERS"], env["GATEWAY_PEER_DIR"]) == ("1", "3", "/run/gw")
    assert env["GATEWAY_READY_FD"] == "7" and env["GATEWAY_SUPERVISOR_PID"] == str(os.getpid())
    assert env["PROMETHEUS_MULTIPROC_DIR"] == "/run/gw/metrics"  # the workers' merged /metrics


def test_a_crash_after_serving_restarts_at_once_a_crash_loop_backs_off():
    assert next_backoff(8.0, lived_s=60.0) == 0.0  # it served a while: a crash, not a loop
    d, seen = 0.0, []
    for _ in range(10):
        d = next_backoff(d, lived_s=0.2)
        seen.append(d)
    assert seen[0] == 0.5 and seen[1] == 1.0 and seen[2] == 2.0
    assert max(seen) == MAX_BACKOFF_S == seen[-1]


def test_serve_with_workers_on_memory_budgets_exits_2_with_the_reason(tmp_path):
    c = tmp_path / "gw.yaml"
    c.write_text("server: {port: 1}\nbudgets: {store: memory}\n")
    r = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(c), "--workers", "2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2
    assert "2 workers: budgets.store: memory" in r.stderr and "sqlite" in r.stderr and "redis" in r.stderr


def test_an_unknown_budget_store_is_a_config_error_naming_the_stores():
    import pytest

    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match="budgets.store.*'auto', 'memory', 'sqlite' or 'redis'"):
        cfg("{store: postgres}")


def test_serve_refuses_zero_workers(tmp_path):
    c = tmp_path / "gw.yaml"
    c.write_text("server: {port: 1}\n")
    r = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(c), "--workers", "0"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "at least 1" in r.stderr


def test_sighup_skips_a_worker_still_starting():
    """SIGHUP's default action would kill a worker mid-import; one still starting reads the new config anyway."""
    import signal as sig
    from dataclasses import dataclass

    from gateway.workers import Supervisor, Worker

    @dataclass
    class P:
        sent: list
        pid: int = 1

        def poll(self):
            return None

        def send_signal(self, s):
            self.sent.append(s)

    ready, starting = P([]), P([])
    sup = Supervisor("c.yaml", 2, None, "/tmp", 1.0)  # type: ignore[arg-type]
    sup.workers = {0: Worker(0, ready, 0, 0.0, ready=True), 1: Worker(1, starting, 0, 0.0)}  # type: ignore[arg-type]
    sup.signal_all(sig.SIGHUP, ready_only=True)
    assert ready.sent == [sig.SIGHUP] and starting.sent == []
    sup.signal_all(sig.SIGTERM)
    assert starting.sent == [sig.SIGTERM]  # a drain reaches every worker
