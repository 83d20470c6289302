"""NetworkPolicy ingress rules, enforced on the emulated pod network as a CNI plugin with policy support (Calico,
Cilium, Azure NPM on AKS) enforces them: in the kernel, on each pod's own traffic.

Semantics (networking.k8s.io/v1, https://kubernetes.io/docs/concepts/services-networking/network-policies/ and
the API reference of ``NetworkPolicySpec``):
- a pod is isolated for ingress when a policy of its namespace selects it (``podSelector``; empty: every pod)
  and that policy's ``policyTypes`` holds ``Ingress`` (when ``policyTypes`` is absent: always Ingress);
- an isolated pod accepts a connection that any selecting policy's ``ingress`` rules allow (policies add up):
  a rule without ``from`` allows every source; a peer is a ``podSelector`` (pods of the policy's namespace), a
  ``namespaceSelector`` (every pod of the matching namespaces), both (pods matching one in namespaces matching
  the other), or an ``ipBlock`` (``cidr`` less ``except``); a rule without ``ports`` allows every port;
- replies to connections the pod made, traffic over its own loopback, and traffic from the node the pod runs on
  ("traffic to and from the node where a Pod is running is always allowed, regardless of the IP address of the
  Pod or the node": the page above, ipBlock) are never blocked. Every emulated node is this machine, whose
  address on the pod network is the bridge's (``PodNetwork.gateway``).

Modelled: ingress of TCP/UDP with numeric ports. Not modelled (refused at creation where a test would rely on
it): egress rules, named ports, ``endPort``, SCTP. The rules are brought up to date whenever a pod gets its
network or goes, and whenever a policy, a pod or a namespace is created, changed or deleted (labels decide).

Each pod's rules live in its own network namespace (an ``iptables`` chain ``LANEFLOW-INGRESS`` jumped to from
``INPUT``), so each test process's emulator enforces its own cluster's policies. Only the chains whose rules
changed are rewritten. A chain that cannot be written is the plugin's error (``Cluster.controller_errors``, looked
at when the emulator stops), never the API request's or the kubelet's that caused the update; it is tried again at
the next one.
"""

from __future__ import annotations

import ipaddress
import subprocess
from typing import TYPE_CHECKING

from tests.cluster.apierrors import Rejection
from tests.cluster.selectors import label_selector_object

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

CHAIN = "LANEFLOW-INGRESS"


def check_supported(policy: dict) -> None:
    """Refuse what the emulator does not enforce, rather than accept a policy and silently not enforce it."""
    spec = policy.get("spec") or {}
    unsupported = []
    if "Egress" in (spec.get("policyTypes") or []) or spec.get("egress"):
        unsupported.append("egress rules")
    for rule in spec.get("ingress") or []:
        for port in rule.get("ports") or []:
            if isinstance(port.get("port"), str):
                unsupported.append("named ports")
            if "endPort" in port:
                unsupported.append("endPort")
            if port.get("protocol", "TCP") not in ("TCP", "UDP"):
                unsupported.append(f"protocol {port.get('protocol')}")
    if unsupported:
        raise Rejection(422, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "reason": "Invalid", "code": 422,
                              "message": "the emulated cluster does not enforce " + ", ".join(sorted(set(unsupported)))
                                         + " in NetworkPolicies (tests/cluster/network_policy.py)"})


def _selects(policy: dict, pod: dict) -> bool:
    spec = policy.get("spec") or {}
    if policy["metadata"].get("namespace") != pod["metadata"].get("namespace"):
        return False
    if "Ingress" not in (spec.get("policyTypes") or ["Ingress"]):
        return False
    return label_selector_object(spec.get("podSelector") or {})(pod)


def _peer_sources(cluster: Cluster, policy: dict, peer: dict, addresses: dict[tuple[str, str], str]) -> list[str]:
    """The source addresses (CIDRs) one ``from`` peer allows."""
    if "ipBlock" in peer:
        block = ipaddress.ip_network(peer["ipBlock"]["cidr"], strict=False)
        excluded = [ipaddress.ip_network(c, strict=False) for c in peer["ipBlock"].get("except") or []]
        parts = [block]
        for cut in excluded:
            parts = [piece for part in parts if not part.subnet_of(cut)
                     for piece in (part.address_exclude(cut) if cut.subnet_of(part) else [part])]
        return [str(part) for part in parts]
    namespaces = {policy["metadata"]["namespace"]}
    if "namespaceSelector" in peer:
        chosen = label_selector_object(peer["namespaceSelector"] or {})
        namespaces = {name for (_, name), ns in cluster.objects["namespaces"].items() if chosen(ns)}
    pods = label_selector_object(peer.get("podSelector") or {})
    return [f"{ip}/32" for (namespace, name), ip in addresses.items()
            if namespace in namespaces and (pod := cluster.objects["pods"].get((namespace, name))) and pods(pod)]


def ingress_rules(cluster: Cluster, pod: dict, addresses: dict[tuple[str, str], str],
                  node: str) -> tuple[str, ...]:
    """The ``iptables`` rules of ``pod``'s chain (none: no policy selects it, it accepts everything); ``node``: the
    address of the pod's node on the pod network."""
    selecting = [p for p in cluster.objects["networkpolicies"].values() if _selects(p, pod)]
    if not selecting:
        return ()
    rules = ["-m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT", "-i lo -j ACCEPT", f"-s {node}/32 -j ACCEPT"]
    for policy in selecting:
        for rule in (policy.get("spec") or {}).get("ingress") or []:
            sources = (["0.0.0.0/0"] if not rule.get("from") else
                       [cidr for peer in rule["from"] for cidr in _peer_sources(cluster, policy, peer, addresses)])
            ports = [(port.get("protocol", "TCP").lower(), port.get("port")) for port in rule.get("ports") or []]
            for source in sources:
                if not ports:
                    rules.append(f"-s {source} -j ACCEPT")
                for protocol, number in ports:
                    rules.append(f"-s {source} -p {protocol}" + (f" --dport {number}" if number else "")
                                 + " -j ACCEPT")
    rules.append("-j DROP")
    return tuple(rules)


def enforce(cluster: Cluster) -> None:
    """Bring every pod's chain in line with the policies, pods and namespaces there are now."""
    from tests.cluster.network import node_address

    with cluster.lock:
        if not (cluster.objects["networkpolicies"] or cluster.policy_chains):
            return
        addresses = {key: ip for key, (_, ip) in cluster.pod_networks.items()}
        node = node_address()
        for key, (netns, _) in list(cluster.pod_networks.items()):
            pod = cluster.objects["pods"].get(key)
            if pod is None:
                continue
            rules = ingress_rules(cluster, pod, addresses, node)
            if cluster.policy_chains.get(netns, ()) == rules and (rules or netns not in cluster.policy_chains):
                continue  # as written (or never isolated: nothing installed, nothing to undo)
            try:
                _write_chain(netns, rules, hooked=netns in cluster.policy_chains)
            except RuntimeError as exc:
                if netns in {ns for ns, _ in cluster.pod_networks.values()}:  # not a pod that went meanwhile
                    cluster.controller_errors.append(exc)
                continue
            cluster.policy_chains[netns] = rules


def _write_chain(netns: str, rules: tuple[str, ...], hooked: bool) -> None:
    """Replace the chain's rules in one ``iptables-restore`` (created, and jumped to from INPUT, the first time)."""
    lines = ["*filter", f":{CHAIN} - [0:0]", f"-F {CHAIN}", *[f"-A {CHAIN} {rule}" for rule in rules]]
    if not hooked:
        lines.append(f"-A INPUT -j {CHAIN}")
    lines.append("COMMIT")
    done = subprocess.run(["ip", "netns", "exec", netns, "iptables-restore", "-w", "--noflush"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"iptables-restore in {netns}: {done.stderr.strip()}")
