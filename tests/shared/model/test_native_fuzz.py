"""The C++ kernels called directly with random, mostly wrong arguments: each call returns or raises a
RuntimeError, and the process never dies (SIGFPE, SIGSEGV). Run in a child process so that a crash is seen as
one, not as the end of the test session."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from shared.model.native_build import native_module
from tests.conftest import REPO_ROOT

FUZZ = textwrap.dedent(
    """
    import random, torch
    from shared.model.native_build import native_module

    module = native_module()
    rng = random.Random(7)

    def dim():
        return rng.choice([0, 1, 2, 16, 31, 32, 33, 64, 96, 128])

    def call(function, *args):
        try:
            function(*args)
        except RuntimeError:
            pass

    for _ in range(400):
        m, n, k = dim(), dim(), dim()
        x = torch.randn(m, k) if rng.random() < 0.9 else torch.randn(m, k).double()
        call(module.int8_matmul, x, torch.randint(-127, 128, (n, dim()), dtype=torch.int8),
             torch.rand(dim(), dim(), rng.choice([1, 2])))
        call(module.int4_matmul, x, torch.randint(0, 255, (n, dim()), dtype=torch.uint8),
             torch.rand(dim(), n, 2).half())
        heads, past = rng.choice([0, 1, 2, 4]), rng.choice([-5, 0, 3, 10**6])
        queries, keys = torch.randn(1, heads, 1, 2, 16), torch.randn(1, heads, dim(), 16)
        call(module.attend, queries, keys, keys, torch.zeros(1, dim()), 0.25)
        call(module.attend_paths, queries[0], keys[0], keys[0], rng.choice([-1, 0, 5, 500]),
             torch.randint(-3, 40, (2, rng.choice([0, 1, 3]))), torch.zeros(2, dim()), 0.25)
        call(module.SessionRows, 0, rng.choice([0, 2]), past, [torch.zeros(2, 32)], [rng.choice([0, 1])],
             [rng.choice([1, 2, 4000])], [rng.choice([0, 32, 64])])
    from shared.model import native_layers
    from shared.model.checkpoint import load_checkpoint
    from tests.conftest import DEMO_MODEL_DIR

    checkpoint = load_checkpoint(DEMO_MODEL_DIR, quantize="int4", with_tokenizer=False)
    layer = checkpoint.decoder.layers[0]
    handle = native_layers.native_layer(module, layer)
    hidden, kv_heads = checkpoint.hidden_size, layer.self_attn.config.num_key_value_heads
    head_dim = hidden // layer.self_attn.config.num_attention_heads
    for _ in range(300):
        rows, capacity = rng.choice([0, 1, 2, 5]), rng.choice([0, 4, 64])
        starts = [rng.choice([-1, 0, 1, 2])]
        stops = [rng.choice([0, 1, 2, 5, 4096])]
        session = module.SessionRows(0, rows, rng.choice([-5, 0, 3, 60, 10**6]), [torch.zeros(max(rows, 1), 64)],
                                     starts, stops, [rng.choice([-8, 0, 8, 64, 10**6])], rng.choice([0, -2, 3]),
                                     rng.choice([None, torch.randint(-2, 70, (rows, rng.choice([0, 1, 2])))]))
        cache = torch.zeros(kv_heads, capacity, head_dim)
        call(module.run_layers, [handle], torch.randn(rows, hidden), [cache], [cache.clone()], [session],
             torch.randn(rows, head_dim), torch.randn(rows, head_dim))
    print("survived")
    """
)


def test_the_kernels_survive_random_arguments():
    assert native_module() is not None, "make install builds the extension"
    done = subprocess.run([sys.executable, "-c", FUZZ], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0 and "survived" in done.stdout, done.stderr[-2000:]
