"""The default embedder, `cache.embedder: wordllama`: the `wordllama` package's bundled model, loaded from the
installed package's files with no network at all (a subprocess whose sockets raise, and one in a network
namespace without interfaces where `unshare -n` works), embedding deterministically into 256 unit dims where a
paraphrase (synonyms included) is closer than a near miss; the stage hits on a synonym rewrite at the default
threshold and the guards still refuse number / entity swaps; config validation of the new value."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gateway.cache.config import CacheConfig
from gateway.cache.embed import WORDLLAMA_DIMS, WordLlamaEmbedder, load_wordllama
from tests.cache.helpers import answer_of, make_ctx, serve, user

_LOAD_AND_EMBED = textwrap.dedent("""
    import asyncio, sys
    from gateway.cache.embed import WordLlamaEmbedder
    e = WordLlamaEmbedder()
    v = asyncio.run(e.embed(None, "user: How do I reset the password for my Orion account?"))
    assert v is not None and v.shape == (256,), v
    print("embedded", v.shape[0])
""")

_NO_SOCKETS = textwrap.dedent("""
    import socket
    def _refuse(*a, **k):
        raise AssertionError("network access attempted: %r" % (a[:2],))
    socket.socket.connect = _refuse
    socket.socket.connect_ex = _refuse
    socket.create_connection = _refuse
    socket.getaddrinfo = _refuse
""")


def _run(code: str, tmp_path, prefix: list[str] = ()) -> subprocess.CompletedProcess:
    # HOME points at an empty dir: no ~/.cache/wordllama could stand in for the package's own files
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=env, cwd=str(Path(__file__).resolve().parents[2]))


def test_loads_and_embeds_with_every_socket_refused(tmp_path):
    r = _run(_NO_SOCKETS + _LOAD_AND_EMBED, tmp_path)
    assert r.returncode == 0 and "embedded 256" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / ".cache").exists()  # nothing downloaded or cached under HOME


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="unshare -n is not permitted here")
def test_loads_and_embeds_in_a_network_namespace_without_network(tmp_path):
    r = _run(_LOAD_AND_EMBED, tmp_path, ["unshare", "-n"])
    assert r.returncode == 0 and "embedded 256" in r.stdout, r.stdout + r.stderr


def test_vectors_unit_deterministic_and_paraphrase_closer_than_a_near_miss():
    e = WordLlamaEmbedder()
    assert e.name == "wordllama" and load_wordllama() is load_wordllama()  # one model per process
    a = e.vector("user: How do I reset the password for my Orion account?")
    assert a is not None and a.shape == (WORDLLAMA_DIMS,) and a.dtype == np.float32
    assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-5
    assert np.array_equal(a, e.vector("user: How do I reset the password for my Orion account?"))
    synonym = e.vector("user: What is the way to reset the password for my Orion account?")
    polite = e.vector("user: Hi! could you tell me how do i reset the password for my orion account? Thanks!")
    other_intent = e.vector("user: How do I delete my Orion account?")
    unrelated = e.vector("user: Which browsers does the Orion web app support?")
    sim = lambda v: float(a @ v)  # noqa: E731
    assert sim(synonym) > sim(other_intent) + 0.2 and sim(polite) > sim(other_intent) + 0.2
    assert sim(synonym) >= CacheConfig().default_similarity and sim(other_intent) < CacheConfig().default_similarity
    assert sim(unrelated) < sim(other_intent)
    assert e.vector("") is None  # no token: a miss, never a NaN vector


async def test_the_stage_hits_a_synonym_rewrite_and_the_guards_still_refuse_swaps():
    from gateway.cache.config import CacheLocation
    from gateway.cache.stage import CacheStage
    from gateway.cache.store import MemoryStore

    cc = CacheConfig(location=CacheLocation(country="DE"))
    assert cc.embedder == "wordllama"
    stage = CacheStage(lambda: SimpleNamespace(raw=SimpleNamespace(cache=cc)), MemoryStore(100, cc.location),
                       WordLlamaEmbedder(), None)
    assert await serve(stage, make_ctx(user("How do I reset the password for order 1234 at Orion?"),
                                       similarity=None), "A") == "miss"
    hit = make_ctx(user("What is the way to reset the password for order 1234 at Orion?"), similarity=None)
    assert await serve(stage, hit, "B") == "hit" and answer_of(hit) == "A"
    assert float(hit.extra_headers["x-gateway-cache-similarity"]) >= cc.default_similarity
    for q in ("How do I reset the password for order 1243 at Orion?",
              "How do I reset the password for order 1234 at Atlas?",
              "How do I not reset the password for order 1234 at Orion?"):
        c = make_ctx(user(q), similarity=None)
        assert await serve(stage, c, "C") == "miss", q


def test_config_default_and_validation(monkeypatch):
    import importlib.util

    from gateway.cache import embed
    from gateway.cache.embed import BackendEmbedder, LexicalEmbedder
    from gateway.cache.service import build_embedder
    from gateway.config import ConfigError

    gw = SimpleNamespace(config=None, upstreams=None)
    assert CacheConfig().embedder == "wordllama"
    assert isinstance(build_embedder(gw, CacheConfig()), WordLlamaEmbedder)
    assert isinstance(build_embedder(gw, CacheConfig(embedder="lexical")), LexicalEmbedder)
    assert isinstance(build_embedder(gw, CacheConfig(embedder="backend", embeddings_model="e")), BackendEmbedder)
    with pytest.raises(ConfigError, match="one of wordllama, lexical, backend"):
        build_embedder(gw, CacheConfig(embedder="minilm"))
    real = importlib.util.find_spec
    monkeypatch.setattr(embed.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wordllama" else real(name, *a))
    with pytest.raises(ConfigError, match="cache.embedder: wordllama: the wordllama package is not installed"):
        build_embedder(gw, CacheConfig())
    assert isinstance(build_embedder(gw, CacheConfig(embedder="lexical")), LexicalEmbedder)  # lexical needs none


def test_a_package_without_its_bundled_files_is_a_config_error(monkeypatch, tmp_path):
    from gateway.cache import embed
    from gateway.cache.service import build_embedder
    from gateway.config import ConfigError

    (tmp_path / "wordllama").mkdir()
    (tmp_path / "wordllama" / "__init__.py").write_text("")
    monkeypatch.setattr(embed.importlib.util, "find_spec", lambda name, *a: SimpleNamespace(
        origin=str(tmp_path / "wordllama" / "__init__.py")))
    with pytest.raises(ConfigError, match="lacks its bundled weights/l2_supercat_256.safetensors"):
        build_embedder(None, CacheConfig())


def test_the_config_loader_accepts_wordllama_and_lexical(tmp_path):
    import yaml

    from gateway.config import parse_config

    for name in ("wordllama", "lexical"):
        cfg = parse_config(yaml.safe_dump({"cache": {"embedder": name}}), "t.yaml", base_dir=tmp_path)
        assert cfg.raw.cache.embedder == name
    assert parse_config("{}", "t.yaml", base_dir=tmp_path).raw.cache.embedder == "wordllama"
