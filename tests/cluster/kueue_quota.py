"""Kueue's quota model (kubernetes-sigs/kueue v0.19.2, commit 8eab687, ``pkg/scheduler/flavorassigner``,
``pkg/cache/scheduler/resource_node.go``): what a pod set asks for, what a ClusterQueue has room for in each
flavor (its own nominal quota and what its cohort lends), and the flavors a Workload's pod sets get — or the
message saying why they get none. Pure functions of the objects; ``kueue_scheduler`` acts on them."""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal
from typing import TYPE_CHECKING

from tests.cluster.quantities import quantity_value

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

Usage = dict[tuple[str, str], Decimal]  # (flavor, resource) -> amount


def amount(quantity: object) -> Decimal:
    """A quantity's value (0 for one that does not parse: the API server refused those already)."""
    value, _ = quantity_value(str(quantity))
    return value or Decimal(0)


def show(resource: str, value: Decimal) -> str:
    """How Kueue prints an amount in its messages: CPU in millicores, memory in binary units, the rest plain."""
    if resource == "cpu":
        return f"{int(value * 1000)}m"
    if resource == "memory":
        for suffix, size in (("Ti", 1024 ** 4), ("Gi", 1024 ** 3), ("Mi", 1024 ** 2), ("Ki", 1024)):
            if value >= size and value % size == 0:
                return f"{int(value // size)}{suffix}"
        return str(int(value))
    return str(int(value)) if value == value.to_integral() else str(value)


def pod_requests(template: dict) -> dict[str, Decimal]:
    """What one pod of a pod set asks for: each container's requests (a limit where there is no request, as
    the API server defaults it), summed."""
    total: dict[str, Decimal] = defaultdict(Decimal)
    for container in (template.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        for name, quantity in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
            total[name] += amount(quantity)
    return dict(total)


def usage(workloads: list[dict]) -> Usage:
    """What admitted Workloads use of each flavor's resources (their admissions' ``resourceUsage``)."""
    used: Usage = defaultdict(Decimal)
    for workload in workloads:
        for assignment in workload["status"]["admission"]["podSetAssignments"]:
            for resource, flavor in assignment["flavors"].items():
                used[(flavor, resource)] += amount(assignment["resourceUsage"][resource])
    return used


def quota(queue: dict) -> dict[tuple[str, str], dict]:
    """A ClusterQueue's quota entries by (flavor, resource)."""
    return {(flavor["name"], entry["name"]): entry for group in queue["spec"].get("resourceGroups") or []
            for flavor in group["flavors"] for entry in flavor["resources"]}


def room(cluster: Cluster, queue: dict, used_by: dict[str, Usage], key: tuple[str, str]) -> Decimal:
    """What ``queue`` may still take of ``key`` (flavor, resource): its own unused nominal quota and, in a
    cohort, what the others lend and do not use, within its borrowing limit."""
    entry = quota(queue).get(key)
    if entry is None:
        return Decimal(0)
    name = queue["metadata"]["name"]
    own = amount(entry["nominalQuota"]) - used_by[name].get(key, Decimal(0))
    cohort = queue["spec"].get("cohortName")
    if not cohort:
        return own
    lent = Decimal(0)
    for other in cluster.objects["clusterqueues"].values():
        if other["metadata"]["name"] == name or other["spec"].get("cohortName") != cohort:
            continue
        theirs = quota(other).get(key)
        if theirs is not None:
            lendable = amount(theirs.get("lendingLimit", theirs["nominalQuota"]))
            lent += max(Decimal(0), lendable - used_by[other["metadata"]["name"]].get(key, Decimal(0)))
    borrowing = entry.get("borrowingLimit")
    return own + (min(lent, amount(borrowing)) if borrowing is not None else lent)


def assign(cluster: Cluster, queue: dict, workload: dict, used_by: dict[str, Usage]
           ) -> tuple[list[dict] | None, str]:
    """Every pod set's flavor for each resource (``podSetAssignments``), or None and the message saying why
    not (``Assignment.Message``)."""
    groups = queue["spec"].get("resourceGroups") or []
    taken: Usage = defaultdict(Decimal)  # by earlier pod sets of this Workload
    assignments, problems = [], []
    for podset in workload["spec"]["podSets"]:
        per_pod = pod_requests(podset["template"])
        total = {resource: each * podset["count"] for resource, each in per_pod.items() if each}
        flavors: dict[str, str] = {}
        reasons: list[str] = []
        for resource, asked in sorted(total.items()):
            group = next((g for g in groups if resource in g["coveredResources"]), None)
            if group is None:
                reasons.append(f"resource {resource} unavailable in ClusterQueue")
                continue
            tried = []
            for flavor in group["flavors"]:
                key = (flavor["name"], resource)
                free = room(cluster, queue, used_by, key) - taken[key]
                if asked <= free:
                    flavors[resource] = flavor["name"]
                    break
                tried.append(f"insufficient unused quota for {resource} in flavor {flavor['name']}, "
                             f"{show(resource, asked - free)} more needed")
            else:
                reasons.extend(tried)
        if reasons:
            problems.append(f"couldn't assign flavors to pod set {podset['name']}: " + ", ".join(sorted(reasons)))
            continue
        for resource, flavor in flavors.items():
            taken[(flavor, resource)] += total[resource]
        assignments.append({"name": podset["name"], "count": podset["count"], "flavors": flavors,
                            "resourceUsage": {r: show(r, a) for r, a in total.items()}})
    if problems:
        return None, "; ".join(problems)
    return assignments, ""
