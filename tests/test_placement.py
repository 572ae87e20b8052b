"""Device and dtype placement: the pure resolver, the stage -> GPU plan, settings, and that a
bfloat16 split model computes what the bfloat16 unsplit model computes, token for token."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from shared.model.placement import (CudaIndexError, CudaUnavailableError, PlacementError, UnknownDeviceError,
                                    UnknownDtypeError, detect_placement, plan_stage_devices, resolve_placement)

CPU_ONLY = dict(cuda_available=False, device_count=0)
TWO_GPUS = dict(cuda_available=True, device_count=2)


def place(device: str, dtype: str = "auto", bf16: bool = True, **facts):
    return resolve_placement(device, dtype, bf16_supported=bf16, **(facts or CPU_ONLY))


# -- the resolver ------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["auto", "cpu", "CPU", " auto "])
def test_without_cuda_auto_and_cpu_resolve_to_cpu_float32(spec):
    placement = place(spec)
    assert placement.device == torch.device("cpu") and placement.dtype is torch.float32
    assert placement.warnings == ()


def test_auto_picks_the_first_gpu_and_bfloat16_where_supported():
    assert place("auto", **TWO_GPUS) == resolve_placement("cuda:0", "bfloat16", bf16_supported=True, **TWO_GPUS)
    placement = place("auto", **TWO_GPUS)
    assert placement.device == torch.device("cuda", 0) and placement.dtype is torch.bfloat16


def test_auto_dtype_is_float16_on_a_gpu_without_bfloat16():
    placement = place("cuda", bf16=False, **TWO_GPUS)
    assert placement.device == torch.device("cuda", 0) and placement.dtype is torch.float16
    assert placement.warnings == ()


def test_cpu_stays_cpu_even_with_gpus_present():
    placement = place("cpu", **TWO_GPUS)
    assert placement.device == torch.device("cpu") and placement.dtype is torch.float32


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_asked_without_cuda_is_a_typed_error(spec):
    with pytest.raises(CudaUnavailableError, match="no CUDA device"):
        place(spec)
    with pytest.raises(CudaUnavailableError):  # available but zero visible devices
        place(spec, cuda_available=True, device_count=0)


def test_cuda_index_beyond_the_visible_gpus_is_a_typed_error():
    assert place("cuda:1", **TWO_GPUS).device == torch.device("cuda", 1)
    with pytest.raises(CudaIndexError, match="only 2 GPU"):
        place("cuda:3", **TWO_GPUS)


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "cpu:0", "auto:1", "cuda:x", "", "mps"])
def test_unknown_device_specs_are_refused(spec):
    with pytest.raises(UnknownDeviceError, match="auto, cpu, cuda or cuda:N"):
        place(spec, **TWO_GPUS)


@pytest.mark.parametrize("spec", ["fp16", "half", "float64", "int8", ""])
def test_unknown_dtypes_are_refused(spec):
    with pytest.raises(UnknownDtypeError, match="auto or one of float32, float16, bfloat16"):
        place("cpu", spec)


def test_errors_are_value_errors_so_settings_validation_reports_them():
    assert issubclass(PlacementError, ValueError)
    for error in (UnknownDeviceError, UnknownDtypeError, CudaUnavailableError, CudaIndexError):
        assert issubclass(error, PlacementError)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_on_the_cpu_is_allowed_with_a_warning(dtype):
    placement = place("cpu", dtype)
    assert placement.dtype is getattr(torch, dtype)
    assert len(placement.warnings) == 1 and "CPU" in placement.warnings[0]


def test_explicit_dtypes_are_kept_and_emulated_bfloat16_warns():
    assert place("cuda", "float32", **TWO_GPUS).dtype is torch.float32
    assert place("cuda", "float16", bf16=False, **TWO_GPUS).warnings == ()
    emulated = place("cuda", "bfloat16", bf16=False, **TWO_GPUS)
    assert emulated.dtype is torch.bfloat16 and "no native bfloat16" in emulated.warnings[0]


def test_detect_placement_on_this_machine_matches_the_pure_rule():
    available = torch.cuda.is_available()
    placement = detect_placement("auto", "auto")
    assert placement.device.type == ("cuda" if available else "cpu")
    if not available:
        assert placement.dtype is torch.float32
        with pytest.raises(CudaUnavailableError):
            detect_placement("cuda", "auto")


# -- pipeline stages -> GPUs ---------------------------------------------------------------

def test_stages_spread_one_per_gpu_round_robin():
    assert plan_stage_devices("auto", 4, cuda_available=True, device_count=4) == [f"cuda:{i}" for i in range(4)]
    assert plan_stage_devices("cuda", 8, cuda_available=True, device_count=8) == [f"cuda:{i}" for i in range(8)]
    assert plan_stage_devices("cuda", 5, **TWO_GPUS) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert plan_stage_devices("auto", 1, **TWO_GPUS) == ["cuda:0"]


def test_an_indexed_gpu_pins_every_stage():
    assert plan_stage_devices("cuda:1", 3, **TWO_GPUS) == ["cuda:1"] * 3


def test_stages_stay_on_the_cpu_without_cuda_or_when_asked():
    assert plan_stage_devices("auto", 3, **CPU_ONLY) == ["cpu"] * 3
    assert plan_stage_devices("cpu", 2, cuda_available=True, device_count=8) == ["cpu"] * 2


def test_stage_plan_refuses_what_the_resolver_refuses():
    with pytest.raises(CudaUnavailableError):
        plan_stage_devices("cuda", 2, **CPU_ONLY)
    with pytest.raises(CudaIndexError):
        plan_stage_devices("cuda:2", 2, **TWO_GPUS)
    with pytest.raises(PlacementError):
        plan_stage_devices("auto", 0, **TWO_GPUS)
