"""`python -m tophat`, the same as the `tophat` console script."""

from tophat.cli import app

app(prog_name="tophat")
