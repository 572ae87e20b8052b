"""The runner's quantized decoder layers in C++ (shared/model/native/layers.cpp), where it is built.

At int4 a decode token is about half matmul and half small operations, each paying 2-3 us of Python
and dispatch between the kernels. The C++ file keeps ATen's calls where the result depends on the kernel
(matmuls, reductions, softmax, SiLU) and runs the elementwise steps between them as loops of the same
float operations, so its results are the bits of layers.py / attention.py / invariant_attention.py
(tests check it); the interpreter and most dispatches between the kernels go.

It covers what decode and verification run: packed sessions' causal rows and draft-tree rows through
int4/int8 layers with batch-invariant attention, on the CPU in float32. Dense weights and other
devices stay on the Python runner, which is also the fallback where the extension was not built
(`make install` builds it; the container images have no compiler and run the Python runner).

The build is keyed by a hash of the source, its compiler flags, torch's version and Python's, so a stale
library is never loaded: a changed source without a new build means the Python runner until `make install`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from shared.model.attention import PassPlan
from shared.model.fused import FusedLayer, Projection, fused_layer
from shared.model.kv_cache import SessionKV

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "layers.cpp"
MODULE = "tophat_native_layers"
BUILD_ROOT_ENV = "TOPHAT_NATIVE_DIR"  # where builds live (default: the checkout's build/native)
SWITCH_ENV = "TOPHAT_NATIVE_LAYERS"  # "off": always the Python runner
# -march=native: the attention loops vectorize with this CPU's widest registers, lane by lane, which changes
# no bit; no contraction of a * b + c into one fused multiply-add, so each product rounds as ATen's kernels do
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off"]


def build_dir() -> Path:
    """This source's build directory: one per (source, torch, Python), so a stale build is never found."""
    root = Path(os.environ.get(BUILD_ROOT_ENV) or Path(__file__).resolve().parents[2] / "build" / "native")
    key = hashlib.sha256()
    for path in sources():
        key.update(path.name.encode() + path.read_bytes())
    key.update(f"{torch.__version__} {sys.version_info[:2]} {CFLAGS} {cpu_flags()}".encode())
    return root / key.hexdigest()[:16]


def sources() -> list[Path]:
    """The C++ file and the headers it includes (all of native/), in a fixed order."""
    return sorted(SOURCE.parent.glob("*.h")) + ([SOURCE] if SOURCE.exists() else [])


def cpu_flags() -> str:
    """This CPU's feature flags (the build targets the machine it is made on, -march=native)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def library_path() -> Path:
    return build_dir() / f"{MODULE}.so"


def build() -> Path:
    """Compile the extension into `build_dir()` (about 40 s on 2 cores) unless it is there already."""
    target = library_path()
    if not target.exists():
        from torch.utils.cpp_extension import load

        target.parent.mkdir(parents=True, exist_ok=True)
        load(MODULE, [str(SOURCE)], build_directory=str(target.parent), extra_cflags=CFLAGS, verbose=False)
    return target


_loaded: ModuleType | None = None
_load_tried = False
_load_lock = threading.Lock()
_disabled = 0  # python_runner() depth


def native_module() -> ModuleType | None:
    """The built extension, loaded once; None where it was not built, could not load, or is switched off."""
    if os.environ.get(SWITCH_ENV, "").lower() == "off":
        return None
    if not _load_tried:
        with _load_lock:  # pipeline stages may run their first passes in threads at once: one load
            _load_once()
    return _loaded


def _load_once() -> None:
    """Load the build (under _load_lock); marked tried only when done, so no thread sees a half-done load."""
    global _loaded, _load_tried
    if _load_tried:
        return
    path = library_path()
    if path.exists():
        try:
            spec = importlib.util.spec_from_file_location(MODULE, path)
            assert spec is not None and spec.loader is not None  # a file path always gives both
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _loaded = module
            log.info("native layers loaded from %s", path)
        except ImportError as error:
            log.warning("native layers at %s do not load (%s): the Python runner serves", path, error)
    else:
        log.info("native layers not built (%s): the Python runner serves", path)
    _load_tried = True


@contextlib.contextmanager
def python_runner() -> Iterator[None]:
    """Within it, every pass runs on the Python runner (benches compare the two side by side)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def native_attention(*tensors: torch.Tensor) -> ModuleType | None:
    """The extension, for batch-invariant attention over these tensors (float32 on the CPU), or None.

    python_runner() does not switch it off: the reference model, the Python runner and the C++ layers in
    one process must all attend with the same kernel to compute the same bits."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    return native_module()


_HANDLES: weakref.WeakKeyDictionary[FusedLayer, Any | None] = weakref.WeakKeyDictionary()


def _projection_parts(projection: Projection) -> list[torch.Tensor | None]:
    return [projection.weight, projection.scales, projection.bias]


def _is_silu(act_fn: Any) -> bool:
    """Whether the layer's activation computes F.silu's bits (the C++ file calls at::silu): nn.SiLU and
    transformers' own SiLU module both do; a probe tells, whatever the class."""
    probe = torch.linspace(-8, 8, 257)
    with torch.no_grad():
        return bool(torch.equal(act_fn(probe), torch.nn.functional.silu(probe)))


def native_layer(module: ModuleType, layer: Any) -> Any | None:
    """The C++ handle of one decoder layer, or None if it is not one the C++ file computes."""
    fused = fused_layer(layer)
    if fused in _HANDLES:
        return _HANDLES[fused]  # a handle, or None: a layer found unfit once is not probed again
    projections = (fused.qkv, fused.o, fused.gate_up, fused.down)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if (
        any(p.scales is None or p.weight.device.type != "cpu" for p in projections)
        or not _is_silu(layer.mlp.act_fn)
        or any(getattr(norm, "variance_epsilon", None) is None for norm in norms)
    ):
        _HANDLES[fused] = None
        return None
    handle = module.Layer(
        norms[0].weight,
        float(norms[0].variance_epsilon),
        norms[1].weight,
        float(norms[1].variance_epsilon),
        [part for p in projections for part in _projection_parts(p)],
        fused.q_size // fused.head_dim,
        fused.kv_size // fused.head_dim,
        fused.head_dim,
        float(fused.scaling),
    )
    _HANDLES[fused] = handle
    return handle


def run_native(
    layers: Sequence[torch.nn.Module], plan: PassPlan, hidden: torch.Tensor, caches: Sequence[SessionKV]
) -> torch.Tensor | None:
    """The pass on the C++ layers, or None where they do not apply (the caller runs the Python runner)."""
    # hidden: [T, H]
    module = None if _disabled else native_module()
    invariant = plan.invariant
    if module is None or invariant is None or hidden.dtype != torch.float32 or hidden.device.type != "cpu":
        return None
    if any(cache.layer(0).keys.dtype != torch.float32 for cache in caches if layers):
        return None
    handles = [native_layer(module, layer) for layer in layers]
    if any(handle is None for handle in handles):
        return None
    sessions = []
    for layout, cache, past, (start, stop) in zip(invariant.layouts, caches, plan.pasts, invariant.bounds):
        blocks = layout.blocks
        if blocks:  # a chain's blocks read up to their padded width; tree rows gather rows below the new length
            cache.reserve(past + layout.rows if layout.tails is not None else max(past + layout.rows, blocks[-1].width))
        sessions.append(
            module.SessionRows(
                start,
                stop,
                past,
                [block.bias for block in blocks],
                [block.start for block in blocks],
                [block.stop for block in blocks],
                [block.width for block in blocks],
                layout.shared,
                layout.tails,
            )
        )
    count = len(layers)
    keys = [cache.layer(index).keys for index in range(count) for cache in caches]
    values = [cache.layer(index).values for index in range(count) for cache in caches]
    out = module.run_layers(handles, hidden, keys, values, sessions, plan.cos, plan.sin)
    for cache, n in zip(caches, plan.lengths):
        cache.advance(n)
    return out
