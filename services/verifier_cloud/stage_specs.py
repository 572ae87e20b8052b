"""The verifier's pipeline stages from its settings: which layers, on which device, behind which link."""

from __future__ import annotations

import httpx

from services.verifier_cloud.kv_plan import KVPlan
from services.verifier_cloud.remote_stages import RemoteStages
from services.verifier_cloud.settings import Settings
from services.verifier_cloud.stage_plan import (
    check_layers_cover,
    parse_address,
    parse_stage_layers,
    parse_stage_links,
    parse_stage_slowdowns,
)
from services.verifier_cloud.stages import StageSpec
from shared.auth import verify as auth
from shared.auth.client import TokenBroker
from shared.model.placement import cuda_facts, plan_stage_devices
from shared.model.split import SplitError, stage_ranges, validate_split
from shared.wire.stage_codec import StageLinkError


def plan_stages(settings: Settings, num_layers: int, cuda: tuple[bool, int] | None = None) -> list[StageSpec]:
    """The P stage specs for `settings`, or a SplitError naming the flag that does not fit the model (a
    PlacementError for a device this machine lacks). `cuda`: (available, GPU count); None asks torch."""
    validate_split(num_layers, settings.split_layers)
    try:
        if settings.stage_layers:  # explicit ranges (Settings checked their syntax and start)
            ranges = parse_stage_layers(settings.stage_layers, settings.split_layers)
            check_layers_cover(ranges, num_layers)
        else:
            ranges = stage_ranges(settings.split_layers, num_layers, settings.pipeline_stages)
    except (SplitError, ValueError) as exc:
        flag = (
            f"--stage-layers {settings.stage_layers}"
            if settings.stage_layers
            else f"--pipeline-stages {settings.pipeline_stages}"
        )
        raise SplitError(
            f"{flag} does not fit: {exc} (layers {settings.split_layers}..{num_layers - 1} run in the cloud)"
        ) from exc
    available, count = cuda if cuda is not None else cuda_facts()
    devices = plan_stage_devices(settings.device, len(ranges), cuda_available=available, device_count=count)
    slowdowns = parse_stage_slowdowns(settings.stage_slowdowns, len(ranges))
    links = parse_stage_links(settings.stage_links, len(ranges))  # P + 1 hops
    return [
        StageSpec(
            i,
            settings.model_dir,
            settings.split_layers,
            r,
            settings.torch_threads,
            settings.log_level,
            device=device,
            dtype=settings.dtype,
            host=settings.stage_host,
            in_link=links[i],
            out_link=links[i + 1],
            slowdown=slowdowns[i],
            hidden_rotation=settings.hidden_rotation,
            kv=KVPlan.of(settings, on_cuda=device.startswith("cuda")),
        )
        for i, (r, device) in enumerate(zip(ranges, devices))
    ]


def remote_stages(settings: Settings, broker: TokenBroker | None) -> RemoteStages | None:
    """The stages started on their own that `settings` names (stage_addresses), or None: spawn them here.
    With a broker (an authenticated mesh) each wiring presents a service token for the stages' audience."""
    addresses = settings.remote_stage_addresses()
    if not addresses:
        return None

    async def credential() -> bytes:
        if broker is None:
            return b"open"
        try:
            return (await broker.token(auth.STAGE)).encode()
        except httpx.HTTPError as exc:  # CredentialUnavailable is one
            raise StageLinkError(f"no token for the stages from the issuer: {exc}") from None

    if settings.stage_return_address.strip():
        return_host, return_port = parse_address(settings.stage_return_address)
    else:
        return_host, return_port = settings.stage_host, 0
    return RemoteStages(
        tuple(addresses),
        (settings.stage_host, return_port),
        return_host,
        credential,
        settings.stage_handshake_timeout_s,
    )
