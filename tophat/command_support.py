"""What every `tophat` command shares: the usage-error exit, the errors that are the user's to fix,
and the process setup of the commands that run a model here. Nothing heavy at import time: every
command module imports this, and `tophat --help` must not load torch or transformers."""

from __future__ import annotations

import logging
from typing import NoReturn

import typer


def user_errors() -> tuple[type[Exception], ...]:
    """A bad model, adapter, split or option: the errors a command turns into a one-line message and exit
    status 2, not a traceback (`except user_errors() as exc`). Imported when called: the modules that define
    them import torch and transformers, which `tophat --help` must not load."""
    from shared.model.adapter import AdapterError
    from shared.model.checkpoint import ModelLoadError
    from shared.model.split import SplitError
    from shared.specdec.device_session import SessionError

    return (ModelLoadError, AdapterError, SplitError, SessionError, ValueError)


SPLIT_LAYERS_HELP = "m: decoder layers on the device"
MODEL_HELP = (
    "smollm2 (SmolLM2-135M-Instruct, imported by `make install`) | demo (the small stdlib model) | a checkpoint dir"
)


def fail(message: str) -> NoReturn:
    """End the command with a usage error (exit status 2), its reason in red on stderr."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def setup_torch(threads: int | None) -> None:
    """Warnings-only logging and a small torch thread pool: the commands that run a model share the
    machine with the mesh's processes."""
    import torch

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads or min(2, torch.get_num_threads()))
