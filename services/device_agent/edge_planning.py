"""The Edge SD draft server's planning (services/device_agent/edge_server.py): each round's plan, asked of the
chunk planner and checked before it is run (planned here from the server's own samples when the planner cannot
be reached or answers a plan that does not fit), and the samples each round measures, kept for those plans and
posted to the state monitor."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TypeGuard

import httpx

from shared.edge_sd.batching import InfeasibleBatchingError
from shared.edge_sd.plan import EdgeTelemetry, PlanDefaults, PlanRequest, plan_round
from shared.edge_sd.runtime import ModelShape
from shared.specdec.device_session import SessionError

log = logging.getLogger("services.device_agent.edge_server")  # the draft server's log

SAMPLES_KEPT = 512  # runtime and verdict samples kept for planning without the planner
PLAN_TIMEOUT_S = 10.0  # a plan is a DP per speculation length: seconds for a large round, not a lookup


@dataclass
class RoundRecord:
    """What one round planned and how its stages ran, for /edge-sd/plan and the bench."""

    plan: dict
    started: float
    upload_s: float = 0.0
    # per (step, batch): draft and verify seconds as measured, and when each ended (since the round's start)
    stages: list[dict] = field(default_factory=list)
    inference_s: float = 0.0


class EdgePlanning:
    """Where a draft server's rounds get their plans, and where the samples those plans are made from go."""

    def __init__(
        self,
        draft_shape: ModelShape,
        target_shape: ModelShape,
        http: httpx.AsyncClient | None = None,
        planner_url: str = "",
        monitor_url: str = "",
        timeout_s: float = 1.0,
        node: str = "edge-0",
    ):
        self.draft_shape, self.target_shape = draft_shape, target_shape
        self.http, self.planner_url, self.monitor_url = http, planner_url.rstrip("/"), monitor_url.rstrip("/")
        self.timeout_s, self.node = timeout_s, node
        self.telemetry = EdgeTelemetry(draft=[], verify=[], verdicts=[])  # kept for planning alone
        self._posts: set[asyncio.Task] = set()

    async def plan(self, request: PlanRequest) -> dict:
        """The round's plan from the chunk planner; planned here from this server's samples without it."""
        tasks = len(request.tasks)
        failure = "default:no-planner"
        if self.planner_url and self.http is not None:
            try:
                response = await self.http.post(
                    f"{self.planner_url}/edge-sd/plan",
                    json=request.as_dict(),
                    timeout=max(self.timeout_s, PLAN_TIMEOUT_S),
                )
                if response.status_code != 200:
                    failure = f"default:planner-error-{response.status_code}"
                elif plan_fits(answer := _json_or_none(response), tasks):
                    return answer
                else:
                    log.warning(
                        "the chunk planner's edge-sd plan does not fit the round's %d tasks; planning here", tasks
                    )
                    failure = "default:planner-bad-answer"
            except httpx.HTTPError as exc:
                log.info("edge-sd plan from the chunk planner failed (%s); planning here", exc)
                failure = "default:planner-unreachable"
        try:
            plan = plan_round(request, self.telemetry, PlanDefaults()).as_dict()
        except InfeasibleBatchingError as exc:
            raise SessionError(f"the round cannot be planned: {exc}") from None
        plan["sources"]["planner"] = failure
        return plan

    def report(self, record: RoundRecord) -> None:
        """The round's measured passes and verdicts: kept here, and sent to the state monitor."""
        draft, verify = self.telemetry.draft, self.telemetry.verify
        for entry in record.stages:
            if "verify_s" not in entry:
                continue
            b = entry["size"]
            # per pass: the step's draft seconds over its passes (eq. 17 is linear, so the mean pass fits)
            passes = 1 if entry["step"] == 1 else record.plan["spec_len"]
            draft.append((b, self._draft_pass_flops(record, entry), entry["draft_s"] / passes))
            verify.append((b, self._verify_flops(record, entry), entry["verify_s"]))
        for table in (draft, verify, self.telemetry.verdicts):
            del table[:-SAMPLES_KEPT]
        if self.monitor_url and self.http is not None:
            sample = {
                "node": self.node,
                "draft": [list(s) for s in draft[-64:]],
                "verify": [list(s) for s in verify[-64:]],
                "verdicts": [list(v) for v in self.telemetry.verdicts[-256:]],
            }
            task = asyncio.ensure_future(self._post_telemetry(self.http, sample))
            self._posts.add(task)
            task.add_done_callback(self._posts.discard)

    def _draft_pass_flops(self, record: RoundRecord, entry: dict) -> float:
        """Per task, the mean pass of the step (eq. 13): the prompt's prefill, or one token on the context."""
        if entry["step"] == 1:
            return self.draft_shape.prefill_flops(max(1, round(entry["context"])))
        return self.draft_shape.decode_flops(entry["context"] + (record.plan["spec_len"] - 1) / 2)

    def _verify_flops(self, record: RoundRecord, entry: dict) -> float:
        """Per task (eq. 14): the prompt's prefill, or the pending token + l drafts on the context."""
        if entry["step"] == 1:
            return self.target_shape.prefill_flops(max(1, round(entry["context"])))
        return self.target_shape.forward_flops(1 + record.plan["spec_len"], entry["context"])

    async def _post_telemetry(self, http: httpx.AsyncClient, sample: dict) -> None:
        try:
            response = await http.post(f"{self.monitor_url}/edge-sd/telemetry", json=sample, timeout=self.timeout_s)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            log.info("edge-sd telemetry not sent: %s", exc)

    async def aclose(self) -> None:
        for task in self._posts:
            task.cancel()
        await asyncio.gather(*self._posts, return_exceptions=True)


def _json_or_none(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:  # not JSON (or NaN / Infinity, which JSON does not have)
        return None


def plan_fits(plan: object, tasks: int) -> TypeGuard[dict]:
    """A plan this server can run: every task in exactly one batch, l >= 1, an upload time per task."""
    if not isinstance(plan, dict):
        return False
    batches, spec_len, uploads = plan.get("batches"), plan.get("spec_len"), plan.get("upload_s")
    if not (isinstance(batches, list) and all(isinstance(b, list) and b for b in batches)):
        return False
    members = [i for b in batches for i in b]
    return (
        all(isinstance(i, int) and not isinstance(i, bool) for i in members)
        and sorted(members) == list(range(tasks))
        and isinstance(spec_len, int)
        and not isinstance(spec_len, bool)
        and 1 <= spec_len <= 64
        and isinstance(uploads, list)
        and len(uploads) == tasks
        and all(isinstance(u, (int, float)) and 0 <= u < 3600 for u in uploads)
        and isinstance(plan.get("sources"), dict)
    )
