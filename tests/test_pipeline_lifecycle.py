"""Lifecycle and Pipeline (gateway/pipeline.py): finish exactly once whatever path a request takes, dispatch as
the terminal stage, a prepared answer skipping straight to dispatch, and the refusing stage named."""
from __future__ import annotations

import asyncio

import pytest

from gateway.completion import Completion, Step, finish_of
from gateway.errors import GatewayError
from gateway.pipeline import Lifecycle, Pipeline, RequestContext
from tests.support.wait import async_wait_until


class Rec:
    """A stage that records its runs and finishes into a shared log; optionally refuses or answers."""

    def __init__(self, name: str, log: list[str], refuse: bool = False, answer: object = None) -> None:
        self.name, self.log, self.refuse, self.answer = name, log, refuse, answer

    async def run(self, ctx: RequestContext) -> None:
        self.log.append(f"run:{self.name}")
        if self.refuse:
            raise GatewayError(429, "no", code="refused_here")
        if self.answer is not None:
            ctx.answer = self.answer

    async def finish(self, ctx: RequestContext) -> None:
        self.log.append(f"finish:{self.name}")


class Dispatch(Rec):
    async def run(self, ctx: RequestContext) -> None:
        self.log.append("run:dispatch")
        if self.refuse:
            raise GatewayError(503, "no backend", code="no_backend_available")
        ctx.result = ctx.answer if ctx.answer is not None else "upstream"


def ctx() -> RequestContext:
    return RequestContext(request_id="r", endpoint="chat", headers={}, body={})


def pipeline(log: list[str], **kw: object) -> Pipeline:
    return Pipeline([Rec("a", log), Rec("b", log, refuse=bool(kw.get("refuse_b"))),
                     Rec("c", log, answer=kw.get("answer_c"))],
                    Dispatch("dispatch", log, refuse=bool(kw.get("refuse_dispatch"))))


async def test_success_runs_every_stage_then_dispatch_and_finishes_once_in_reverse() -> None:
    log: list[str] = []
    c = ctx()
    life = Lifecycle(pipeline(log), c)
    assert await life.run() == "upstream"
    await life.finish()
    await life.finish()  # a second finish (stream end and handler exit both call it) does nothing
    assert log == ["run:a", "run:b", "run:c", "run:dispatch",
                   "finish:dispatch", "finish:c", "finish:b", "finish:a"]
    assert set(c.stage_timings_us) == {"a", "b", "c"}  # dispatch's time is the upstream's, not a stage's


async def test_a_refusal_finishes_the_started_stages_once_and_records_the_status() -> None:
    log: list[str] = []
    c = ctx()
    p = pipeline(log, refuse_b=True)
    life = Lifecycle(p, c)
    with pytest.raises(GatewayError):
        await life.run()
    await life.finish()
    assert log == ["run:a", "run:b", "finish:b", "finish:a"]
    assert (c.status, c.error) == (429, "refused_here")
    assert p.refusing_stage(c) == "b"


async def test_a_dispatch_refusal_is_named_dispatch() -> None:
    log: list[str] = []
    c = ctx()
    p = pipeline(log, refuse_dispatch=True)
    with pytest.raises(GatewayError):
        await Lifecycle(p, c).run()
    assert p.refusing_stage(c) == "dispatch"
    assert log[-4:] == ["finish:dispatch", "finish:c", "finish:b", "finish:a"]


async def test_a_prepared_answer_skips_to_dispatch() -> None:
    log: list[str] = []
    p = Pipeline([Rec("a", log, answer="cached"), Rec("b", log)], Dispatch("dispatch", log))
    c = ctx()
    assert await Lifecycle(p, c).run() == "cached"
    assert log == ["run:a", "run:dispatch"]


async def test_finish_is_shielded_from_the_requests_own_cancellation() -> None:
    log: list[str] = []
    gate = asyncio.Event()

    class Slow(Rec):
        async def finish(self, ctx: RequestContext) -> None:
            await gate.wait()
            self.log.append("finish:slow")

    c = ctx()
    life = Lifecycle(Pipeline([Slow("slow", log)], Dispatch("dispatch", log)), c)
    await life.run()
    task = asyncio.ensure_future(life.finish())
    await asyncio.sleep(0)
    task.cancel()  # the client left while the request was settling
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await async_wait_until(lambda: "finish:slow" in log, timeout=2, what="the shielded settle to finish")
    assert "finish:slow" in log  # the settle ran to its end anyway
    await life.finish()
    assert log.count("finish:slow") == 1


class Plain:
    """A stage with no completion work (no finish)."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def run(self, ctx: RequestContext) -> None:
        return None


def test_with_stage_after_copies_without_touching_the_original() -> None:
    log: list[str] = []
    p = pipeline(log)
    q = p.with_stage_after("a", Plain("x"))
    assert [s.name for s in q.stages] == ["a", "x", "b", "c"]
    assert [s.name for s in p.stages] == ["a", "b", "c"]
    assert q.dispatch is p.dispatch
    assert q.completion is p.completion


def test_a_stage_whose_finish_the_completion_list_does_not_name_is_refused_when_built() -> None:
    """A variant (the batch lane's, a shadow copy's) cannot add a stage whose finish would never run."""
    log: list[str] = []
    with pytest.raises(ValueError, match=r"\['x'\]"):
        pipeline(log).with_stage_after("a", Rec("x", log))
    with pytest.raises(ValueError, match="named twice"):
        Completion([finish_of("a"), finish_of("a")])


async def test_the_completion_runs_in_its_declared_order_and_skips_stages_that_did_not_start() -> None:
    """The declared order, not the stage order: hooks run for every request; a stage's finish only where its run
    started (b refused: c never started); a failing step does not stop the later ones."""
    log: list[str] = []

    async def hook(ctx: RequestContext) -> None:
        log.append("hook")

    async def broken(ctx: RequestContext) -> None:
        raise RuntimeError("a finisher's bug")

    stages = [Rec("a", log), Rec("b", log, refuse=True), Rec("c", log)]
    done = Completion([finish_of("c"), Step("broken", broken), finish_of("a"), Step("hook", hook),
                       finish_of("b")])
    p = Pipeline(stages, Plain("dispatch"), done)
    c = ctx()
    with pytest.raises(GatewayError):
        await Lifecycle(p, c).run()
    assert log == ["run:a", "run:b", "finish:a", "hook", "finish:b"]
    assert [s.name for s in p.with_step(Step("probe", hook), after="a").completion.steps] == [
        "c", "broken", "a", "probe", "hook", "b"]


async def test_an_unshielded_lifecycle_defers_a_cancel_until_it_has_settled() -> None:
    """The ingress's lifecycle finishes in the request's own task (no Task per request): a client that leaves
    while it settles (Lifecycle.cancel) cancels the task only once every finisher ran."""
    log: list[str] = []
    gate = asyncio.Event()

    class Slow(Rec):
        async def finish(self, ctx: RequestContext) -> None:
            await gate.wait()
            self.log.append("finish:slow")

    life = Lifecycle(Pipeline([Rec("a", log), Slow("slow", log)], Dispatch("dispatch", log)), ctx(), shielded=False)

    async def request() -> None:
        await life.run()
        await life.finish()
        await asyncio.sleep(1)  # the deferred cancel lands at the first suspension after finish
        log.append("after sleep")

    task = asyncio.ensure_future(request())
    for _ in range(5):
        await asyncio.sleep(0)
    assert life.finishing
    life.cancel(task)  # the client left mid-settle
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log[-2:] == ["finish:slow", "finish:a"] and "after sleep" not in log
    other = asyncio.ensure_future(asyncio.sleep(10))
    life.cancel(other)  # outside a finish a cancel is immediate
    await asyncio.sleep(0)
    assert other.cancelled()
