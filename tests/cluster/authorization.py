"""RBAC as kube-apiserver authorizes a request (kubernetes ``plugin/pkg/auth/authorizer/rbac``): allowed when
any rule of any Role or ClusterRole bound to the caller's service account covers its verb, resource, API
group and name; otherwise 403 Forbidden, worded as the API server words it. Enforced once ``Cluster.load``
brought RBAC objects; the anonymous caller (no token) is granted nothing then. Discovery paths are open to
every authenticated caller (the bootstrap ClusterRole ``system:discovery``, bound to
``system:authenticated``), ``/version`` and the health paths to anyone (``system:public-info-viewer``)
(``plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.cluster.apierrors import status_body
from tests.cluster.objects import RESOURCES

if TYPE_CHECKING:
    from tests.cluster.authentication import Identity
    from tests.cluster.state import Cluster

PUBLIC_PATHS = ("/version", "/healthz", "/livez", "/readyz")


def forbidden(who: Identity, verb: str, resource: str, namespace: str | None, name: str | None) -> dict:
    group = RESOURCES[resource][0]
    what = f'{resource.split("/")[0]} "{name}"' if name else resource.split("/")[0]
    where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
    return status_body(403, "Forbidden", f'{what} is forbidden: User "{who.user}" cannot {verb} resource '
                                         f'"{resource}" in API group "{group}"{where}')


def authorize_path(cluster: Cluster, who: Identity, path: str) -> dict | None:
    """A non-resource path (discovery, /version): None when allowed, else the 403 Status."""
    if not cluster.rbac_enforced or who.account is not None or path in PUBLIC_PATHS:
        return None
    return status_body(403, "Forbidden", f'forbidden: User "{who.user}" cannot get path "{path}"')


def authorize(cluster: Cluster, who: Identity, verb: str, resource: str, namespace: str | None,
              name: str | None) -> dict | None:
    """RBAC as kube-apiserver evaluates it: any rule of any Role/ClusterRole bound to the caller."""
    if not cluster.rbac_enforced:
        return None
    if who.account is None:
        return forbidden(who, verb, resource, namespace, name)
    group = RESOURCES[resource][0]
    sa_namespace, sa_name = who.account

    def bound(binding: dict) -> bool:
        return any(s.get("kind") == "ServiceAccount" and s.get("name") == sa_name
                   and s.get("namespace", binding["metadata"].get("namespace")) == sa_namespace
                   for s in binding.get("subjects") or [])

    def allows(role: dict | None) -> bool:
        for rule in (role or {}).get("rules") or []:
            if (group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", [])) and \
                    (resource in rule.get("resources", []) or "*" in rule.get("resources", [])) and \
                    (verb in rule.get("verbs", []) or "*" in rule.get("verbs", [])) and \
                    (not rule.get("resourceNames") or name in rule["resourceNames"]):
                return True
        return False

    with cluster.lock:
        for binding in cluster.objects["clusterrolebindings"].values():
            if bound(binding) and allows(cluster.objects["clusterroles"].get(("", binding["roleRef"]["name"]))):
                return None
        if namespace:
            for (ns, _), binding in cluster.objects["rolebindings"].items():
                if ns != namespace or not bound(binding):
                    continue
                ref = binding["roleRef"]
                role = cluster.objects["roles"].get((ns, ref["name"])) if ref["kind"] == "Role" else \
                    cluster.objects["clusterroles"].get(("", ref["name"]))
                if allows(role):
                    return None
    return forbidden(who, verb, resource, namespace, name)
