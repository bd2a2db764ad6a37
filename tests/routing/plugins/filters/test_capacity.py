"""`capacity`: a prompt at or over a backend's context window drops it, with the reason; no window keeps it."""
from gateway.routing.registry import build_plugin, plugin_class
from tests.routing.plugins.helpers import item


def test_capacity_drops_a_backend_whose_context_window_the_prompt_reaches():
    f = build_plugin({"type": "capacity"})
    assert plugin_class("capacity").kind == "filter" and f.name == "capacity"
    assert f.keep(item(context_window=4096), 4095) is None
    assert f.keep(item(context_window=4096), 4096) == "prompt of ~4096 tokens exceeds context window 4096"
    assert f.keep(item(context_window=None), 10**9) is None  # no declared window: kept
