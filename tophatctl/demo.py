"""`tophat demo` (`make demo`): start the mesh, stream answers to a few prompts through the chat client, stop.

`--model smollm2` (the default, SmolLM2-135M-Instruct) is asked what a user would ask; its
chat template is applied on the device. `--model demo` (a small Llama trained on Python's
standard library) has no chat template and writes code, so it gets code to continue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from shared.model.checkpoint import ModelLoadError
from tophatctl.chat_client import run_chat
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig, MeshStartError
from tophatctl.mesh_ports import find_port_base

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear Python functions.",
    "Explain what a hash table is in two sentences.",
]
CODE_PROMPTS = [  # for the demo model, which continues code rather than chatting
    'import os\n\n\ndef list_python_files(root):\n    """Return the .py files under root."""\n',
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
]


def has_chat_template(model_dir: Path) -> bool:
    """Whether the checkpoint's tokenizer ships a chat template (read from its files, no tokenizer load)."""
    if (model_dir / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def main(args: argparse.Namespace) -> int:
    """`tophat demo`'s run with its options (model, adapter, devices, max_new_tokens, dtype); the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = MeshConfig(
        model_dir=args.model,
        adapter=args.adapter,
        num_devices=args.devices,
        dtype=args.dtype,
        port_base=find_port_base(args.devices),
    )
    print(f"starting the mesh ({args.model}, {args.devices} device agents, {args.dtype} weights) ...", flush=True)
    try:
        mesh = Mesh(config).start()
    except (MeshStartError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    assert mesh.model_dir is not None, "start() resolved the model"
    prompts = CHAT_PROMPTS if has_chat_template(mesh.model_dir) else CODE_PROMPTS
    status = 0
    try:
        print(f"  logs in {config.log_dir}")
        for name, url in mesh.urls().items():
            print(f"  {name:16s} {url}")
        print(f"  {'web console':16s} {config.streamer_url}/   (chat, devices, verifier, live plots)")
        for prompt in prompts:
            print("\n>>> " + prompt.replace("\n", "\n... "), flush=True)
            answer = run_chat(config.streamer_url, prompt, max_tokens=args.max_new_tokens, temperature=0.0)
            status |= asyncio.run(answer)
    finally:
        mesh.stop()
        print("\nmesh stopped")
    return status
