"""The emulated Kubernetes cluster, for contract tests: an in-process API server on 127.0.0.1 that also plays
the controllers, the scheduler and the kubelet of its nodes (one by default). Tests import it from here
(``from tests.cluster import KubernetesEmulator``).

It is as strict as the real API server, and its controllers behave as their upstream source says: each
module models one component and cites the file it follows.

- ``emulator.py``: ``KubernetesEmulator``, the cluster as a test starts and stops it (the API server's
  thread, the time-driven controllers' tick, a kubeconfig).
- ``state.py``: ``Cluster``, the state every component shares and tests hold; ``Fault``, ``Request``,
  ``ContainerLog``.
- ``objects.py``: what every component does to objects (resources, time stamps, system metadata, owner
  references, events, delayed actions).
- ``apiserver.py``: the API server: REST routing, storage, list and selectors, PATCH/PUT/DELETE, faults,
  request recording (apiserver ``registry/generic/registry/store.go``).
- ``authorization.py``: RBAC authorization of every request.
- ``admission.py``: what the API server admits: schema and Go validation, refused as the API server
  refuses; the LimitRanger and PVC resize admission plugins.
- ``schemas.py``: the OpenAPI schemas of the core kinds and the MPIJob and VolumeSnapshot CRD schemas.
- ``apierrors.py``: Status refusals and field causes (apimachinery ``pkg/api/errors``).
- ``quantities.py``: Kubernetes quantities as the API server reads them (apimachinery ``pkg/api/resource``).
- ``updates.py``: PATCH by media type, immutable fields, what an update may change.
- ``controller_manager.py``: which controller acts on a new object, and on a change of an owned one.
- ``garbage_collector.py``: deletion propagation (Foreground, Background, Orphan), graceful pod deletion,
  finalizers that hold a deletion.
- ``disruption.py``: the eviction subresource and PodDisruptionBudgets (the disruption controller's status).
- ``node_lifecycle.py``: cordon, ``kubectl drain`` and the kubelet's graceful node shutdown.
- ``ttl_controller.py``: the TTL-after-finished controller.
- ``job_controller.py``: the Job controller (kubernetes ``pkg/controller/job``).
- ``mpi_operator.py``: the MPI operator (kubeflow/mpi-operator ``pkg/controller/mpi_job_controller.go``).
- ``pod_control.py``: pods made from a controller's template, through ServiceAccount admission.
- ``pv_binder.py``: PVC binding and provisioning, from a snapshot too (PV controller, external-provisioner).
- ``snapshot_controller.py``: VolumeSnapshots (kubernetes-csi/external-snapshotter).
- ``scheduler.py``: kube-scheduler's filters and binding over the nodes.
- ``kubelet.py``: the kubelet: pod start, image pull, container state, crash loop, stop and eviction.
- ``kubelet_volumes.py``: the kubelet's volumes: PVC, Secret, ConfigMap and emptyDir mounts.
- ``podlogs.py``: container logs as the kubelet keeps them and ``pods/log`` serves them.
- ``runtime.py``: the container runtime: each container's real command in namespaces of its own, a memory
  cgroup for ``limits.memory``.
- ``podinit.py``: a container's PID 1, which builds its file system and execs its command.
- ``images.py``: the image registry: laneflow's images as ``scripts/images.py`` builds them (buildah).
- ``network.py``: the pod network: a network namespace and address per pod on a bridge.
- ``network_policy.py``: NetworkPolicy ingress rules enforced in each pod's network namespace (iptables), as a
  policy plugin (Azure NPM, Calico, Cilium) does; egress and named ports are refused, not modelled.

Containers really run here, through the pod runtime (``runtime.py``): each container's command, from the root
file system of the image it names (built from ``deployments/Dockerfile.*``; nothing of this machine is
visible inside), with its env, working directory, host name and volumes, in namespaces of its own. The MPI
operator's launcher reaches its workers' real ``sshd`` (the image's) with the operator's key and runs the
image's real ``mpirun``. Nothing here knows laneflow's commands or paths.
"""

from tests.cluster.apiserver import JOB_DELETE_WARNING
from tests.cluster.emulator import KubernetesEmulator
from tests.cluster.state import Cluster, Fault

__all__ = ["JOB_DELETE_WARNING", "Cluster", "Fault", "KubernetesEmulator"]
