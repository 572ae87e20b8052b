"""shared/settings.py: environment variables over an optional settings file, typed and validated."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from shared.settings import SETTINGS_FILE_VAR, SettingsError, from_env, read_settings_file


@dataclass(frozen=True)
class Example:
    port: int = 1
    name: str = "x"
    fast: bool = False

    def validate(self) -> None:
        if self.port < 0:
            raise ValueError("port must be >= 0")


def test_file_values_apply_under_the_environment(tmp_path):
    path = tmp_path / "settings.env"
    path.write_text("# tunables\n\nEX_PORT = 9\nEX_NAME=file\nOTHER_KEY=ignored\n")
    got = from_env(Example, "EX_", {SETTINGS_FILE_VAR: str(path), "EX_NAME": "env"})
    assert got == Example(port=9, name="env", fast=False)
    assert from_env(Example, "EX_", {SETTINGS_FILE_VAR: str(path)}, port=3).port == 3  # overrides win


def test_bad_files_and_values_are_clear_errors(tmp_path):
    with pytest.raises(SettingsError, match="cannot read"):
        from_env(Example, "EX_", {SETTINGS_FILE_VAR: str(tmp_path / "missing.env")})
    bad = tmp_path / "bad.env"
    bad.write_text("EX_PORT=1\nthis is not a setting\n")
    with pytest.raises(SettingsError, match=r"bad.env:2: expected KEY=VALUE"):
        read_settings_file(str(bad))
    typed = tmp_path / "typed.env"
    typed.write_text("EX_FAST=maybe\n")
    with pytest.raises(SettingsError, match="EX_FAST"):
        from_env(Example, "EX_", {SETTINGS_FILE_VAR: str(typed)})
    with pytest.raises(SettingsError, match="port must be"):
        from_env(Example, "EX_", {"EX_PORT": "-1"})


def test_several_files_later_ones_override_and_the_environment_overrides_all(tmp_path):
    # a Swarm config beside a Swarm secret: TOPHAT_SETTINGS_FILE=/etc/tophat/tophat.env,/run/secrets/mesh.env
    tunables = tmp_path / "tophat.env"
    tunables.write_text("EX_PORT=9\nEX_NAME=tunables\n")
    secrets = tmp_path / "mesh.env"
    secrets.write_text("EX_NAME=secret\nEX_FAST=true\n")
    listed = f"{tunables}, {secrets},"  # spaces and an empty entry are tolerated
    assert from_env(Example, "EX_", {SETTINGS_FILE_VAR: listed}) == Example(port=9, name="secret", fast=True)
    assert from_env(Example, "EX_", {SETTINGS_FILE_VAR: listed, "EX_NAME": "env"}).name == "env"
    with pytest.raises(SettingsError, match="missing.env"):
        from_env(Example, "EX_", {SETTINGS_FILE_VAR: f"{tunables},{tmp_path / 'missing.env'}"})


SERVICES = ("chunk_planner", "device_agent", "state_monitor", "token_streamer", "verifier_cloud")


@pytest.mark.parametrize("service", SERVICES)
def test_every_service_refuses_a_port_out_of_range(service):
    """A port past 65535 is a settings error naming it, not an OverflowError when the socket binds."""
    import importlib

    settings = importlib.import_module(f"services.{service}.settings")
    for port in ("65536", "99999", "-1"):
        with pytest.raises(SettingsError, match=f"port out of range: {port}"):
            settings.load_settings({f"{settings.ENV_PREFIX}PORT": port})
    assert settings.load_settings({f"{settings.ENV_PREFIX}PORT": "65535"}).port == 65535
