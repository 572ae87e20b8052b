"""Device and dtype placement: the pure resolver, the stage -> GPU plan, settings, and that a
bfloat16 split model computes what the bfloat16 unsplit model computes, token for token."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from shared.model.placement import (
    CudaIndexError,
    CudaUnavailableError,
    PlacementError,
    UnknownDeviceError,
    UnknownDtypeError,
    detect_placement,
    plan_stage_devices,
    resolve_placement,
)

CPU_ONLY = dict(cuda_available=False, device_count=0)
TWO_GPUS = dict(cuda_available=True, device_count=2)


def place(device: str, dtype: str = "auto", bf16: bool = True, **facts):
    return resolve_placement(device, dtype, bf16_supported=bf16, **(facts or CPU_ONLY))


# -- the resolver ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["auto", "cpu", "CPU", " auto "])
def test_without_cuda_auto_and_cpu_resolve_to_the_cpu_default_int4_weights(spec):
    placement = place(spec)
    assert placement.device == torch.device("cpu") and placement.dtype is torch.float32
    assert placement.quantize == "int4" and placement.warnings == ()
    assert place(spec, "f32").quantize is None  # an explicit dtype is what it says


@pytest.mark.parametrize("native", ["on", "off"])
def test_auto_on_a_cpu_is_int4_only_where_the_native_layers_load(monkeypatch, caplog, native):
    """Without the native layers int4 would run in plain torch ops (the container images build none), so auto
    falls back to float32 there and says why; $TOPHAT_CPU_DTYPE still names what auto is."""
    monkeypatch.delenv("TOPHAT_CPU_DTYPE", raising=False)
    monkeypatch.setattr("shared.model.placement.native_module", lambda: object() if native == "on" else None)
    with caplog.at_level("WARNING", logger="shared.model.placement"):
        placement = detect_placement("cpu", "auto")
    assert placement.quantize == ("int4" if native == "on" else None) and placement.dtype is torch.float32
    assert ("make native" in caplog.text) == (native == "off")
    monkeypatch.setenv("TOPHAT_CPU_DTYPE", "int8")
    assert detect_placement("cpu", "auto").quantize == "int8"
    caplog.clear()
    with caplog.at_level("WARNING", logger="shared.model.placement"):
        assert detect_placement("cpu", "int4").quantize == "int4"  # an explicit dtype is what it says
    assert ("plain torch ops" in caplog.text) == (native == "off")  # and says what it costs


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


@pytest.mark.parametrize("spec", ["fp16", "half", "float64", "int2", "uint8", ""])
def test_unknown_dtypes_are_refused(spec):
    with pytest.raises(
        UnknownDtypeError, match="auto or one of float32, float16, bfloat16, f32, f16, bf16, int8, int4"
    ):
        place("cpu", spec)


@pytest.mark.parametrize("alias,dtype", [("f32", torch.float32), ("bf16", torch.bfloat16), ("F16", torch.float16)])
def test_short_dtype_names_are_the_long_ones(alias, dtype):
    assert place("cpu", alias).dtype is dtype and place("cpu", alias).quantize is None


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_weights_have_float32_activations_on_the_cpu_only(kind):
    placement = place("cpu", kind)
    assert placement.quantize == kind and placement.dtype is torch.float32 and placement.warnings == ()
    assert f"{kind} weights" in str(placement)
    with pytest.raises(PlacementError, match=f"{kind} weights run on the CPU"):
        place("cuda", kind, **TWO_GPUS)


def test_errors_are_value_errors_so_settings_validation_reports_them():
    assert issubclass(PlacementError, ValueError)
    for error in (UnknownDeviceError, UnknownDtypeError, CudaUnavailableError, CudaIndexError):
        assert issubclass(error, PlacementError)


def test_float16_on_the_cpu_is_allowed_with_a_warning_and_bfloat16_without():
    placement = place("cpu", "float16")
    assert placement.dtype is torch.float16
    assert len(placement.warnings) == 1 and "CPU" in placement.warnings[0]
    assert place("cpu", "bfloat16").warnings == ()  # faster than float32 on AVX-512 BF16 (make bench-engine)


def test_explicit_dtypes_are_kept_and_emulated_bfloat16_warns():
    assert place("cuda", "float32", **TWO_GPUS).dtype is torch.float32
    assert place("cuda", "float16", bf16=False, **TWO_GPUS).warnings == ()
    emulated = place("cuda", "bfloat16", bf16=False, **TWO_GPUS)
    assert emulated.dtype is torch.bfloat16 and "no native bfloat16" in emulated.warnings[0]


def test_detect_placement_on_this_machine_matches_the_pure_rule(monkeypatch):
    monkeypatch.delenv("TOPHAT_CPU_DTYPE", raising=False)  # the suite's f32 for `auto` (conftest.py)
    available = torch.cuda.is_available()
    placement = detect_placement("auto", "auto")
    assert placement.device.type == ("cuda" if available else "cpu")
    if not available:
        assert placement.dtype is torch.float32 and placement.quantize == "int4"
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


# -- bfloat16: the split model equals the unsplit model, token for token ------------------------


def _through_wire(t: torch.Tensor, wire_dtype) -> torch.Tensor:
    from shared.wire import schema as wire

    encoded = wire.encode_tensor(t, wire_dtype)
    encoded["b"] = bytes(encoded["b"])  # what msgpack hands the receiver
    return wire.decode_tensor(encoded)


class WireRunnerCloud:
    """The verifier's ModelRunner behind a wire round trip each way, as the device agent sees it: states
    arrive in the wire dtype, and the device gets fp32 back (services/device_agent/cloud_client.py)."""

    def __init__(self, runner, wire_dtype):
        self.runner, self.wire_dtype = runner, wire_dtype

    def _run(self, kind, session_id: int, position: int, shallow: torch.Tensor) -> torch.Tensor:
        from services.verifier_cloud.runner import RunItem

        result = self.runner.run([RunItem(session_id, kind, position, _through_wire(shallow, self.wire_dtype))])[0]
        assert result.error is None, result.error
        return _through_wire(result.output, self.wire_dtype).float()  # [S, H]

    async def open(self, session_id):
        self.runner.open(session_id)

    async def send_prefill(self, session_id, start_pos, shallow, is_last):
        from services.verifier_cloud.work import WorkKind

        deep = self._run(WorkKind.PREFILL, session_id, start_pos, shallow)
        future = asyncio.get_running_loop().create_future()
        future.set_result(deep[-1:] if is_last else None)
        return future

    async def verify(self, session_id, commit_len, shallow):
        from services.verifier_cloud.work import WorkKind

        return self._run(WorkKind.VERIFY, session_id, commit_len, shallow)

    async def close(self, session_id):
        self.runner.close(session_id)


def split_greedy(checkpoint, ids: list[int], max_new: int, wire_dtype, chunk_size: int, max_draft: int):
    """Greedy decoding of the split model (m = 2) with a random draft adapter, through the verifier's
    runner and the wire: (tokens, each verify pass's (commit_len, rows fed), the KV caches' dtypes)."""
    from services.verifier_cloud.runner import ModelRunner
    from shared.model.split import MiddleSubmodel
    from shared.runtime import RANDOM_ADAPTER, build_device_model
    from shared.specdec.decode_loop import generate
    from shared.specdec.device_session import DeviceSession, DraftConfig

    device_model = build_device_model(checkpoint, 2, RANDOM_ADAPTER, speculative=max_draft > 0)
    runner = ModelRunner(MiddleSubmodel(checkpoint, 2), checkpoint.config.max_position_embeddings)
    session = DeviceSession(
        device_model, ids, draft_config=DraftConfig(eta=0.0, max_draft=max_draft), max_new_tokens=max_new
    )
    passes: list[tuple[int, list[int]]] = []
    draft = session.draft

    def recording_draft():
        pending = session.pending_token  # the verify pass feeds (pending, d_1..d_k)
        made = draft()
        passes.append((made.commit_len, [pending, *made.tokens]))
        return made

    session.draft = recording_draft
    dtypes = {session.input_cache.layer(0).keys.dtype}
    if session.adapter_cache is not None:
        dtypes.add(session.adapter_cache.layer(0).keys.dtype)
    result = asyncio.run(
        generate(
            session,
            WireRunnerCloud(runner, wire_dtype),
            chunk_size=chunk_size,
            parallel_candidates=2 if max_draft else 0,
            parallel_steps=2,
        )
    )
    dtypes |= {caches.middle.layer(0).keys.dtype for caches in runner.sessions.values()}
    return result.token_ids, passes, dtypes


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny bf16 matmuls only lose to thread hand-offs on a shared machine (5x here): one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load_bf16(model: str, tiny_llama_dir, tiny_qwen2_dir):
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(
        tiny_llama_dir if model == "llama" else tiny_qwen2_dir, dtype=torch.bfloat16, with_tokenizer=False
    )
    assert checkpoint.model.dtype is torch.bfloat16
    return checkpoint


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_bfloat16_split_passes_equal_unsplit_passes_bit_for_bit(model, tiny_llama_dir, tiny_qwen2_dir):
    """Each pass of the split model (any chunking, after rollbacks) gives exactly the unsplit model's logits."""
    from transformers import DynamicCache

    from shared.model.split import SplitModel

    checkpoint = load_bf16(model, tiny_llama_dir, tiny_qwen2_dir)
    split = SplitModel.from_checkpoint(checkpoint, 2)
    rng = random.Random(5)
    for _ in range(2):
        ids = [rng.randrange(1, checkpoint.vocab_size) for _ in range(30)]
        unsplit_cache, device_cache, cloud_cache = DynamicCache(), split.input.new_cache(), split.middle.new_cache()
        position = 0
        for size in [rng.randint(1, 9) for _ in range(6)]:
            rows = ids[position : position + size]
            with torch.inference_mode():
                expected = (
                    checkpoint.model(input_ids=torch.tensor([rows]), past_key_values=unsplit_cache, use_cache=True)
                    .logits[0]
                    .float()
                )  # [S, V]
            shallow = split.input(torch.tensor(rows), device_cache)
            got = split.output(split.middle.forward_batch([(cloud_cache, shallow)])[0])
            assert torch.equal(got, expected)
            position += len(rows)
            if rng.random() < 0.5 and position > 3:  # a rejected draft: both sides roll back
                back = rng.randint(1, 3)
                position -= back
                unsplit_cache.crop(-back)
                device_cache.truncate(position)
                cloud_cache.truncate(position)


@pytest.mark.parametrize("wire_dtype", ["bf", "f4"])  # both carry every bfloat16 value exactly
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_bfloat16_split_greedy_equals_bfloat16_unsplit(model, wire_dtype, tiny_llama_dir, tiny_qwen2_dir):
    """bf16 on both sides, through the verifier's runner and the wire, making the reference's passes (the
    prompt in one pass, then one token per pass: U-shape): the unsplit model's greedy tokens exactly."""
    from shared.specdec.reference import generate_full

    checkpoint = load_bf16(model, tiny_llama_dir, tiny_qwen2_dir)
    rng = random.Random(11)
    for prompt_len in (23, 30):
        ids = [rng.randrange(1, checkpoint.vocab_size) for _ in range(prompt_len)]
        got, passes, dtypes = split_greedy(checkpoint, ids, 16, wire_dtype, chunk_size=64, max_draft=0)
        assert dtypes == {torch.bfloat16}
        assert len(passes) == len(got) - 1 and all(len(rows) == 1 for _, rows in passes)
        assert got == generate_full(checkpoint, ids, 16).token_ids


def unsplit_replay(checkpoint, ids: list[int], chunk_sizes: list[int], passes, max_new: int) -> list[int]:
    """The unsplit model decoding greedily with exactly the passes a speculative run made: the prompt in
    the same chunks, then each verify pass's rows after rolling back to its commit_len."""
    from transformers import DynamicCache

    from shared.specdec.sampling import accept_greedy

    cache, position = DynamicCache(), 0

    def run(rows: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return (
                checkpoint.model(input_ids=torch.tensor([rows]), past_key_values=cache, use_cache=True)
                .logits[0]
                .float()
            )  # [S, V]

    for size in chunk_sizes:
        logits = run(ids[position : position + size])
        position += size
    tokens = [int(logits[-1].argmax())]
    for commit_len, rows in passes:
        assert rows[0] == tokens[-1] and cache.get_seq_length() >= commit_len
        if cache.get_seq_length() > commit_len:
            cache.crop(commit_len - cache.get_seq_length())
        verdict = accept_greedy(rows[1:], run(rows))
        tokens += rows[1 : 1 + verdict.num_accepted] + [verdict.next_token]
    cut = next((i + 1 for i, t in enumerate(tokens) if t == checkpoint.eos_token_id), len(tokens))
    return tokens[: min(cut, max_new)]


@pytest.mark.parametrize("max_draft", [0, 3])
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_bfloat16_split_equals_the_unsplit_model_making_the_same_passes(
    model, max_draft, tiny_llama_dir, tiny_qwen2_dir
):
    """Chunked prefill and verify passes of k+1 rows give a logit computed in an n-row pass, which in bf16 can
    differ by one bf16 step from the same logit computed in a pass of another size (the kernels round per
    shape; fp32's difference is far below the logit gaps). So chunked and speculative runs are compared with
    the unsplit model making the very same passes, and must equal it token for token."""
    from shared.planning.planners import fixed_chunks

    checkpoint = load_bf16(model, tiny_llama_dir, tiny_qwen2_dir)
    rng = random.Random(11)
    for prompt_len, chunk_size in ((23, 8), (30, 7)):
        ids = [rng.randrange(1, checkpoint.vocab_size) for _ in range(prompt_len)]
        got, passes, dtypes = split_greedy(checkpoint, ids, 16, "bf", chunk_size, max_draft=max_draft)
        assert dtypes == {torch.bfloat16}
        assert any(len(rows) > 1 for _, rows in passes) == (max_draft > 0)  # drafts really were verified
        assert got == unsplit_replay(checkpoint, ids, fixed_chunks(len(ids), chunk_size), passes, 16)


# -- settings, the verifier's and the device's loading paths ---------------------------------------


@pytest.mark.parametrize("service", ["verifier", "device"])
def test_settings_take_device_and_dtype_from_the_environment_and_refuse_bad_ones(service):
    from services.device_agent.settings import load_settings as device_settings
    from services.verifier_cloud.settings import load_settings as verifier_settings
    from shared.settings import SettingsError

    load, prefix = (
        (verifier_settings, "TOPHAT_VERIFIER_") if service == "verifier" else (device_settings, "TOPHAT_DEVICE_")
    )
    defaults = load({})
    assert (defaults.device, defaults.dtype) == ("auto", "auto")
    chosen = load({prefix + "DEVICE": "cuda:1", prefix + "DTYPE": "float16"})
    assert (chosen.device, chosen.dtype) == ("cuda:1", "float16")  # syntax only: no GPU needed to configure
    with pytest.raises((SettingsError, ValueError), match="auto, cpu, cuda or cuda:N"):
        load({prefix + "DEVICE": "gpu0"})
    with pytest.raises((SettingsError, ValueError), match="float32, float16, bfloat16"):
        load({prefix + "DTYPE": "fp8"})


def test_stage_specs_carry_one_gpu_each_and_the_dtype_setting():
    from services.verifier_cloud.settings import Settings
    from services.verifier_cloud.stage_specs import plan_stages

    settings = Settings(split_layers=1, pipeline_stages=4, dtype="bfloat16")
    specs = plan_stages(settings, num_layers=9, cuda=(True, 4))
    assert [s.device for s in specs] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert {s.dtype for s in specs} == {"bfloat16"} and [s.layers for s in specs] == [(1, 3), (3, 5), (5, 7), (7, 9)]
    assert [s.device for s in plan_stages(settings, 9, cuda=(False, 0))] == ["cpu"] * 4
    with pytest.raises(CudaUnavailableError):
        plan_stages(Settings(split_layers=1, pipeline_stages=2, device="cuda"), 9, cuda=(False, 0))


@pytest.mark.parametrize("stages", [1, 2])
def test_a_verifier_asked_for_a_missing_gpu_refuses_to_start_with_a_settings_error(tiny_llama_dir, stages, monkeypatch):
    import services.verifier_cloud.stage_specs as stage_specs
    import shared.model.placement as placement
    from services.verifier_cloud.server import VerifierServer
    from services.verifier_cloud.settings import Settings
    from shared.settings import SettingsError

    for module in (placement, stage_specs):  # a machine without CUDA, wherever the test runs
        monkeypatch.setattr(module, "cuda_facts", lambda: (False, 0))

    settings = Settings(model_dir=str(tiny_llama_dir), pipeline_stages=stages, device="cuda")
    with pytest.raises(SettingsError, match="no CUDA device"):
        VerifierServer.from_settings(settings)


def test_a_stage_worker_loads_its_layers_in_the_dtype_asked_and_answers_on_the_cpu(tiny_llama_dir):
    from services.verifier_cloud.stages import MicroBatch, StageItem, StageSpec, build_worker
    from services.verifier_cloud.work import WorkKind

    worker = build_worker(StageSpec(0, str(tiny_llama_dir), 2, (2, 4), device="cpu", dtype="bfloat16"))
    layers = worker.runner.layers
    assert layers.dtype is torch.bfloat16 and next(layers.parameters()).dtype is torch.bfloat16
    worker.runner.open(7)
    assert worker.runner.sessions[7].middle.layer(0).keys.dtype is torch.bfloat16
    hidden = torch.randn(3, 64).numpy()  # what crosses the stage transport: float32 numpy
    batch = MicroBatch(1, [StageItem(7, 0, WorkKind.PREFILL, 0, 3, hidden)])
    worker.run_batch(batch)
    assert batch.items[0].error is None and batch.items[0].hidden.shape == (3, 64)
    assert worker.runner.lengths() == {7: 3}


def test_device_model_takes_the_clouds_states_in_its_own_dtype(tiny_llama_dir):
    from shared.runtime import RANDOM_ADAPTER, build_device_model

    checkpoint = load_bf16("llama", tiny_llama_dir, None)
    model = build_device_model(checkpoint, 2, RANDOM_ADAPTER).to("cpu")
    assert (model.device, model.dtype) == (torch.device("cpu"), torch.bfloat16)
    states = model.compute_states(torch.randn(2, 64, dtype=torch.float16))  # as decoded from an f2 frame
    assert states.dtype is torch.bfloat16 and states.device == model.device
    assert model.output(states).dtype is torch.float32 and model.output(states).device.type == "cpu"


def test_tophat_cpu_dtype_names_what_auto_is_on_a_cpu(monkeypatch):
    monkeypatch.setenv("TOPHAT_CPU_DTYPE", "int8")
    assert detect_placement("cpu", "auto").quantize == "int8"
    assert detect_placement("cpu", "f32").quantize is None  # a named dtype is what it names
    monkeypatch.setenv("TOPHAT_CPU_DTYPE", "auto")
    with pytest.raises(UnknownDtypeError, match="TOPHAT_CPU_DTYPE"):
        detect_placement("cpu", "auto")
