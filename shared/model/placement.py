"""Where a model runs and in which dtype: `auto|cpu|cuda[:N]` x `auto|float32|float16|bfloat16`.

The rules live in pure functions of explicit facts (is CUDA there, how many
GPUs, does the chosen GPU do bfloat16 natively), so every branch is tested on
a machine without a GPU; `detect_placement` is the one place that asks torch.

    device auto  -> cuda:0 when CUDA is available, else cpu
    device cuda  -> cuda:0 (an explicit device, so every process names the same GPU)
    dtype  auto  -> CPU_DEFAULT (int4; $TOPHAT_CPU_DTYPE names another) on the CPU; on CUDA bfloat16
                    where the GPU has it natively (compute capability >= 8.0: Ampere, Hopper, Jetson Orin),
                    else float16
                    (Volta / Jetson Xavier)
           int8  -> weight-only int8 in groups of 32 (Q8_0, shared/model/quantized.py), float32
                    activations; CPU only
           int4  -> the decoder's projections as the GGUF's own Q4_1 blocks, the LM head as Q8_0: the
                    CPU's fastest decode; CPU only
           f32, bf16, f16 name float32, bfloat16, float16

Pipeline stages (`plan_stage_devices`): with CUDA and an unindexed spec
(auto / cuda) stage i runs on cuda:(i mod count), one stage per GPU when P
equals the GPU count; an indexed spec (cuda:N) pins every stage to GPU N.

Hidden states on the wire keep their wire dtype; callers convert at the
boundaries (received states to the compute device/dtype, replies to the CPU).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import torch

from shared.model.native_build import native_module

log = logging.getLogger(__name__)

# What `auto` runs on a CPU: the fastest dtype whose answers pass make bench-engine's quality gate against f32
# (same top token >= 99.3 %, mean KL <= 1e-4, >= 58 of 64 held-out chat answers identical; docs/benchmarks/)
CPU_DEFAULT = "int4"
# Names another dtype for `auto` on a CPU, for every process that inherits it (the test suite's f32 references)
CPU_DEFAULT_ENV = "TOPHAT_CPU_DTYPE"


# What `auto` runs on a CPU where the native layers are not built or do not load (`make native`; the cpu image
# builds them for its build host's CPU, so on another CPU they are not found): int4/int8 then compute in plain
# torch ops, many times slower than float32's GEMM
CPU_DEFAULT_WITHOUT_NATIVE = "f32"


def cpu_default(native_layers: bool = True) -> str:
    """What `auto` means on a CPU in this process: $TOPHAT_CPU_DTYPE if set, else CPU_DEFAULT where the native
    layers are built (`native_layers`), else CPU_DEFAULT_WITHOUT_NATIVE."""
    spec = os.environ.get(CPU_DEFAULT_ENV, "").strip() or (CPU_DEFAULT if native_layers else CPU_DEFAULT_WITHOUT_NATIVE)
    if parse_dtype_spec(spec) is None:
        raise UnknownDtypeError(f"{CPU_DEFAULT_ENV} must name a dtype, not {spec!r}")
    return spec


DEVICE_SPECS = "auto, cpu, cuda or cuda:N"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
QUANTIZED = ("int8", "int4")  # weight-only quantization, float32 activations
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


class PlacementError(ValueError):
    """A device or dtype setting that is malformed or that this machine cannot honour."""


class UnknownDeviceError(PlacementError):
    """Not one of auto, cpu, cuda, cuda:N."""


class UnknownDtypeError(PlacementError):
    """Not one of auto, float32, float16, bfloat16 (f32, f16, bf16), int8 or int4."""


class CudaUnavailableError(PlacementError):
    """CUDA was asked for and this process has none."""


class CudaIndexError(PlacementError):
    """cuda:N with N >= the number of visible GPUs."""


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    warnings: tuple[str, ...] = ()  # allowed but probably not what the operator wants (logged by detect_placement)
    quantize: str | None = None  # "int8" | "int4": quantized weights (dtype is then the activations', float32)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.device} {self.quantize} weights, {dtype} activations" if self.quantize else f"{self.device} {dtype}"
        )


def parse_device_spec(spec: str) -> tuple[str, int | None]:
    """Syntax only (no hardware probe): 'auto' | 'cpu' | 'cuda' | 'cuda:N' -> (kind, index or None)."""
    match = _DEVICE_RE.match(spec.strip().lower()) if isinstance(spec, str) else None
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise UnknownDeviceError(f"device must be {DEVICE_SPECS}, got {spec!r}")
    kind, index = match.group(1), match.group(2)
    return kind, None if index is None else int(index)


def parse_dtype_spec(spec: str) -> torch.dtype | None:
    """Syntax only: 'auto' -> None (decided with the device), else the named (activation) dtype."""
    name = spec.strip().lower() if isinstance(spec, str) else ""
    name = DTYPE_ALIASES.get(name, name)
    if name == "auto":
        return None
    if name in QUANTIZED:
        return torch.float32
    if name not in DTYPES:
        choices = ", ".join([*DTYPES, *DTYPE_ALIASES, *QUANTIZED])
        raise UnknownDtypeError(f"dtype must be auto or one of {choices}, got {spec!r}")
    return DTYPES[name]


def quantized_spec(spec: str) -> str | None:
    """'int8' or 'int4' for a quantized-weights spec, else None."""
    name = spec.strip().lower() if isinstance(spec, str) else ""
    return name if name in QUANTIZED else None


def resolve_device(spec: str, cuda_available: bool, device_count: int) -> torch.device:
    kind, index = parse_device_spec(spec)
    if kind == "cpu" or (kind == "auto" and not (cuda_available and device_count > 0)):
        return torch.device("cpu")
    if not cuda_available or device_count < 1:
        raise CudaUnavailableError(
            f"device {spec!r} asks for CUDA, but this process has no CUDA device "
            "(a CPU build of torch, no driver, or CUDA_VISIBLE_DEVICES hides them); "
            "use cpu or auto"
        )
    index = 0 if index is None else index
    if index >= device_count:
        raise CudaIndexError(f"device {spec!r}: only {device_count} GPU(s) visible (cuda:0..cuda:{device_count - 1})")
    return torch.device("cuda", index)


def resolve_dtype(spec: str, device: torch.device, bf16_supported: bool) -> tuple[torch.dtype, tuple[str, ...]]:
    """(dtype, warnings) for `spec` on `device`; `bf16_supported`: the GPU computes bfloat16 natively."""
    dtype = parse_dtype_spec(spec)
    on_cuda = device.type == "cuda"
    if dtype is None:
        dtype = torch.float32 if not on_cuda else torch.bfloat16 if bf16_supported else torch.float16
        return dtype, ()
    warnings = []
    if quantized_spec(spec):
        if on_cuda:
            raise PlacementError(f"{spec} weights run on the CPU; on {device} use bfloat16 (or auto)")
        return dtype, ()
    if not on_cuda and dtype is torch.float16:
        # bfloat16 is faster than float32 on a CPU with AVX-512 BF16 (measured: make bench-engine); float16 is not
        warnings.append(f"{dtype} on the CPU is allowed but usually slower than float32 there")
    if on_cuda and dtype is torch.bfloat16 and not bf16_supported:
        warnings.append(
            f"{device} has no native bfloat16 (compute capability < 8.0): emulated, slow; "
            "float16 is the fast choice there"
        )
    return dtype, tuple(warnings)


def resolve_placement(
    device_spec: str,
    dtype_spec: str,
    *,
    cuda_available: bool,
    device_count: int,
    bf16_supported: bool,
    cpu_auto: str = CPU_DEFAULT,
) -> Placement:
    """The pure rule: settings + machine facts -> where and how the model computes (or a PlacementError);
    `cpu_auto`: what `auto` is on a CPU."""
    device = resolve_device(device_spec, cuda_available, device_count)
    if parse_dtype_spec(dtype_spec) is None and device.type == "cpu":
        dtype_spec = cpu_auto
    dtype, warnings = resolve_dtype(dtype_spec, device, bf16_supported)
    return Placement(device, dtype, warnings, quantize=quantized_spec(dtype_spec))


def plan_stage_devices(device_spec: str, num_stages: int, *, cuda_available: bool, device_count: int) -> list[str]:
    """One device string per pipeline stage: unindexed CUDA specs spread stage i to cuda:(i mod count);
    cuda:N pins all stages to GPU N; cpu (or auto without CUDA) keeps them all on the CPU."""
    if num_stages < 1:
        raise PlacementError(f"need at least one stage, got {num_stages}")
    first = resolve_device(device_spec, cuda_available, device_count)  # every refusal, before any process starts
    if first.type == "cpu":
        return ["cpu"] * num_stages
    _, index = parse_device_spec(device_spec)
    if index is not None:
        return [str(first)] * num_stages
    return [f"cuda:{i % device_count}" for i in range(num_stages)]


def cuda_facts() -> tuple[bool, int]:
    """(available, visible device count) without creating a CUDA context (safe before spawning workers)."""
    available = torch.cuda.is_available()
    return available, torch.cuda.device_count() if available else 0


def detect_placement(device_spec: str, dtype_spec: str, *, what: str = "model") -> Placement:
    """`resolve_placement` with this process's CUDA facts; logs the choice and any warning."""
    available, count = cuda_facts()
    device = resolve_device(device_spec, available, count)
    # Capability is asked only once a GPU is chosen: it initialises CUDA in this process.
    bf16 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
    native_layers = device.type != "cpu" or native_module() is not None
    if not native_layers and parse_dtype_spec(dtype_spec) is None and not os.environ.get(CPU_DEFAULT_ENV, "").strip():
        log.warning(
            "%s placement: the native int4/int8 layers are not built here (make native), so auto runs %s: "
            "int4 in plain torch ops would be many times slower",
            what,
            CPU_DEFAULT_WITHOUT_NATIVE,
        )
    placement = resolve_placement(
        device_spec,
        dtype_spec,
        cuda_available=available,
        device_count=count,
        bf16_supported=bf16,
        cpu_auto=cpu_default(native_layers),
    )
    if placement.quantize and not native_layers:
        log.warning(
            "%s placement: %s weights without the native layers (make native) compute in plain torch ops, several "
            "times slower than f32",
            what,
            placement.quantize,
        )
    for warning in placement.warnings:
        log.warning("%s placement: %s", what, warning)
    log.info("%s runs on %s (device=%s dtype=%s)", what, placement, device_spec, dtype_spec)
    return placement
