"""The device agent's plan cache: the planner's answers never sit on a request's TTFT path once a
plan exists, are refreshed in the background, and are asked with this device's own A."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
import pytest

from services.device_agent import settings as device_settings
from services.device_agent.agent import ASYNC_RETRY_EVERY, DeviceAgent
from services.device_agent.app import create_app
from services.device_agent.plans import PROVISIONAL_REFRESH_S, PlanCache, wire_bytes_per_token
from shared.planning.draft_budget import SLOWDOWN_RANGE
from shared.wire.schema import WireDtype
from tests.mesh_tools import verifier_on_loopback

PLANNER = "http://planner"


@pytest.fixture(scope="module")
def tiny_llama_checkpoint(tiny_llama_dir):
    from shared.model.checkpoint import load_checkpoint

    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


class FakePlanner(httpx.AsyncBaseTransport):
    """Answers like the chunk planner, counts calls, and can be held (a planner that hangs)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.released = asyncio.Event()
        self.released.set()
        self.chunk = 48
        self.chunk_source = "eq3"
        self.shape = "chain"  # POST /draft-budget's answer
        self.tokens_per_s: dict[str, float] = {}  # and its predictions (none: no trials)
        self.modelled: dict[str, float] = {}  # and its round model's rates (none: no slowdown measured)
        self.budget_asks: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        self.calls.append((request.url.path, params))
        await self.released.wait()
        if request.url.path == "/draft-budget":
            self.budget_asks.append(json.loads(await request.aread()))
            answer = {"shape": self.shape, "source": "budget", "tokens_per_s": self.tokens_per_s}
            return httpx.Response(200, json={**answer, "modelled_tokens_per_s": self.modelled})
        if request.url.path == "/chunk-size":
            return httpx.Response(200, json={"chunk_size": self.chunk, "source": self.chunk_source})
        rows = int(params["draft_len"])
        return httpx.Response(
            200, json={"steps": rows, "source": "eq6", "steps_by_draft_len": [n // 2 for n in range(rows + 1)]}
        )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def planned_agent(checkpoint, planner: FakePlanner, clock: Clock, **overrides):
    """A device agent on a loopback verifier whose planner is `planner`, and an HTTP client for its API."""
    async with verifier_on_loopback(checkpoint, 2) as (_, url):
        settings = device_settings.Settings(
            model_dir=str(checkpoint.path),
            split_layers=2,
            adapter="random",
            verifier_url=url,
            wire_dtype="f4",
            chunk_planner_url=PLANNER,
            bandwidth_probe_interval_s=0,
            rtt_probe_interval_s=0,
            **overrides,
        )
        agent = await asyncio.to_thread(DeviceAgent, settings)
        agent.plans.http = httpx.AsyncClient(transport=planner)
        agent.plans.clock = clock
        app = create_app(settings, agent)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://device", timeout=60
            ) as http:
                yield settings, agent, http


def cache(planner: FakePlanner, clock: Clock, timeout_s: float = 1.0) -> PlanCache:
    http = httpx.AsyncClient(transport=planner)
    return PlanCache(
        http,
        PLANNER,
        "dev-7",
        bytes_per_token=wire_bytes_per_token(576, WireDtype.F32),
        max_prompt_tokens=4096,
        max_rows=9,
        default_chunk_size=128,
        default_steps=2,
        refresh_s=5.0,
        timeout_s=timeout_s,
        clock=clock,
    )


async def test_cached_plan_is_used_and_refreshed_in_the_background() -> None:
    planner, clock = FakePlanner(), Clock()
    plans = cache(planner, clock)
    first = await plans.current()  # no plan yet: this one request waits for it
    assert len(planner.calls) == 2
    assert {p["bytes_per_token"] for _, p in planner.calls} == {str(576 * 4)}  # the device's own A
    assert dict(planner.calls)["/parallel-draft-steps"]["draft_len"] == "9"  # max_draft + 1 rows
    assert (first.chunk_for(1000), first.chunk_for(20), first.steps_for(3), first.steps_for(50)) == (48, 20, 1, 4)

    clock.now += 4.0  # fresh: no planner call at all
    assert await plans.current() is first and len(planner.calls) == 2

    clock.now += 2.0  # old: the old plan now, a refresh in the background (held: the planner hangs)
    planner.released.clear()
    planner.chunk = 96
    assert await asyncio.wait_for(plans.current(), 0.5) is first
    assert plans.refreshing is not None
    assert await plans.current() is first and plans.refreshing is not None  # one refresh at a time
    planner.released.set()
    await asyncio.wait_for(asyncio.shield(plans.refreshing), 2.0)
    assert len(planner.calls) == 4 and (await plans.current()).chunk_for(1000) == 96
    await plans.aclose()


async def test_a_plan_the_planner_answered_by_default_is_asked_again_soon() -> None:
    """Before the monitor has this device's telemetry the planner answers `default:...`: such a plan is asked
    again after PROVISIONAL_REFRESH_S, not after the whole refresh interval; an answer from telemetry keeps
    the interval."""
    planner, clock = FakePlanner(), Clock()
    planner.chunk_source = "default:no-telemetry"
    plans = cache(planner, clock)
    first = await plans.current()
    assert first.provisional
    clock.now += PROVISIONAL_REFRESH_S
    planner.chunk_source = "eq3"
    assert await plans.current() is first and plans.refreshing is not None
    await asyncio.wait_for(asyncio.shield(plans.refreshing), 2.0)
    measured = await plans.current()
    assert measured is not first and not measured.provisional
    clock.now += PROVISIONAL_REFRESH_S
    assert await plans.current() is measured and plans.refreshing is None
    await plans.aclose()


async def test_concurrent_first_requests_share_one_planner_fetch() -> None:
    planner, clock = FakePlanner(), Clock()
    planner.released.clear()
    plans = cache(planner, clock)
    waiting = [asyncio.create_task(plans.current()) for _ in range(5)]
    await asyncio.sleep(0.05)
    waiting[0].cancel()  # a client that leaves does not cancel the fetch the others wait for
    planner.released.set()
    got = await asyncio.gather(*waiting[1:])
    assert len(planner.calls) == 2  # one /chunk-size and one /parallel-draft-steps, not five of each
    assert all(plan is got[0] and plan.chunk_for(1000) == 48 for plan in got)
    await plans.aclose()


async def test_a_planner_that_hangs_or_breaks_costs_at_most_the_timeout() -> None:
    planner, clock = FakePlanner(), Clock()
    planner.released.clear()
    plans = cache(planner, clock, timeout_s=0.1)
    plan = await asyncio.wait_for(plans.current(), 1.0)  # bounded: defaults
    assert (plan.chunk_for(1000), plan.steps_for(5)) == (128, 2)
    planner.released.set()
    fresh = await plans.current()
    assert fresh.chunk_for(1000) == 48
    clock.now += 10
    broken = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    plans.http = broken
    assert await plans.current() is fresh
    await asyncio.wait_for(asyncio.shield(plans.refreshing), 2.0)
    assert await plans.current() is fresh  # a failed refresh keeps the last plan
    await plans.aclose()


async def test_requests_make_no_planner_call_on_their_ttft_path(tiny_llama_checkpoint) -> None:
    """Through the agent's HTTP API: with a plan cached, a request never waits for the planner, even
    when it hangs; an old plan is refreshed off the request's path."""
    checkpoint = tiny_llama_checkpoint
    planner, clock = FakePlanner(), Clock()
    async with planned_agent(checkpoint, planner, clock, draft_budgets="none,chain") as (settings, agent, http):

        async def generate() -> list[dict]:
            body = {"prompt_ids": list(range(3, 103)), "max_new_tokens": 6}
            response = await asyncio.wait_for(http.post("/generate", json=body), 30)
            assert response.status_code == 200
            events = [json.loads(line) for line in response.text.splitlines()]
            assert events[-1]["type"] == "done", events[-1]
            return events

        await generate()  # the first request fetches the first plan: chunk size, PD steps, draft budget
        assert len(planner.calls) == 3
        asked = {p["bytes_per_token"] for path, p in planner.calls if path != "/draft-budget"}
        assert asked == {str(checkpoint.hidden_size * 4)}
        assert planner.budget_asks[0]["bytes_per_token"] == checkpoint.hidden_size * 4
        planner.released.clear()  # from now on the planner hangs
        await generate()  # fresh plan: no call
        assert len(planner.calls) == 3
        clock.now += settings.plan_refresh_s + 1
        await generate()  # old plan: used as is; the refresh waits in the background
        assert len(planner.calls) == 6 and agent.plans.refreshing is not None
        planner.released.set()
        await asyncio.wait_for(asyncio.shield(agent.plans.refreshing), 5)
    assert agent.plans.plan is not None and agent.plans.plan.fetched_at == clock.now


async def test_a_budgeting_device_drafts_in_the_shape_the_planner_chose(tiny_llama_checkpoint) -> None:
    """With TOPHAT_DEVICE_DRAFT_BUDGETS, hat requests run the planner's shape, and a drafting shape never
    measured yet runs for one round of one request (a trial costs a round, not a request); then the planner's
    choice (here no drafts at all); the device posts what each shape did, and the greedy answer is the same
    whatever the shape."""
    checkpoint = tiny_llama_checkpoint
    planner, clock = FakePlanner(), Clock()
    planner.shape = "tree8"
    planner.tokens_per_s = {"none": 9.0, "chain": 10.0, "tree8": 10.5}  # both within TRIAL_SHARE of the best
    async with planned_agent(checkpoint, planner, clock, draft_budgets="none,tree8") as (settings, agent, http):

        async def generate(**extra) -> list[int]:
            body = {"prompt_ids": list(range(3, 40)), "max_new_tokens": 8, **extra}
            response = await asyncio.wait_for(http.post("/generate", json=body), 30)
            events = [json.loads(line) for line in response.text.splitlines()]
            assert events[-1]["type"] == "done", events[-1]
            return [t for e in events if e["type"] == "tokens" for t in e["token_ids"]]

        await asyncio.wait_for(agent.plans.refresh(), 5)  # the planner's predictions, before the first request
        as_tree = await generate()  # the planner's tree, and one round of the chain (never measured)
        stats = agent.budget.stats
        assert stats["tree8"].accept.count == 1 and stats["tree8"].rows.value > 2
        assert stats["chain"].accept.count == 1 and 1 < stats["chain"].rows.value <= settings.max_draft + 1
        assert stats["none"].accept.count == 0
        as_chain = await generate()  # nothing left to try: the tree's rounds only
        assert stats["chain"].accept.count == 1 and stats["tree8"].accept.count == 2
        ask = planner.budget_asks[-1]
        assert ask["default"] == "chain" and {o["name"] for o in ask["options"]} == {"none", "chain", "tree8"}
        planner.shape = "none"
        clock.now += settings.plan_refresh_s + 1
        await asyncio.wait_for(agent.plans.refresh(), 5)
        without_drafts = await generate()
        assert stats["none"].accept.count == 1 and stats["none"].rows.value == 1
        assert stats["none"].accept.value == 1.0
        assert without_drafts == as_tree == as_chain
        # a request may name its own shape (a bench's fixed rows); not one of the budget's: not measured
        counts = {name: s.accept.count for name, s in stats.items()}
        assert await generate(draft_shape="tree3") == as_tree
        assert await generate(draft_shape="tree8") == as_tree  # a shape of the budget's, named: not measured
        assert {name: s.accept.count for name, s in stats.items()} == counts
        bad = await http.post("/generate", json={"prompt_ids": [3, 4], "draft_shape": "bush"})
        assert bad.status_code in (400, 422)
        tree_posted = {o["name"]: o for o in planner.budget_asks[-1]["options"]}["tree8"]
        assert tree_posted["accept"] == stats["tree8"].accept.value


async def test_a_shape_predicted_far_slower_gets_no_trial_round(tiny_llama_checkpoint) -> None:
    """A trial costs a round: a shape the planner predicts well below the best (a tree on a busy CPU verifier) is
    not tried at all, one near it runs one round inside a request of the planner's choice; without a
    prediction nothing is tried."""
    planner, clock = FakePlanner(), Clock()
    planner.shape = "none"
    async with planned_agent(tiny_llama_checkpoint, planner, clock, draft_budgets="none,chain,tree8") as (
        settings,
        agent,
        http,
    ):

        async def generate() -> None:
            body = {"prompt_ids": list(range(3, 20)), "max_new_tokens": 4}
            response = await asyncio.wait_for(http.post("/generate", json=body), 30)
            assert json.loads(response.text.splitlines()[-1])["type"] == "done"

        stats = agent.budget.stats
        await asyncio.wait_for(agent.plans.refresh(), 5)
        await generate()  # the plan has no predictions: no trial, the planner's shape
        assert stats["none"].accept.count == 1 and not agent.budget.tried
        planner.tokens_per_s = {"none": 20.0, "chain": 17.0, "tree8": 6.0}  # chain at 0.85 of the best, tree8 0.3
        clock.now += settings.plan_refresh_s + 1
        await asyncio.wait_for(agent.plans.refresh(), 5)
        assert agent.plans.plan.predicted == planner.tokens_per_s
        await generate()  # the planner's shape, with one round of the chain
        await generate()
        assert stats["chain"].accept.count == 1 and stats["tree8"].accept.count == 0
        assert stats["none"].accept.count == 3 and agent.budget.tried == {"chain"}


async def test_a_budgeting_device_measures_how_much_slower_its_shape_runs_than_modelled(tiny_llama_checkpoint) -> None:
    """Each request in the planner's shape (no trial round in it) is a sample of that shape's slowdown: the round
    model's tokens/s (the planner's `modelled_tokens_per_s`) over the request's own (1 / its TBT), posted with
    the shape's figures; a shape the model has no rate for stays unmeasured."""
    planner, clock = FakePlanner(), Clock()
    planner.shape = "none"
    planner.modelled = {"none": 1e6}  # far faster than any CPU request: the slowdown's upper clamp
    async with planned_agent(tiny_llama_checkpoint, planner, clock, draft_budgets="none,chain") as (
        settings,
        agent,
        http,
    ):
        await asyncio.wait_for(agent.plans.refresh(), 5)
        body = {"prompt_ids": list(range(3, 20)), "max_new_tokens": 6}
        response = await asyncio.wait_for(http.post("/generate", json=body), 30)
        assert json.loads(response.text.splitlines()[-1])["type"] == "done"
        stats = agent.budget.stats
        assert stats["none"].slowdown.count == 1 and stats["none"].slowdown.value == SLOWDOWN_RANGE[1]
        assert stats["chain"].slowdown.value is None
        clock.now += settings.plan_refresh_s + 1
        await asyncio.wait_for(agent.plans.refresh(), 5)
        posted = {o["name"]: o for o in planner.budget_asks[-1]["options"]}
        assert posted["none"]["slowdown"] == SLOWDOWN_RANGE[1] and posted["chain"]["slowdown"] == 1.0


async def test_a_seeded_sampled_request_drafts_in_the_configured_shape_whatever_the_budget(
    tiny_llama_checkpoint,
) -> None:
    """Which tokens a seeded sample picks depends on the drafts: so that the same seed gives the same answer
    whatever the verifier's load, such a request runs the configured shape, with no trial round, unmeasured."""
    planner, clock = FakePlanner(), Clock()
    planner.shape = "tree8"
    planner.tokens_per_s = {"none": 9.0, "chain": 10.0, "tree8": 10.5}
    async with planned_agent(tiny_llama_checkpoint, planner, clock, draft_budgets="none,tree8") as (
        settings,
        agent,
        http,
    ):

        async def generate() -> list[int]:
            body = {"prompt_ids": list(range(3, 30)), "max_new_tokens": 8, "temperature": 0.9, "seed": 7}
            response = await asyncio.wait_for(http.post("/generate", json=body), 30)
            events = [json.loads(line) for line in response.text.splitlines()]
            assert events[-1]["type"] == "done", events[-1]
            return [t for e in events if e["type"] == "tokens" for t in e["token_ids"]]

        await asyncio.wait_for(agent.plans.refresh(), 5)
        first, second = await generate(), await generate()
        assert first == second
        assert not agent.budget.tried and all(s.accept.count == 0 for s in agent.budget.stats.values())


async def test_a_device_is_not_ready_until_its_first_link_probe_ran(tiny_llama_checkpoint) -> None:
    planner, clock = FakePlanner(), Clock()
    async with planned_agent(tiny_llama_checkpoint, planner, clock) as (_, agent, http):
        for _ in range(50):
            if agent.cloud.ready:
                break
            await asyncio.sleep(0.1)
        assert (await http.get("/readyz")).status_code == 200
        agent.probes.first_probe_done = False  # as a fresh device with probing on, before its probe ran
        answer = await http.get("/readyz")
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "measuring_link"


async def test_peek_never_waits_but_keeps_the_plan_current() -> None:
    """A request that needs only the draft shape reads the cached plan without waiting; with none yet, or an old
    or provisional one, that read starts the one background refresh."""
    planner, clock = FakePlanner(), Clock()
    planner.chunk_source = "default:no-telemetry"
    plans = cache(planner, clock)
    assert plans.peek() is None and plans.refreshing is not None  # nothing cached: fetched in the background
    await asyncio.wait_for(asyncio.shield(plans.refreshing), 2.0)
    provisional = plans.peek()
    assert provisional is not None and provisional.provisional and plans.refreshing is None
    clock.now += PROVISIONAL_REFRESH_S
    planner.chunk_source = "eq3"
    assert plans.peek() is provisional and plans.refreshing is not None
    await asyncio.wait_for(asyncio.shield(plans.refreshing), 2.0)
    measured = plans.peek()
    assert measured is not None and not measured.provisional
    await plans.aclose()


async def test_hat_async_is_served_by_hats_rounds_where_the_budget_runs_no_chain(tiny_llama_checkpoint) -> None:
    """hat-async drafts chains ahead: where the budget has the device on no drafts (a loaded verifier) or a tree,
    HAT's rounds serve it (its fallback, measured by the budget) with the same greedy answer; on a chain too until
    HAT's chain rounds are measured (its yardstick). Then it runs its own pipeline, as do a request naming its shape
    and a seeded sampled one at any time, until it measures slower than HAT's chain rounds against the same round
    model; then one request in ASYNC_RETRY_EVERY still runs it."""
    planner, clock = FakePlanner(), Clock()
    planner.shape = "none"
    async with planned_agent(tiny_llama_checkpoint, planner, clock, draft_budgets="none,chain") as (
        settings,
        agent,
        http,
    ):

        async def served(**extra) -> tuple[str, list[int]]:
            body = {"prompt_ids": list(range(3, 30)), "max_new_tokens": 8, "mode": "hat-async", **extra}
            response = await asyncio.wait_for(http.post("/generate", json=body), 30)
            events = [json.loads(line) for line in response.text.splitlines()]
            assert events[-1]["type"] == "done", events[-1]
            return events[-1]["stats"]["mode"], [t for e in events if e["type"] == "tokens" for t in e["token_ids"]]

        await asyncio.wait_for(agent.plans.refresh(), 5)
        mode, as_hat = await served()
        assert mode == "hat" and agent.budget.stats["none"].accept.count == 1  # measured as the budget's shape
        assert (await served(draft_shape="chain"))[0] == "hat-async"
        assert (await served(temperature=0.8, seed=3))[0] == "hat-async"
        for refused in ({"speculative": False}, {"keep": True}):  # what hat-async refuses, it still refuses
            body = {"prompt_ids": list(range(3, 30)), "max_new_tokens": 8, "mode": "hat-async", **refused}
            assert (await asyncio.wait_for(http.post("/generate", json=body), 30)).status_code == 400
        planner.shape = "chain"
        clock.now += settings.plan_refresh_s + 1
        await asyncio.wait_for(agent.plans.refresh(), 5)
        assert (await served())[0] == "hat"  # HAT's chain rounds not measured yet (the plan models none)
        assert agent.budget.measured_slowdown("chain") is None
        # measured: HAT's chain rounds at the model's speed (k at its floor), hat-async far below it (k at its cap)
        planner.modelled = {"chain": 1e-3}
        clock.now += settings.plan_refresh_s + 1
        await asyncio.wait_for(agent.plans.refresh(), 5)
        mode, as_chain = await served()
        assert mode == "hat" and as_chain == as_hat  # served by HAT's chain rounds, which it measured
        assert agent.budget.stats["chain"].slowdown.value == SLOWDOWN_RANGE[0]
        planner.modelled = {"chain": 1e6}
        clock.now += settings.plan_refresh_s + 1
        await asyncio.wait_for(agent.plans.refresh(), 5)
        mode, as_async = await served()
        assert mode == "hat-async" and as_async == as_hat  # hat-async's first measurement
        assert agent.budget.async_slowdown.value == SLOWDOWN_RANGE[1] and agent.budget.async_pays() is False
        modes = [(await served())[0] for _ in range(ASYNC_RETRY_EVERY)]
        assert modes == ["hat"] * (ASYNC_RETRY_EVERY - 1) + ["hat-async"]  # one in ASYNC_RETRY_EVERY re-measures
