"""The Kubernetes API as the cluster platform calls it: one client per block, every call retried.

Separate from the stages because every stage shares it and none should repeat it: 429 (honouring
Retry-After), 5xx and connection errors are tried again with a doubling wait; a 403 fails at once
naming the verb and resource the service account lacks; a 404 for a missing namespace says how to
make it; a 409 on create adopts the object when it is ours and refuses it when it is not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from tasks.platforms.base import TransientPlatformError

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform

T = TypeVar("T")
#: Unknown fields in what laneflow sends are refused (400), never silently dropped (the server's default).
STRICT = "Strict"


class NamespaceNotFound(LookupError):
    """The block's namespace does not exist (the NamespaceLifecycle admission plugin's 404 on create)."""


class _ClientCache:
    """One ``ApiClient`` (one connection pool) per platform instance. Prefect copies blocks (deep copies of
    task parameters, pickled results): a copy starts with no client of its own."""

    def __init__(self) -> None:
        self.client: kubernetes.client.ApiClient | None = None

    def __deepcopy__(self, memo: dict) -> _ClientCache:
        return _ClientCache()

    def __reduce__(self) -> tuple:
        return _ClientCache, ()


class _ApiClient(kubernetes.client.ApiClient):
    """The kubernetes client, with a (connect, read) timeout for every call that sets none: a hung
    connection then fails and ``call`` retries it, instead of blocking its task for good (a Prefect
    task timeout cannot interrupt a task in a worker thread, so laneflow's tasks set none)."""

    def __init__(self, configuration: kubernetes.client.Configuration, timeout: tuple[float, float]) -> None:
        super().__init__(configuration)
        self.default_timeout = timeout

    def call_api(self, *args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        return super().call_api(*args, _request_timeout=_request_timeout or self.default_timeout, **kwargs)


def api_client(platform: ClusterPlatform) -> kubernetes.client.ApiClient:
    """A client for the block's cluster: its credentials, else in-cluster config, else the default kubeconfig."""
    configuration = kubernetes.client.Configuration()
    cluster = platform.credentials.cluster_config if platform.credentials else None
    if cluster is not None:
        kubernetes.config.load_kube_config_from_dict(cluster.config, context=cluster.context_name,
                                                     client_configuration=configuration)
    else:
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=configuration)
    configuration.retries = urllib3.util.Retry(total=0, redirect=0)  # retries are ours (below), counted
    return _ApiClient(configuration, (min(30.0, platform.api_timeout_s), platform.api_timeout_s))


def apis(platform: ClusterPlatform) -> tuple[kubernetes.client.CoreV1Api, kubernetes.client.BatchV1Api,
                                             kubernetes.client.CustomObjectsApi]:
    """The API groups laneflow calls, over one client (one connection pool) per platform instance."""
    if platform._clients.client is None:
        platform._clients.client = api_client(platform)
    client = platform._clients.client
    return (kubernetes.client.CoreV1Api(client), kubernetes.client.BatchV1Api(client),
            kubernetes.client.CustomObjectsApi(client))


def get_path(client: kubernetes.client.ApiClient, path: str) -> Any:
    """GET an API path the generated clients have no method for (an aggregated API's subresource, such as
    Kueue's pending workloads), as JSON; a non-2xx answer raises ``ApiException`` as theirs do."""
    response = client.call_api(*client.param_serialize(method="GET", resource_path=path,
                                                        auth_settings=["BearerToken"]))
    response.read()
    return client.response_deserialize(response_data=response, response_types_map={"200": "object"}).data


def call(platform: ClusterPlatform, verb: str, resource: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """One API call with retries on 429 (Retry-After), 5xx and connection errors; 403 names the permission."""
    delay = platform.api_retry_delay_s
    for attempt in range(1, platform.api_attempts + 1):
        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            if exc.status == 403:
                raise PermissionError(
                    f"the service account may not '{verb}' {resource} in namespace "
                    f"'{platform.effective_namespace()}'; grant it (deployments/base/rbac.yaml lists every "
                    f"permission laneflow needs): {_message(exc)}"
                ) from None
            if exc.status == 404 and (missing := _missing_namespace(exc)) is not None:
                raise NamespaceNotFound(
                    f"namespace '{missing}' does not exist on this cluster, so laneflow cannot create "
                    f"{resource} there. `kubectl apply -k deployments/base` creates namespace laneflow (the "
                    "block's default); a Run:ai project's namespace runai-<project> comes with the project, "
                    "and `kubectl apply -k deployments/runai` prepares it for laneflow; or set the block's "
                    "namespace to one that exists") from None
            if exc.status != 429 and exc.status < 500:
                raise
            wait = _retry_after(exc) or delay
        except (urllib3.exceptions.HTTPError, ConnectionError):
            wait = delay
        if attempt == platform.api_attempts:
            raise TransientPlatformError(f"{verb} {resource}: still failing after {attempt} attempts")
        time.sleep(wait)
        delay = min(delay * 2, 30.0)
    raise AssertionError("unreachable")


def create_or_adopt(platform: ClusterPlatform, kind: str, create: Callable[[], Any], read: Callable[[], Any],
                    is_ours: Callable[[Any], bool], name: str) -> tuple[Any, bool]:
    """Create; on 409 (ours from an earlier try, or someone else's) read it and adopt or refuse."""
    try:
        return call(platform, "create", kind, create), True
    except ApiException as exc:
        if exc.status != 409:
            raise
    existing = call(platform, "get", kind, read)
    if not is_ours(existing):
        raise FileExistsError(f"{kind} '{name}' already exists in namespace '{platform.effective_namespace()}' and "
                              "was not created by laneflow for this run; refusing to touch it (choose another name)")
    return existing, False


def wait_deleted(platform: ClusterPlatform, resource: str, read: Callable[[], Any], what: str,
                 timeout_s: float = 300, check: Callable[[], None] | None = None) -> None:
    """Until ``read`` answers 404 (a Foreground delete ends when the object's dependents are gone); ``check``,
    called between reads, raises when what it waits for can no longer happen by itself."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            call(platform, "get", resource, read)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        if check is not None:
            check()
        time.sleep(platform.poll_interval_s)
    raise TimeoutError(f"{what} was not deleted within {timeout_s:.0f} s")


def _status_of(exc: ApiException) -> dict[str, Any]:
    """The API server's Status body of an error, or {} when the body is not one."""
    try:
        status = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def _missing_namespace(exc: ApiException) -> str | None:
    """The namespace a 404 says does not exist (``namespaces "x" not found``), or None for any other 404."""
    details = _status_of(exc).get("details") or {}
    if details.get("kind") == "namespaces" and details.get("name"):
        return str(details["name"])
    return None


def _message(exc: ApiException) -> str:
    return str(_status_of(exc).get("message", exc.reason))


def _retry_after(exc: ApiException) -> float | None:
    value = (exc.headers or {}).get("Retry-After") if exc.headers else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
