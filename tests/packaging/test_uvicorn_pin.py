"""uvicorn is pinned to the minor release the gateway is tested on: gateway/server_protocol.py subclasses its
private httptools protocol (header limits, slow-loris timer, lingering close, refusals) and gateway/cli.py
overrides Server hooks, neither of which is public API that a minor release keeps. The pin's range must hold
the locked version, and the internals the gateway overrides must exist with the signatures it calls."""
from __future__ import annotations

import inspect
import re
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version

from tests.support.procs import ROOT


def _uvicorn_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(Requirement(d) for d in deps if Requirement(d).name == "uvicorn")


def test_uvicorn_is_pinned_to_one_minor_release_holding_the_locked_version():
    req = _uvicorn_requirement()
    uppers = [s for s in req.specifier if s.operator in ("<", "<=", "~=", "==")]
    assert uppers, f"{req}: no upper bound, a new uvicorn minor would be installed untested"
    locked = re.search(r"^uvicorn==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M).group(1)
    installed = metadata.version("uvicorn")
    assert req.specifier.contains(locked) and req.specifier.contains(installed), (str(req), locked, installed)
    lo = Version(locked)
    assert not req.specifier.contains(f"{lo.major}.{lo.minor + 1}.0"), f"{req} admits the next minor release"


def test_the_protocol_hooks_the_gateway_overrides_exist_in_uvicorn():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from gateway.server_protocol import GatewayHttpProtocol

    overridden = [n for n, f in vars(GatewayHttpProtocol).items()
                  if callable(f) and not n.startswith("__") and not n.startswith("_")]
    assert {"on_url", "on_header", "on_headers_complete", "data_received", "connection_made"} <= set(overridden)
    for name in overridden:
        base = getattr(HttpToolsProtocol, name, None)
        assert base is not None, f"uvicorn's HttpToolsProtocol has no {name} any more"
        ours = list(inspect.signature(getattr(GatewayHttpProtocol, name)).parameters)
        theirs = list(inspect.signature(base).parameters)
        assert ours == theirs, f"{name}: ours {ours} vs uvicorn's {theirs}"


def test_the_private_keep_alive_machinery_the_protocol_replaces_exists_in_uvicorn():
    """on_response_complete is uvicorn's own with one keep-alive timer per connection (server_protocol.py): it
    relies on these names of the base, and on uvicorn calling _unset_keepalive_if_required on each read and when
    the connection is lost."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    src = inspect.getsource(HttpToolsProtocol)
    for name in ("_unset_keepalive_if_required", "timeout_keep_alive_handler", "_start_asgi_task"):
        assert callable(getattr(HttpToolsProtocol, name, None)), name
    for attr in ("self.timeout_keep_alive_task", "self.timeout_keep_alive ", "self.pipeline", "self.flow",
                 "self.server_state.total_requests"):
        assert attr in src, attr
    data_received = inspect.getsource(HttpToolsProtocol.data_received)
    lost = inspect.getsource(HttpToolsProtocol.connection_lost)
    assert "_unset_keepalive_if_required()" in data_received and "_unset_keepalive_if_required()" in lost


def test_the_server_hooks_and_config_keywords_cli_uses_exist():
    import uvicorn

    assert list(inspect.signature(uvicorn.Server.handle_exit).parameters) == ["self", "sig", "frame"]
    assert list(inspect.signature(uvicorn.Server.startup).parameters)[:2] == ["self", "sockets"]
    params = inspect.signature(uvicorn.Config).parameters
    for kw in ("loop", "http", "lifespan", "access_log", "log_config", "timeout_graceful_shutdown",
               "server_header", "date_header", "h11_max_incomplete_event_size", "backlog", "proxy_headers",
               "forwarded_allow_ips"):
        assert kw in params, f"uvicorn.Config lost {kw!r} (gateway/cli.py passes it)"
