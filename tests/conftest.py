"""Shared fixtures: small random Llama-family checkpoints written to disk and
loaded by path (the same code path as any real checkpoint), and the committed
demo model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shared.model.checkpoint import load_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL_DIR = REPO_ROOT / "models" / "demo"

# One intra-op thread: the tests' models are tiny, their ops too small to gain from a second thread, and two
# OpenMP threads that wait on each other at every op cost 2-5x the time (more on a shared machine). The mesh's
# services run one thread each as well (tophatctl/mesh.py sets OMP_NUM_THREADS=1).
torch.set_num_threads(1)

# What `auto` means on a CPU, for the suite and every service it starts: the tests compare meshes and services
# against the f32 reference model (and the demo model's weights lie on no 4-bit grid), so `auto` is f32 here; the
# product's own default, int4 (shared/model/placement.py), is tested where a test removes this or names int4
# (test_placement.py, test_default_dtype.py, test_quantized_exactness.py, test_quantized_modes.py).
os.environ.setdefault("TOPHAT_CPU_DTYPE", "f32")


def _write_random_checkpoint(path: Path, model_type: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=0,
        bos_token_id=0,
    )
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    # Larger-than-default init so random logits are far from ties (greedy stays well defined).
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.08)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return _write_random_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return _write_random_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_checkpoint(request, tiny_llama_dir, tiny_qwen2_dir):
    return load_checkpoint(tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir, with_tokenizer=False)


@pytest.fixture(scope="session")
def demo_checkpoint():
    return load_checkpoint(DEMO_MODEL_DIR)


@pytest.fixture(scope="session")
def smollm2():
    """The real model (models/smollm2), loaded once for the modules that read it (nothing writes to it)."""
    from tophatctl.models import resolve_model

    return load_checkpoint(resolve_model("smollm2"))


@pytest.fixture(scope="session")
def default_demo_mesh():
    """A mesh as `tophat up` starts it on the demo model (one device agent), started once for the modules that
    only send it requests and leave it idle (test_disconnect, test_soak): a mesh start is ~15 s of CPU."""
    from tophatctl.mesh import Mesh
    from tophatctl.mesh_config import MeshConfig
    from tophatctl.mesh_ports import find_port_base

    config = MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=1, port_base=find_port_base(1))
    with Mesh(config) as running:
        yield running
