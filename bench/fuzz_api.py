"""The long API fuzz: schemathesis over /openapi.json (thousands of generated requests, valid and invalid, with
good, bad and missing credentials) plus rounds of hostile raw HTTP (malformed JSON, 10 MB and 100k-deep bodies,
invalid UTF-8, header floods, smuggling, header injection) against one gateway in front of the simulator.

Prints a table: requests, status counts, 5xx, hangs, non-OpenAI refusals, gateway RSS before/after.
Run: .venv/bin/python bench/fuzz_api.py [--examples 300] [--raw-rounds 20]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.hardening.fuzzing import fuzz  # noqa: E402
from tests.hardening.stack import GW_KEY, proc_stats, start_stack, wait_ready  # noqa: E402
from tests.hardening.test_raw_http import OK_BODY, exchange, head, parse, with_body  # noqa: E402
from tests.hardening.fuzzing import check_answer  # noqa: E402


def raw_payloads() -> list[tuple[str, bytes]]:
    big = b'{"model":"sim-model","messages":[{"role":"user","content":"' + b"a" * 10_000_000 + b'"}]}'
    smuggled = "0\r\n\r\nGET /admin/fleet HTTP/1.1\r\nhost: gw\r\n\r\n"
    return [
        ("malformed json", with_body(b'{"model": "sim-model",')),
        ("not an object", with_body(b"[1,2,3]")),
        ("100k-deep", with_body(b"[" * 100_000 + b"]" * 100_000)),
        ("300-deep extra field", with_body(OK_BODY[:-1] + b',"x":' + b"[" * 300 + b"]" * 300 + b"}")),
        ("invalid utf-8", with_body(b'{"model":"sim-model","messages":[{"role":"user","content":"\xff\xfe"}]}')),
        ("10 MB body", with_body(big)),
        ("1000 headers", with_body(OK_BODY, "".join(f"x-h{i}: v\r\n" for i in range(1000)))),
        ("100 KB header", with_body(OK_BODY, "x-big: " + "a" * 100_000 + "\r\n")),
        ("CL + TE", (head("content-length: 5\r\ntransfer-encoding: chunked\r\n") + "\r\n" + smuggled).encode()),
        ("duplicate CL", (head("content-length: 5\r\ncontent-length: 40\r\n") + "\r\n" + smuggled).encode()),
        ("CR in x-request-id", with_body(OK_BODY, "x-request-id: a\rset-cookie: x=1\r\n")),
        ("valid", with_body(OK_BODY)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=300, help="generated requests per operation and mode")
    ap.add_argument("--raw-rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    st = start_stack(Path(tempfile.mkdtemp(prefix="bench-fuzz-")), engines=2, locations="DE,SE",
                     server={"max_body_bytes": 1_000_000, "header_timeout_s": 2.0, "body_timeout_s": 3.0},
                     identity={"auth_fail_limit_per_minute": 1_000_000})  # fuzz past the brute-force limiter
    try:
        wait_ready(st.base)
        before = proc_stats(st.gw.p.pid)
        t0 = time.perf_counter()
        rep = fuzz(st.base, GW_KEY, a.examples, timeout_s=30, seed=a.seed)
        t_fuzz = time.perf_counter() - t0
        raw_status: Counter = Counter()
        raw_bad: list[str] = []
        t0 = time.perf_counter()
        payloads = raw_payloads()
        for _ in range(a.raw_rounds):
            for name, data in payloads:
                try:
                    resp = exchange(st.port, data, timeout=15)
                    status, headers, body = parse(resp)
                except AssertionError as e:
                    raw_bad.append(f"{name}: {e}")
                    continue
                raw_status[status] += 1
                n = int(headers.get("content-length", len(body)))
                bad = check_answer("POST", name, status, headers.get("content-type", ""), body[:n])
                if bad or "set-cookie" in headers or resp.count(b"HTTP/1.1 ") != 1:
                    raw_bad.append(bad or f"{name}: injected header or second response")
        t_raw = time.perf_counter() - t0
        after = proc_stats(st.gw.p.pid)
        log = st.gw.log_path.read_text(errors="replace")
    finally:
        st.stop()
    fivexx = sum(v for k, v in rep.statuses.items() if k >= 500) + sum(v for k, v in raw_status.items() if k >= 500)
    hangs = sum(1 for f in rep.failures + raw_bad if "hang" in f or "no complete answer" in f)
    print("| part | requests | statuses | 5xx | hangs | bad refusals | wall s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| schemathesis ({a.examples}/op/mode, seed {a.seed}) | {rep.requests} | "
          f"{dict(sorted(rep.statuses.items()))} | {sum(v for k, v in rep.statuses.items() if k >= 500)} | "
          f"{sum(1 for f in rep.failures if 'hang' in f)} | {len(rep.failures)} | {t_fuzz:.0f} |")
    print(f"| raw hostile HTTP ({len(payloads)} kinds x {a.raw_rounds}) | {sum(raw_status.values())} | "
          f"{dict(sorted(raw_status.items()))} | {sum(v for k, v in raw_status.items() if k >= 500)} | "
          f"{sum(1 for f in raw_bad if 'no complete answer' in f)} | {len(raw_bad)} | {t_raw:.0f} |")
    print(f"\ngateway RSS {before['rss_mib']:.0f} -> {after['rss_mib']:.0f} MiB (peak {after['peak_rss_mib']:.0f}), "
          f"fds {before['fds']} -> {after['fds']}; tracebacks in gateway log: {log.count('Traceback')}; "
          f"max fuzz latency {rep.max_latency_s * 1000:.0f} ms; total 5xx {fivexx}, hangs {hangs}")
    for f in (rep.failures + raw_bad)[:20]:
        print("FAIL:", f)
    sys.exit(1 if rep.failures or raw_bad else 0)


if __name__ == "__main__":
    main()
