"""Who a request comes from, as kube-apiserver authenticates it (``pkg/kubeapiserver/authenticator``):
a bearer token names a service account, an unknown or expired token is 401 Unauthorized, and a request
without credentials is ``system:anonymous`` (anonymous auth is on by default), whom RBAC grants nothing.

Tokens are issued as the TokenRequest API issues them (``pkg/serviceaccount/jwt.go``): a JWT whose subject
is ``system:serviceaccount:<namespace>:<name>``, bound to a pod when the kubelet asks for one for a pod's
projected volume — such a token stops working when its pod is gone (``pkg/serviceaccount/claims.go``
``Validate``: the bound object must still exist with the same uid). The emulator keeps what it issued and
checks a presented token against that instead of a signature.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tests.cluster.apierrors import Rejection, status_body

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

#: The token of the kubeconfig the test process uses (``KubernetesEmulator.kubeconfig``): it authenticates as
#: ``Cluster.user``, as ``kubectl create token <account>`` would make one for that account.
KUBECONFIG_TOKEN = "emulator-token"
#: What the ServiceAccount admission plugin asks for in a pod's projected volume (``expirationSeconds``).
POD_TOKEN_SECONDS = 3607


@dataclass(frozen=True)
class Identity:
    """An authenticated caller: a service account (namespace, name), or anonymous (``account`` None)."""

    account: tuple[str, str] | None

    @property
    def user(self) -> str:
        if self.account is None:
            return "system:anonymous"
        return f"system:serviceaccount:{self.account[0]}:{self.account[1]}"


ANONYMOUS = Identity(None)


@dataclass(frozen=True)
class Grant:
    account: tuple[str, str]
    expires: float
    pod_uid: str | None = None


def _segment(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data, separators=(",", ":")).encode()).rstrip(b"=").decode()


def issue_token(cluster: Cluster, namespace: str, account: str, *, seconds: int = 3600,
                pod: dict | None = None) -> str:
    """A token for the service account (TokenRequest), bound to ``pod`` when given."""
    issued = int(time.time())
    claims = {"aud": ["https://kubernetes.default.svc.cluster.local"], "exp": issued + seconds, "iat": issued,
              "iss": "https://kubernetes.default.svc.cluster.local",
              "sub": f"system:serviceaccount:{namespace}:{account}",
              "kubernetes.io": {"namespace": namespace, "serviceaccount": {"name": account}}}
    if pod is not None:
        claims["kubernetes.io"]["pod"] = {"name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
    token = ".".join((_segment({"alg": "RS256", "kid": "emulator"}), _segment(claims),
                      base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()))
    cluster.tokens[token] = Grant((namespace, account), issued + seconds,
                                  pod["metadata"]["uid"] if pod is not None else None)
    return token


def unauthorized() -> Rejection:
    """apiserver ``endpoints/handlers/responsewriters`` ``unauthorized``: the whole body says no more."""
    return Rejection(401, status_body(401, "Unauthorized", "Unauthorized"))


def authenticate(cluster: Cluster, authorization: str | None) -> Identity:
    """The caller of a request with this ``Authorization`` header; a 401 ``Rejection`` for a bad token."""
    if not authorization:
        return ANONYMOUS
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise unauthorized()
    if token == KUBECONFIG_TOKEN:
        return Identity(cluster.user)
    grant = cluster.tokens.get(token)
    if grant is None or grant.expires < time.time():
        raise unauthorized()
    if grant.pod_uid is not None and not any(pod["metadata"].get("uid") == grant.pod_uid
                                             for pod in cluster.objects["pods"].values()):
        raise unauthorized()  # bound to a pod that is gone
    return Identity(grant.account)
