"""How the device agent's parts are built from its settings: its verifier connection, the hidden-state clouds
its sessions use, the planner's HTTP client and the plan cache (agent.py holds them)."""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Callable
from pathlib import Path

import httpx

from services.device_agent.cloud_client import WebSocketCloud
from services.device_agent.cloud_errors import verifier_lost
from services.device_agent.link_probes import LinkProbes
from services.device_agent.plans import DEFAULT_PARALLEL_STEPS, PlanCache
from services.device_agent.settings import Settings
from shared.auth import client as auth_client
from shared.auth.verify import ISSUER, PLANNER, VERIFIER
from shared.model.adapter import ADAPTER_FILENAME, ADAPTER_REPORT_FILENAME
from shared.model.checkpoint import Checkpoint, split_fingerprint
from shared.net.links import parse_link_spec, scaled_for_hidden
from shared.planning.budget_tracker import BudgetTracker, priors_from_adapter_report
from shared.planning.draft_budget import DraftShape
from shared.privacy.hidden_rotation import rotated_fingerprint
from shared.privacy.uplink_hardening import with_noise, with_rotation
from shared.runtime import RANDOM_ADAPTER
from shared.specdec.replay import ReplayingCloud
from shared.telemetry.metrics import DeviceMetrics
from shared.wire import schema as wire

log = logging.getLogger("services.device_agent")


def budget_tracker(settings: Settings, checkpoint: Checkpoint) -> BudgetTracker | None:
    """The draft budget's per-shape measurements (None: no planner to choose, or no shapes), with the priors of
    the shapes its adapter's held-out evaluation measured."""
    shapes = settings.budget_shapes() if settings.chunk_planner_url else []
    if not shapes:
        return None
    return BudgetTracker(shapes, adapter_priors(settings, checkpoint, shapes))


def adapter_priors(
    settings: Settings, checkpoint: Checkpoint, shapes: list[DraftShape]
) -> dict[str, tuple[float, float]]:
    """(accept length, rows) per shape from the adapter's report beside it; {} without one (or for an untrained
    adapter), and with a warning for one that cannot be read."""
    if settings.adapter == RANDOM_ADAPTER or not settings.speculative:
        return {}
    adapter = Path(settings.adapter) if settings.adapter else checkpoint.path / ADAPTER_FILENAME
    path = adapter.with_name(ADAPTER_REPORT_FILENAME)
    if not path.is_file():
        return {}
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("adapter report %s unreadable (%s): the draft budget starts from its default priors", path, exc)
        return {}
    priors = priors_from_adapter_report(report, shapes)
    log.info("draft budget priors from %s: %s", path, priors)
    return priors


def verifier_connection(
    settings: Settings,
    checkpoint: Checkpoint,
    probes: LinkProbes,
    metrics: DeviceMetrics,
    broker: auth_client.TokenBroker | None,
) -> WebSocketCloud:
    """The WebSocket to the verifier: this device's split and fingerprint, its shaped link, its credential."""
    link = parse_link_spec(settings.link)
    if settings.link_scaled:
        link = scaled_for_hidden(link, checkpoint.hidden_size)
    return WebSocketCloud(
        settings.verifier_url,
        checkpoint.hidden_size,
        wire.WireDtype(settings.wire_dtype),
        settings.request_timeout_s,
        on_transfer=probes.on_transfer,
        link=link if link.shaped else None,
        on_frame=metrics.frame,
        split_layers=settings.split_layers,
        fingerprint=rotated_fingerprint(
            split_fingerprint(settings.model_dir, settings.split_layers), settings.hidden_rotation
        ),
        tls_ca=settings.tls_ca,
        auth=auth_client.BrokerAuth(broker, VERIFIER) if broker is not None else None,
    )


def hidden_clouds(
    cloud: WebSocketCloud, settings: Settings, hidden_size: int, on_replay: Callable[[int, int, float], None]
):
    """HAT's cloud and hat-async's. HAT sessions keep the shallow rows they sent and replay them on a verifier
    (another replica, or the same one restarted) when theirs goes away mid-generation (shared/specdec/replay.py).
    Uplink hardening (shared/privacy/uplink_hardening.py) for both: rotation inside the replay (replays are
    rotated too), noise outside it (the replay log keeps the noisy rows, so a replay rebuilds the same cache)."""
    hidden_cloud = with_rotation(cloud, settings.hidden_rotation, hidden_size)
    sessions_cloud = with_noise(
        ReplayingCloud(
            hidden_cloud,
            verifier_lost,
            deadline_s=settings.failover_deadline_s,
            max_recoveries=settings.failover_max_recoveries,
            total_deadline_s=settings.failover_total_s,
            on_replay=on_replay,
        ),
        settings.uplink_noise,
    )
    return sessions_cloud, with_noise(hidden_cloud, settings.uplink_noise)  # hat-async: no replay


def planner_http(settings: Settings, broker: auth_client.TokenBroker | None, tls: ssl.SSLContext) -> httpx.AsyncClient:
    """The planner's and the monitor's calls (plans, announcements, edge SD), each with its audience's token."""
    http_auth = (
        auth_client.BrokerAuth(
            broker, audiences={settings.chunk_planner_url: PLANNER, settings.state_monitor_url: ISSUER}
        )
        if broker is not None
        else None
    )
    return httpx.AsyncClient(timeout=settings.planner_timeout_s, verify=tls, auth=http_auth)


def plan_cache(
    http: httpx.AsyncClient,
    settings: Settings,
    bytes_per_token: int,
    context_length: int,
    budget: BudgetTracker | None,
) -> PlanCache | None:
    """The planner's answers, cached per device and refreshed off the request path (plans.py); None without a
    planner."""
    if not settings.chunk_planner_url:
        return None
    return PlanCache(
        http,
        settings.chunk_planner_url,
        settings.device_id,
        bytes_per_token=bytes_per_token,
        max_prompt_tokens=context_length,
        max_rows=settings.max_draft + 1,
        default_chunk_size=settings.default_chunk_size,
        default_steps=DEFAULT_PARALLEL_STEPS,
        refresh_s=settings.plan_refresh_s,
        timeout_s=settings.planner_timeout_s,
        budget=budget,
        default_shape=settings.default_shape(),
    )
