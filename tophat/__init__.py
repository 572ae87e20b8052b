"""The `tophat` command: the top layer, the one package that may import every other (shared <
services < tophatctl < loadgen < tophat). Its modules read options, call the library and print;
cli.py is the typer app that mounts every command."""
