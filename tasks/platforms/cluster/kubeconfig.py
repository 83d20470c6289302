"""What a kubeconfig stored in a platform block gives away: Prefect keeps ``KubernetesClusterConfig.config`` as a
plain dict, readable by anyone who can read the block (the UI, the API with the server's auth string), unlike a
``SecretStr``. A user entry with a bearer token, a client key, a password or an auth provider's tokens is a
credential in clear; an ``exec`` plugin (``kubelogin``, ``aws eks get-token``) or a key *file* path is not."""

from __future__ import annotations

from typing import Any

#: Fields of a kubeconfig ``user`` that hold a credential itself (client-go's ``AuthInfo``).
SECRET_FIELDS = ("token", "client-key-data", "password", "auth-provider")


def credentials_in_clear(config: dict[str, Any] | None) -> list[str]:
    """``<user>.<field>`` for each credential the kubeconfig holds in clear (never the value)."""
    found = []
    for entry in (config or {}).get("users") or []:
        user = entry.get("user") or {}
        found += [f"{entry.get('name', '?')}.{field}" for field in SECRET_FIELDS if user.get(field)]
    return found


def clear_credentials_warning(block_name: str, config: dict[str, Any] | None) -> str | None:
    """The warning a block storing such a kubeconfig gets (None when it stores none)."""
    found = credentials_in_clear(config)
    if not found:
        return None
    return (f"platform block '{block_name}' stores a kubeconfig with credentials in clear ({', '.join(found)}): "
            "anyone who can read blocks can read them. Run the flows in the cluster (the laneflow-k8s work pool) and "
            "leave the block's credentials empty (in-cluster config), or use a kubeconfig whose user is an exec "
            "plugin (kubelogin for AKS), and save the block again")
