"""`python -m services.verifier_cloud [--pipeline-stages P] [--full-model] [--server-chunk-tokens N]
[--max-prefill-step-ms MS]`: serve the verifier.

Settings come from `TOPHAT_VERIFIER_*` environment variables; the few flags
here override them (a flag is easier to type when trying pipeline depths).
"""  # noqa: E501 - the first line is the CLI's --help description, kept whole

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import torch

from services.verifier_cloud.kv_plan import CUDA_GRAPHS, KV_LAYOUTS
from services.verifier_cloud.pipeline_results import PipelineFailed
from services.verifier_cloud.server import VerifierServer
from services.verifier_cloud.settings import Settings, load_settings
from shared.model.checkpoint import ModelLoadError
from shared.model.split import SplitError
from shared.planning.prefill_pieces import DEFAULT_MAX_PREFILL_STEP_MS
from shared.processes.service_main import run_service
from shared.settings import SettingsError

log = logging.getLogger("services.verifier_cloud")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.verifier_cloud", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pipeline-stages",
        type=int,
        default=None,
        metavar="P",
        help="run the middle layers as P worker-process stages (env TOPHAT_VERIFIER_PIPELINE_STAGES; "
        "default 1 = in-process)",
    )
    parser.add_argument(
        "--full-model",
        action="store_true",
        default=None,
        help="also serve token mode, HAT's cloud baseline: hold the whole model and accept token ids "
        "on sessions opened without privacy (env TOPHAT_VERIFIER_FULL_MODEL; default off)",
    )
    parser.add_argument(
        "--server-chunk-tokens",
        type=int,
        default=None,
        metavar="N",
        help="U-Sarathi: compute prefills in pieces of N tokens, one per step "
        "(env TOPHAT_VERIFIER_SERVER_CHUNK_TOKENS; default 0 = off)",
    )
    parser.add_argument(
        "--max-prefill-step-ms",
        type=float,
        default=None,
        metavar="MS",
        help="while another session decodes, compute prefills in pieces whose pass the measured g(mu) predicts "
        f"within MS (env TOPHAT_VERIFIER_MAX_PREFILL_STEP_MS; default {DEFAULT_MAX_PREFILL_STEP_MS:g}; 0 = off)",
    )
    parser.add_argument(
        "--kv-layout",
        choices=KV_LAYOUTS,
        default=None,
        help="dynamic: KV caches grow by doubling; static: a preallocated slot of the whole context per session, "
        "charged whole (env TOPHAT_VERIFIER_KV_LAYOUT; default auto = static where CUDA graphs run)",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=CUDA_GRAPHS,
        default=None,
        help="replay verify passes of up to 32 rows from CUDA graphs per padded bucket "
        "(env TOPHAT_VERIFIER_CUDA_GRAPHS, buckets TOPHAT_VERIFIER_CUDA_GRAPH_ROWS; default auto = on CUDA)",
    )
    return parser.parse_args(argv)


def settings_from(argv: Sequence[str] | None = None) -> Settings:
    """The environment's settings with the command line's flags over them."""
    args = parse_args(argv)
    flags = {
        "pipeline_stages": args.pipeline_stages,
        "full_model": args.full_model,
        "server_chunk_tokens": args.server_chunk_tokens,
        "max_prefill_step_ms": args.max_prefill_step_ms,
        "kv_layout": args.kv_layout,
        "cuda_graphs": args.cuda_graphs,
    }
    overrides = {name: value for name, value in flags.items() if value is not None}
    return load_settings(**overrides)


async def serve(settings: Settings) -> None:
    """The verifier until SIGINT or SIGTERM."""
    torch.set_num_threads(settings.torch_threads)
    server = VerifierServer.from_settings(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.serve_forever(stop)


def main() -> None:
    try:
        settings = settings_from()
        run_service(settings, lambda: serve(settings))
    except (SettingsError, SplitError, ModelLoadError, PipelineFailed) as exc:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # no-op when already configured
        log.error("cannot start: %s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
