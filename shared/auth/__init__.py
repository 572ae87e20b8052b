"""Every hop authenticated: verifying audience-bound tokens and the ASGI guard (verify.py), the callers' side that
fetches tokens (client.py), the issuer's signing keys (signing.py), revocation of open connections
(credential_watch.py) and TLS contexts (tls.py)."""
