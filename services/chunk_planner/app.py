"""Chunk planner: prefill chunk sizes (HAT §3.3, eq. 3), parallel-draft steps (§3.5, eq. 6) and the draft
budget per round (`POST /draft-budget`, shared/planning/draft_budget.py).

A (hidden-state bytes per token) is the caller's: a device passes `bytes_per_token`
(its hidden size x its wire dtype's bytes); P is the caller's `stages`, else what the verifier
reports with its steps (`last.pipeline_stages` of the monitor's /state/cloud), else this
service's `pipeline_stages` (the launcher sets it to the verifier's). Every answer echoes the A and P
it used. Without A from the caller or `hidden_size` in the settings, the answer is the default
with `source: default:no-bytes-per-token`: the planner never solves eq. 3 for a guessed model.

Each request fetches (monitor_client.py) the state monitor's `GET /state/cloud` (μ and the g(μ)
bucket table) and `GET /state/device/{id}` (β_up, β_down, γ, age) over HTTP,
every fetch bounded by `monitor_timeout_s`, and hands the JSON to the pure
planners in `shared.planning.monitor_plans`. When the equations cannot be applied the
answer is the configured default and `source` says why:

    eq3 / eq6                     the equation, from live telemetry
    default:no-monitor            no `state_monitor_url` configured
    default:monitor-unreachable   connection refused, DNS, or the fetch timed out
    default:monitor-error         the monitor answered, but with an error status or not JSON
    default:no-telemetry          unknown device (404) or no g(μ) data yet
    default:stale                 the device's telemetry is older than `stale_after_s`
    default:missing-beta / default:missing-gamma / default:bad-telemetry /
    default:no-bytes-per-token    (see shared.planning.monitor_plans)

Edge SD (paper 001): `POST /edge-sd/plan` takes a `shared.edge_sd.plan_inputs.PlanRequest` body, fetches the
monitor's `GET /state/edge-sd` (measured passes and verdicts, same bound and failure reasons as above, plus
default:bad-telemetry), runs `plan_round` and keeps the answer as the latest, which `GET /edge-sd/plan`
serves. A bad request or one whose task alone exceeds the memory budget is a 422.

The equations for one caller are plans.py's; state.py holds what the requests share (monitor client, keys,
metrics, the latest Edge SD plan); routes.py is the routes over it.
"""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from services.chunk_planner.routes import on_invalid, plans, probes
from services.chunk_planner.settings import Settings, load_settings
from services.chunk_planner.state import PlannerState
from shared.auth import verify as auth


def create_app(settings: Settings | None = None, monitor_transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """Build the app; `monitor_transport` (tests) replaces the network under the monitor client."""
    planner = PlannerState(settings or load_settings(), monitor_transport)
    s = planner.settings
    app = FastAPI(title="tophat chunk planner", lifespan=planner.lifespan)
    # Every answer needs a credential (shared/auth/verify.py); a device's only for its own device id. Probes stay open.
    auth.warn_if_open("the chunk planner", s.authenticated, s.host, "TOPHAT_CHUNK_PLANNER_AUTH_ISSUER_URL")
    auth.install(app, planner.trust, auth.PLANNER, {"device", "service"})
    app.state.planner = planner
    app.exception_handler(RequestValidationError)(on_invalid)
    app.include_router(plans)
    app.include_router(probes)
    return app
