"""OpenAI routes the gateway does not serve (gateway/api/unserved.py), through the official openai SDK against a
real `python -m gateway serve`: each is a 404 in OpenAI's error shape naming what the gateway does not keep, after
authentication (a missing or wrong key is the 401 of any served route); the served routes at the same paths
still work, and paths OpenAI does not have keep the plain "No route" 404."""
from __future__ import annotations

import httpx
import openai
import pytest
import yaml

from gateway.api.unserved import UNSERVED
from tests.support.procs import free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e
KEY = "unserved-key-0123456789"


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unserved")
    up, up_port = start_upstream(tmp)
    port = free_port()
    cfg = {"server": {"host": "127.0.0.1", "port": port},
           "backends": [{"name": "up", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1",
                         "models": ["up-model"], "location": {"country": "DE"}, "retention": "zero"}],
           "keys": [{"key": KEY, "tenant": "t", "name": "k"}],
           "policy": {"audit_path": str(tmp / "audit.jsonl")},
           "identity": {"sqlite_path": str(tmp / "id.db")},
           "budgets": {"sqlite_path": str(tmp / "budgets.db")}}
    path = tmp / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    g, _ = start_gateway(path)
    yield f"http://127.0.0.1:{port}"
    g.stop()
    up.stop()


def client(base: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


class Refusal:
    def __init__(self, e: openai.NotFoundError) -> None:
        err = e.response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] is None
        assert err["type"] == "invalid_request_error" == e.type
        assert e.code == err["code"] and err["message"] in e.message  # what the SDK read
        self.message, self.code = err["message"], err["code"]


def not_found(call) -> Refusal:
    """The SDK call raises NotFoundError: a 404 in OpenAI's error shape (returned: its message and code)."""
    with pytest.raises(openai.NotFoundError) as ei:
        call()
    assert ei.value.status_code == 404 and ei.value.response.headers["x-request-id"]
    return Refusal(ei.value)


def test_the_sdks_stored_chat_completion_methods_say_none_are_kept(gw):
    c = client(gw)
    e = not_found(lambda: c.chat.completions.list())
    assert e.message.startswith("This gateway keeps no stored chat completions (store is not supported)")
    assert "none to list" in e.message and e.code == "stored_completions_not_supported"
    for call, says in ((lambda: c.chat.completions.retrieve("chatcmpl-abc"), "retrieved"),
                       (lambda: c.chat.completions.update("chatcmpl-abc", metadata={"a": "b"}), "updated"),
                       (lambda: c.chat.completions.delete("chatcmpl-abc"), "delete"),
                       (lambda: c.chat.completions.messages.list("chatcmpl-abc"), "messages")):
        e = not_found(call)
        assert "keeps no stored chat completions" in e.message and says in e.message
        assert e.code == "stored_completions_not_supported"
    # the served route at the same path still serves
    r = c.chat.completions.create(model="up-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content


def test_the_sdks_stored_response_methods_say_none_are_kept(gw):
    c = client(gw)
    for call, says in ((lambda: c.responses.retrieve("resp_abc"), "retrieved"),
                       (lambda: c.responses.delete("resp_abc"), "delete"),
                       (lambda: c.responses.cancel("resp_abc"), "cancel"),
                       (lambda: c.responses.input_items.list("resp_abc"), "input items")):
        e = not_found(call)
        assert e.message.startswith("This gateway keeps no stored responses (store is not supported")
        assert says in e.message and e.code == "stored_responses_not_supported"
    e = not_found(lambda: c.responses.input_tokens.count(model="up-model", input="hi"))
    assert "input token counting" in e.message and e.code == "endpoint_not_supported"
    e = not_found(lambda: c.responses.compact(model="up-model", input="hi"))
    assert "compaction" in e.message and e.code == "endpoint_not_supported"


def test_the_sdks_conversation_methods_say_none_are_kept(gw):
    c = client(gw)
    for call in (lambda: c.conversations.create(),
                 lambda: c.conversations.retrieve("conv_abc"),
                 lambda: c.conversations.update("conv_abc", metadata={"a": "b"}),
                 lambda: c.conversations.delete("conv_abc"),
                 lambda: c.conversations.items.list("conv_abc"),
                 lambda: c.conversations.items.create("conv_abc", items=[]),
                 lambda: c.conversations.items.retrieve("item_abc", conversation_id="conv_abc"),
                 lambda: c.conversations.items.delete("item_abc", conversation_id="conv_abc")):
        e = not_found(call)
        assert e.message.startswith("This gateway keeps no conversations") and e.code == "conversations_not_supported"


def test_every_unserved_route_authenticates_first(gw):
    """No key or a wrong key: the 401 any served route gives, never the 404 (so a wrong key reads as a wrong
    key, not as a missing feature)."""
    with pytest.raises(openai.AuthenticationError):
        client(gw, "wrong-key-0123456789").chat.completions.list()
    with pytest.raises(openai.AuthenticationError):
        client(gw, "wrong-key-0123456789").responses.retrieve("resp_abc")
    with httpx.Client(base_url=gw, timeout=10) as h:
        for route in UNSERVED:
            path = route.path.format(completion_id="c1", response_id="r1", conversation_id="v1", item_id="i1")
            for method in route.methods:
                r = h.request(method, path, json={} if method == "POST" else None)
                assert r.status_code == 401, (method, path, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
                r = h.request(method, path, json={} if method == "POST" else None,
                              headers={"authorization": f"Bearer {KEY}"})
                assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", (method, path)


def test_other_methods_and_paths_keep_their_answers(gw):
    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=gw, timeout=10) as h:
        # a method OpenAI does not have at an unserved path: 405 naming the ones it has
        r = h.put("/v1/chat/completions/c1", headers=auth)
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, POST", r.text
        assert r.json()["error"]["code"] == "method_not_allowed"
        r = h.get("/v1/responses/input_tokens", headers=auth)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        # ... and at a served path: 405 "use POST", as before
        r = h.put("/v1/chat/completions", headers=auth)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        r = h.get("/v1/embeddings", headers=auth)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        # no OpenAI route at all: the unauthenticated "No route" 404
        for path in ("/v1/nothing-here", "/v1/chat/completions/c1/messages/m1", "/v1/chat/completions/"):
            r = h.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
        # a bad body on the unserved POST routes is not read: the answer is the same 404
        r = h.post("/v1/conversations", content=b"\xff{not json", headers={**auth, "content-type": "text/plain"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "conversations_not_supported"
