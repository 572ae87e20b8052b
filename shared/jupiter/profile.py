"""A model's profile for Jupiter's planner (§III "profiler", §IV-B): per-layer compute time on the
reference device and the memory a stage needs.

Time: `t(S, c)`, seconds for ONE decoder layer to process a sub-sequence of S tokens when c
positions are already in its KV cache, measured on this machine, which stands for the reference
device class (orin, slowdown 1, shared/planning/device_speed.py). Other classes are the same table times
their slowdown: heterogeneity is emulated by stretching wall time, so one table serves all.
Between grid points the table is interpolated bilinearly; beyond the grid it is extrapolated
linearly from the two outermost points of each axis (attention's cost is linear in c, the
projections' and MLP's linear in S), floored at 0.

Memory: weights per decoder layer, KV bytes per token per layer (2 x kv_heads x head_dim x dtype),
embeddings, head (final norm + LM head) and the draft adapter, all in the dtype the layers run in.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np

log = logging.getLogger(__name__)

PROFILE_FORMAT = "tophat.jupiter.profile"
PROFILE_VERSION = 1
# Small enough to profile the demo model in ~15 s on one CPU core. Attention's cost is linear in c,
# so two prefixes pin it down (bilinear in S and c: exact for its S*c term); beyond S=512 the S^2
# term within a part is extrapolated linearly (under-estimated), which only flatters long parts,
# i.e. the serial and equal baselines, never the planned sub-sequences.
DEFAULT_LENGTHS = (1, 8, 32, 128, 512)
DEFAULT_PREFIXES = (0, 1024)
DEFAULT_REPEATS = 5


class ProfileError(ValueError):
    """A profile that is malformed, truncated, of another format version, or cannot be measured."""


def _check_grid(name: str, values: Sequence[int], lowest: int, min_points: int) -> tuple[int, ...]:
    grid = tuple(values)
    if len(grid) < min_points:
        raise ProfileError(f"profile {name} needs at least {min_points} points, got {list(grid)}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= lowest for v in grid):
        raise ProfileError(f"profile {name} must be integers >= {lowest}, got {list(grid)}")
    if any(b <= a for a, b in zip(grid, grid[1:])):
        raise ProfileError(f"profile {name} must be strictly increasing, got {list(grid)}")
    return grid


def _locate(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices (lo, hi) of the grid segment used for x and x's weight toward hi; outside the grid
    the outermost segment is used with a weight < 0 or > 1 (linear extrapolation)."""
    if len(grid) == 1:  # a single point: constant along this axis
        zero = np.zeros(np.shape(x), dtype=np.intp)
        return zero, zero, np.zeros(np.shape(x))
    lo = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, len(grid) - 2)
    hi = lo + 1
    return lo, hi, (x - grid[lo]) / (grid[hi] - grid[lo])


@dataclass(frozen=True)
class Profile:
    """One model's per-layer time table and memory sizes (see the module docstring)."""

    model_name: str
    num_layers: int
    hidden_size: int
    layer_weight_bytes: int  # one decoder layer's parameters
    kv_bytes_per_token_layer: int  # keys + values of one position in one layer
    embed_bytes: int  # token embeddings (the first stage)
    head_bytes: int  # final norm + LM head (the last stage; the first too, for drafting)
    lengths: tuple[int, ...]  # S grid, >= 1, strictly increasing, >= 2 points
    prefixes: tuple[int, ...]  # c grid, >= 0, strictly increasing, >= 1 point
    layer_times: tuple[tuple[float, ...], ...]  # [len(lengths)][len(prefixes)] seconds per layer
    draft_bytes: int = 0  # the draft adapter (the first stage)
    dtype: str = "float32"
    measured_on: str = ""
    _grid: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str):
            raise ProfileError(f"model_name must be a string, got {self.model_name!r}")
        for name in ("num_layers", "hidden_size", "layer_weight_bytes", "kv_bytes_per_token_layer"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ProfileError(f"profile {name} must be an integer >= 1, got {value!r}")
        for name in ("embed_bytes", "head_bytes", "draft_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ProfileError(f"profile {name} must be an integer >= 0, got {value!r}")
        lengths = _check_grid("lengths", self.lengths, 1, 2)
        prefixes = _check_grid("prefixes", self.prefixes, 0, 1)
        rows = tuple(tuple(row) for row in self.layer_times)
        if len(rows) != len(lengths) or any(len(row) != len(prefixes) for row in rows):
            raise ProfileError(f"layer_times must be {len(lengths)} rows of {len(prefixes)} times (lengths x prefixes)")
        for row in rows:
            for value in row:
                if (
                    not isinstance(value, (int, float))
                    or isinstance(value, bool)
                    or not math.isfinite(value)
                    or value <= 0
                ):
                    raise ProfileError(f"layer_times must be finite positive seconds, got {value!r}")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "prefixes", prefixes)
        object.__setattr__(self, "layer_times", tuple(tuple(float(v) for v in row) for row in rows))
        table = np.array(self.layer_times, dtype=np.float64)  # [nS, nC]
        object.__setattr__(self, "_grid", (np.array(lengths, np.float64), np.array(prefixes, np.float64), table))

    # --- time -------------------------------------------------------------------------------
    def layer_time(self, length, prefix):
        """Seconds for one decoder layer on the reference device: S=`length` new tokens after
        `prefix` cached ones. Scalars give a float; numpy arrays broadcast and give an array."""
        s_grid, c_grid, table = self._grid
        s, c = np.broadcast_arrays(np.asarray(length, np.float64), np.asarray(prefix, np.float64))
        i0, i1, ws = _locate(s_grid, s)
        j0, j1, wc = _locate(c_grid, c)
        value = (
            (1 - ws) * (1 - wc) * table[i0, j0]
            + ws * (1 - wc) * table[i1, j0]
            + (1 - ws) * wc * table[i0, j1]
            + ws * wc * table[i1, j1]
        )
        value = np.maximum(value, 0.0)
        return float(value) if value.ndim == 0 else value

    def stage_time(self, num_layers: int, length, prefix, slowdown: float = 1.0):
        """Seconds for a stage of `num_layers` layers on a device `slowdown` times the reference."""
        return num_layers * self.layer_time(length, prefix) * slowdown

    # --- memory -----------------------------------------------------------------------------
    @property
    def embed_head_bytes(self) -> int:
        return self.embed_bytes + self.head_bytes

    def stage_memory(
        self,
        num_layers: int,
        max_len: int,
        with_embeddings: bool = False,
        with_head: bool = False,
        with_draft: bool = False,
    ) -> int:
        """Bytes a stage of `num_layers` layers holds with one sequence of `max_len` positions in its
        KV cache. `with_embeddings` adds embeddings + head (the first stage: it embeds and drafts
        with the head), `with_head` the head alone (the last stage), `with_draft` the adapter."""
        total = num_layers * (self.layer_weight_bytes + max_len * self.kv_bytes_per_token_layer)
        if with_embeddings:
            total += self.embed_head_bytes
        elif with_head:
            total += self.head_bytes
        if with_draft:
            total += self.draft_bytes
        return total

    # --- storage ----------------------------------------------------------------------------
    def to_json(self) -> dict:
        body = {name: getattr(self, name) for name in _stored_fields()}
        body["lengths"], body["prefixes"] = list(self.lengths), list(self.prefixes)
        body["layer_times"] = [list(row) for row in self.layer_times]
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **body}

    @classmethod
    def from_json(cls, obj: object) -> "Profile":
        obj = check_document(obj, PROFILE_FORMAT, PROFILE_VERSION, ProfileError, "profile")
        names = _stored_fields()
        required = [f for f in names if cls.__dataclass_fields__[f].default is MISSING]
        missing = [f for f in required if f not in obj]
        if missing:
            raise ProfileError(f"profile is missing {', '.join(missing)}")
        try:
            return cls(**{f: obj[f] for f in names if f in obj})
        except (TypeError, ValueError) as exc:
            raise ProfileError(f"bad profile: {exc}") from exc

    def save(self, path: str | Path) -> Path:
        return save_json(path, self.to_json())


def check_document(obj: object, fmt: str, version: int, error: type[ValueError], what: str) -> dict[str, Any]:
    """A stored profile or plan is a JSON object naming its format and version: refuse anything else.
    Returns `obj`, known from here on to be that object."""
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        raise error(f"not a Jupiter {what} (expected format {fmt!r})")
    if obj.get("version") != version:
        raise error(
            f"{what} format version {obj.get('version')!r}; this build reads version {version} (re-run `tophat {what}`)"
        )
    return obj


def save_json(path: str | Path, obj: dict) -> Path:
    """Write `obj` as JSON through a temporary file, so a reader never sees half a profile or plan."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)
    return path


def _stored_fields() -> list[str]:
    return [f.name for f in fields(Profile) if f.init]


def load_profile(path: str | Path) -> Profile:
    """Read a profile written by `Profile.save`; any defect is a ProfileError naming the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path} is not valid JSON (truncated?): {exc}") from exc
    try:
        return Profile.from_json(obj)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from exc


def measure_profile(
    model_dir: str | Path,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    prefixes: Sequence[int] = DEFAULT_PREFIXES,
    repeats: int = DEFAULT_REPEATS,
    model_name: str | None = None,
    seed: int = 0,
) -> Profile:
    """Time the model's whole decoder stack (`LayerRange(0, n)`) on this machine at every (S, c)
    of the grid: the cache is first filled with c random hidden states (untimed), then S new
    positions are timed `repeats` times (the cache rolled back to c in between). Per-layer time =
    median stack time / n. Sizes come from the parameters and the config."""
    import torch

    from shared.model.checkpoint import load_checkpoint
    from shared.model.split import LayerRange, warm_up_layers

    lengths = _check_grid("lengths", [int(v) for v in lengths], 1, 2)
    prefixes = _check_grid("prefixes", [int(v) for v in prefixes], 0, 1)
    if repeats < 1:
        raise ProfileError(f"repeats must be >= 1, got {repeats}")
    model_dir = Path(model_dir)
    checkpoint = load_checkpoint(model_dir, with_tokenizer=False)
    n, hidden = checkpoint.num_layers, checkpoint.hidden_size
    stack = LayerRange(checkpoint, 0, n)
    warm_up_layers(stack, hidden, sizes=(max(lengths), 1))
    generator = torch.Generator().manual_seed(seed)

    def random_hidden(rows: int) -> torch.Tensor:
        # hidden: [rows, H], unit scale like a normalised residual stream
        return torch.randn(rows, hidden, generator=generator).to(stack.dtype)

    table = []
    for length in lengths:
        row = []
        for prefix in prefixes:
            cache = stack.new_cache()
            try:
                if prefix:
                    stack.forward_batch([(cache, random_hidden(prefix))])
                new = random_hidden(length)
                samples = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    stack.forward_batch([(cache, new)])
                    if stack.device.type == "cuda":
                        torch.cuda.synchronize(stack.device)
                    samples.append(time.perf_counter() - start)
                    cache.truncate(prefix)
            finally:
                cache.free()
            row.append(max(statistics.median(samples) / n, 1e-9))
        table.append(tuple(row))
        log.info("profiled S=%d: %s", length, ", ".join(f"c={c}: {t * 1e3:.3f}ms" for c, t in zip(prefixes, row)))

    def param_bytes(module: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    inner = checkpoint.decoder
    element = torch.empty((), dtype=stack.dtype).element_size()
    draft_file = model_dir / "draft_adapter.safetensors"
    return Profile(
        model_name=model_name or model_dir.name,
        num_layers=n,
        hidden_size=hidden,
        layer_weight_bytes=max(param_bytes(layer) for layer in inner.layers),
        kv_bytes_per_token_layer=2 * stack.num_kv_heads * stack.head_dim * element,
        embed_bytes=param_bytes(inner.embed_tokens),
        # lm_head is set at run time: nn.Module.__getattr__ types it Tensor | Module
        head_bytes=param_bytes(inner.norm) + param_bytes(checkpoint.model.lm_head),  # type: ignore[arg-type]
        draft_bytes=draft_file.stat().st_size if draft_file.is_file() else 0,
        lengths=lengths,
        prefixes=prefixes,
        layer_times=tuple(table),
        dtype=str(stack.dtype).removeprefix("torch."),
        measured_on=f"{stack.device.type}, {torch.get_num_threads()} threads",
    )
