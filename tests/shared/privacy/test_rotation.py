"""The secret rotation of the hidden basis (shared/privacy/hidden_rotation.py) is exact: re-parameterised middle layers
on rotated input give the rotated output of the original layers; and the knowing cloud's attack
(tophatctl/privacy/rotation_attack.py) solves for Q from the weights it holds."""

from __future__ import annotations

import pytest
import torch

from shared.model.checkpoint import load_checkpoint
from shared.model.split import MiddleSubmodel
from shared.privacy.hidden_rotation import RotationError, check_rotation, rotate_layers, rotation_tag, secret_rotation
from tophatctl.privacy.rotation_attack import recover_rotation, rotation_error


def test_secret_rotation_is_orthogonal_and_a_function_of_the_secret():
    q = secret_rotation("deployment-secret", 64, torch.float64)
    assert torch.allclose(q @ q.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, secret_rotation("deployment-secret", 64, torch.float64))
    assert not torch.allclose(q, secret_rotation("another-secret", 64, torch.float64), atol=0.1)
    assert torch.equal(secret_rotation(7, 16), secret_rotation("7", 16))
    assert rotation_tag("a") != rotation_tag("b")
    assert secret_rotation("s", 8, torch.float32).dtype == torch.float32


def test_bad_rotations_are_refused(tiny_llama_dir):
    middle = MiddleSubmodel(load_checkpoint(tiny_llama_dir, with_tokenizer=False), 2)
    with pytest.raises(RotationError, match="must be \\[64, 64\\]"):
        rotate_layers(middle, secret_rotation("s", 32))
    with pytest.raises(RotationError, match="not orthogonal"):
        rotate_layers(middle, 2 * secret_rotation("s", 64))
    with pytest.raises(RotationError, match="not orthogonal"):
        check_rotation(secret_rotation("s", 64).to(torch.bfloat16), 64)
    with pytest.raises(RotationError):
        secret_rotation("", 8)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_rotated_layers_compute_the_rotated_function(model_type, tiny_llama_dir, tiny_qwen2_dir):
    path = tiny_llama_dir if model_type == "llama" else tiny_qwen2_dir
    original = MiddleSubmodel(load_checkpoint(path, with_tokenizer=False), 2)
    rotated = MiddleSubmodel(load_checkpoint(path, with_tokenizer=False), 2)  # its own weights: rotated in place
    q = secret_rotation("test", 64)
    rotate_layers(rotated, q)
    assert not torch.allclose(rotated.layers[0].self_attn.q_proj.weight, original.layers[0].self_attn.q_proj.weight)
    if model_type == "qwen2":  # q/k/v biases stay as they are
        assert torch.equal(rotated.layers[0].self_attn.q_proj.bias, original.layers[0].self_attn.q_proj.bias)
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1))  # two chunks of one session: [7, H]
    plain_cache, rotated_cache = original.new_cache(), rotated.new_cache()
    for chunk in x:
        expected = original.forward_batch([(plain_cache, chunk)])[0]  # [7, H]
        got = rotated.forward_batch([(rotated_cache, chunk @ q.T)])[0]
        assert torch.allclose(got, expected @ q.T, atol=1e-4, rtol=1e-4)
        assert torch.allclose(got @ q, expected, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(got, expected, atol=1e-1)


def test_knowing_cloud_recovers_the_rotation_from_the_weights(demo_checkpoint):
    from tests.conftest import DEMO_MODEL_DIR

    public = MiddleSubmodel(demo_checkpoint, 2)  # the public checkpoint's layers (not modified)
    held = MiddleSubmodel(load_checkpoint(DEMO_MODEL_DIR, dtype=torch.float32), 2)
    q = secret_rotation("demo-deployment", demo_checkpoint.hidden_size)
    rotate_layers(held, q)
    q_hat = recover_rotation(public, held)
    assert rotation_error(q_hat, q) < 1e-5  # relative Frobenius error
    assert rotation_error(secret_rotation("a guess", demo_checkpoint.hidden_size), q) > 1.0
