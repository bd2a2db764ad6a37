"""Unit tests of the vLLM launcher's pure parts (run in the gateway venv, which has no vllm)."""
from __future__ import annotations

import http.server
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import yaml

from backends.vllm import launcher
from gateway.config import parse_config


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_command_has_every_flag_the_gateway_relies_on() -> None:
    cmd = launcher.build_command("/m/tiny", 8011, 5571, 5572, python="/venv/bin/python",
                                 served_model_name="tiny-llama", block_size=32, num_gpu_blocks_override=80,
                                 priority_scheduling=True)
    assert cmd[:4] == ["/venv/bin/python", str(launcher.ENTRY), "serve", "/m/tiny"]
    assert Path(cmd[1]).name == "_vllm_entry.py" and Path(cmd[1]).is_file()
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"):
        assert flag in cmd
    assert _flag(cmd, "--port") == "8011"
    assert _flag(cmd, "--host") == "127.0.0.1"
    assert _flag(cmd, "--max-model-len") == "2048"
    assert _flag(cmd, "--block-size") == "32"
    assert _flag(cmd, "--num-gpu-blocks-override") == "80"
    assert _flag(cmd, "--scheduling-policy") == "priority"
    assert _flag(cmd, "--served-model-name") == "tiny-llama"
    assert json.loads(_flag(cmd, "--kv-events-config")) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5571",
        "replay_endpoint": "tcp://*:5572"}  # no topic: vLLM's default "" (KVEventsConfig.topic)


def test_an_explicit_kv_topic_is_passed_to_vllm() -> None:
    cmd = launcher.build_command("m", 8000, 5557, 5558, python="py", kv_topic="kv")
    assert json.loads(_flag(cmd, "--kv-events-config"))["topic"] == "kv"


def test_optional_flags_are_left_out_by_default_and_extra_args_come_last() -> None:
    cmd = launcher.build_command("m", 8000, 5557, 5558, python="py", enforce_eager=False,
                                 extra_args=["--dtype", "float32"])
    for flag in ("--block-size", "--num-gpu-blocks-override", "--scheduling-policy", "--enforce-eager",
                 "--served-model-name"):
        assert flag not in cmd
    assert cmd[-2:] == ["--dtype", "float32"]


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 16}, "multiple of 32"),
    ({"block_size": 0}, "positive"),
    ({"block_size": -32, "device": "cuda"}, "positive"),
    ({"num_gpu_blocks_override": 0}, "positive"),
])
def test_invalid_engine_sizes_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        launcher.build_command("m", 8000, 5557, 5558, python="py", **kwargs)


@pytest.mark.parametrize("ports", [(8000, 8000, 5558), (8000, 5557, 5557), (0, 5557, 5558), (8000, 70000, 1)])
def test_bad_or_clashing_ports_are_rejected(ports: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        launcher.build_command("m", *ports, python="py")


def test_gpu_block_sizes_are_passed_through() -> None:
    cmd = launcher.build_command("m", 8000, 5557, 5558, python="py", block_size=16, device="cuda")
    assert _flag(cmd, "--block-size") == "16"


def test_env_is_offline_cpu_and_dev_mode() -> None:
    env = launcher.build_env({"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "40"}, kvcache_gib=2, omp_threads_bind="1")
    assert env["PATH"] == "/bin"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    gpu = launcher.build_env({"PATH": "/bin"}, device="cuda")
    assert "VLLM_TARGET_DEVICE" not in gpu and "VLLM_CPU_KVCACHE_SPACE" not in gpu
    assert gpu["VLLM_SERVER_DEV_MODE"] == "1"


def test_backend_config_yaml_parses_as_a_gateway_backend() -> None:
    cfg = launcher.backend_config("vllm-a", 8011, 5571, 5572, "tiny-llama", country="DE", priority_scheduling=True)
    text = launcher.render_backend_yaml(cfg)
    assert text.startswith("- name: vllm-a\n  kind: vllm\n  url: http://127.0.0.1:8011/v1\n")
    assert "  kv_events: tcp://127.0.0.1:5571\n  replay: tcp://127.0.0.1:5572\n" in text
    assert "  models: [tiny-llama]\n  location: {country: DE}\n  retention: zero\n" in text
    assert yaml.safe_load(text) == [cfg]
    be = parse_config("backends:\n" + textwrap.indent(text, "  ")).backends[0]
    assert (be.name, be.kind, be.url, be.kv_events, be.replay) == (
        "vllm-a", "vllm", "http://127.0.0.1:8011/v1", "tcp://127.0.0.1:5571", "tcp://127.0.0.1:5572")
    assert be.models == ["tiny-llama"] and be.location is not None and be.location.country == "DE"
    assert be.retention_days == 0 and be.priority_scheduling and be.context_window == 2048
    assert be.metrics == "http://127.0.0.1:8011/metrics"


def test_yaml_quotes_awkward_names() -> None:
    cfg = launcher.backend_config("a b", 1, 2, 3, "org/model: v2", country="NO")
    loaded = yaml.safe_load(launcher.render_backend_yaml(cfg))
    assert loaded[0]["name"] == "a b" and loaded[0]["models"] == ["org/model: v2"]
    assert loaded[0]["location"] == {"country": "NO"}  # would be False if left bare in YAML 1.1


def test_served_name_comes_from_tiny_model_json(tmp_path: Path) -> None:
    assert launcher.served_name_for(tmp_path) == tmp_path.name
    (tmp_path / "tiny_model.json").write_text(json.dumps({"served_name": "tiny-llama"}))
    assert launcher.served_name_for(tmp_path) == "tiny-llama"


def test_launcher_imports_without_vllm() -> None:
    code = "import sys, backends.vllm.launcher, backends.vllm.__main__; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=launcher.REPO_ROOT)
    assert out.stdout.strip() == "False"


def test_version_shim_answers_for_the_aliased_distribution() -> None:
    code = textwrap.dedent(f"""
        import importlib.metadata as md, importlib.util
        spec = importlib.util.spec_from_file_location("shim", {str(launcher.ENTRY)!r})
        shim = importlib.util.module_from_spec(spec); spec.loader.exec_module(shim)
        shim._ALIASES["no-such-dist-xyz"] = "msgspec"
        assert md.version("no-such-dist-xyz") == md.version("msgspec")
        assert md.distribution("no-such-dist-xyz").metadata["Name"] == "msgspec"
        try:
            md.version("another-missing-dist-xyz")
        except md.PackageNotFoundError:
            print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_wait_ready_polls_health_under_the_server_root() -> None:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        waited = launcher.wait_ready(f"http://127.0.0.1:{srv.server_address[1]}/v1", timeout=5, interval=0.05)
        assert 0 <= waited < 5
    finally:
        srv.shutdown()
        srv.server_close()


def test_wait_ready_times_out_and_notices_a_dead_child() -> None:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = srv.server_address[1]
    srv.server_close()  # nothing listens there now
    with pytest.raises(TimeoutError):
        launcher.wait_ready(f"http://127.0.0.1:{port}", timeout=0.3, interval=0.05)
    proc = launcher.launch([sys.executable, "-c", "raise SystemExit(3)"], env={})
    proc.wait(10)
    with pytest.raises(RuntimeError, match="code 3"):
        launcher.wait_ready(f"http://127.0.0.1:{port}", timeout=5, proc=proc, interval=0.05)


def test_launch_and_stop_end_the_whole_process_group(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            "print('up', flush=True); time.sleep(60)")
    proc = launcher.launch([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin"}, log_path=log)
    for _ in range(100):
        if log.exists() and "up" in log.read_text():
            break
        threading.Event().wait(0.05)
    rc = launcher.stop(proc, timeout=5)
    assert rc is not None and rc < 0
    ps = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True)
    assert ps.stdout.strip() == ""


def test_default_python_takes_the_env_var_then_the_checkout_then_the_user_env(tmp_path: Path, monkeypatch) -> None:
    """An installed wheel has no checkout around it: its .venv-vllm guess must not point into site-packages."""
    monkeypatch.setenv(launcher.PYTHON_ENV, "/opt/vllm/bin/python")
    assert launcher.default_python() == "/opt/vllm/bin/python"
    monkeypatch.delenv(launcher.PYTHON_ENV)
    user = tmp_path / "cache" / "policy-gateway" / "venv-vllm" / "bin" / "python"
    user.parent.mkdir(parents=True)
    user.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_VENV", raising=False)
    site = tmp_path / "site-packages"  # what parents[2] of an installed backends/vllm/launcher.py looks like
    (site / ".venv-vllm" / "bin").mkdir(parents=True)
    (site / ".venv-vllm" / "bin" / "python").write_text("")
    monkeypatch.setattr(launcher, "REPO_ROOT", site)
    monkeypatch.setattr(launcher, "DEFAULT_VENV_PYTHON", site / ".venv-vllm" / "bin" / "python")
    assert launcher.default_python() == str(user)
    (site / "pyproject.toml").write_text("")  # a real checkout: its own .venv-vllm wins
    (site / "backends" / "vllm").mkdir(parents=True)
    assert launcher.default_python() == str(site / ".venv-vllm" / "bin" / "python")
    user.unlink()
    import shutil
    shutil.rmtree(site)
    assert launcher.default_python() == sys.executable
