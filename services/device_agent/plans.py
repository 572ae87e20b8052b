"""The chunk planner's answers for this device, cached so no request waits for them.

A plan is one snapshot of the planner's view of this device: the eq. 3 chunk size (asked for
the longest prompt the model takes; a shorter prompt's answer is the same size capped at the
prompt, exactly as the planner caps it) and eq. 6's λ for every draft length up to
max_draft + 1 rows (one table, so each round looks up λ for the k + 1 rows it actually sends), and, where
the device budgets its drafts, the draft shape its hat requests use (`POST /draft-budget`).

Requests read the cached plan; a plan older than `refresh_s` is still used, and one background
refresh (an owned task, bounded by `timeout_s`) replaces it for the next request. Only when no
plan was ever had does a request wait, at most `timeout_s`, for the first one. The device tells
the planner A (its hidden size x its wire dtype's bytes): the planner does not guess a model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from shared.planning.budget_tracker import BudgetTracker, predicted_rates
from shared.planning.draft_budget import BudgetRequest
from shared.planning.planners import hidden_bytes_per_token
from shared.wire.schema import WireDtype, dtype_bytes

log = logging.getLogger(__name__)

DEFAULT_PARALLEL_STEPS = 2  # used when the planner (eq. 6) is unreachable or has no telemetry

# A plan some of whose answers are the planner's defaults (its telemetry was not there yet) is asked again this
# soon, not after the whole refresh interval: the first requests of a fresh mesh must not run on guesses for long.
PROVISIONAL_REFRESH_S = 0.5


def wire_bytes_per_token(hidden_size: int, wire_dtype: WireDtype) -> int:
    """A in eq. 3 / eq. 6: one hidden state on this device's wire."""
    return hidden_bytes_per_token(hidden_size, dtype_bytes(wire_dtype))


@dataclass(frozen=True)
class Plan:
    chunk_size: int  # for a prompt of any length, capped at that length when used
    steps_by_rows: tuple[int, ...]  # λ for 0..max_draft+1 rows per verification
    source: str  # the planner's sources, "chunk:<eq3|default:...> steps:<eq6|default:...>"
    fetched_at: float
    shape: str | None = (
        None  # the draft shape for hat requests (shared/planning/draft_budget.py); None: the configured one
    )
    predicted: Mapping[str, float] = field(default_factory=dict)  # the planner's tokens/s per shape (trials)
    modelled: Mapping[str, float] = field(default_factory=dict)  # its round model's alone (measured against)

    @classmethod
    def defaults(cls, chunk_size: int, steps: int) -> Plan:
        """The plan without a planner: fixed chunk size and pre-draft steps, never fresh."""
        return cls(chunk_size, (steps,), "default:no-planner", float("-inf"))

    @property
    def provisional(self) -> bool:
        """Some answer is a default for want of telemetry: ask again soon."""
        return "default:" in self.source

    def chunk_for(self, prompt_tokens: int) -> int:
        return max(1, min(self.chunk_size, prompt_tokens))

    def steps_for(self, rows: int) -> int:
        return self.steps_by_rows[min(max(rows, 0), len(self.steps_by_rows) - 1)]


class PlanCache:
    def __init__(
        self,
        http: httpx.AsyncClient,
        planner_url: str,
        device_id: str,
        *,
        bytes_per_token: int,
        max_prompt_tokens: int,
        max_rows: int,
        default_chunk_size: int,
        default_steps: int,
        refresh_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        budget: BudgetTracker | None = None,
        default_shape: str = "chain",
    ):
        self.http = http
        self.planner_url = planner_url.rstrip("/")
        self.device_id = device_id
        self.bytes_per_token = bytes_per_token
        self.max_prompt_tokens = max_prompt_tokens
        self.max_rows = max_rows
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.budget = budget  # the shapes' measurements, posted with each refresh (None: no budgeting)
        self.default_shape = default_shape
        self.default = Plan.defaults(default_chunk_size, default_steps)
        self.plan: Plan | None = None
        self.refreshing: asyncio.Task | None = None  # the one background refresh, owned here

    async def current(self) -> Plan:
        """The plan for a request starting now: the cached one (refreshed in the background when
        old), or, before any plan was had, the first fetch (bounded by timeout_s) or the defaults.
        Concurrent first requests share one fetch."""
        if self.plan is None:
            await asyncio.shield(self.refresh())  # a cancelled request leaves the shared fetch running
            return self.plan or self.default
        return self.peek() or self.default

    def peek(self) -> Plan | None:
        """The cached plan (None: none yet) without waiting; a missing or old one is refreshed in the background,
        so a request that needs only the draft shape still keeps the plan current."""
        plan = self.plan
        refresh_s = (
            min(self.refresh_s, PROVISIONAL_REFRESH_S) if plan is not None and plan.provisional else self.refresh_s
        )
        if plan is None or self.clock() - plan.fetched_at >= refresh_s:
            self.refresh()
        return plan

    def refresh(self) -> asyncio.Task:
        """Start a refresh unless one is running (single flight); the task is owned here."""
        if self.refreshing is None:
            self.refreshing = asyncio.create_task(self._refresh_once(), name="plan-refresh")
            self.refreshing.add_done_callback(self._refresh_done)
        return self.refreshing

    def _refresh_done(self, task: asyncio.Task) -> None:
        if self.refreshing is task:
            self.refreshing = None
        if not task.cancelled() and task.exception() is not None:  # _refresh_once handles what it expects
            log.error("plan refresh failed", exc_info=task.exception())

    async def _refresh_once(self) -> None:
        try:
            self.plan = await asyncio.wait_for(self._fetch(), self.timeout_s)
        except (TimeoutError, httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            # Keep the last plan (old telemetry beats none); the next request tries again.
            log.warning(
                "chunk planner unavailable (%s: %s); %s",
                type(exc).__name__,
                exc,
                "keeping the last plan" if self.plan else "using defaults",
            )

    async def _fetch(self) -> Plan:
        base = {"device_id": self.device_id, "bytes_per_token": self.bytes_per_token}
        chunk, steps, budget = await asyncio.gather(
            self._get("/chunk-size", {**base, "prompt_tokens": self.max_prompt_tokens}),
            self._get("/parallel-draft-steps", {**base, "draft_len": self.max_rows, "all_lengths": "true"}),
            self._budget(),
        )
        table = tuple(max(0, int(n)) for n in steps["steps_by_draft_len"])
        if not table:
            raise ValueError("empty steps_by_draft_len")
        source = f"chunk:{chunk.get('source')} steps:{steps.get('source')}"
        shape, predicted, modelled = None, {}, {}
        if budget is not None and self.budget is not None:
            shape = budget["shape"] if budget["shape"] in self.budget.shapes else None
            predicted = predicted_rates(budget.get("tokens_per_s"), self.budget.shapes)
            modelled = predicted_rates(budget.get("modelled_tokens_per_s"), self.budget.shapes)
            source += f" budget:{budget['source']}"
        plan = Plan(int(chunk["chunk_size"]), table, source, self.clock(), shape, predicted, modelled)
        log.debug("plan for %s: %s", self.device_id, plan)
        if self.plan is None or self.plan.source != source or self.plan.shape != shape:
            log.info("plan for %s: chunk %s, draft shape %s (%s)", self.device_id, chunk["chunk_size"], shape, source)
        return plan

    async def _budget(self) -> dict[str, Any] | None:
        """The planner's draft shape (None: no budgeting, or no answer). A planner that cannot answer it (an older
        one, a refused request) costs only the budget: the chunk size and the PD steps still come."""
        if self.budget is None:
            return None
        current = self.plan.shape if self.plan is not None else None
        ask = BudgetRequest(self.device_id, self.bytes_per_token, self.default_shape, self.budget.options(), current)
        try:
            answer = await self._call("POST", "/draft-budget", json=ask.to_json())
        except (httpx.HTTPError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
            log.warning("draft budget unavailable (%s: %s); the configured shape runs", type(exc).__name__, exc)
            return {"shape": "", "source": f"error:{type(exc).__name__}"}
        shape, source = answer.get("shape"), answer.get("source")
        rates, modelled = answer.get("tokens_per_s"), answer.get("modelled_tokens_per_s")
        shape = shape if isinstance(shape, str) else ""
        return {"shape": shape, "source": str(source), "tokens_per_s": rates, "modelled_tokens_per_s": modelled}

    async def _get(self, path: str, params: dict) -> dict:
        return await self._call("GET", path, params=params)

    async def _call(self, method: str, path: str, **kwargs) -> dict:
        response = await self.http.request(method, f"{self.planner_url}{path}", timeout=self.timeout_s, **kwargs)
        response.raise_for_status()
        body = response.json()
        if not isinstance(body, dict):
            raise ValueError(f"{path}: not a JSON object")
        return body

    async def aclose(self) -> None:
        task, self.refreshing = self.refreshing, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
