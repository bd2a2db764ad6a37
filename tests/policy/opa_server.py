"""A tiny server speaking OPA's REST data API (POST /v1/data/<path> {"input": ...} -> {"result": ...}).

Backed by regopy, a real Rego evaluator (the Rego reference interpreter, rego-cpp), so the gateway's OPA
client is exercised against real Rego semantics where no `opa` binary is available. Undefined results
answer `{}` like OPA does. `delay_s` makes it slow (timeout tests); `requests` counts queries (cache tests).
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import regopy


class RegoDataServer:
    def __init__(self, rego_files: list[Path], host: str = "127.0.0.1", port: int = 0) -> None:
        self.modules = [(f.name, f.read_text(encoding="utf-8")) for f in rego_files]
        self.delay_s = 0.0
        self.requests = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                return None

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, {}) if self.path.startswith("/health") else self._send(404, {"code": "not_found"})

            def do_POST(self) -> None:
                if not self.path.startswith("/v1/data"):
                    return self._send(404, {"code": "not_found", "message": self.path})
                n = int(self.headers.get("content-length") or 0)
                try:
                    body = json.loads(self.rfile.read(n) or b"{}")
                except ValueError as e:
                    return self._send(400, {"code": "invalid_parameter", "message": str(e)})
                server.requests += 1
                if server.delay_s:
                    time.sleep(server.delay_s)
                path = self.path.split("?")[0][len("/v1/data"):].strip("/")
                query = "data" + ("." + path.replace("/", ".") if path else "")
                try:
                    ok, result = server.evaluate(query, body.get("input"))
                except Exception as e:  # a Rego evaluation error is a 500, like OPA's internal_error
                    return self._send(500, {"code": "internal_error", "message": str(e)})
                self._send(200, {"result": result} if ok else {})

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def evaluate(self, query: str, input_doc: object) -> tuple[bool, object]:
        """(defined, value) of a Rego query with an input document."""
        with self._lock:
            interp = regopy.Interpreter()
            for name, text in self.modules:
                interp.add_module(name, text)
            if input_doc is not None:
                interp.set_input_term(json.dumps(input_doc))
            out = interp.query(query)
        text = str(out)
        if text == "undefined":
            return False, None
        data = json.loads(text)
        if "expressions" not in data:
            raise RuntimeError(text)
        return True, data["expressions"][0]

    def __enter__(self) -> "RegoDataServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
