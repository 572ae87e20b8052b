"""`tophat credentials issue | revoke | rotate`: the operator's hand on the mesh's issuer (the state monitor).

Each command calls the issuer's operator endpoints (services/state_monitor/issuer.py) with a short-lived
operator token, minted from the signing key ring the operator made (`tophat mesh-secrets`' signing-keys.json,
or `tophat serve`'s log directory) or given as `--operator-token` (a token `issue --role operator` printed).
"""

from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

app = typer.Typer(no_args_is_help=True, help="Issue, revoke and rotate the mesh's credentials (at the issuer).")

OPERATOR_TOKEN_TTL_S = 120.0


class Role(str, Enum):
    device = "device"
    service = "service"
    bootstrap = "bootstrap"
    operator = "operator"


def _call(
    issuer: str,
    path: str,
    body: dict[str, Any] | None,
    key_file: Optional[Path],
    operator_token: str,
    ca: Optional[Path],
) -> dict[str, Any]:
    import httpx

    from shared.auth import verify as auth
    from shared.auth.signing import KeyRing
    from shared.auth.tls import client_context

    if not operator_token:
        if key_file is None:
            raise typer.BadParameter("give --key-file (the signing key ring) or --operator-token")
        try:
            ring = KeyRing.load(key_file)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        operator_token = ring.mint("tophat-operator", "operator", auth.ISSUER, OPERATOR_TOKEN_TTL_S, time.time())
    try:
        response = httpx.post(
            f"{issuer.rstrip('/')}{path}",
            json=body,
            timeout=10,
            trust_env=False,
            headers={"Authorization": f"Bearer {operator_token}"},
            verify=client_context(str(ca) if ca else ""),
        )
    except httpx.HTTPError as exc:
        typer.echo(f"error: the issuer at {issuer} is unreachable: {exc}", err=True)
        raise typer.Exit(1) from exc
    if response.status_code != 200:
        typer.echo(f"error: the issuer refused {path}: HTTP {response.status_code} {response.text[:300]}", err=True)
        raise typer.Exit(1)
    return dict(response.json())


ISSUER = typer.Option("http://127.0.0.1:8765", "--issuer", envvar="TOPHAT_ISSUER_URL", help="the state monitor's URL")
KEY_FILE = typer.Option(
    None,
    "--key-file",
    help="the signing key ring (signing-keys.json; after a rotation the "
    "issuer's issuer-state.json) to mint the operator's token with",
)
OPERATOR_TOKEN = typer.Option(
    "",
    "--operator-token",
    envvar="TOPHAT_OPERATOR_TOKEN",
    show_default=False,
    help="an operator token instead of --key-file",
)
CA = typer.Option(None, "--ca", help="the CA certificate an https issuer's certificate is from")


@app.command("issue")
def issue(
    role: Role = typer.Option(..., "--role"),
    subject: str = typer.Option(
        ...,
        "--subject",
        help="a device id (a bootstrap's: the one id it enrols, now bound to this token), a service's name",
    ),
    audience: str = typer.Option(
        "state-monitor", "--audience", help="what the token is for (the issuer: a credential to enrol or renew with)"
    ),
    ttl_s: float = typer.Option(86_400.0, "--ttl-s"),
    issuer: str = ISSUER,
    key_file: Optional[Path] = KEY_FILE,
    operator_token: str = OPERATOR_TOKEN,
    ca: Optional[Path] = CA,
):
    """Print a new credential (e.g. a device's bootstrap token, a service's credential)."""
    body = {"role": role.value, "subject": subject, "audience": audience, "ttl_s": ttl_s}
    typer.echo(_call(issuer, "/credentials/issue", body, key_file, operator_token, ca)["token"])


@app.command("revoke")
def revoke(
    device: str = typer.Option(
        "", "--device", help="a device id: its every token, its bootstrap's too, is refused from its next call"
    ),
    service: str = typer.Option("", "--service", help="a service's name"),
    token_id: str = typer.Option("", "--token-id", help="one token's jti (e.g. a leaked bootstrap token)"),
    issuer: str = ISSUER,
    key_file: Optional[Path] = KEY_FILE,
    operator_token: str = OPERATOR_TOKEN,
    ca: Optional[Path] = CA,
):
    """Revoke a device, a service or one token; verifying services refuse it within their refresh period."""
    given = [v for v in (device, service, token_id) if v]
    if len(given) != 1:
        raise typer.BadParameter("give exactly one of --device, --service, --token-id")
    body = (
        {"token_id": token_id}
        if token_id
        else {"role": "device" if device else "service", "subject": device or service}
    )
    typer.echo(json.dumps(_call(issuer, "/credentials/revoke", body, key_file, operator_token, ca)))


@app.command("rotate")
def rotate(
    issuer: str = ISSUER,
    key_file: Optional[Path] = KEY_FILE,
    operator_token: str = OPERATOR_TOKEN,
    ca: Optional[Path] = CA,
):
    """Make a new signing key active; the old one verifies until every token it signed has expired."""
    typer.echo(json.dumps(_call(issuer, "/credentials/rotate", None, key_file, operator_token, ca)))
