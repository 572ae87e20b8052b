"""An edge-pipeline plan: which layers each device holds and how prompts are cut into pipelined
sub-sequences. Built once from a stored profile (`tophat plan`), saved as JSON, reused by every
request (Jupiter §IV-B3: planning is offline and amortised).

Kinds:
  jupiter  DP layer partition (eq. 1) + DP sub-sequences with the count chosen by eq. 4
  equal    equal layer counts + equal sub-sequences, as many as there are stages (P): the
           pipelined-prefill baseline with no planning
  serial   equal layer counts, the whole prompt as one sub-sequence (EdgeShard-style serial
           pipeline, no intra-sequence pipelining)

Stage cost for device i over layers [a, b): profile.stage_time(b - a, S_ref, 0, slowdown_i) at the
reference length S_ref (default 128 tokens, a typical sub-sequence: every layer costs the same
per token up to the profile's interpolation, so the argmin barely depends on it), and math.inf when
the stage's weights + KV for max_len positions exceed the device's budget; device 0 also holds the
embeddings, the head (drafting needs it) and the draft adapter, the last device the norm + head.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from shared.jupiter.partition import Partition, PartitionError, equal_partition, partition_layers
from shared.jupiter.profile import Profile, check_document, save_json
from shared.jupiter.sequence import (
    DEFAULT_K_MAX,
    DEFAULT_L_MIN_TOLERANCE,
    SequencePlan,
    equal_sub_sequences,
    min_subsequence_length,
    pipeline_latency,
    plan_sequences,
)
from shared.net.links import PROFILES, parse_bytes, parse_link_spec
from shared.planning.device_speed import speed_schedule

PLAN_FORMAT = "tophat.jupiter.plan"
PLAN_VERSION = 1
PLAN_KINDS = ("jupiter", "equal", "serial")
DEFAULT_MEMORY_BYTES = 8 * 1024**3  # generous: an AGX board's share for one model
DEFAULT_REFERENCE_LENGTH = 128
# Between stages hidden states travel in the layers' own dtype (bfloat16 as float32: numpy has none), so the
# pipeline stays exact; the LAN time of a token is hidden_size x these bytes.
STAGE_WIRE_BYTES = {"float32": 4, "bfloat16": 4, "float16": 2}


class PlanError(ValueError):
    """A plan that is malformed, of another version, for another model, or cannot be built."""


@dataclass(frozen=True)
class DeviceSpec:
    """One edge device of the pipeline: a speed class name, its slowdown vs the reference device,
    and the bytes it may hold for this model."""

    name: str
    slowdown: float
    memory_bytes: int = DEFAULT_MEMORY_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.slowdown, (int, float)) or not math.isfinite(self.slowdown) or self.slowdown < 1:
            raise ValueError(f"device {self.name!r}: slowdown must be a finite number >= 1, got {self.slowdown!r}")
        if not isinstance(self.memory_bytes, int) or isinstance(self.memory_bytes, bool) or self.memory_bytes < 1:
            raise ValueError(
                f"device {self.name!r}: memory_bytes must be a positive integer, got {self.memory_bytes!r}"
            )


def parse_memory(text: str) -> int:
    """'512MiB', '8GiB', '2GB', '1000000' (bytes) -> bytes."""
    size = parse_bytes(text, bits=False)
    if size is None:
        raise ValueError(f"bad memory budget {text!r} (use e.g. 512MiB, 8GiB, 2GB; a bare number is bytes)")
    value = int(size)
    if value < 1:
        raise ValueError(f"memory budget {text!r} is zero")
    return value


def parse_edge_pipeline(spec: str) -> list[DeviceSpec]:
    """'orin;xavier;xavier:512MiB' -> devices in pipeline order. Each item is a speed class of
    shared/planning/device_speed.py (orin, xavier) or a fixed slowdown ('2.5'), optionally ':' a memory
    budget (default 8GiB). Time-varying classes (cycle) cannot be planned for. >= 2 devices."""
    items = [item.strip() for item in spec.split(";")]
    if len(items) < 2 or any(not item for item in items):
        raise ValueError(f"edge pipeline {spec!r} needs at least 2 devices separated by ';' (e.g. orin;xavier;xavier)")
    devices = []
    for index, item in enumerate(items):
        name, _, memory = item.partition(":")
        name = name.strip().lower()
        try:
            schedule = speed_schedule(name)
        except ValueError as exc:
            raise ValueError(f"edge pipeline device {index} ({item!r}): {exc}") from exc
        if len(set(schedule.modes)) != 1:
            raise ValueError(
                f"edge pipeline device {index} ({item!r}): a time-varying speed cannot be planned for; "
                "use a fixed class (orin, xavier) or slowdown"
            )
        budget = parse_memory(memory) if memory.strip() else DEFAULT_MEMORY_BYTES
        devices.append(DeviceSpec(name, schedule.modes[0], budget))
    return devices


def parse_lan(spec: str) -> tuple[float, float]:
    """A LAN link -> (bytes/s, one-way latency s). '100mbit,lat=1ms' (a bare rate = both ways), any
    shared/net/links.py spec ('up=..,down=..,lat=..', a profile name); the slower direction counts."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if parts and "=" not in parts[0] and parts[0].lower() not in PROFILES:
        parts[0:1] = [f"up={parts[0]}", f"down={parts[0]}"]
    link = parse_link_spec(",".join(parts))
    return min(link.uplink_bytes_s, link.downlink_bytes_s), link.latency_s


def lan_spec(bytes_per_s: float, latency_s: float) -> str:
    """The canonical spec string of a symmetric LAN link (parse_lan reads it back exactly)."""
    rate = "inf" if math.isinf(bytes_per_s) else repr(float(bytes_per_s))
    return f"up={rate},down={rate},lat={float(latency_s)!r}s"


def ttft_buckets(max_len: int) -> list[int]:
    """Prompt lengths the plan predicts TTFT for: powers of two from 16, and max_len."""
    buckets = [2**i for i in range(4, 32) if 2**i < max_len]
    return buckets + [max_len]


@dataclass(frozen=True)
class EdgePlan:
    """A stored edge-pipeline plan (module docstring). Checked on construction."""

    model_name: str
    num_layers: int  # with hidden_size: the fingerprint a loader checks against its model
    hidden_size: int
    kind: str
    devices: tuple[DeviceSpec, ...]
    stage_layers: tuple[tuple[int, int], ...]  # [start, stop) per device, in order, covering [0, n)
    draft_layers: int  # m: device 0 keeps at least these (the drafter's own layers)
    lan: str  # lan_spec(...) of the link between neighbours
    reference_length: int
    l_min: int
    k_max: int
    max_len: int
    sequence_table: tuple[tuple[int, ...], ...]  # [L - 1]: the parts of a length-L prompt
    predicted_bottleneck_s: float  # slowest stage at the reference length
    predicted_ttft: tuple[tuple[int, float], ...]  # (bucket prompt length, predicted prefill seconds)
    _sequences: SequencePlan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in PLAN_KINDS:
            raise PlanError(f"plan kind must be one of {', '.join(PLAN_KINDS)}, got {self.kind!r}")
        devices = tuple(d if isinstance(d, DeviceSpec) else DeviceSpec(**d) for d in self.devices)
        ranges = tuple((int(a), int(b)) for a, b in self.stage_layers)
        if not devices or len(ranges) != len(devices):
            raise PlanError(f"plan has {len(devices)} devices but {len(ranges)} stages")
        for name in ("num_layers", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"plan {name} must be an integer >= 1, got {value!r}")
        contiguous = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        non_empty = all(start < stop for start, stop in ranges)
        if ranges[0][0] != 0 or ranges[-1][1] != self.num_layers or not contiguous or not non_empty:
            raise PlanError(f"stage layers {ranges} do not cover layers [0, {self.num_layers}) in order")
        if not 0 <= self.draft_layers <= ranges[0][1]:
            raise PlanError(f"device 0 holds {ranges[0][1]} layers, fewer than the draft's {self.draft_layers}")
        parse_lan(self.lan)
        try:
            sequences = SequencePlan(
                self.max_len,
                self.l_min,
                self.k_max,
                tuple(tuple(p) for p in self.sequence_table),
                (0.0,) * self.max_len,
            )
        except (TypeError, ValueError) as exc:
            raise PlanError(f"bad sequence table: {exc}") from exc
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "stage_layers", ranges)
        object.__setattr__(self, "sequence_table", sequences.table)
        object.__setattr__(self, "predicted_ttft", tuple((int(n), float(s)) for n, s in self.predicted_ttft))
        object.__setattr__(self, "_sequences", sequences)

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    def chunk_sizes(self, prompt_len: int) -> list[int]:
        """The sub-sequence lengths a `prompt_len`-token prompt enters the pipeline as (sum = prompt_len)."""
        return self._sequences.sub_sequences(prompt_len)

    def check_model(self, num_layers: int, hidden_size: int) -> None:
        """Refuse a plan made for another model (layers and width must match)."""
        if (num_layers, hidden_size) != (self.num_layers, self.hidden_size):
            raise PlanError(
                f"plan is for {self.model_name!r} ({self.num_layers} layers, hidden {self.hidden_size}); "
                f"this model has {num_layers} layers, hidden {hidden_size}: re-run `tophat profile` and `tophat plan`"
            )

    def to_json(self) -> dict:
        body = {name: getattr(self, name) for name in self.__dataclass_fields__ if not name.startswith("_")}
        body["devices"] = [asdict(d) for d in self.devices]
        body["stage_layers"] = [list(r) for r in self.stage_layers]
        body["sequence_table"] = [list(p) for p in self.sequence_table]
        body["predicted_ttft"] = [list(b) for b in self.predicted_ttft]
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, **body}

    @classmethod
    def from_json(cls, obj: object) -> "EdgePlan":
        obj = check_document(obj, PLAN_FORMAT, PLAN_VERSION, PlanError, "plan")
        names = [n for n in cls.__dataclass_fields__ if not n.startswith("_")]
        missing = [n for n in names if n not in obj]
        if missing:
            raise PlanError(f"plan is missing {', '.join(missing)}")
        try:
            return cls(**{n: obj[n] for n in names})
        except (TypeError, ValueError) as exc:
            raise PlanError(f"bad plan: {exc}") from exc

    def save(self, path: str | Path) -> Path:
        return save_json(path, self.to_json())


def load_plan(path: str | Path, num_layers: int | None = None, hidden_size: int | None = None) -> EdgePlan:
    """Read a plan; with num_layers and hidden_size, also refuse one made for another model."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except OSError as exc:
        raise PlanError(f"cannot read plan {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise PlanError(f"plan {path} is not valid JSON (truncated?): {exc}") from exc
    try:
        plan = EdgePlan.from_json(obj)
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from exc
    if num_layers is not None and hidden_size is not None:
        plan.check_model(num_layers, hidden_size)
    return plan


def stage_cost_fn(profile: Profile, devices: Sequence[DeviceSpec], max_len: int, reference_length: int):
    """stage_cost(device, start, stop) for the partition DP (module docstring)."""
    last = len(devices) - 1

    def cost(device: int, start: int, stop: int) -> float:
        memory = profile.stage_memory(
            stop - start, max_len, with_embeddings=device == 0, with_head=device == last, with_draft=device == 0
        )
        if memory > devices[device].memory_bytes:
            return math.inf
        return profile.stage_time(stop - start, reference_length, 0, devices[device].slowdown)

    return cost


def build_plan(
    profile: Profile,
    devices: Sequence[DeviceSpec],
    lan_bytes_per_s: float,
    lan_latency_s: float,
    draft_layers: int,
    max_len: int,
    kind: str = "jupiter",
    reference_length: int = DEFAULT_REFERENCE_LENGTH,
    k_max: int = DEFAULT_K_MAX,
    l_min_tolerance: float = DEFAULT_L_MIN_TOLERANCE,
) -> EdgePlan:
    """Plan `profile`'s model over `devices` (module docstring). Raises PlanError when no layer
    partition fits the memory budgets (or the equal split does not, for the baselines)."""
    if kind not in PLAN_KINDS:
        raise PlanError(f"plan kind must be one of {', '.join(PLAN_KINDS)}, got {kind!r}")
    if max_len < 1 or reference_length < 1 or not lan_bytes_per_s > 0 or lan_latency_s < 0:
        raise PlanError("need max_len >= 1, reference_length >= 1, a positive LAN bandwidth and latency >= 0")
    devices = tuple(devices)
    n = profile.num_layers
    cost = stage_cost_fn(profile, devices, max_len, reference_length)
    try:
        if kind == "jupiter":
            partition = partition_layers(cost, n, len(devices), first_min_layers=max(1, draft_layers))
        else:
            partition = _feasible_equal(cost, n, len(devices), draft_layers)
    except PartitionError as exc:
        raise PlanError(str(exc)) from exc
    # each stage's time is (its layers x its slowdown) x layer_time: the bottleneck has the largest weight
    weights = [(stop - start) * d.slowdown for (start, stop), d in zip(partition.ranges, devices)]
    heaviest = max(weights)

    def bottleneck_time(length, prefix):
        return heaviest * profile.layer_time(length, prefix)

    scales = [w / heaviest for w in weights]
    hop_s_per_token = profile.hidden_size * STAGE_WIRE_BYTES.get(profile.dtype, 4) / lan_bytes_per_s
    l_min = min_subsequence_length(
        profile.lengths, [profile.layer_time(s, 0) for s in profile.lengths], l_min_tolerance
    )
    if kind == "jupiter":
        table = plan_sequences(
            bottleneck_time, len(devices), max_len, l_min, k_max, hop_s_per_token, lan_latency_s, scales
        ).table
    else:
        count = len(devices) if kind == "equal" else 1
        table = tuple(tuple(equal_sub_sequences(length, count)) for length in range(1, max_len + 1))
    ttft = tuple(
        (b, pipeline_latency(table[b - 1], bottleneck_time, len(devices), hop_s_per_token, lan_latency_s, scales))
        for b in ttft_buckets(max_len)
    )
    return EdgePlan(
        model_name=profile.model_name,
        num_layers=n,
        hidden_size=profile.hidden_size,
        kind=kind,
        devices=devices,
        stage_layers=partition.ranges,
        draft_layers=draft_layers,
        lan=lan_spec(lan_bytes_per_s, lan_latency_s),
        reference_length=reference_length,
        l_min=l_min,
        k_max=max(k_max, len(devices)),
        max_len=max_len,
        sequence_table=table,
        predicted_bottleneck_s=partition.bottleneck,
        predicted_ttft=ttft,
    )


def _feasible_equal(cost, num_layers: int, num_devices: int, draft_layers: int) -> Partition:
    partition = equal_partition(cost, num_layers, num_devices)
    if not math.isfinite(partition.bottleneck):
        raise PartitionError(f"the equal split {partition.layer_counts} exceeds a device's memory budget")
    if partition.layer_counts[0] < draft_layers:
        raise PartitionError(
            f"the equal split gives device 0 {partition.layer_counts[0]} layers, fewer than the draft's {draft_layers}"
        )
    return partition
