"""The identity directory: tenants, teams, projects, partners and API keys, created, read, edited, revoked and
rotated for the admin API (gateway/identity/admin.py) and the CLI, over the identity store. Apart from the
authenticator (gateway/identity/service.py, the per-request hot path): a change here tells it, through `changed`,
what it may have cached stale (every replica learns the same from the store's change events).

Every input is validated here, field by field (400 naming the field); a record may only tighten a restriction
label its parents set (403 `restriction_loosened`); a record with dependents is not deleted (409)."""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, Mapping

from gateway.errors import GatewayError
from gateway.identity import keys as keyfmt
from gateway.identity.clock import Clock
from gateway.identity.model import ApiKey, Conflict, InUse, NotEditable, NotFound, Partner, Project, Team, Tenant
from gateway.identity.restrictions import DEFAULT as DEFAULT_RESTRICTIONS
from gateway.identity.restrictions import Restrictions
from gateway.identity.store import IdentityStore

log = logging.getLogger("gateway.identity")

_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request")


def merge_labels(*levels: Mapping[str, str] | None, restrictions: Restrictions = DEFAULT_RESTRICTIONS
                 ) -> dict[str, str]:
    """Labels merged tenant -> ... -> key; later levels win, except that a restriction label (residency,
    retention, labels the policy restricts on) set above can only be tightened below (restrictions.py)."""
    return restrictions.merge(*levels)


def loosening_error(label: str, above: Mapping[str, str]) -> GatewayError:
    return GatewayError(
        403, f"Label '{label}' is '{above[label][:64]}' at a higher scope; a lower record may only tighten a "
             "restriction label, never loosen it (docs/identity.md, Restriction labels).",
        code="restriction_loosened", param=f"labels.{label}")


def validate_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise _bad(f"{what} must be 1-64 chars of a-z, 0-9, '_', '.', '-' starting with a letter or digit.",
                   param=what)
    return value


NAME_MAX = 256
MAX_OVERLAP_S = 30 * 86400.0  # a rotation overlap longer than 30 days is a second key, not an overlap


def validate_name(value: Any, default: str) -> str:
    """A record's display name: a string of 1-256 characters; absent, null or "" take `default` (the id)."""
    if value is None or value == "":
        return default
    if not isinstance(value, str) or len(value) > NAME_MAX:
        raise _bad(f"name must be a string of 1-{NAME_MAX} characters.", param="name")
    return value


def validate_labels(value: Any, what: str = "labels") -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= 64 and len(v) <= 256 for k, v in value.items()):
        raise _bad(f"{what} must map strings (<=64 chars) to strings (<=256 chars).", param=what)
    return dict(value)


def validate_str_list(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(x, str) and 0 < len(x) <= 128 for x in value):
        raise _bad(f"{what} must be a list of strings.", param=what)
    return list(value)


# What an update (admin PATCH) may change. Ids, parents, purpose and the secret never change: a key in another
# place or with another purpose is a new key (create + revoke, or rotate).
HIER_EDITABLE = ("name", "labels")
KEY_EDITABLE = ("name", "labels", "scopes", "models", "expires_at")


def validate_changes(changes: Mapping[str, Any], editable: tuple[str, ...], now: float) -> dict[str, Any]:
    """An update body checked field by field: 400 naming the first offending field. `labels` replaces the whole
    label set; null clears labels/scopes/models (empty `models` = no model restriction) and `expires_at`."""
    out: dict[str, Any] = {}
    for f, v in changes.items():
        if f not in editable:
            raise _bad(f"Field '{f[:64]}' cannot be changed; editable fields: {', '.join(editable)}.", param=f[:64])
        if f == "name":
            if not isinstance(v, str) or not 0 < len(v) <= NAME_MAX:
                raise _bad(f"name must be a string of 1-{NAME_MAX} characters.", param="name")
            out[f] = v
        elif f == "labels":
            out[f] = validate_labels(v)
        elif f in ("scopes", "models"):
            out[f] = validate_str_list(v, f)
        elif f == "expires_at":
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= now):
                raise _bad("expires_at must be a future unix time, or null for no expiry.", param="expires_at")
            out[f] = None if v is None else float(v)
    return out


def in_use(what: str, e: InUse) -> GatewayError:
    deps = ", ".join(f"{n} {kind[:-1] if n == 1 and kind.endswith('s') else kind}" for kind, n in e.dependents.items())
    return GatewayError(409, f"{what} still has {deps} attached; delete those (revoke keys) first.",
                        code="resource_in_use")


class Directory:
    """The CRUD of the identity records. `store`, `restrictions` and `rotation_overlap_s` are read when used (the
    store opens at start; a policy or config reload replaces the others); `changed` gets each change's event
    name ("tenant:<id>", "key:<id>", ...), applied at once in this process."""

    def __init__(self, store: Callable[[], IdentityStore | None], clock: Clock,
                 restrictions: Callable[[], Restrictions], changed: Callable[[str], None],
                 rotation_overlap_s: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._restrictions = restrictions
        self._changed = changed
        self._rotation_overlap_s = rotation_overlap_s

    def _s(self) -> IdentityStore:
        store = self._store()
        assert store is not None, "IdentityService.start() was not awaited"
        return store

    async def _above(self, tenant: str, team: str | None = None, project: str | None = None,
                     partner: str | None = None) -> dict[str, str]:
        """The merged labels of a record's parents, read from the store now (not the hot-path cache)."""
        s = self._s()
        t = await s.get_tenant(tenant)
        pa = await s.get_partner(partner) if partner else None
        tm = await s.get_team(tenant, team) if team else None
        pr = await s.get_project(tenant, team, project) if team and project else None
        return merge_labels(t.labels if t else None, pa.labels if pa else None, tm.labels if tm else None,
                            pr.labels if pr else None, restrictions=self._restrictions())

    def _check_tightens(self, above: Mapping[str, str], labels: Mapping[str, str] | None) -> None:
        bad = self._restrictions().loosened(above, labels)
        if bad is not None:
            raise loosening_error(bad, above)

    async def _guard(self, coro: Any) -> Any:
        try:
            return await coro
        except Conflict:
            raise GatewayError(409, "A resource with this id already exists.", code="conflict") from None
        except NotFound as e:
            raise GatewayError(404, str(e), code="not_found") from None

    async def create_tenant(self, tenant_id: str, name: Any = "", labels: dict[str, str] | None = None) -> Tenant:
        t = Tenant(validate_id(tenant_id, "id"), validate_name(name, tenant_id), validate_labels(labels), self._clock.time())
        return await self._guard(self._s().create_tenant(t))

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        return await self._s().get_tenant(tenant_id)

    async def list_tenants(self) -> list[Tenant]:
        return await self._s().list_tenants()

    async def update_tenant_labels(self, tenant_id: str, labels: dict[str, str]) -> Tenant | None:
        return await self.update_tenant(tenant_id, {"labels": labels})

    # Updates and deletes publish their change event in the store's transaction (every replica drops what it
    # cached); this replica also applies it synchronously, so its next request already sees the change.
    async def update_tenant(self, tenant_id: str, changes: Mapping[str, Any]) -> Tenant | None:
        t = await self._s().update_tenant(tenant_id, validate_changes(changes, HIER_EDITABLE, self._clock.time()))
        self._changed(f"tenant:{tenant_id}")
        return t

    async def delete_tenant(self, tenant_id: str) -> bool:
        """Remove a tenant with no teams, projects, partners or unrevoked keys (else 409). False if unknown."""
        try:
            done = await self._s().delete_tenant(tenant_id)
        except InUse as e:
            raise in_use(f"Tenant '{tenant_id}'", e) from None
        self._changed(f"tenant:{tenant_id}")
        if done:
            log.info("tenant %s deleted", tenant_id)
        return done

    async def create_team(self, tenant: str, team_id: str, name: Any = "",
                          labels: dict[str, str] | None = None) -> Team:
        t = Team(tenant, validate_id(team_id, "id"), validate_name(name, team_id), validate_labels(labels), self._clock.time())
        self._check_tightens(await self._above(tenant), t.labels)
        return await self._guard(self._s().create_team(t))

    async def get_team(self, tenant: str, team_id: str) -> Team | None:
        return await self._s().get_team(tenant, team_id)

    async def list_teams(self, tenant: str) -> list[Team]:
        return await self._s().list_teams(tenant)

    async def update_team(self, tenant: str, team_id: str, changes: Mapping[str, Any]) -> Team | None:
        ch = validate_changes(changes, HIER_EDITABLE, self._clock.time())
        if "labels" in ch:
            self._check_tightens(await self._above(tenant), ch["labels"])
        t = await self._s().update_team(tenant, team_id, ch)
        self._changed(f"team:{tenant}/{team_id}")
        return t

    async def delete_team(self, tenant: str, team_id: str) -> bool:
        """Remove a team with no projects or unrevoked keys (else 409). False if unknown."""
        try:
            done = await self._s().delete_team(tenant, team_id)
        except InUse as e:
            raise in_use(f"Team '{team_id}'", e) from None
        self._changed(f"team:{tenant}/{team_id}")
        if done:
            log.info("team %s/%s deleted", tenant, team_id)
        return done

    async def create_project(self, tenant: str, team: str, project_id: str, name: Any = "",
                             labels: dict[str, str] | None = None) -> Project:
        p = Project(tenant, validate_id(team, "team"), validate_id(project_id, "id"), validate_name(name, project_id),
                    validate_labels(labels), self._clock.time())
        self._check_tightens(await self._above(tenant, team), p.labels)
        return await self._guard(self._s().create_project(p))

    async def get_project(self, tenant: str, team: str, project_id: str) -> Project | None:
        return await self._s().get_project(tenant, team, project_id)

    async def list_projects(self, tenant: str, team: str | None = None) -> list[Project]:
        return await self._s().list_projects(tenant, team)

    async def update_project(self, tenant: str, team: str, project_id: str,
                             changes: Mapping[str, Any]) -> Project | None:
        ch = validate_changes(changes, HIER_EDITABLE, self._clock.time())
        if "labels" in ch:
            self._check_tightens(await self._above(tenant, team), ch["labels"])
        p = await self._s().update_project(tenant, team, project_id, ch)
        self._changed(f"project:{tenant}/{team}/{project_id}")
        return p

    async def delete_project(self, tenant: str, team: str, project_id: str) -> bool:
        """Remove a project with no unrevoked keys (else 409). False if unknown."""
        try:
            done = await self._s().delete_project(tenant, team, project_id)
        except InUse as e:
            raise in_use(f"Project '{project_id}'", e) from None
        self._changed(f"project:{tenant}/{team}/{project_id}")
        if done:
            log.info("project %s/%s/%s deleted", tenant, team, project_id)
        return done

    async def create_partner(self, partner_id: str, tenant: str, name: Any = "",
                             labels: dict[str, str] | None = None) -> Partner:
        p = Partner(validate_id(partner_id, "id"), validate_id(tenant, "tenant"), validate_name(name, partner_id),
                    validate_labels(labels), self._clock.time())
        self._check_tightens(await self._above(tenant), p.labels)
        return await self._guard(self._s().create_partner(p))

    async def get_partner(self, partner_id: str) -> Partner | None:
        return await self._s().get_partner(partner_id)

    async def list_partners(self, tenant: str | None = None) -> list[Partner]:
        return await self._s().list_partners(tenant)

    async def update_partner(self, partner_id: str, changes: Mapping[str, Any]) -> Partner | None:
        ch = validate_changes(changes, HIER_EDITABLE, self._clock.time())
        if "labels" in ch:
            cur = await self._s().get_partner(partner_id)
            if cur is not None:
                self._check_tightens(await self._above(cur.tenant), ch["labels"])
        p = await self._s().update_partner(partner_id, ch)
        self._changed(f"partner:{partner_id}")
        return p

    async def delete_partner(self, partner_id: str) -> bool:
        """Remove a partner with no unrevoked keys (else 409). False if unknown."""
        try:
            done = await self._s().delete_partner(partner_id)
        except InUse as e:
            raise in_use(f"Partner '{partner_id}'", e) from None
        self._changed(f"partner:{partner_id}")
        if done:
            log.info("partner %s deleted", partner_id)
        return done

    async def create_key(self, tenant: str, *, team: str | None = None, project: str | None = None,
                         partner: str | None = None, name: Any = "", purpose: str = "data",
                         labels: dict[str, str] | None = None, scopes: list[str] | None = None,
                         models: list[str] | None = None, expires_at: float | None = None,
                         rotated_from: str | None = None) -> tuple[ApiKey, str]:
        """Create a key; returns the record and the full secret key string (shown once, never stored)."""
        if purpose not in ("data", "admin"):
            raise _bad("purpose must be 'data' or 'admin'.", param="purpose")
        if expires_at is not None and (not isinstance(expires_at, (int, float)) or expires_at <= self._clock.time()):
            raise _bad("expires_at must be a future unix time.", param="expires_at")
        validate_id(tenant, "tenant")
        for what, v in (("team", team), ("project", project), ("partner", partner)):
            if v is not None:
                validate_id(v, what)
        if project is not None and team is None:
            raise _bad("A project key needs its team.", param="team")
        secret = keyfmt.new_secret()
        k = ApiKey(id=keyfmt.new_key_id(), tenant=tenant, secret_hash=keyfmt.hash_secret(secret), team=team,
                   project=project, partner=partner, name=validate_name(name, ""), purpose=purpose,
                   labels=validate_labels(labels), scopes=validate_str_list(scopes, "scopes"),
                   models=validate_str_list(models, "models"), created_at=self._clock.time(),
                   expires_at=float(expires_at) if expires_at is not None else None, rotated_from=rotated_from)
        self._check_tightens(await self._above(tenant, team, project, partner), k.labels)
        await self._guard(self._s().create_key(k))
        self._changed(f"key:{k.id}")
        log.info("api key %s created for tenant %s", k.id, tenant)
        return k, keyfmt.format_key(k.id, secret)

    async def get_key(self, key_id: str) -> ApiKey | None:
        return await self._s().get_key(key_id)

    async def list_keys(self, tenant: str | None = None) -> list[ApiKey]:
        return await self._s().list_keys(tenant)

    async def update_key(self, key_id: str, changes: Mapping[str, Any]) -> ApiKey | None:
        """Edit name/labels/scopes/models/expires_at; 409 for a revoked key or the expiry of a rotated one."""
        ch = validate_changes(changes, KEY_EDITABLE, self._clock.time())
        if "labels" in ch:
            cur = await self._s().get_key(key_id)
            if cur is not None:
                self._check_tightens(await self._above(cur.tenant, cur.team, cur.project, cur.partner), ch["labels"])
        try:
            k = await self._s().update_key(key_id, ch)
        except NotEditable as e:
            raise GatewayError(409, str(e), code="conflict") from None
        self._changed(f"key:{key_id}")
        if k is not None and ch:
            log.info("api key %s updated (%s)", key_id, ", ".join(sorted(ch)))
        return k

    async def revoke_key(self, key_id: str) -> ApiKey | None:
        k = await self._s().revoke_key(key_id, self._clock.time())
        self._changed(f"key:{key_id}")
        if k is not None:
            log.info("api key %s revoked", key_id)
        return k

    async def rotate_key(self, key_id: str, overlap_s: float | None = None) -> tuple[ApiKey, str] | None:
        """A successor with the same attributes; the old key keeps working for `overlap_s`, then expires.
        None when the key does not exist, is revoked or was already rotated."""
        old = await self._s().get_key(key_id)
        if old is None:
            return None
        if overlap_s is not None and (isinstance(overlap_s, bool) or not isinstance(overlap_s, (int, float))
                                      or not 0 <= overlap_s <= MAX_OVERLAP_S):  # NaN fails both comparisons
            raise _bad(f"overlap_s must be a number of seconds in [0, {MAX_OVERLAP_S:.0f}] (30 days).",
                       param="overlap_s")
        overlap = self._rotation_overlap_s() if overlap_s is None else float(overlap_s)
        secret = keyfmt.new_secret()
        now = self._clock.time()
        new = dataclasses_replace_key(old, id=keyfmt.new_key_id(), secret_hash=keyfmt.hash_secret(secret),
                                      created_at=now, revoked_at=None, rotated_from=old.id, rotated_to=None)
        done = await self._guard(self._s().rotate_key(old.id, new, now + overlap))
        self._changed(f"key:{old.id}")
        self._changed(f"key:{new.id}")
        if done is None:
            return None
        log.info("api key %s rotated to %s (overlap %.0fs)", old.id, new.id, overlap)
        return new, keyfmt.format_key(new.id, secret)


def dataclasses_replace_key(k: ApiKey, **changes: Any) -> ApiKey:
    import msgspec

    return msgspec.structs.replace(k, **changes)
