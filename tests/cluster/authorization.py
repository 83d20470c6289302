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
    if allowed(cluster, who, verb, RESOURCES[resource][0], resource, namespace, name):
        return None
    return forbidden(who, verb, resource, namespace, name)


def allowed(cluster: Cluster, who: Identity, verb: str, group: str, resource: str, namespace: str | None,
            name: str | None) -> bool:
    """Whether RBAC allows ``verb`` on ``resource`` (``resource/subresource``) of API ``group`` to the caller."""
    if not cluster.rbac_enforced:
        return True
    if who.account is None:
        return False
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
                return True
        if namespace:
            for (ns, _), binding in cluster.objects["rolebindings"].items():
                if ns != namespace or not bound(binding):
                    continue
                ref = binding["roleRef"]
                role = cluster.objects["roles"].get((ns, ref["name"])) if ref["kind"] == "Role" else \
                    cluster.objects["clusterroles"].get(("", ref["name"]))
                if allows(role):
                    return True
    return False


#: SelfSubjectAccessReview: "may I?", asked by the caller about itself (API reference: authorization.k8s.io/v1
#: SelfSubjectAccessReview; kubernetes pkg/registry/authorization/selfsubjectaccessreview/rest.go ``Create``).
SELF_SUBJECT_ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


def self_subject_access_review(cluster: Cluster, who: Identity, method: str, body: object) -> tuple[int, dict]:
    """A POST of a SelfSubjectAccessReview, as kube-apiserver answers it: the review is not stored; its spec comes
    back with ``status.allowed`` as the authorizer decides for the caller's own identity. Creating one is open to
    every authenticated caller (the bootstrap ClusterRole ``system:basic-user``, bound to ``system:authenticated``:
    plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go), not to the anonymous one. A spec needs exactly one
    of ``resourceAttributes`` and ``nonResourceAttributes`` (pkg/apis/authorization/validation
    ``ValidateSelfSubjectAccessReviewSpec``): 422 otherwise."""
    if method != "POST":
        return 405, status_body(405, "MethodNotAllowed", f"{method} is not supported on selfsubjectaccessreviews")
    if cluster.rbac_enforced and who.account is None:
        return 403, status_body(403, "Forbidden", f'selfsubjectaccessreviews.authorization.k8s.io is forbidden: User '
                                                  f'"{who.user}" cannot create resource "selfsubjectaccessreviews" in '
                                                  'API group "authorization.k8s.io" at the cluster scope')
    spec = body.get("spec") if isinstance(body, dict) else None
    spec = spec if isinstance(spec, dict) else {}
    attributes, non_resource = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
    if (attributes is None) == (non_resource is None):
        return 422, status_body(422, "Invalid", 'SelfSubjectAccessReview.authorization.k8s.io "" is invalid: '
                                                "spec.resourceAttributes: Invalid value: \"null\": exactly one of "
                                                "nonResourceAttributes or resourceAttributes must be specified")
    if attributes is not None:
        resource = attributes.get("resource", "")
        if attributes.get("subresource"):
            resource = f"{resource}/{attributes['subresource']}"
        decision = allowed(cluster, who, attributes.get("verb", ""), attributes.get("group", ""), resource,
                           attributes.get("namespace") or None, attributes.get("name") or None)
    else:
        decision = non_resource.get("verb") == "get" and \
            authorize_path(cluster, who, non_resource.get("path", "")) is None
    status = {"allowed": decision}
    if decision and cluster.rbac_enforced:
        status["reason"] = "RBAC: allowed by a binding of the caller's service account"
    return 201, {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                 "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}
