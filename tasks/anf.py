"""Azure NetApp Files access: a volume's service level (by moving it between capacity pools) and snapshots.

Configured by a Prefect block. Credentials: a service principal whose secret is a ``SecretStr`` (never
logged, never in artifacts), or ``DefaultAzureCredential`` (managed identity, workload identity, CLI)
when no secret is given. Long-running operations are awaited with a timeout; a failed one raises an
error naming the operation and the volume. The Azure SDK itself retries 429 (honouring Retry-After)
and 5xx.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from azure.core.exceptions import HttpResponseError, ResourceNotFoundError
from prefect.blocks.core import Block
from pydantic import Field, PrivateAttr, SecretStr, model_validator

from tasks.platform_errors import ServiceLevelBusy
from tasks.service_level import SERVICE_LEVELS

DEFAULT_AUTHORITY = "login.microsoftonline.com"
_POOL_ID = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft\.NetApp/"
                      r"netAppAccounts/(?P<account>[^/]+)/capacityPools/(?P<pool>[^/]+)/?$", re.IGNORECASE)
Level = Literal["Standard", "Premium", "Ultra"]



_PRIVATE: list[Path] = []
_PRIVATE_LOCK = threading.Lock()


def _private_folder() -> Path:
    """A folder of this process only (0700, removed at exit) for the CA bundle the SDKs read from a path: a file at a
    predictable place in the shared temporary folder could be planted by another local user beforehand, and a CA
    of theirs would then be trusted for the token request that carries the client secret."""
    with _PRIVATE_LOCK:
        if not _PRIVATE or not _PRIVATE[0].is_dir():
            folder = Path(tempfile.mkdtemp(prefix="laneflow-anf-"))
            atexit.register(shutil.rmtree, folder, True)
            _PRIVATE[:] = [folder]
        return _PRIVATE[0]

class AnfError(RuntimeError):
    """An ANF operation that failed for good; names the operation and the volume."""


class AnfBusy(ServiceLevelBusy, AnfError):
    """Azure refused a pool change with 409 RequestConflict: another operation on the volume is running."""


class _Busy(Exception):
    """The volume's provisioningState is not terminal: an operation on it is running."""


class AnfVolume(Block):
    """A NetApp account's capacity pools (one per service level) that its volumes may move between, and how to
    reach Azure; ``for_volume`` binds it to one volume. In a cluster platform the volume is each claim's own,
    read from its PV (``tasks.platforms.cluster.volumes.anf_volume_of``), never a fixed field."""

    _block_type_name: ClassVar[str] = "Laneflow ANF Volume"
    _block_type_slug: ClassVar[str] = "laneflow-anf-volume"
    _description: ClassVar[str] = "An Azure NetApp Files volume whose service level laneflow changes around training."

    subscription_id: str = Field(description="Azure subscription of the NetApp account")
    resource_group: str = Field(description="resource group of the NetApp account")
    account: str = Field(description="NetApp account name")
    volume: str | None = Field(None, description="the ANF volume; leave empty in a cluster platform's block: each "
                                                  "claim's own volume is read from its PV")
    location: str = Field(description="Azure region, e.g. westeurope")
    pool_ids: dict[Level, str] = Field(description="capacity pool resource id per service level")
    ceiling: Level = Field("Ultra", description="never promote above this level")
    tenant_id: str | None = Field(None, description="service principal tenant (with client_id and client_secret)")
    client_id: str | None = Field(None, description="service principal (application) id, with tenant_id and "
                                                     "client_secret")
    client_secret: SecretStr | None = Field(None, description="service principal secret; empty: "
                                                              "DefaultAzureCredential")
    authority_host: str = Field(DEFAULT_AUTHORITY, description="Entra ID host (sovereign clouds differ)")
    arm_endpoint: str = Field("https://management.azure.com", description="Azure Resource Manager endpoint")
    ca_bundle: str | None = Field(None, description="CA bundle to trust instead of the system's: a file, or the "
                                                    "PEM text itself (a flow run in a pod then needs no file)")
    operation_timeout_s: float = Field(3600, gt=0, description="wait at most this long for a pool change")
    polling_interval_s: float = Field(10.0, ge=0, description="how often a long-running operation is polled when "
                                                              "the service names no Retry-After")
    hold_ttl_s: float = Field(600.0, gt=0, description="a run holding the volume's level renews its hold every "
                                                       "quarter of this; one silent this long (a killed process) is "
                                                       "taken for dead and no longer keeps the volume promoted")
    _management_client: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _pools_of_this_account(self) -> AnfVolume:
        """A volume moves only to a capacity pool of its own NetApp account (Microsoft Learn, "Dynamically
        change the service level of a volume": the destination pool must be in the same NetApp account):
        refuse any other pool when the block is made, not when a run promotes the volume."""
        expected = (self.subscription_id.lower(), self.resource_group.lower(), self.account.lower())
        for level, pool_id in self.pool_ids.items():
            match = _POOL_ID.match(pool_id)
            if match is None:
                raise ValueError(f"pool_ids[{level!r}] = {pool_id!r} is not a capacity pool resource id "
                                 "(/subscriptions/<sub>/resourceGroups/<rg>/providers/Microsoft.NetApp/"
                                 "netAppAccounts/<account>/capacityPools/<pool>)")
            found = (match["sub"].lower(), match["rg"].lower(), match["account"].lower())
            if found != expected:
                raise ValueError(f"pool_ids[{level!r}] is a pool of NetApp account '{match['account']}' (resource "
                                 f"group '{match['rg']}'), but the volume is in account '{self.account}' (resource "
                                 f"group '{self.resource_group}'): a volume moves only between pools of its own "
                                 "NetApp account")
        return self
    #: Pool changes of ours that outlived operation_timeout_s: Azure carries on with them.
    _in_flight: list[tuple[str, Any]] = PrivateAttr(default_factory=list)

    def for_volume(self, name: str) -> AnfVolume:
        """This account's configuration bound to volume ``name`` (sharing the client, so one token)."""
        bound = self.model_copy(update={"volume": name})
        bound._management_client = self._client()
        bound._in_flight = []
        return bound

    def _volume_name(self) -> str:
        if not self.volume:
            raise ValueError("this ANF block names no volume: a cluster platform reads each claim's volume from its "
                             "PV; elsewhere bind it with for_volume(<name>)")
        return self.volume

    def pools_volumes(self) -> list[str]:
        """The names of the volumes in the configured pools (ANF Volumes_List)."""
        client = self._client()
        names = []
        for pool_id in self.pool_ids.values():
            try:
                found = client.volumes.list(self.resource_group, self.account, self.pool_name(pool_id))
                names += [volume.name.rsplit("/", 1)[-1] for volume in found]
            except ResourceNotFoundError:
                continue
        return sorted(set(names))

    # --- clients -------------------------------------------------------------------------------------
    def _verify(self) -> str | bool:
        """What the Azure clients verify TLS with: the system's CAs, a bundle file, or the bundle's PEM text
        written to a file of this process (the SDKs take a path only)."""
        if not self.ca_bundle:
            return True
        if not self.ca_bundle.lstrip().startswith("-----BEGIN"):
            return self.ca_bundle
        digest = hashlib.sha256(self.ca_bundle.encode()).hexdigest()[:16]
        path = _private_folder() / f"ca-{digest}.pem"
        if not path.exists():
            fd, staged = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as handle:
                handle.write(self.ca_bundle)
            os.replace(staged, path)
        return str(path)

    def _credential(self) -> Any:
        from azure.identity import ClientSecretCredential, DefaultAzureCredential

        if self.client_secret is None:
            return DefaultAzureCredential()
        if not (self.tenant_id and self.client_id):
            raise ValueError("client_secret is set but tenant_id or client_id is missing: set all three, "
                             "or none to use DefaultAzureCredential")
        return ClientSecretCredential(self.tenant_id, self.client_id, self.client_secret.get_secret_value(),
                                      authority=self.authority_host,
                                      disable_instance_discovery=self.authority_host != DEFAULT_AUTHORITY,
                                      connection_verify=self._verify())

    def _client(self) -> Any:
        """One client (and credential, so one token) per block instance."""
        if self._management_client is None:
            self._management_client = self._new_client()
        return self._management_client

    def _new_client(self) -> Any:
        from azure.mgmt.netapp import NetAppManagementClient

        return NetAppManagementClient(self._credential(), self.subscription_id, base_url=self.arm_endpoint,
                                      connection_verify=self._verify(), retry_backoff_factor=0.5,
                                      polling_interval=self.polling_interval_s,
                                      credential_scopes=[f"{self.arm_endpoint.rstrip('/')}/.default"])

    @staticmethod
    def pool_name(pool_id: str) -> str:
        return pool_id.rstrip("/").rsplit("/", 1)[-1]

    # --- operations ----------------------------------------------------------------------------------
    def locate(self) -> tuple[str, str, float]:
        """(pool name, service level, quota in TiB) of the volume, looked up in the configured pools. While
        Azure is changing the volume (a pool change another process started: a crashed run's), its level
        means nothing yet: wait for that to end, at most ``operation_timeout_s``."""
        deadline = time.monotonic() + self.operation_timeout_s
        while True:
            try:
                return self._locate_once()
            except _Busy as busy:
                if time.monotonic() > deadline:
                    raise AnfError(f"volume '{self._volume_name()}' is still {busy} after "
                                   f"{self.operation_timeout_s:.0f} s (an operation on it has not ended)") from None
                time.sleep(max(self.polling_interval_s, 0.05))

    def _locate_once(self) -> tuple[str, str, float]:
        client = self._client()
        for pool_id in self.pool_ids.values():
            pool = self.pool_name(pool_id)
            try:
                found = client.volumes.get(self.resource_group, self.account, pool, self._volume_name())
            except ResourceNotFoundError:
                continue
            if found.provisioning_state not in (None, "Succeeded", "Failed"):
                raise _Busy(str(found.provisioning_state))
            level = getattr(found.service_level, "value", found.service_level)
            return pool, str(level), found.usage_threshold / 1024 ** 4
        raise AnfError(f"volume '{self.volume}' is in none of the configured capacity pools "
                       f"({', '.join(self.pool_name(p) for p in self.pool_ids.values())}); check pool_ids")

    def current_level(self) -> str:
        return self.locate()[1]

    def change_level(self, level: str) -> bool:
        """Move the volume to ``level``'s pool (no data moves); False when it is already there."""
        if level not in self.pool_ids:
            known = ", ".join(self.pool_ids)
            raise ValueError(f"no capacity pool configured for service level '{level}' (configured: {known})")
        from azure.mgmt.netapp.models import PoolChangeRequest

        self.settle()  # the volume's level means nothing while an earlier move of ours runs
        pool, current, _ = self.locate()  # waits while another process's operation on the volume runs
        if current == level:
            return False
        operation = f"pool change of volume '{self.volume}' from {current} ({pool}) to {level}"
        try:
            poller = self._client().volumes.begin_pool_change(
                self.resource_group, self.account, pool, self.volume,
                PoolChangeRequest(new_pool_resource_id=self.pool_ids[level]))
        except HttpResponseError as exc:
            # 409 RequestConflict: another operation on the volume started between our read and our request
            # (ARM refuses to modify a resource whose provisioning state is not terminal). The caller waits for
            # it and decides again: the level it wants may have changed, or this very move was made.
            if exc.status_code == 409 and getattr(exc.error, "code", None) == "RequestConflict":
                raise AnfBusy(f"{operation} refused while another operation on the volume runs: "
                              f"{_reason(exc)}") from None
            raise AnfError(f"{operation} failed: {_reason(exc)}") from None
        try:
            poller.result(timeout=self.operation_timeout_s)
        except HttpResponseError as exc:
            raise AnfError(f"{operation} failed: {_reason(exc)}") from None
        if not poller.done():
            self._in_flight.append((operation, poller))
            raise AnfError(f"{operation} did not finish within {self.operation_timeout_s:.0f} s; Azure carries "
                           "on with it")
        return True

    def settle(self) -> None:
        """Wait for moves of ours that outlived their timeout (once more as long), so that a level read, or a
        move back, happens after them and is not undone by them."""
        while self._in_flight:
            operation, poller = self._in_flight[0]
            with contextlib.suppress(HttpResponseError):  # it failed: the volume did not move
                poller.result(timeout=self.operation_timeout_s)
            if not poller.done():
                raise AnfError(f"{operation} is still running after {2 * self.operation_timeout_s:.0f} s")
            self._in_flight.pop(0)

    def pool_change_command(self, level: str) -> str:
        """What an operator runs to move the volume to ``level`` by hand (Az.NetAppFiles PowerShell)."""
        try:
            pool = self.locate()[0]
        except Exception:  # the command is for when laneflow could not do it: do not depend on Azure here
            pool = "<its current pool>"
        return (f"Set-AzNetAppFilesVolumePool -ResourceGroupName {self.resource_group} -AccountName {self.account} "
                f"-PoolName {pool} -Name {self.volume} -NewPoolResourceId {self.pool_ids.get(level, '<pool id>')}")

    def create_snapshot(self, name: str) -> str:
        """An ANF snapshot of the volume (adopted when one of that name exists); returns its resource id."""
        from azure.mgmt.netapp.models import Snapshot

        pool, _, _ = self.locate()
        client = self._client()
        try:
            return client.snapshots.get(self.resource_group, self.account, pool, self.volume, name).id
        except ResourceNotFoundError:
            pass
        try:
            poller = client.snapshots.begin_create(self.resource_group, self.account, pool, self.volume, name,
                                                   Snapshot(location=self.location))
            created = poller.result(timeout=self.operation_timeout_s)
        except HttpResponseError as exc:
            raise AnfError(f"snapshot '{name}' of volume '{self.volume}' failed: {_reason(exc)}") from None
        if not poller.done():
            raise AnfError(f"snapshot '{name}' of volume '{self.volume}' was not created within "
                           f"{self.operation_timeout_s:.0f} s; Azure carries on with it")
        return created.id

    def list_snapshots(self) -> list[AnfSnapshot]:
        """The volume's snapshots, as Azure reports them (a snapshot being taken is not ready yet)."""
        pool, _, _ = self.locate()
        found = self._client().snapshots.list(self.resource_group, self.account, pool, self.volume)
        return [AnfSnapshot(name=snapshot.name.rsplit("/", 1)[-1], id=snapshot.id,
                            ready=snapshot.provisioning_state == "Succeeded",
                            created=snapshot.created.isoformat() if snapshot.created else None)
                for snapshot in found]


@dataclass(frozen=True)
class AnfSnapshot:
    """An ANF snapshot: ``ready`` once its ``provisioningState`` is Succeeded."""

    name: str
    id: str
    ready: bool
    created: str | None


def _reason(exc: HttpResponseError) -> str:
    error = getattr(exc, "error", None)
    if error is not None and getattr(error, "message", None):
        return f"{error.code}: {error.message}"
    return str(exc.message).splitlines()[0]


LEVEL_ORDER = [name for name, _ in SERVICE_LEVELS]
