"""`--config FILE` for any command: a TOML or YAML file of the command's own options, read before the other
options and set as the command's defaults (click's default_map), so a flag given on the command line (or its
environment variable) wins over the file. Keys are option names, in snake_case or kebab-case (`port_base`,
`port-base`, or any of an option's long names); a key that names no option of the command is refused, naming
it. Add it to a command with `config: Optional[Path] = config_option()`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

FORMATS = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}


class ConfigFileError(ValueError):
    """A config file that cannot be read, parsed, or applied to the command (an unknown key)."""


def read_config_file(path: Path) -> dict[str, Any]:
    """The file's top-level table: TOML by a .toml suffix, YAML by .yaml / .yml."""
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ConfigFileError(f"{path}: a config file is TOML (.toml) or YAML (.yaml, .yml)")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigFileError(f"cannot read {path}: {exc.strerror}") from exc
    if kind == "TOML":
        import tomllib

        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigFileError(f"{path} is not valid TOML: {exc}") from exc
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigFileError(f"{path} is not valid YAML: {exc}") from exc
        data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: expected a table of option = value, got a {type(data).__name__}")
    return data


def option_keys(command: Any) -> dict[str, str]:
    """Every key a config file may use for `command`'s options (snake_case), each to its parameter's name:
    the parameter's name and each of its long option names. Not --config itself, --help, or the negative
    name of an on/off flag (set the flag to false instead)."""
    keys: dict[str, str] = {}
    for param in command.params:
        if param.param_type_name != "option" or "--config" in param.opts or param.name == "help":
            continue
        for name in [param.name, *(opt[2:] for opt in param.opts if opt.startswith("--"))]:
            keys[name.replace("-", "_")] = param.name
    return keys


def config_defaults(path: Path, command: Any) -> dict[str, Any]:
    """The file's values by parameter name, for the command's default_map."""
    keys = option_keys(command)
    defaults: dict[str, Any] = {}
    for key, value in read_config_file(path).items():
        name = keys.get(str(key).replace("-", "_"))
        if name is None:
            known = ", ".join(sorted({k.replace("_", "-") for k in keys}))
            raise ConfigFileError(f"{path}: unknown key {key!r}: `{command.name}` has no such option (known: {known})")
        if name in defaults:
            raise ConfigFileError(f"{path}: {key!r} sets {name.replace('_', '-')} a second time")
        defaults[name] = value
    return defaults


def load_config(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Path]) -> Optional[Path]:
    """--config's callback (eager, so it runs before the other options are read): the file as their defaults."""
    if value is None or ctx.resilient_parsing:
        return value
    try:
        defaults = config_defaults(value, ctx.command)
    except ConfigFileError as exc:
        # typer hands callbacks a CallbackParam, which BadParameter's annotation (typer's private
        # _TyperParameter, a sibling class) does not name; at run time it is the option itself
        raise typer.BadParameter(str(exc), ctx=ctx, param=param) from exc  # type: ignore[arg-type]
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def config_option() -> Any:
    """The --config option (a parameter default, as typer reads options)."""
    return typer.Option(
        None,
        "--config",
        is_eager=True,
        callback=load_config,
        exists=True,
        dir_okay=False,
        help="a TOML or YAML file of this command's options (keys: the flag names, snake_case or kebab-case); "
        "flags given on the command line or by environment variable win over it",
    )
