"""Each MPIJob's pods reachable only from each other: a NetworkPolicy per job (``render_network_policy``).

Created as soon as the MPIJob exists, owned by it: the operator's pods need scheduling, an image and a started
sshd before anything listens, and the policy is one API call after the job. It takes effect where the cluster's
network plugin enforces NetworkPolicies (AKS: Azure NPM, Calico or Cilium, chosen when the cluster is created);
elsewhere it is stored and does nothing, which laneflow cannot see from the API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kubernetes
from kubernetes.client.exceptions import ApiException

from tasks.k8s.manifests import render_network_policy
from tasks.platforms.cluster.api import STRICT, apis, call

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform


def isolate(platform: ClusterPlatform, job: dict) -> None:
    """The NetworkPolicy of ``job`` (an MPIJob as the API server returned it). A 409 is this job's own from an
    earlier try: the name holds the job's uid, which nobody but the job's creator has before it exists."""
    policy = render_network_policy(job, platform.job_labels(job["metadata"]["name"]))
    core, _, _ = apis(platform)
    networking = kubernetes.client.NetworkingV1Api(core.api_client)
    try:
        call(platform, "create", "networkpolicies", networking.create_namespaced_network_policy,
             platform.effective_namespace(), policy, field_validation=STRICT)
    except ApiException as exc:
        if exc.status != 409:
            raise
