"""The `tophat` console script as a module (`-m tophat`), for an environment without its entry point."""

from tophat.cli import app

app(prog_name="tophat")
