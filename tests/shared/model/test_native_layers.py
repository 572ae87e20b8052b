"""The C++ layers (shared/model/native_layers.py) against the Python runner: the same bits, or not used at all.

`make install` builds the extension, so these tests expect it built. Every comparison is exact (torch.equal):
the C++ file computes what the Python runner's ATen operations do, element for element and with the same
reductions, so nothing may differ, in outputs or caches.
"""

from __future__ import annotations

import pytest
import torch

from shared.model import native_build, native_layers
from shared.model.attention import PassPlan
from shared.model.checkpoint import load_checkpoint
from shared.model.fused import fused_layer
from shared.model.invariant_attention import uses_invariant_attention
from shared.model.kv_cache import KVCacheError, SessionKV
from shared.model.native_build import native_module
from shared.model.native_layers import python_runner, run_native
from shared.model.quantized import QuantizedLinear
from shared.model.split import LayerRange, OutputSubmodel
from shared.model.tree_rows import TreeRows, ancestor_mask_from_parents
from tests.conftest import DEMO_MODEL_DIR


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request):
    checkpoint = load_checkpoint(DEMO_MODEL_DIR, quantize=request.param, with_tokenizer=False)
    return LayerRange(checkpoint, 0, checkpoint.num_layers), checkpoint.hidden_size


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized_head(request):
    """The final norm and int8 LM head of a quantized checkpoint (int4 layers keep an int8 head)."""
    checkpoint = load_checkpoint(DEMO_MODEL_DIR, quantize=request.param, with_tokenizer=False)
    return OutputSubmodel(checkpoint), checkpoint.hidden_size


def prefilled_pair(layers: LayerRange, prefix: torch.Tensor) -> tuple[SessionKV, SessionKV]:
    """Two caches holding the same prefix, one filled by each runner."""
    native_cache, python_cache = layers.new_cache(), layers.new_cache()
    if not prefix.shape[0]:
        return native_cache, python_cache
    layers.forward_batch([(native_cache, prefix)])
    with python_runner():
        layers.forward_batch([(python_cache, prefix)])
    return native_cache, python_cache


def assert_same_caches(one: SessionKV, other: SessionKV) -> None:
    assert one.length == other.length
    for index in range(len(one.layers or [])):
        a, b = one.layer(index), other.layer(index)
        assert torch.equal(a.keys[:, : a.length], b.keys[:, : b.length])
        assert torch.equal(a.values[:, : a.length], b.values[:, : b.length])


@pytest.mark.parametrize(
    "prefixes, new_rows",
    [
        ([5], [1]),  # a decode step
        ([0], [70]),  # a prefill of two causal blocks
        ([31], [1]),  # the row that fills a 32-position chunk
        ([40, 7, 100], [1, 5, 0]),  # packed sessions, one without new rows
        ([3, 64], [66, 2]),  # a long chunk beside a short one
    ],
)
def test_a_native_pass_gives_the_python_runners_bits(quantized, prefixes, new_rows):
    layers, hidden = quantized
    generator = torch.Generator().manual_seed(sum(prefixes) + sum(new_rows))
    pairs = [prefilled_pair(layers, torch.randn(n, hidden, generator=generator)) for n in prefixes]
    rows = [torch.randn(n, hidden, generator=generator) for n in new_rows]
    native_out = layers.forward_batch([(native, r) for (native, _), r in zip(pairs, rows)])
    with python_runner():
        python_out = layers.forward_batch([(python, r) for (_, python), r in zip(pairs, rows)])
    for a, b in zip(native_out, python_out):
        assert torch.equal(a, b)
    for native, python in pairs:
        assert_same_caches(native, python)


@pytest.mark.parametrize("base", [20, 70], ids=["tree-within-the-first-chunk", "tree-after-whole-chunks"])
def test_tree_rows_beside_chains_give_the_python_runners_bits(quantized, base):
    layers, hidden = quantized
    generator = torch.Generator().manual_seed(base)
    pairs = [prefilled_pair(layers, torch.randn(n, hidden, generator=generator)) for n in (40, base, 7)]
    parents = [-1, 0, 0, 1, 2, 4, 4]
    trees = [None, TreeRows.for_new_tree(base, ancestor_mask_from_parents(parents)), None]
    rows = [torch.randn(n, hidden, generator=generator) for n in (1, len(parents), 3)]
    native_out = layers.forward_batch([(native, r) for (native, _), r in zip(pairs, rows)], trees)
    with python_runner():
        python_out = layers.forward_batch([(python, r) for (_, python), r in zip(pairs, rows)], trees)
    for a, b in zip(native_out, python_out):
        assert torch.equal(a, b)
    for native, python in pairs:
        assert_same_caches(native, python)


@torch.inference_mode()
def test_the_runner_takes_the_native_path_where_it_applies(quantized):
    layers, hidden = quantized
    cache = layers.new_cache()
    modules = list(layers.layers)
    out = run_native(modules, plan_for(layers, [cache], [3], hidden), torch.randn(3, hidden), [cache])
    assert out is not None and out.shape == (3, hidden) and cache.length == 3
    tree = TreeRows.for_new_tree(3, ancestor_mask_from_parents([-1, 0, 0]))
    out = run_native(modules, plan_for(layers, [cache], [3], hidden, [tree]), torch.randn(3, hidden), [cache])
    assert out is not None and cache.length == 6


@torch.inference_mode()
def test_a_ranges_handles_are_made_once_and_again_after_a_weight_is_replaced():
    checkpoint = load_checkpoint(DEMO_MODEL_DIR, quantize="int4", with_tokenizer=False)
    layers, hidden = LayerRange(checkpoint, 0, checkpoint.num_layers), checkpoint.hidden_size
    module, modules = native_module(), list(layers.layers)
    first = native_layers.range_handles(module, modules)
    assert first is not None and native_layers.range_handles(module, modules) is first
    assert native_layers.range_handles(module, modules[1:]) is not first  # another range, its own handles
    # the last layer's down projection re-quantized from other values: the next pass must compute with it
    down = modules[-1].mlp.down_proj
    modules[-1].mlp.down_proj = QuantizedLinear.from_linear(
        torch.nn.Linear(down.in_features, down.out_features), bits=4
    )
    again = native_layers.range_handles(module, modules)
    assert again is not None and again is not first and again[:-1] == first[:-1] and again[-1] is not first[-1]
    rows = torch.randn(3, hidden)
    native_cache, python_cache = layers.new_cache(), layers.new_cache()
    out = run_native(modules, plan_for(layers, [native_cache], [3], hidden), rows, [native_cache])
    with python_runner():
        expected = layers.forward_batch([(python_cache, rows)])[0]
    assert out is not None and torch.equal(out, expected)
    # a module moved off its tensors (here: a buffer replaced in its dict, as .to() does) is noticed too
    modules[0].self_attn.o_proj._buffers["weight"] = modules[0].self_attn.o_proj.weight.clone()
    third = native_layers.range_handles(module, modules)
    assert third is not None and third[0] is not again[0] and third[1:] == again[1:]


def plan_for(layers: LayerRange, caches, lengths, hidden: int, trees=None):
    modules = list(layers.layers)
    like = torch.zeros(sum(lengths), hidden)
    return PassPlan.build(layers.rotary_emb, like, caches, lengths, trees, invariant=uses_invariant_attention(modules))


@torch.inference_mode()
def test_dense_weights_and_the_switches_keep_the_python_runner(quantized, monkeypatch):
    layers, hidden = quantized
    modules = list(layers.layers)
    cache = layers.new_cache()
    layers.forward_batch([(cache, torch.randn(4, hidden))])
    rows = torch.randn(3, hidden)
    with python_runner():
        assert run_native(modules, plan_for(layers, [cache], [3], hidden), rows, [cache]) is None
    assert cache.length == 4  # untouched
    monkeypatch.setenv(native_build.SWITCH_ENV, "off")
    assert native_module() is None
    assert run_native(modules, plan_for(layers, [cache], [3], hidden), rows, [cache]) is None

    dense = load_checkpoint(DEMO_MODEL_DIR, with_tokenizer=False)
    monkeypatch.delenv(native_build.SWITCH_ENV)
    dense_layers = LayerRange(dense, 0, dense.num_layers)
    dense_cache = dense_layers.new_cache()
    plan = plan_for(dense_layers, [dense_cache], [2], hidden)
    assert run_native(list(dense_layers.layers), plan, torch.randn(2, hidden), [dense_cache]) is None


def test_without_a_compiler_the_build_is_skipped_in_one_line_and_torch_computes(
    quantized, tmp_path, monkeypatch, caplog
):
    layers, hidden = quantized
    monkeypatch.setenv(native_build.BUILD_ROOT_ENV, str(tmp_path))  # no build there
    monkeypatch.setenv("CXX", "g++")
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)  # and no compiler on PATH
    monkeypatch.setattr(native_build, "_loaded", None)
    monkeypatch.setattr(native_build, "_load_tried", False)
    with caplog.at_level("WARNING", logger=native_build.__name__):
        assert native_build.build() is None
    assert [r.getMessage() for r in caplog.records] == [native_build.no_compiler_message()]
    assert "no C++ compiler (g++ is not on PATH" in native_build.no_compiler_message()
    assert native_build.build_summary() == native_build.no_compiler_message()  # make native's one line
    assert not native_build.library_path().exists() and native_module() is None
    cache = layers.new_cache()
    rows = torch.randn(3, hidden)
    assert run_native(list(layers.layers), plan_for(layers, [cache], [3], hidden), rows, [cache]) is None
    out = layers.forward_batch([(cache, rows)])  # the Python runner and torch's attention
    assert cache.length == 3 and out[0].shape == (3, hidden) and torch.isfinite(out[0]).all()


@torch.inference_mode()
def test_bad_arguments_to_the_extension_raise_instead_of_crashing(quantized):
    layers, hidden = quantized
    module = native_module()
    assert module is not None
    cache = layers.new_cache()
    plan = plan_for(layers, [cache], [2], hidden)
    modules = list(layers.layers)
    assert run_native(modules, plan, torch.randn(2, hidden), [cache]) is not None
    handles = [native_layers.native_layer(module, layer) for layer in modules]
    session = module.SessionRows(0, 2, 0, [torch.zeros(2, 32)], [0], [2], [32])
    keys = [cache.layer(i).keys for i in range(len(modules))]
    values = [cache.layer(i).values for i in range(len(modules))]
    with pytest.raises(RuntimeError, match="one key and one value cache"):
        module.run_layers(handles, torch.randn(2, hidden), keys[:-1], values, [session], plan.cos, plan.sin)
    with pytest.raises(RuntimeError, match="add up to the packed rows"):
        module.run_layers(handles, torch.randn(3, hidden), keys, values, [session], plan.cos, plan.sin)
    with pytest.raises(RuntimeError, match="one start, stop and width"):
        bad = module.SessionRows(0, 2, 0, [torch.zeros(2, 32)], [0], [2], [])
        module.run_layers(handles, torch.randn(2, hidden), keys, values, [bad], plan.cos, plan.sin)
    with pytest.raises(RuntimeError, match="the layers' width"):
        module.run_layers(handles, torch.randn(2, hidden + 1), keys, values, [session], plan.cos, plan.sin)
    with pytest.raises(RuntimeError, match="room for its session's past and new rows"):
        late = keys[0].shape[1] - 1
        past = module.SessionRows(0, 2, late, [torch.zeros(2, late + 2)], [0], [2], [late + 2])
        module.run_layers(handles, torch.randn(2, hidden), keys, values, [past], plan.cos, plan.sin)
    with pytest.raises(RuntimeError, match="a block's width reaches its last row"):
        short = module.SessionRows(0, 2, 40, [torch.zeros(2, 32)], [0], [2], [32])
        module.run_layers(handles, torch.randn(2, hidden), keys, values, [short], plan.cos, plan.sin)
    with pytest.raises(RuntimeError, match="past rows are not negative"):  # was an out-of-bounds write
        negative = module.SessionRows(0, 2, -5, [torch.zeros(2, 32)], [0], [2], [32])
        module.run_layers(handles, torch.randn(2, hidden), keys, values, [negative], plan.cos, plan.sin)
    with pytest.raises(RuntimeError, match="cover its rows in order"):  # a block over 1 of 2 rows: reads past it
        partial = module.SessionRows(0, 2, 0, [torch.zeros(1, 32)], [1], [2], [32])
        module.run_layers(handles, torch.randn(2, hidden), keys, values, [partial], plan.cos, plan.sin)
    with pytest.raises(RuntimeError, match="cover all its rows"):
        uncovered = module.SessionRows(0, 2, 0, [torch.zeros(1, 32)], [0], [1], [32])
        module.run_layers(handles, torch.randn(2, hidden), keys, values, [uncovered], plan.cos, plan.sin)
    with pytest.raises(RuntimeError, match="float caches"):
        halves = [k.bfloat16() for k in keys]
        module.run_layers(handles, torch.randn(2, hidden), halves, values, [session], plan.cos, plan.sin)


def test_a_cache_reserves_room_and_advances_into_it():
    cache = SessionKV(2, 3, 8)
    cache.reserve(100)
    assert all(layer.capacity >= 100 and layer.length == 0 for layer in cache.layers or [])
    cache.advance(100)
    assert cache.length == 100
    with pytest.raises(KVCacheError):
        cache.advance(cache.layer(0).capacity)


@torch.inference_mode()
def test_a_layer_with_another_activation_keeps_the_python_runner():
    checkpoint = load_checkpoint(DEMO_MODEL_DIR, quantize="int4", with_tokenizer=False)
    layers = LayerRange(checkpoint, 0, checkpoint.num_layers)
    layers.layers[-1].mlp.act_fn = torch.nn.GELU()  # not the at::silu the C++ file calls
    cache, hidden = layers.new_cache(), checkpoint.hidden_size
    rows = torch.randn(2, hidden)
    for _ in range(2):  # found unfit once, then remembered
        assert run_native(list(layers.layers), plan_for(layers, [cache], [2], hidden), rows, [cache]) is None
    assert cache.length == 0


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_the_native_head_gives_the_python_heads_bits(quantized_head, rows):
    head, hidden = quantized_head
    x = torch.randn(rows, hidden) * 4
    native = native_layers.run_native_head(head.norm, head.lm_head, x)
    with python_runner():
        assert native_layers.run_native_head(head.norm, head.lm_head, x) is None
        expected = head(x)
    assert native is not None and native.dtype == torch.float32 and torch.equal(native, expected)
    assert torch.equal(head(x), expected)  # the submodel takes the native path


class HalfNorm(torch.nn.Module):
    """An RMSNorm look-alike (a gain and an epsilon) that computes something else: the probe must refuse it."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


@torch.inference_mode()
def test_the_native_head_is_used_only_where_it_computes_the_same_bits(quantized_head):
    head, hidden = quantized_head
    x = torch.randn(2, hidden)
    assert native_layers.run_native_head(HalfNorm(head.norm), head.lm_head, x) is None
    assert native_layers.run_native_head(head.norm, torch.nn.Linear(hidden, 7), x) is None  # a dense head
    assert native_layers.run_native_head(head.norm, head.lm_head, x.double()) is None
    assert native_layers.run_native_head(head.norm, head.lm_head, x) is not None


def test_a_layer_with_impossible_heads_is_refused_when_made():
    """0 key/value heads was a division by zero (SIGFPE) in the first pass; now the handle is refused."""
    checkpoint = load_checkpoint(DEMO_MODEL_DIR, quantize="int4", with_tokenizer=False)
    layer = checkpoint.decoder.layers[0]
    module = native_module()
    fused = fused_layer(layer)
    parts = [part for p in (fused.qkv, fused.o, fused.gate_up, fused.down) for part in (p.weight, p.scales, p.bias)]
    norms = (layer.input_layernorm.weight, 1e-5, layer.post_attention_layernorm.weight, 1e-5)
    heads = fused.q_size // fused.head_dim
    for q_heads, kv_heads, head_dim in (
        (heads, 0, fused.head_dim),
        (0, 1, fused.head_dim),
        (heads, 3, fused.head_dim),
        (heads, fused.kv_size // fused.head_dim, fused.head_dim + 2),
    ):
        with pytest.raises(RuntimeError, match="head|qkv"):
            module.Layer(*norms, parts, q_heads, kv_heads, head_dim, 0.125)
