"""Settings from environment variables, as checked frozen dataclasses.

Each service declares a dataclass whose fields carry defaults; `from_env` reads
`<PREFIX><FIELD_NAME_UPPER>` for every field, converts it to the field's type
and runs the class's `validate()` (if any) so a bad value fails at startup with
a clear message rather than deep inside a request.

`TOPHAT_SETTINGS_FILE` names optional files of `KEY=VALUE` lines (`#` comments, blank
lines), comma-separated, read under the environment: a later file overrides an earlier one, and a
variable set in the environment wins over every file. It is how a Swarm `config` or a Kubernetes
ConfigMap (tunables) and a mounted secret (the mesh secret, API keys) set a service's settings.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, TypeVar

T = TypeVar("T")

SETTINGS_FILE_VAR = "TOPHAT_SETTINGS_FILE"


class SettingsError(ValueError):
    """An environment variable could not be parsed or failed validation."""


def _convert(raw: str, annotation: Any, name: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if raw == "" or raw.lower() == "none":
            return None
        return _convert(raw, args[0], name)
    try:
        if annotation is bool:
            lowered = raw.strip().lower()
            if lowered in {"1", "true", "yes", "on"}:
                return True
            if lowered in {"0", "false", "no", "off"}:
                return False
            raise ValueError(f"not a boolean: {raw!r}")
        if annotation in (int, float, str):
            return annotation(raw)
    except ValueError as exc:
        raise SettingsError(f"{name}: {exc}") from exc
    raise SettingsError(f"{name}: unsupported settings type {annotation!r}")


def read_settings_file(path: str) -> dict[str, str]:
    """`KEY=VALUE` lines; a line that is neither that, blank nor a `#` comment is an error (with its number)."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise SettingsError(f"{SETTINGS_FILE_VAR}: cannot read {path}: {exc}") from exc
    values: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, sep, value = stripped.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"{path}:{number}: expected KEY=VALUE, got {stripped[:80]!r}")
        values[key.strip()] = value.strip()
    return values


def from_env(cls: type[T], prefix: str, environ: typing.Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build `cls` from `prefix + FIELD` environment variables (over the settings file, if one is named);
    `overrides` win."""
    environ = os.environ if environ is None else environ
    if environ.get(SETTINGS_FILE_VAR):
        from_files: dict[str, str] = {}
        for path in (p.strip() for p in environ[SETTINGS_FILE_VAR].split(",")):
            if path:
                from_files.update(read_settings_file(path))
        environ = {**from_files, **environ}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = f"{prefix}{field.name.upper()}"
        if field.name in overrides:
            values[field.name] = overrides[field.name]
        elif key in environ:
            values[field.name] = _convert(environ[key], hints[field.name], key)
    instance = cls(**values)
    validate = getattr(instance, "validate", None)
    if validate is not None:
        try:
            validate()
        except (ValueError, TypeError) as exc:
            raise SettingsError(f"{cls.__name__}: {exc}") from exc
    return instance
