"""The Entra ID (Azure AD) endpoints the ARM emulator answers before any ARM call: a tenant's OpenID
configuration and the OAuth 2.0 token endpoint (client credentials). Every client secret it is sent is
recorded (``Arm.secrets_seen``), so tests can tell where secrets went; the token it hands out is ``TOKEN``,
the only bearer token ARM accepts.
"""

from __future__ import annotations

import urllib.parse

TOKEN = "emulated-bearer-token-5f1c2d"


def entra_answer(base: str, path: str, raw: bytes, secrets_seen: list[str]) -> dict | None:
    """Entra ID's answer (200) to a request for ``path`` on the emulator at ``base``, or None when ``path`` is
    not one of its endpoints."""
    if path.endswith("/.well-known/openid-configuration"):
        tenant = path.split("/")[1]
        base = f"{base}/{tenant}"
        return {"token_endpoint": f"{base}/oauth2/v2.0/token",
                "authorization_endpoint": f"{base}/oauth2/v2.0/authorize",
                "issuer": f"{base}/v2.0", "device_authorization_endpoint": f"{base}/oauth2/v2.0/device",
                "token_endpoint_auth_methods_supported": ["client_secret_post"]}
    if path.endswith("/oauth2/v2.0/token"):
        form = urllib.parse.parse_qs(raw.decode())
        secrets_seen.append(form.get("client_secret", [""])[0])
        return {"token_type": "Bearer", "expires_in": 3600, "ext_expires_in": 3600, "access_token": TOKEN}
    return None
