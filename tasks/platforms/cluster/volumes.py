"""The volume: a PVC created ReadWriteMany or adopted, and its bound PV ReadWriteMany for the workers.

Separate because it is the one stage that waits on a claim rather than on pods: until the claim is bound
(failing early when the provisioner refuses it). A claim laneflow makes is ReadWriteMany from the start; only a
claim made by hand (ReadWriteOnce, as the seed had it) needs its PV patched and verified, which takes the opt-in
rule of ``deployments/rwo-claims``: by default the flows may read PVs, never change one.

The PV says which Azure NetApp Files volume a claim is (``anf_volume_of``: Trident provisions one ANF volume per
claim). The claim carries laneflow's records as annotations — the runs holding the volume's service level
(``tasks.level_holds``), a sweep's study lock: the API server replaces an object only at the ``resourceVersion``
it was read at, which makes each record a compare-and-swap, within the namespace's own rights.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException

from tasks.k8s.diagnose import claim_problems
from tasks.k8s.manifests import MANAGED_BY, render_pvc
from tasks.level_holds import LevelRecord
from tasks.names import validate_name
from tasks.platforms.base import (
    NoServiceLevel,
    NotOurClaim,
    StageDeadlineExceeded,
    TransientPlatformError,
    VolumeNotBound,
    VolumeRef,
)
from tasks.platforms.cluster.api import STRICT, apis, call, create_or_adopt
from tasks.platforms.cluster.problems import act_on, problem_clock

if TYPE_CHECKING:
    from tasks.anf import AnfVolume
    from tasks.platforms.cluster import ClusterPlatform

_LOG = logging.getLogger("laneflow.cluster")
#: The claim's annotation holding the volume's service-level record (JSON of ``LevelRecord``).
LEVEL_RECORD_ANNOTATION = "laneflow.io/service-level"
#: How often a record update that lost a race (409 Conflict) is read and made again before giving up.
_UPDATE_RACES = 50
_ANNOTATION_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
#: Trident's CSI driver, and the PV attribute naming the ANF volume it provisioned for a claim (NetApp/trident
#: frontend/csi/controller_server.go getCSIVolumeFromTridentVolume: ``internalID`` is the volume's Azure resource
#: id, storage_drivers/azure/azure_anf.go Create; Trident >= 23.01). The id's last part is the volume's name,
#: also for a volume imported into Trident, whose creation token (``internalName``) may differ.
TRIDENT_DRIVER = "csi.trident.netapp.io"
_ANF_VOLUME_ID = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/"
                            r"Microsoft\.NetApp/netAppAccounts/(?P<account>[^/]+)/capacityPools/(?P<pool>[^/]+)/"
                            r"volumes/(?P<volume>[^/]+)$", re.IGNORECASE)


class NotOnAnf(NoServiceLevel):
    """The claim's PV is not an Azure NetApp Files volume of the platform's NetApp account."""


def ensure_volume(platform: ClusterPlatform, name: str) -> VolumeRef:
    validate_name(name, "volume")
    core, _, _ = apis(platform)
    namespace = platform.effective_namespace()
    try:
        claim = call(platform, "get", "persistentvolumeclaims", core.read_namespaced_persistent_volume_claim, name,
                     namespace)
        _check_adoptable(platform, claim)
        return VolumeRef(name=name, location=f"{namespace}/{name}", created=False)
    except ApiException as exc:
        if exc.status != 404:
            raise
    body = render_pvc(name, platform.layout(), {**MANAGED_BY})
    claim, created = create_or_adopt(
        platform, "persistentvolumeclaims",
        lambda: core.create_namespaced_persistent_volume_claim(namespace, body, field_validation=STRICT),
        lambda: core.read_namespaced_persistent_volume_claim(name, namespace), lambda _: True, name)
    if not created:  # made by someone else between the read and the create
        _check_adoptable(platform, claim)
    return VolumeRef(name=name, location=f"{namespace}/{name}", created=created)


def _check_adoptable(platform: ClusterPlatform, claim: Any) -> None:
    """A claim laneflow made (its managed-by label), or one the block names in ``adopt_claims``; else
    ``NotOurClaim``: a name typed by mistake must not take over another team's volume (patched to RWX, written,
    snapshotted, moved between ANF pools)."""
    name, labels = claim.metadata.name, claim.metadata.labels or {}
    if labels.get("app.kubernetes.io/managed-by") == MANAGED_BY["app.kubernetes.io/managed-by"]:
        return
    if name in platform.adopt_claims:
        return
    raise NotOurClaim(
        f"PVC {platform.effective_namespace()}/{name} exists but laneflow did not create it (it has no label "
        "app.kubernetes.io/managed-by=laneflow): a run on it would write to it, patch its volume to ReadWriteMany, "
        f"snapshot it and may move it between service levels. If it is yours (a hand-made claim, as the seed had), "
        f"add '{name}' to the platform block's adopt_claims and run again; otherwise choose another volume name")


def ensure_shared_access(platform: ClusterPlatform, volume: VolumeRef) -> str:
    core, _, _ = apis(platform)
    namespace = platform.effective_namespace()
    deadline = time.monotonic() + 600
    clock = problem_clock(platform)
    while True:
        claim = call(platform, "get", "persistentvolumeclaims", core.read_namespaced_persistent_volume_claim,
                     volume.name, namespace)
        if claim.spec.volume_name and (claim.status and claim.status.phase == "Bound"):
            break
        # Pending: is the provisioner refusing it (no such storage class, a restore too small, quota)?
        events = call(platform, "list", "events", core.list_namespaced_event, namespace,
                      field_selector=f"involvedObject.kind=PersistentVolumeClaim,"
                                     f"involvedObject.name={volume.name}").items
        problems = claim_problems(volume.name, [core.api_client.sanitize_for_serialization(e) for e in events])
        act_on(platform, problems, clock, _LOG.warning, stopping=None)
        if time.monotonic() > deadline:
            raise StageDeadlineExceeded(f"PVC {volume.location} is not bound after 10 minutes and no event says "
                                        "why; check its storage class and provisioner")
        time.sleep(platform.poll_interval_s)
    pv_name = claim.spec.volume_name
    if "ReadWriteMany" in ((claim.status.access_modes if claim.status else None) or []):
        return f"PV {pv_name} of {volume.location} is ReadWriteMany"  # the claim's status says what its PV has
    pv = call(platform, "get", "persistentvolumes", core.read_persistent_volume, pv_name)
    if "ReadWriteMany" in (pv.spec.access_modes or []):
        return f"PV {pv_name} of {volume.location} is already ReadWriteMany"
    try:
        call(platform, "patch", "persistentvolumes", core.patch_persistent_volume, pv_name,
             {"spec": {"accessModes": ["ReadWriteMany"]}}, field_validation=STRICT)
    except PermissionError as exc:
        raise PermissionError(
            f"{exc}. PV {pv_name} of {volume.location} is {', '.join(pv.spec.access_modes or ['of no access mode'])}"
            " and the workers need ReadWriteMany; by default laneflow's flows may not change PVs. Either recreate "
            "the claim ReadWriteMany (laneflow makes its own so), or let the flows patch the PVs of such claims: "
            "kubectl apply -k deployments/rwo-claims") from None
    pv = call(platform, "get", "persistentvolumes", core.read_persistent_volume, pv_name)
    if "ReadWriteMany" not in (pv.spec.access_modes or []):
        raise RuntimeError(f"patched PV {pv_name} to ReadWriteMany but it reports {pv.spec.access_modes}; "
                           "does its storage backend support RWX (ANF does)?")
    return f"PV {pv_name} of {volume.location} patched to ReadWriteMany and verified"


def update_level_record(platform: ClusterPlatform, volume: VolumeRef,
                        change: Callable[[LevelRecord | None], LevelRecord | None]) -> LevelRecord | None:
    """Read the record on the claim, apply ``change``, and write the result only if nobody wrote the claim in
    between (``_update_claim_annotation``). A change that changes nothing writes nothing."""
    def change_text(raw: str | None, claim: str) -> str | None:
        record = _record_of(claim, raw)
        updated = change(record)
        if updated == record:
            return raw
        return updated.model_dump_json() if updated is not None else None

    written = _update_claim_annotation(platform, volume, LEVEL_RECORD_ANNOTATION, change_text,
                                    "it has no service level to hold", "the service-level record")
    return _record_of("", written)


def record_annotation(key: str) -> str:
    """The PV annotation that keeps record ``key``: ``laneflow.io/<key>`` (a qualified name: its part after
    the prefix at most 63 characters of letters, digits, '-', '_' and '.')."""
    if not _ANNOTATION_NAME.match(key):
        raise ValueError(f"record key {key!r} cannot name an annotation: at most 63 letters, digits, '-', '_' or '.', "
                         "starting and ending with a letter or digit")
    return f"laneflow.io/{key}"


def update_volume_record(platform: ClusterPlatform, volume: VolumeRef, key: str,
                         change: Callable[[str | None], str | None]) -> str | None:
    """Record ``key`` as an annotation of the claim (``_update_claim_annotation``)."""
    annotation = record_annotation(key)
    return _update_claim_annotation(platform, volume, annotation, lambda raw, _: change(raw), "it keeps no records",
                                    f"annotation {annotation}")


def _update_claim_annotation(platform: ClusterPlatform, volume: VolumeRef, annotation: str,
                             change: Callable[[str | None, str], str | None], unbound: str, what: str) -> str | None:
    """Replace annotation ``annotation`` of the bound claim by ``change(value, claim's location)``, only if nobody
    wrote the claim since it was read: the patch carries the ``resourceVersion`` it was read at, which the API
    server checks before it applies a patch (409 Conflict otherwise; Kubernetes API concepts, "Resource versions"
    / conflicts: every update and patch that names a resourceVersion is a precondition on it). A lost race reads
    again. Returns the value as written (None: no annotation)."""
    core, _, _ = apis(platform)
    namespace = platform.effective_namespace()
    for _ in range(_UPDATE_RACES):
        claim = call(platform, "get", "persistentvolumeclaims", core.read_namespaced_persistent_volume_claim,
                     volume.name, namespace)
        if not claim.spec.volume_name:
            raise VolumeNotBound(f"PVC {namespace}/{volume.name} is not bound to a volume yet: {unbound}")
        current = (claim.metadata.annotations or {}).get(annotation)
        updated = change(current, f"{namespace}/{volume.name}")
        if updated == current:
            return current
        patch = {"metadata": {"resourceVersion": claim.metadata.resource_version,
                              "annotations": {annotation: updated}}}
        try:
            call(platform, "patch", "persistentvolumeclaims", core.patch_namespaced_persistent_volume_claim,
                 volume.name, namespace, patch, field_validation=STRICT)
        except ApiException as exc:
            if exc.status == 409:  # written since it was read: read it again and redo the change
                continue
            raise
        return updated
    raise TransientPlatformError(f"{what} on PVC {namespace}/{volume.name} kept changing under laneflow "
                                 f"({_UPDATE_RACES} conflicts in a row)")


def _record_of(claim: str, raw: str | None) -> LevelRecord | None:
    """The record in annotation text ``raw`` of claim ``claim`` (namespace/name)."""
    if not raw:
        return None
    try:
        return LevelRecord.model_validate_json(raw)
    except ValueError as exc:
        namespace, _, name = claim.partition("/")
        raise ValueError(f"PVC {claim}'s annotation {LEVEL_RECORD_ANNOTATION} is not a laneflow service-level "
                         f"record ({exc.errors()[0]['msg'] if hasattr(exc, 'errors') else exc}); check who wrote "
                         f"it, then remove it (kubectl annotate pvc -n {namespace} {name} {LEVEL_RECORD_ANNOTATION}-): "
                         "the next run records the volume's level afresh") from None


def anf_volume_of(platform: ClusterPlatform, volume: VolumeRef) -> AnfVolume:
    """The ANF volume behind the claim, as its PV names it (Trident's ``internalID``), bound in the platform's
    ANF block; one per volume for the platform's lifetime (it remembers its moves still running on Azure)."""
    if platform.anf is None:
        raise NotOnAnf("the platform names no ANF account (its 'anf' field): it changes no service levels")
    core, _, _ = apis(platform)
    namespace = platform.effective_namespace()
    claim = call(platform, "get", "persistentvolumeclaims", core.read_namespaced_persistent_volume_claim,
                 volume.name, namespace)
    if not claim.spec.volume_name:
        raise VolumeNotBound(f"PVC {namespace}/{volume.name} is not bound to a volume yet")
    pv = call(platform, "get", "persistentvolumes", core.read_persistent_volume, claim.spec.volume_name)
    csi = pv.spec.csi
    internal_id = ((csi.volume_attributes or {}).get("internalID") or "") if csi else ""
    found = _ANF_VOLUME_ID.match(internal_id)
    where = f"PVC {namespace}/{volume.name} (PV {pv.metadata.name})"
    if csi is None or csi.driver != TRIDENT_DRIVER or found is None:
        driver = f"CSI driver '{csi.driver}'" if csi else "no CSI driver"
        raise NotOnAnf(f"{where} is not an Azure NetApp Files volume provisioned by Trident ({driver}, no "
                       f"volumeAttributes.internalID naming a Microsoft.NetApp volume; Trident sets it since 23.01): "
                       "laneflow cannot change its service level or take ANF snapshots of it. Train with "
                       "promote: false and the platform's snapshotter 'csi', or put the claim on a Trident "
                       "azure-netapp-files storage class")
    anf = platform.anf
    theirs = (found["sub"].lower(), found["rg"].lower(), found["account"].lower())
    if theirs != (anf.subscription_id.lower(), anf.resource_group.lower(), anf.account.lower()):
        raise NotOnAnf(f"{where} is ANF volume {found['volume']} of NetApp account '{found['account']}' (resource "
                       f"group '{found['rg']}'), but the platform's ANF block is for account '{anf.account}' "
                       f"(resource group '{anf.resource_group}'): save the block with that volume's account and its "
                       "pools")
    bound = platform._anf_volumes.get(internal_id.lower())
    if bound is None:
        bound = platform._anf_volumes[internal_id.lower()] = anf.for_volume(found["volume"])
    return bound
