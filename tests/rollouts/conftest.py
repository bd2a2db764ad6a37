"""A config with one weighted alias over the identity store (SQLite or Postgres), as the identity tests build it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import Config, parse_config
from tests.identity.conftest import PG_DSN, pg_schema  # noqa: F401 (the fixture: a fresh schema, dropped after)


def rollout_config(tmp_path: Path, store: str = "sqlite", schema: str | None = None, **alias: Any) -> Config:
    ident: dict[str, Any] = {"store": store, "sqlite_path": str(tmp_path / "identity.db")}
    if store == "postgres":
        ident.update(postgres_dsn=PG_DSN, postgres_schema=schema)
    data = {
        "identity": ident,
        "admin": {"key": "admin-" + "x" * 32},
        "backends": [{"name": "b1", "url": "http://127.0.0.1:9/v1", "models": ["support-v1", "support-v2"]}],
        "aliases": [{"name": "support", **{"targets": [{"model": "support-v2", "weight": 5},
                                                       {"model": "support-v1", "weight": 95}], **alias}}],
    }
    return parse_config(yaml.safe_dump(data), source="test.yaml", base_dir=tmp_path)


@pytest.fixture(params=["sqlite", "postgres"])
def config_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Configs that share one store (the same SQLite file or the same Postgres schema): replicas."""
    schema = request.getfixturevalue("pg_schema") if request.param == "postgres" else None
    return lambda **alias: rollout_config(tmp_path, request.param, schema, **alias)
