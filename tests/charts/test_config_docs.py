"""docs/configuration.md is exactly what scripts/gen_config_docs.py generates from the config Structs."""
from __future__ import annotations

import importlib.util

from tests.charts.conftest import ROOT


def _gen():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_configuration_md_is_generated_and_current() -> None:
    text = _gen().render()
    assert (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8") == text, \
        "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


def test_every_config_field_is_documented() -> None:
    import msgspec.inspect as mi

    from gateway.config import GatewayConfigRaw

    text = _gen().render()
    seen: set[type] = set()

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        for f in mi.type_info(cls).fields:
            assert f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name} missing from the reference"
            for sub in _gen()._structs(f.type):
                walk(sub)

    walk(GatewayConfigRaw)
    assert len(seen) >= 15
