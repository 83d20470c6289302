"""The MPI operator's defaults and validation of an MPIJob (kubeflow/mpi-operator v0.8
``pkg/apis/kubeflow/v2beta1/default.go``, ``pkg/apis/kubeflow/validation/validation.go``), which it applies in
memory on each sync, never writing the spec back."""

from __future__ import annotations

import copy
import json
import re

from tests.cluster.apierrors import invalid, not_supported, required


def operator_defaults(spec: dict) -> dict:
    """``SetDefaults_MPIJob`` (default.go L27-80), in memory only: the operator never writes spec back."""
    spec = copy.deepcopy(spec)
    spec.setdefault("runPolicy", {}).setdefault("cleanPodPolicy", "None")
    spec.setdefault("slotsPerWorker", 1)
    spec.setdefault("sshAuthMountPath", "/root/.ssh")
    spec.setdefault("mpiImplementation", "OpenMPI")
    spec.setdefault("launcherCreationPolicy", "AtStartup")
    replicas = spec.get("mpiReplicaSpecs") or {}
    if "Launcher" in replicas:
        replicas["Launcher"].setdefault("restartPolicy", "OnFailure")
        replicas["Launcher"].setdefault("replicas", 1)
    if "Worker" in replicas:
        replicas["Worker"].setdefault("restartPolicy", "Never")
        replicas["Worker"].setdefault("replicas", 0)
    return spec


def operator_validation(name: str, spec: dict) -> list:
    """``ValidateMPIJob`` (validation.go): the rules the controller applies before creating anything."""
    causes = []
    replicas = spec.get("mpiReplicaSpecs") or {}
    workers = replicas.get("Worker", {}).get("replicas", 0) if "Worker" in replicas else 0
    host = f"{name}-worker-{max(workers, 1) - 1}"
    problems = []
    if len(host) > 63:
        problems.append("must be no more than 63 characters")
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", host):
        problems.append("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                        "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
                        "'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
    if problems:
        causes.append(invalid("metadata.name", name, f"will not able to create pod and service with invalid DNS "
                                                     f"label {json.dumps(host)}: {', '.join(problems)}"))
    if spec["slotsPerWorker"] < 0:
        causes.append(invalid("spec.slotsPerWorker", spec["slotsPerWorker"], "must be greater than or equal to 0"))
    policy = spec["runPolicy"]
    if policy["cleanPodPolicy"] not in ("All", "None", "Running"):
        causes.append(not_supported("spec.runPolicy.cleanPodPolicy", policy["cleanPodPolicy"],
                                    ["All", "None", "Running"]))
    for key in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        if policy.get(key) is not None and policy[key] < 0:
            causes.append(invalid(f"spec.runPolicy.{key}", policy[key], "must be greater than or equal to 0"))
    if not spec["sshAuthMountPath"]:
        causes.append(required("spec.sshAuthMountPath", "must have a mount path for SSH credentials"))
    if "Launcher" not in replicas:
        causes.append(required("spec.mpiReplicaSpecs[Launcher]", "must have Launcher replica spec"))
    for role, replica in replicas.items():
        where = f"spec.mpiReplicaSpecs[{role}]"
        if replica["restartPolicy"] not in ("Never", "OnFailure"):
            causes.append(not_supported(f"{where}.restartPolicy", replica["restartPolicy"], ["Never", "OnFailure"]))
        if not (replica.get("template") or {}).get("spec", {}).get("containers"):
            causes.append(required(f"{where}.template.spec.containers", "must define at least one container"))
    if "Launcher" in replicas and replicas["Launcher"]["replicas"] != 1:
        causes.append(invalid("spec.mpiReplicaSpecs[Launcher].replicas", replicas["Launcher"]["replicas"],
                              "must be 1"))
    if "Worker" in replicas and replicas["Worker"]["replicas"] <= 0:
        causes.append(invalid("spec.mpiReplicaSpecs[Worker].replicas", replicas["Worker"]["replicas"],
                              "must be greater than or equal to 1"))
    return causes
