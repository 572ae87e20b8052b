"""How the device agent's parts are built from its settings: its verifier connection, the hidden-state clouds
its sessions use, the planner's HTTP client and the plan cache (agent.py holds them)."""

from __future__ import annotations

import ssl
from collections.abc import Callable

import httpx

from services.device_agent.cloud_client import WebSocketCloud
from services.device_agent.cloud_errors import verifier_lost
from services.device_agent.link_probes import LinkProbes
from services.device_agent.plans import DEFAULT_PARALLEL_STEPS, PlanCache
from services.device_agent.settings import Settings
from shared.auth import client as auth_client
from shared.auth.verify import ISSUER, PLANNER, VERIFIER
from shared.model.checkpoint import Checkpoint, split_fingerprint
from shared.net.links import parse_link_spec, scaled_for_hidden
from shared.planning.draft_budget import BudgetTracker
from shared.privacy.hidden_rotation import rotated_fingerprint
from shared.privacy.uplink_hardening import with_noise, with_rotation
from shared.specdec.replay import ReplayingCloud
from shared.telemetry.metrics import DeviceMetrics
from shared.wire import schema as wire


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
