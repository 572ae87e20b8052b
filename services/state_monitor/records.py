"""What the state monitor accepts: the telemetry records (a discriminated union on `kind`), a device
agent's announcement and an edge draft server's measurements, as checked pydantic models.

Every bound here is also a bound on memory: an identifier's length and alphabet (it becomes part
of a Redis key), non-negative finite times, list lengths.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from shared.telemetry import sink as tk

IDENT_PATTERN = r"^[A-Za-z0-9_.\-]{1,128}$"
Ident = Annotated[str, Field(min_length=1, max_length=128, pattern=IDENT_PATTERN)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ts: float | None = Field(default=None, description="sender's wall-clock time (unix s)")


class VerifierStep(_Record):
    kind: Literal["verifier_step"]
    batched_tokens: int = Field(ge=0, description="mu_hat: tokens in the batch")
    compute_s: Seconds = Field(description="eta_hat: batch compute time")
    num_sessions: int = Field(default=0, ge=0)
    step_kinds: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    overhead_s: Seconds | None = Field(default=None, description="step wall time beyond compute_s")
    pipeline_stages: int | None = Field(default=None, ge=1, le=1024, description="P: the verifier's stages")
    runs_on: Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z0-9_.:\- ]+$")] | None = Field(
        default=None, description="the torch device the verifier computes on (cpu, cuda:0, ...)"
    )


class VerifierCalibration(_Record):
    """A pass the verifier timed at startup: a point of g(mu), no load (mu) and no served step."""

    kind: Literal["verifier_calibration"]
    batched_tokens: int = Field(ge=1, description="rows of the pass")
    compute_s: Seconds = Field(description="its compute time")


class DeviceDraft(_Record):
    kind: Literal["device_draft"]
    device_id: Ident
    step_s: PositiveSeconds = Field(description="gamma: seconds per draft step")
    steps: int = Field(default=1, ge=1, description="draft steps this measurement averaged over")
    round_overhead_s: Seconds | None = Field(
        default=None,
        description="mean device time per round outside drafting and the cloud wait (output head, accept, thread hops)",
    )
    round_overhead_median_s: Seconds | None = Field(default=None, description="median of the same per-round times")
    rounds: int = Field(default=0, ge=0, description="rounds round_overhead_s averaged over")
    prefill_token_s: PositiveSeconds | None = Field(
        default=None, description="prompt cost per token (input layers + upload call), per chunk averaged"
    )
    prefill_tokens: int = Field(default=0, ge=0, description="prompt tokens prefill_token_s averaged over")
    pd_hit_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="parallel drafting: share of corrected last draft tokens that were a pre-drafted candidate",
    )
    pd_chances: int = Field(default=0, ge=0, description="rounds pd_hit_rate is over")
    full_accept_rate: float | None = Field(
        default=None, ge=0, le=1, description="share of verification rounds that accepted every drafted token"
    )


class DeviceTransfer(_Record):
    kind: Literal["device_transfer"]
    device_id: Ident
    direction: Literal["up", "down"]
    bytes: int = Field(ge=0)
    seconds: PositiveSeconds


class DeviceRtt(_Record):
    kind: Literal["device_rtt"]
    device_id: Ident
    rtt_s: PositiveSeconds = Field(description="round trip of a one-row probe (latency both ways + framing)")


class RequestDone(_Record):
    kind: Literal["request"]
    request_id: Ident
    device_id: Ident | None = None
    ttft_s: Seconds | None = None
    token_times_s: list[Seconds] = Field(
        default_factory=list, max_length=100_000, description="gaps between consecutive delivered tokens (TBT)"
    )
    accept_lengths: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=100_000, description="accepted draft tokens per verification"
    )
    prompt_tokens: int | None = Field(default=None, ge=0)
    generated_tokens: int | None = Field(default=None, ge=0)
    endpoint: Literal["device", "cloud", "hat"] | None = Field(
        default=None, description="DiSCo: the endpoint that delivered the first token"
    )
    server_ttft_s: Seconds | None = Field(
        default=None,
        description="the server endpoint's own TTFT, also when "
        "it lost the race; None when it was cancelled before its first token",
    )
    cost: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        default=None, description="$ for the request (DiSCo's unified cost)"
    )
    dispatch: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$")] | None = None


class DeviceAnnouncement(BaseModel):
    """A device agent saying where it serves (shared/device_registry.py); repeated every few seconds."""

    model_config = ConfigDict(extra="forbid")
    device_id: Ident
    url: Annotated[str, Field(min_length=8, max_length=512, pattern=r"^https?://[^\s/]+$")]
    max_sessions: int | None = Field(default=None, ge=1)


Record = Annotated[
    VerifierStep | VerifierCalibration | DeviceDraft | DeviceTransfer | DeviceRtt | RequestDone,
    Field(discriminator="kind"),
]
RECORDS = TypeAdapter(list[Record])  # a POST /telemetry body, one record or a batch, once its size is checked

# Edge SD (paper 001): measured passes for T(b, F) = c1*F*b + c2 (eq. 17) and verdicts for alpha, per list.
EDGE_SD_KEYS = {name: f"{tk.PREFIX}:edge_sd:{name}" for name in ("draft", "verify", "verdicts")}
EdgePass = tuple[Annotated[int, Field(ge=1, strict=True)], Annotated[float, Field(ge=0, allow_inf_nan=False)], Seconds]
Verdict = tuple[Annotated[int, Field(ge=0, strict=True)], Annotated[int, Field(ge=0, strict=True)]]


class EdgeSdTelemetry(BaseModel):
    """An edge draft server's (SBS) measurements: passes as [batch_size, flops_per_task, seconds] of its draft
    model and of the verifier's target model, verdicts as [drafts, accepted]."""

    model_config = ConfigDict(extra="forbid")
    node: Ident
    draft: list[EdgePass] = Field(default_factory=list, max_length=10_000)
    verify: list[EdgePass] = Field(default_factory=list, max_length=10_000)
    verdicts: list[Verdict] = Field(default_factory=list, max_length=10_000)

    @field_validator("verdicts")
    @classmethod
    def _accepted_within_drafts(cls, verdicts: list[tuple[int, int]]) -> list[tuple[int, int]]:
        if any(accepted > drafts for drafts, accepted in verdicts):
            raise ValueError("a verdict's accepted count exceeds its drafts")
        return verdicts
