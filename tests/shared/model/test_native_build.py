"""The C++ extension's build and loading (shared/model/native_build.py), and its batch-invariant attention
(native/attention.h) against invariant_attention's torch version: close, not equal (another order of sums,
another exp); each one's own invariance is tested in test_invariant_attention.py, both ways."""

from __future__ import annotations

import pytest
import torch

from shared.model import invariant_attention, native_build
from shared.model.invariant_attention import RowLayout, padded_length
from shared.model.native_build import native_module
from shared.model.quantized import project
from shared.model.tree_rows import TreeRows, ancestor_mask_from_parents


def test_make_install_built_the_extension_and_it_loads():
    reason = None if native_build.library_path().exists() else native_build.missing()
    if reason is not None:
        pytest.skip(reason)  # make install skipped it, as it should
    assert native_build.library_path().exists(), "make install builds it (make native)"
    assert native_module() is not None


def test_without_python_headers_the_build_is_skipped_in_one_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(native_build.BUILD_ROOT_ENV, str(tmp_path))  # no build there
    monkeypatch.setattr(native_build, "compiler", lambda: "/usr/bin/c++")  # a compiler, but no Python.h
    monkeypatch.setattr(native_build, "python_header", lambda: tmp_path / "include" / "Python.h")
    with caplog.at_level("WARNING", logger=native_build.__name__):
        assert native_build.build() is None
    line = native_build.no_headers_message()
    assert [r.getMessage() for r in caplog.records] == [line]
    assert f"no Python headers ({tmp_path}/include/Python.h is missing; install python3-dev)" in line
    assert native_build.build_summary() == line  # make native's one line
    assert not native_build.library_path().exists()


def test_the_ninja_torch_runs_is_on_path_for_the_build_only(monkeypatch):
    monkeypatch.setenv("PATH", "/nowhere")
    with native_build.ninja_on_path():
        assert native_build.shutil.which("ninja") is not None  # the ninja wheel's, a dependency
    assert native_build.os.environ["PATH"] == "/nowhere"


def test_a_changed_source_is_a_new_build_directory(tmp_path, monkeypatch):
    before = native_build.build_dir()
    changed = tmp_path / "layers.cpp"
    changed.write_bytes(native_build.SOURCE.read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(native_build, "SOURCE", changed)
    assert native_build.build_dir() != before
    assert not native_build.library_path().exists()
    monkeypatch.setenv(native_build.BUILD_ROOT_ENV, str(tmp_path))
    assert native_build.build_dir().parent == tmp_path


def test_a_fresh_build_is_found_where_it_was_built_in_the_same_process(tmp_path, monkeypatch):
    """torch's builder appends its own flags to the lists it is given; the build key hashes ours, so a build that
    handed over its own lists was looked for elsewhere right after (the cpu image's build stage checks that)."""
    import torch.utils.cpp_extension

    def load(name, sources, build_directory, extra_cflags, extra_ldflags, verbose):
        extra_cflags.append("-fPIC")
        extra_ldflags.append("-shared")
        (native_build.Path(build_directory) / f"{name}.so").write_bytes(b"built")

    monkeypatch.setenv(native_build.BUILD_ROOT_ENV, str(tmp_path))
    monkeypatch.setattr(native_build, "missing", lambda: None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    before = native_build.library_path()
    assert native_build.build() == before
    assert native_build.library_path() == before and before.exists()


def test_a_build_that_does_not_load_leaves_torch_to_compute(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(native_build.BUILD_ROOT_ENV, str(tmp_path))
    native_build.build_dir().mkdir(parents=True)
    native_build.library_path().write_bytes(b"not a shared library")
    monkeypatch.setattr(native_build, "_loaded", None)
    monkeypatch.setattr(native_build, "_load_tried", False)
    with caplog.at_level("WARNING", logger=native_build.__name__):
        assert native_module() is None
    assert "do not load" in caplog.text


def torch_attention(monkeypatch, function, *args):
    """invariant_attention's torch version of `function` (the C++ kernels switched off for the call)."""
    with monkeypatch.context() as patch:
        patch.setenv(native_build.SWITCH_ENV, "off")
        return function(*args)


@pytest.mark.parametrize("past, rows", [(0, 1), (37, 1), (5, 40), (100, 3)])
def test_the_native_attention_is_close_to_the_torch_version(monkeypatch, past, rows):
    generator = torch.Generator().manual_seed(past + rows)
    width = padded_length(past + rows)
    queries = torch.randn(2, 3, 3, rows, 64, generator=generator)  # [B, Hkv, G, n, D]
    keys, values = (torch.randn(2, 3, width, 64, generator=generator) * 3 for _ in range(2))
    seen = torch.arange(width)[None, :] <= past + torch.arange(rows)[:, None]
    bias = torch.zeros(rows, width).masked_fill(~seen, float("-inf"))
    module = native_module()
    native = module.attend(queries, keys, values, bias, 0.125)
    reference = torch_attention(monkeypatch, invariant_attention.attend, queries, keys, values, bias, 0.125)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)  # other sum orders, another exp
    assert torch.equal(invariant_attention.attend(queries, keys, values, bias, 0.125), native)  # the dispatch


def test_the_native_tree_attention_is_close_to_the_torch_version(monkeypatch):
    generator = torch.Generator().manual_seed(7)
    length, parents = 70, [-1, 0, 0, 1, 2]
    keys, values = (torch.randn(3, length, 64, generator=generator) for _ in range(2))
    tree = TreeRows.for_new_tree(length - len(parents), ancestor_mask_from_parents(parents))
    layout = RowLayout.build(length - len(parents), len(parents), tree, "cpu")
    queries = torch.randn(3, 3, len(parents), 64, generator=generator)
    args = (queries, keys, values, layout.shared, layout.tails, layout.blocks[0].bias, 0.125)
    native = native_module().attend_paths(*args)
    torch.testing.assert_close(native, torch_attention(monkeypatch, invariant_attention.attend_paths, *args))


def test_bad_arguments_to_the_native_attention_raise_instead_of_crashing():
    module = native_module()
    queries, keys, bias = torch.randn(1, 3, 3, 1, 64), torch.randn(1, 3, 32, 64), torch.zeros(1, 32)
    with pytest.raises(RuntimeError, match="float on the CPU"):
        module.attend(queries.double(), keys, keys, bias, 0.125)
    with pytest.raises(RuntimeError, match="matching the queries"):
        module.attend(queries, torch.randn(1, 3, 32, 32), torch.randn(1, 3, 32, 32), bias, 0.125)
    tails = torch.tensor([[0] * 31 + [40]])
    with pytest.raises(RuntimeError, match="tail rows index the cache"):
        module.attend_paths(queries[0], keys[0], keys[0], 0, tails, torch.zeros(1, 32), 0.125)
    with pytest.raises(RuntimeError, match="the shared positions lie in the cache"):
        module.attend_paths(queries[0], keys[0], keys[0], 64, tails[:, :0], torch.zeros(1, 64), 0.125)


def int16_rows(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply for float32 rows x [M, K] (native/int16_rows.h): per group of 32, codes
    round(x * 32767 / max |x|) times max |x| / 32767, each step in float32 as the C++ takes it."""
    groups = x.float().view(x.shape[0], -1, 32)
    largest = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.tensor(32767.0) / largest, torch.zeros_like(largest))
    codes = torch.round(groups * inverse).clamp(-32767, 32767)
    return (codes.double() * (largest / torch.tensor(32767.0)).double()).view(x.shape)


def q8_weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 codes, a float scale and min per group of 32 inputs (fp16 values, as GGUF blocks keep them; half the
    groups with min 0, as Q8_0's); and the float64 weight."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    groups = in_features // 32
    scale = (torch.rand(out_features, groups, generator=generator) / 50).half().float()
    low = (torch.randn(out_features, groups, generator=generator) / 20).half().float()
    low[:, ::2] = 0.0
    scales = torch.stack([scale, low], dim=-1)
    dense = weight.double().view(out_features, -1, 32) * scale.double()[..., None] + low.double()[..., None]
    return weight, scales, dense.view(out_features, in_features)


# 7 rows of whole 16-row weight blocks: 4 at once, then 2, then 1 (int8_matmul.h's batched_rows)
@pytest.mark.parametrize(
    "rows, out_features, in_features", [(1, 49152 // 64, 576), (5, 13, 64), (3, 4, 32), (7, 48, 64), (12, 40, 96)]
)
def test_the_native_int8_product_is_the_int16_rows_exact_one_and_each_row_its_own(rows, out_features, in_features):
    weight, scales, dense = q8_weight(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    module = native_module()
    out = module.int8_matmul(x, weight, scales)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    reference = int16_rows(x) @ dense.T  # exact integer sums per group, float32 steps, no rounding of the output
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), x.double() @ dense.T, rtol=1e-3, atol=1e-3)  # and the float32 rows'

    for row in range(rows):  # a row alone gives the bits it gets among the others: batch-invariant
        assert torch.equal(module.int8_matmul(x[row : row + 1], weight, scales), out[row : row + 1])


def test_quantized_int8_products_go_through_the_native_kernel_where_it_is_built(monkeypatch):
    weight, scales, dense = q8_weight(8, 64, seed=1)
    x = torch.randn(2, 64)
    native = native_module().int8_matmul(x, weight, scales)
    assert torch.equal(project(x, weight, None, scales), native)
    monkeypatch.setenv(native_build.SWITCH_ENV, "off")  # torch_product: the same int16 rows and exact group sums
    torch.testing.assert_close(project(x, weight, None, scales).double(), int16_rows(x) @ dense.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(project(x, weight, None, scales), native, rtol=1e-5, atol=1e-5)


def test_bad_arguments_to_the_native_int8_product_raise_instead_of_crashing():
    module = native_module()
    weight, scales, _ = q8_weight(8, 32, seed=2)
    with pytest.raises(RuntimeError, match="with the weight's K"):
        module.int8_matmul(torch.randn(2, 31), weight, scales)
    with pytest.raises(RuntimeError, match="scales: float"):
        module.int8_matmul(torch.randn(2, 32), weight, scales.bfloat16())
    with pytest.raises(RuntimeError, match="scales: float"):
        module.int8_matmul(torch.randn(2, 32), weight, scales[:4])
    with pytest.raises(RuntimeError, match="scales: float"):
        module.int8_matmul(torch.randn(2, 32), weight, scales[..., 0])
    with pytest.raises(RuntimeError, match="weight: int8"):
        module.int8_matmul(torch.randn(2, 32), weight.float(), scales)
    with pytest.raises(RuntimeError, match="a positive multiple of 32"):
        module.int8_matmul(torch.randn(2, 40), torch.zeros(8, 40, dtype=torch.int8), torch.ones(8, 1, 2))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        module.int8_matmul(torch.randn(2, 32).double(), weight, scales)


def test_the_native_int8_product_sums_a_16_row_block_as_it_sums_one_row():
    # rows 0-31 go through the 16-row reduction, a weight of one row through lane_sum: the same tree, bit for bit
    weight, scales, _ = q8_weight(33, 576, seed=16)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(16))
    module = native_module()
    out = module.int8_matmul(x, weight, scales)
    for row in range(33):
        assert torch.equal(module.int8_matmul(x, weight[row : row + 1], scales[row : row + 1]), out[:, row : row + 1])


def packed_int4(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes 0..15, fp16 scales and mins (Q4_1's), packed as quantize_q4 packs them; and the float64 weight."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32, generator=generator)
    groups = in_features // 32
    scale = (torch.rand(groups, out_features, generator=generator) / 50).half()
    low = (torch.randn(groups, out_features, generator=generator) / 20).half()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    dense = codes.double().view(out_features, groups, 32) * scale.double().T[..., None] + low.double().T[..., None]
    return packed, torch.stack([scale, low], dim=-1), dense.view(out_features, in_features)


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 576, 576), (6, 192, 1536), (9, 128, 64)])
def test_the_native_int4_product_is_the_int16_rows_exact_one_and_each_row_its_own(rows, out_features, in_features):
    packed, scales, dense = packed_int4(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    module = native_module()
    out = module.int4_matmul(x, packed, scales)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    reference = int16_rows(x) @ dense.T  # q * scale + min against the int16 rows, no rounding of the output
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), x.double() @ dense.T, rtol=1e-3, atol=1e-3)
    for row in range(rows):  # a row alone gives the bits it gets among the others: batch-invariant
        assert torch.equal(module.int4_matmul(x[row : row + 1], packed, scales), out[row : row + 1])
    assert torch.equal(module.int4_matmul(x.repeat(5, 1), packed, scales), out.repeat(5, 1))  # 4 rows at a time too
    halves = x.bfloat16()  # bfloat16 rows: widened, then the same int16 rows
    assert torch.equal(module.int4_matmul(halves, packed, scales), module.int4_matmul(halves.float(), packed, scales))


def test_the_products_sums_are_exact_integers_whatever_the_order():
    """A group's products (here 32767 * 15, 1 and -32767 * 15) add up as integers: exactly 1, then scaled."""
    codes = torch.zeros((64, 32), dtype=torch.int32)
    codes[:, [0, 1, 2]] = torch.tensor([15, 1, 15], dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales = torch.stack([torch.ones(1, 64), torch.zeros(1, 64)], dim=-1).half()  # scale 1, min 0
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([32767.0, 1.0, -32767.0])  # codes themselves: the group's largest is 32767
    assert torch.equal(native_module().int4_matmul(x, packed, scales), torch.full((1, 64), 1.0))
    weight = torch.zeros(16, 32, dtype=torch.int8)
    weight[:, :3] = torch.tensor([127, 1, 127], dtype=torch.int8)
    scales = torch.stack([torch.ones(16, 1), torch.zeros(16, 1)], dim=-1)  # scale 1, min 0
    assert torch.equal(native_module().int8_matmul(x, weight, scales), torch.full((1, 16), 1.0))


def test_a_row_that_is_not_finite_gives_nan_in_its_own_outputs_only():
    packed, scales, _ = packed_int4(64, 64, seed=6)
    x = torch.randn(2, 64)
    clean = native_module().int4_matmul(x, packed, scales)
    for bad in (float("nan"), float("inf")):
        x[0, 5] = bad
        out = native_module().int4_matmul(x, packed, scales)
        assert out[0].isnan().all() and torch.equal(out[1], clean[1])
        head = native_module().int8_matmul(x, torch.ones(8, 64, dtype=torch.int8), torch.ones(8, 2, 2))
        assert head[0].isnan().all() and head[1].isfinite().all()


def test_an_int4_weight_that_is_not_whole_64_row_blocks_goes_to_aten_in_float32():
    packed, scales, dense = packed_int4(80, 64, seed=3)  # a 64-row block and a 16-row tail, packed otherwise
    x = torch.randn(2, 64)
    out = native_module().int4_matmul(x, packed, scales)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), x.double() @ dense.T, rtol=1e-5, atol=1e-5)


def test_quantized_int4_products_go_through_the_native_kernel_where_it_is_built(monkeypatch):
    packed, scales, dense = packed_int4(64, 64, seed=4)
    x = torch.randn(2, 64)
    native = native_module().int4_matmul(x, packed, scales)
    assert torch.equal(project(x, packed, None, scales), native)
    monkeypatch.setenv(native_build.SWITCH_ENV, "off")  # torch_product: the same int16 rows and exact group sums
    torch.testing.assert_close(project(x, packed, None, scales).double(), int16_rows(x) @ dense.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(project(x, packed, None, scales), native, rtol=1e-5, atol=1e-5)


def test_bad_arguments_to_the_native_int4_product_raise_instead_of_crashing():
    module = native_module()
    packed, scales, _ = packed_int4(64, 64, seed=5)
    with pytest.raises(RuntimeError, match="with the weight's K"):
        module.int4_matmul(torch.randn(2, 63), packed, scales)
    with pytest.raises(RuntimeError, match="scales: float16"):
        module.int4_matmul(torch.randn(2, 64), packed, scales.float())
    with pytest.raises(RuntimeError, match="weight: packed int4"):
        module.int4_matmul(torch.randn(2, 64), packed.to(torch.int8), scales)
    with pytest.raises(RuntimeError, match="scales: float16"):
        module.int4_matmul(torch.randn(2, 64), packed, scales[:, :32])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        module.int4_matmul(torch.randn(2, 64).double(), packed, scales)
