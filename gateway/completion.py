"""What happens after a response, in one declared order: the completion list.

A request's completion is a list of named steps, declared once next to the stage list (gateway/wiring.py) and
frozen with it in the `Pipeline`. A step is either the `finish` of a stage (it settles what that stage's `run`
opened: a budget hold, a routing slot, an adapter hold; it runs only where that stage's run started) or a hook of a
subsystem that runs for every request that entered the pipeline (cost, telemetry, evidence, access log, trace
end). The steps tell each other what they found through the request's typed `Outcome` (gateway/pipeline.py);
`ctx.evidence` is their output only (the audit record).

A stage that has a `finish` must be named in the completion list of every pipeline it is in: building such a
pipeline without it raises, so no stage's finish is forgotten by a new variant (the batch lane's, a shadow copy's).
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext

log = logging.getLogger("gateway.pipeline")

Hook = Callable[["RequestContext"], Awaitable[None]]


class Finishing(Protocol):
    """A stage with completion work (its `finish`)."""

    name: str

    async def finish(self, ctx: RequestContext) -> None: ...


@dataclass(frozen=True, slots=True)
class Step:
    """One step of the completion: `hook` None is the finish of the stage named `name` (skipped where that stage
    did not start); else `hook` runs for every request that entered the pipeline."""

    name: str
    hook: Hook | None = None
    why: str = ""  # what it does and why it is here in the order (rendered in docs/architecture.md)

    @property
    def of_stage(self) -> bool:
        return self.hook is None


def finish_of(name: str, why: str = "") -> Step:
    """The `finish` of the stage named `name`."""
    return Step(name, None, why)


def has_finish(stage: object) -> bool:
    """Whether a stage has completion work (a `finish`): the pipeline checks the completion names it."""
    return callable(getattr(type(stage), "finish", None))


class Completion:
    """The ordered completion steps of a pipeline (frozen; `with_step` returns a copy)."""

    __slots__ = ("steps", "_stage_steps")

    def __init__(self, steps: Iterable[Step]) -> None:
        self.steps: tuple[Step, ...] = tuple(steps)
        names = [s.name for s in self.steps]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"completion steps named twice: {sorted(dup)}")
        self._stage_steps = frozenset(s.name for s in self.steps if s.of_stage)

    def names_stage(self, name: str) -> bool:
        return name in self._stage_steps

    def with_step(self, step: Step, after: str) -> Completion:
        """A copy with `step` right after the step named `after` (a test's probe, an extension's hook)."""
        names = [s.name for s in self.steps]
        at = names.index(after) + 1
        return Completion([*self.steps[:at], step, *self.steps[at:]])

    async def run(self, ctx: RequestContext, started: Sequence[Any]) -> None:
        """Every step in order: a stage's finish where that stage started, every hook. A step that fails is
        logged and never stops the others (a budget must settle even when the audit write fails)."""
        ran: dict[str, Finishing] = {st.name: st for st in started}
        for step in self.steps:  # a stage step names a stage with a finish (the Pipeline checks it when built)
            if step.hook is not None:
                fn: Hook = step.hook
            else:
                stage = ran.get(step.name)
                if stage is None:
                    continue
                fn = stage.finish
            try:
                await fn(ctx)
            except Exception:
                log.exception("completion step %s failed for %s", step.name, ctx.request_id)


def render_table(steps: Sequence[Step]) -> str:
    """The completion list as docs/architecture.md shows it (one row per step, in order)."""
    rows = [f"| `{s.name}` | {'stage finish' if s.of_stage else 'hook'} | {s.why} |" for s in steps]
    return "\n".join(["| step | kind | what and why here |", "|---|---|---|", *rows])
