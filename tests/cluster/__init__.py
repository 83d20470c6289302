"""The emulated Kubernetes cluster: tests import it from here (``from tests.cluster import KubernetesEmulator``)."""

from tests.k8s_emulator import JOB_DELETE_WARNING, Cluster, Fault, KubernetesEmulator

__all__ = ["JOB_DELETE_WARNING", "Cluster", "Fault", "KubernetesEmulator"]
