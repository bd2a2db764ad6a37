"""The adapter registry as the gateway uses it: validated management (the admin routes call it) and a cached
name -> Adapter snapshot for the request path, dropped on every adapter change event of the identity store
(this replica's or another's) and re-read at most `identity.cache_ttl_s` old otherwise."""
from __future__ import annotations

import asyncio
import builtins
import time
from typing import Any, Mapping

from gateway.adapters.model import DESCRIPTION_MAX, NAME_RE, RANK_MAX, SOURCE_MAX, Adapter, source_allowed
from gateway.adapters.store import EDITABLE, AdapterStore, granted
from gateway.config import Config
from gateway.errors import GatewayError
from gateway.identity.model import Conflict, NotFound
from gateway.identity.directory import validate_id
from gateway.identity.service import IdentityService
from gateway.identity.store import SqlIdentityStore, Tx, _lock_row

PREFIXES_MAX = 64
RESERVED = frozenset({"placement"})  # paths under /admin/adapters/ that are not an adapter
# what a tenant admin sees of an engine in the placement view (nothing about other tenants' adapters)
ENGINE_FIELDS = ("backend", "max_loras", "load_s", "load_learned", "read_age_s")
ADAPTER_FIELDS = ("name", "inflight", "idle_s")


def bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request")


def not_found() -> GatewayError:
    return GatewayError(404, "Adapter not found.", code="not_found")


def validate_name(cfg: Config, name: Any) -> str:
    """A name clients can send as `model` that no alias or base model of the config already means (a name the
    config serves only as some backend's static LoRA adapter may be registered: that claims it)."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise bad("name must be 1-128 chars of letters, digits, '.', '_', ':', '/', '-' starting with a letter "
                  "or digit.", "name")
    if name in RESERVED:
        raise bad(f"name {name!r} is reserved (GET /admin/adapters/{name} is the placement view).", "name")
    if name in cfg.aliases:
        raise bad(f"name {name!r} is an alias of the config.", "name")
    if name in cfg.models and not any(name in b.lora_adapters for b in cfg.backends if name in b.models):
        raise bad(f"name {name!r} is a model the config serves, not a LoRA adapter.", "name")
    return name


def validate_source(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > SOURCE_MAX:
        raise bad(f"source must be a path or URI of 1-{SOURCE_MAX} characters.", "source")
    return value


def validate_rank(value: Any) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= RANK_MAX):
        raise bad(f"rank must be an integer from 1 to {RANK_MAX}.", "rank")
    return value


def validate_description(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > DESCRIPTION_MAX:
        raise bad(f"description must be a string of at most {DESCRIPTION_MAX} characters.", "description")
    return value


def validate_prefixes(value: Any) -> list[str]:
    if (not isinstance(value, list) or len(value) > PREFIXES_MAX
            or not all(isinstance(x, str) and 0 < len(x) <= SOURCE_MAX for x in value)):
        raise bad(f"prefixes must be a list of at most {PREFIXES_MAX} non-empty strings.", "prefixes")
    for x in value:
        if not source_allowed(x, [x]):  # the same path rules as a source: no '.'/'..' segments
            raise bad(f"prefix {x!r} has a '.' or '..' segment, a backslash or a control character.", "prefixes")
    return list(value)


def source_refused(source: str) -> GatewayError:
    return GatewayError(403, f"source {source!r} is not under a prefix granted to the owner tenant.",
                        code="adapter_source_forbidden", param="source")


class AdapterService:
    def __init__(self, identity: IdentityService) -> None:
        self.identity = identity
        self.store: AdapterStore | None = None
        self._snap: dict[str, Adapter] | None = None
        self._loaded_at = 0.0
        self._gen = 0
        self._lock = asyncio.Lock()
        self.placement: Any = None  # gateway.adapters.placement.Placement (wired with the adapters)

    @property
    def config(self) -> Config:
        return self.identity.config

    async def start(self) -> None:
        """After the identity service (it opens the store): create the tables, listen for changes."""
        s = self.identity.store
        assert isinstance(s, SqlIdentityStore), "the adapter registry needs a SQL identity store"
        self.store = AdapterStore(s)
        await self.store.migrate()
        await s.listen(self._on_event)

    async def close(self) -> None:
        return None

    def check_config(self, config: Config) -> None:
        """A reload (gateway.app.Reloadable): nothing to check; the registry lives in the identity store."""

    def swap_config(self, config: Config) -> None:
        """Nothing to swap: `config()` reads the identity service's current config."""

    def _on_event(self, event: str) -> None:
        if event == "*" or event.startswith("adapter:"):
            self._gen += 1
            self._snap = None

    def _s(self) -> AdapterStore:
        assert self.store is not None, "AdapterService.start() was not awaited"
        return self.store

    async def registry(self) -> Mapping[str, Adapter]:
        """name -> adapter, for the request path (cached; see the module doc)."""
        snap = self._snap
        if snap is not None and time.monotonic() - self._loaded_at < self.identity.cache_ttl_s:
            return snap
        async with self._lock:
            if self._snap is not None and time.monotonic() - self._loaded_at < self.identity.cache_ttl_s:
                return self._snap
            gen = self._gen
            fresh = {a.name: a for a in await self._s().list()}
            if gen == self._gen:  # no change event raced the read: keep it
                self._snap, self._loaded_at = fresh, time.monotonic()
            return fresh

    # ---- management
    async def set_prefixes(self, tenant: str, prefixes: Any) -> list[str]:
        try:
            return await self._s().set_prefixes(tenant, validate_prefixes(prefixes))
        except NotFound as e:
            raise GatewayError(404, str(e), code="not_found") from None

    async def prefixes(self, tenant: str) -> list[str]:
        return await self._s().prefixes(tenant)

    async def create(self, tenant: str, body: Mapping[str, Any]) -> Adapter:
        """Register an adapter owned by `tenant` (the caller's scope was checked by the route)."""
        name = validate_name(self.config, body.get("name"))
        base = body.get("base_model")
        if not isinstance(base, str) or base not in self.config.models:
            raise bad("base_model must be a model a backend of this gateway serves.", "base_model")
        source = validate_source(body.get("source"))
        owner = body.get("owner") or {}
        team = owner.get("team")
        project = owner.get("project")
        team = None if team is None else validate_id(team, "owner.team")
        project = None if project is None else validate_id(project, "owner.project")
        if project is not None and team is None:
            raise bad("owner.project needs owner.team.", "owner.project")
        now = time.time()
        a = Adapter(name=name, base_model=base, source=source, tenant=tenant, team=team, project=project,
                    rank=validate_rank(body.get("rank")), description=validate_description(body.get("description")),
                    created_at=now, updated_at=now)

        async def check(tx: Tx) -> None:
            if not await _lock_row(tx, "tenants", "id = ?", tenant):
                raise NotFound(f"tenant {tenant!r} does not exist")
            if team is not None and not await _lock_row(tx, "teams", "tenant = ? AND id = ?", tenant, team):
                raise NotFound(f"team {team!r} does not exist in tenant {tenant!r}")
            if project is not None and not await _lock_row(tx, "projects", "tenant = ? AND team = ? AND id = ?",
                                                           tenant, team, project):
                raise NotFound(f"project {project!r} does not exist in team {team!r}")
            if not source_allowed(source, await granted(tx, tenant)):
                raise source_refused(source)

        try:
            made = await self._s().create(a, check)
            if self.placement is not None:
                self.placement.registered(name)
            return made
        except Conflict:
            raise GatewayError(409, f"An adapter named {name!r} already exists.", code="conflict",
                               param="name") from None
        except NotFound as e:
            raise GatewayError(404, str(e), code="not_found") from None

    async def get(self, name: str) -> Adapter | None:
        return await self._s().get(name)

    async def list(self, tenant: str | None) -> list[Adapter]:
        return await self._s().list(tenant)

    async def update(self, name: str, body: Mapping[str, Any]) -> Adapter | None:
        bad_fields = sorted(set(body) - set(EDITABLE))
        if bad_fields:
            raise bad(f"Only {', '.join(EDITABLE)} can be changed; not {', '.join(bad_fields)} (register a new "
                      "adapter for another base model or owner).", bad_fields[0])
        changes: dict[str, Any] = {}
        if "source" in body:
            changes["source"] = validate_source(body["source"])
        if "rank" in body:
            changes["rank"] = validate_rank(body["rank"])
        if "description" in body:
            changes["description"] = validate_description(body["description"])

        async def check(tx: Tx, cur: Adapter) -> None:
            if "source" in changes and not source_allowed(changes["source"], await granted(tx, cur.tenant)):
                raise source_refused(changes["source"])

        return await self._s().update(name, changes, check)

    async def placement_view(self, tenant: str | None) -> builtins.list[dict[str, Any]]:
        """Where adapters are resident, as this process's placement believes (`Placement.snapshot`), one entry per
        dynamic engine of the config (an engine not used yet: no adapters, `read_age_s` None), each adapter with
        its registration's `base_model` and `owner`. `tenant` None: every adapter (one no longer registered, e.g.
        deleted and waiting for its requests to finish, with `owner` None); a tenant: only that tenant's adapters,
        the others left out entirely, and only ENGINE_FIELDS and ADAPTER_FIELDS."""
        snap: builtins.list[dict[str, Any]] = self.placement.snapshot() if self.placement is not None else []
        reg = {a.name: a for a in await self.list(tenant)}  # the store, not the cache: an admin view is exact
        seen = {e.get("backend") for e in snap}
        for b in self.config.backends:  # dynamic engines no request has reached yet
            if b.lora is not None and b.lora.dynamic and b.name not in seen:
                snap.append({"backend": b.name, "max_loras": b.lora.max_loras, "load_s": None,
                             "load_learned": False, "read_age_s": None, "adapters": []})
        out = []
        for e in sorted(snap, key=lambda x: str(x.get("backend"))):
            view = dict(e) if tenant is None else {k: e.get(k) for k in ENGINE_FIELDS}
            ads = []
            for x in e.get("adapters") or []:
                a = reg.get(x.get("name"))
                if a is None and tenant is not None:
                    continue
                own = dict(x) if tenant is None else {k: x.get(k) for k in ADAPTER_FIELDS}
                ads.append({**own, "base_model": a.base_model if a else None,
                            "owner": {"tenant": a.tenant, "team": a.team, "project": a.project} if a else None})
            view["adapters"] = ads
            out.append(view)
        return out

    async def delete(self, name: str) -> bool:
        gone = await self._s().delete(name)
        if gone and self.placement is not None:  # unload its copies on dynamic engines once requests finish
            await self.placement.forget(name)
        return gone
