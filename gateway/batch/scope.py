"""Who owns batch files and batches, and the decision an input file was uploaded under.

**Ownership** is the full principal scope that policy tells apart: tenant, team, project, partner and the
restriction labels of the principal (`residency`, `retention` and every label a restricting rule of the loaded
policy matches on: gateway/identity/restrictions.py). Two principals share files and batches only when all of
these are equal: a partner and its tenant, two partners of one tenant, or two keys of one project whose
restriction labels differ, each see only their own. `owner_of` writes the scope as one string; a principal with
no partner and no restriction label gets `tenant/team/project`, the form every row was written with before the
partner and labels were part of it, so such rows stay with exactly that scope.

**The input file's decision.** At upload the file records, per model it names, what policy decided for the
uploader and that request (countries / jurisdiction, retention). A batch over the file is created with that
record (`BatchStore.insert_job` copies it from the file, whoever creates the batch) and every line runs under
the intersection of the record and the line's own decision (`InputFileDecision`, after `decide`): countries
intersect, zero retention stays zero. A file any of whose models is zero-retention makes the whole batch
zero-retention: input deleted at the end, output and error files after `zero_retention_delete_after_s`, and no
content of any of its lines in audit, logs or traces (`RetentionGuard`, which also covers lines refused by
`decide` itself, before `InputFileDecision` ran).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping
from urllib.parse import quote

from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.types import Decision, Principal

ALWAYS_RESTRICTED = ("residency", "retention")
# request headers never handed to policy for the upload's decision (credentials)
_SECRET_HEADERS = frozenset({"authorization", "x-api-key", "cookie", "proxy-authorization"})


def _q(v: str) -> str:
    """One scope component, escaped so that no id or label can forge another scope's string ("-" alone means
    "none" in the legacy form, so a component that is literally "-" is escaped too)."""
    return "%2D" if v == "-" else quote(v, safe="")


def owner_of(p: Principal, restricted: Iterable[str] = ALWAYS_RESTRICTED) -> str:
    """The owner scope of what `p` creates: `tenant/team/project`, then `;partner=<id>` for a partner and
    `;labels=k=v,...` (sorted) for the restriction labels it carries."""
    out = f"{_q(p.tenant)}/{_q(p.team) if p.team else '-'}/{_q(p.project) if p.project else '-'}"
    if p.partner:
        out += f";partner={_q(p.partner)}"
    names = set(restricted)
    labels = sorted((k, v) for k, v in p.labels.items() if k in names)
    if labels:
        out += ";labels=" + ",".join(f"{_q(k)}={_q(v)}" for k, v in labels)
    return out


def upload_headers(headers: Any) -> dict[str, str]:
    """The upload request's headers as policy sees them (lower-case names), without credentials."""
    from gateway.policy.stage import lower_headers

    return {k: v for k, v in lower_headers(headers).items() if k not in _SECRET_HEADERS}


def record_decisions(decisions: Mapping[str, Decision], zero_label: bool = False) -> dict[str, Any]:
    """The JSON kept with an input file: per model its countries (None: anywhere), jurisdiction and retention,
    and whether the file is zero-retention (any model's decision, or the uploader's `retention: zero` label)."""
    models = {m: {"countries": sorted(d.allowed_countries) if d.allowed_countries is not None else None,
                  "jurisdiction": d.jurisdiction, "residency_rule": d.residency_rule,
                  "retention": d.retention, "retention_rule": d.retention_rule}
              for m, d in sorted(decisions.items())}
    zero = zero_label or any(r["retention"] == "zero" for r in models.values())
    return {"v": 1, "models": models, "zero_retention": zero}


def _for_model(restriction: Mapping[str, Any], model: str) -> tuple[frozenset[str] | None, str | None]:
    """(countries, the rule that set them) the record holds for `model`; for a model it does not name (it never
    should: the lines come from the file), the intersection over every model it names."""
    models: Mapping[str, Any] = restriction.get("models") or {}
    r = models.get(model)
    if r is not None:
        c = r.get("countries")
        return (frozenset(c) if c is not None else None), r.get("residency_rule")
    out: frozenset[str] | None = None
    rules = []
    for r in models.values():
        c = r.get("countries")
        if c is not None:
            out = frozenset(c) if out is None else out & frozenset(c)
            rules.append(str(r.get("residency_rule")))
    return out, (",".join(rules) or None)


def _label(countries: frozenset[str]) -> str:
    from gateway.policy.engine import _jurisdiction_label

    return _jurisdiction_label(countries)


def tighten(d: Decision, restriction: Mapping[str, Any] | None, model: str, zero: bool) -> tuple[Decision, list[str]]:
    """`d` narrowed to the input file's recorded decision (never widened) and, with `zero` (the batch is
    zero-retention), retention zero. Returns the decision and what was applied."""
    applied: list[str] = []
    if restriction:
        countries, rule = _for_model(restriction, model)
        if countries is not None:
            have = d.allowed_countries
            new = countries if have is None else have & countries
            if new != have:
                d = dataclasses.replace(d, allowed_countries=new, jurisdiction=_label(new),
                                        residency_rule=",".join(x for x in (d.residency_rule,
                                                                             f"input-file:{rule}") if x))
                applied.append(f"countries: {_label(new)}")
        zero = zero or bool(restriction.get("zero_retention"))
    if zero and d.retention != "zero":
        d = dataclasses.replace(d, retention="zero", retention_rule="input-file:zero-retention")
        applied.append("retention: zero")
    return d, applied


class InputFileDecision:
    """Batch pipeline only, right after `decide`: the line's decision never looser than its input file's
    recorded decision (countries intersect) nor than its batch's zero retention. A line whose file and own
    decision leave no country is refused like any request no backend may serve."""

    name = "batch_input_file"

    def __init__(self, restriction: Mapping[str, Any] | None, zero: bool) -> None:
        self.restriction = restriction
        self.zero = zero

    async def run(self, ctx: RequestContext) -> None:
        if ctx.decision is None:
            return
        d, applied = tighten(ctx.decision, self.restriction, ctx.model, self.zero)
        if not applied:
            return
        ctx.decision = d
        ctx.evidence["decision"] = d.to_evidence()
        ctx.evidence["batch_input_file"] = {"applied": applied}
        if d.allowed_countries is not None and not d.allowed_countries:
            raise GatewayError(403, "The batch's input file was uploaded under a residency that, with this "
                               "request's own, allows no country.", code="residency_unsatisfiable")


class RetentionGuard:
    """Batch pipeline only, right after `observe` (so its finish runs just before the audit record, logs and
    metrics are written): a line of a zero-retention batch or file is zero-retention there even when it was
    refused before `InputFileDecision` ran (by `decide` itself), so none of its content is kept."""

    name = "batch_retention"

    def __init__(self, restriction: Mapping[str, Any] | None, zero: bool) -> None:
        self.zero = zero or bool((restriction or {}).get("zero_retention"))

    async def run(self, ctx: RequestContext) -> None:
        return None

    async def finish(self, ctx: RequestContext) -> None:
        d = ctx.decision
        if self.zero and d is not None and d.retention != "zero":
            ctx.decision = dataclasses.replace(d, retention="zero", retention_rule="input-file:zero-retention")
            if isinstance(ctx.evidence.get("decision"), dict):
                ctx.evidence["decision"]["retention"] = "zero"
