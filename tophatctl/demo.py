"""`make demo`: start the mesh, stream answers to a few prompts through the chat client, stop.

The demo model is a small Llama trained on Python's standard library, so the
prompts are code and the answers are (plausible-looking) code.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from tophatctl.chat_client import run_chat
from tophatctl.launcher import Mesh, MeshConfig, MeshStartError, find_port_base

PROMPTS = [
    "import os\n\n\ndef list_python_files(root):\n    \"\"\"Return the .py files under root.\"\"\"\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
]


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = MeshConfig(num_devices=2, port_base=find_port_base(2))
    print(f"starting the mesh (2 device agents, logs in {config.log_dir or 'a temp dir'}) ...", flush=True)
    try:
        mesh = Mesh(config).start()
    except MeshStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    status = 0
    try:
        for name, url in mesh.urls().items():
            print(f"  {name:16s} {url}")
        for prompt in PROMPTS:
            print("\n>>> " + prompt.replace("\n", "\n... "), flush=True)
            status |= asyncio.run(run_chat(config.streamer_url, prompt, max_tokens=64, temperature=0.0))
    finally:
        mesh.stop()
        print("\nmesh stopped")
    return status


if __name__ == "__main__":
    sys.exit(main())
