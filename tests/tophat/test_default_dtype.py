"""The product's default dtype: what `tophat serve`, `make demo` and the services run when no dtype is named is
placement.CPU_DEFAULT on a CPU (int4: the fastest dtype through make bench-engine's quality gate), and at it
SmolLM2 answers the demo's first question as f32 does."""

from __future__ import annotations

import torch

from shared.model.checkpoint import load_checkpoint
from shared.model.placement import CPU_DEFAULT, detect_placement
from shared.specdec.reference import generate_full
from tophatctl.adapter_training.dataset import user_prompt_ids
from tophatctl.demo import CHAT_PROMPTS
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_settings import device_env, verifier_env
from tophatctl.models import resolve_model


def demo_default_dtype() -> str:
    """`tophat demo`'s --dtype when none is given."""
    import typer.main

    from tophat.cli import app

    demo = typer.main.get_command(app).commands["demo"]
    return next(param.default for param in demo.params if param.name == "dtype")


def test_serve_demo_and_the_services_default_to_auto_which_is_int4_on_a_cpu(monkeypatch):
    from typer.main import get_command

    from services.device_agent.settings import Settings as DeviceSettings
    from services.verifier_cloud.settings import Settings as VerifierSettings
    from tophat.cli import app

    serve = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    assert next(p.default for p in serve.params if p.name == "dtype") == "auto"
    assert demo_default_dtype() == "auto" and MeshConfig().dtype == "auto"
    monkeypatch.delenv("TOPHAT_CPU_DTYPE", raising=False)  # the suite's f32 (conftest.py); a user's shell: none
    assert VerifierSettings().dtype == DeviceSettings().dtype == "auto"
    config = MeshConfig()
    assert "TOPHAT_VERIFIER_DTYPE" not in verifier_env(config, 0, "127.0.0.1", "models/demo", {})
    assert "TOPHAT_DEVICE_DTYPE" not in device_env(config, 0, "models/demo")
    if not torch.cuda.is_available():
        assert detect_placement("auto", "auto").quantize == CPU_DEFAULT == "int4"


def test_at_the_default_dtype_smollm2_answers_the_demos_first_question_as_f32_does():
    question = CHAT_PROMPTS[0]
    assert question == "What is the capital of France?"
    answers = []
    for quantize in (CPU_DEFAULT, None):
        checkpoint = load_checkpoint(resolve_model("smollm2"), quantize=quantize)
        prompt = user_prompt_ids(checkpoint, question)
        tokens = generate_full(checkpoint, prompt, 24).token_ids
        answers.append(checkpoint.tokenizer.decode(tokens))
    assert "Paris" in answers[0] and answers[0] == answers[1]
