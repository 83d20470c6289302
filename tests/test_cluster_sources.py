"""A dataset URL with a credential (an Azure SAS) reaches the dataset Job's pod from a Secret, never from its spec:
a pod spec is kept in etcd and shown to anyone who may ``get pods`` (issue 50). Against the emulated cluster with
deployments/base's RBAC enforced, whose pods really run and download over HTTP."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import pytest

from tasks.k8s.manifests import render_sources_secret, sources_secret_name
from tasks.platforms.cluster.jobs import dataset_job_name, put_sources
from tests.cluster.network import node_address
from tests.cluster.state import Fault as ApiFault
from tests.cluster_platform_helpers import admin_core, cluster_platform
from tests.http_server import Fault, RunningServer
from tests.test_cluster_pipeline import needs_kubectl, rendered
from tests.waiting import wait_until
from training.data.sources import Artifact

SAS = "sv=2024-11-04&sr=b&sp=r&sig=c2VjcmV0LXNpZ25hdHVyZQ%3D%3D"


@needs_kubectl
def test_a_sas_url_reaches_the_dataset_pod_from_a_secret_that_is_gone_when_the_job_ends(
        emulator: tuple, synthetic_archive: tuple[Path, str]) -> None:
    emu, cluster = emulator
    cluster.load(rendered("base"))  # the flows' account may create, patch and delete Secrets, never read one
    platform = cluster_platform(emu, namespace="laneflow")
    volume = platform.ensure_volume("sas")
    archive, sha256 = synthetic_archive
    stored: list[str] = []  # every Job and pod as the API server holds them, while they exist

    def seen(state, namespace: str, pod: str, line: str) -> None:
        stored.append(json.dumps([state.objects["jobs"].get((namespace, pod.rsplit("-", 1)[0])),
                                  state.objects["pods"].get((namespace, pod))]))

    cluster.on_log_line = seen
    with RunningServer(host=node_address()) as server:
        server.files[archive.name] = archive.read_bytes()
        artifact = Artifact(f"{server.url(archive.name)}?{SAS}", sha256)
        # An earlier try of this preparation was interrupted (a drain of the flow's pod) after it made its Secret,
        # with a SAS that has expired since: this one replaces the Secret's data, and its pod downloads with it.
        job = dataset_job_name(volume.name, [artifact])
        labels = platform.job_labels(job, {"volume": volume.name})
        expired = Artifact(f"{server.url(archive.name)}?sv=2020&sig=expired", sha256)
        put_sources(platform, render_sources_secret(job, platform.layout(), [expired], labels))
        summary = platform.prepare_dataset(volume, [artifact], lambda _: None)
        asked = [request["query"] for request in server.requests]
    assert (cluster.claim_dir("laneflow", "sas") / summary["dataset_dir"] / "seg_label").is_dir()
    assert asked and all("sig=c2VjcmV0" in query for query in asked), asked  # the renewed SAS, from the Secret
    assert stored and not [text for text in stored if "sig=" in text or "c2VjcmV0" in text]
    (pod,) = [p for p in cluster.objects["pods"].values() if p["metadata"]["name"].startswith(job)]
    (env,) = pod["spec"]["containers"][0]["env"]
    assert env["valueFrom"]["secretKeyRef"]["name"] == sources_secret_name(job)
    assert not [key for key in cluster.objects["secrets"] if key[1] == sources_secret_name(job)]  # gone after


@needs_kubectl
def test_a_sources_secret_another_run_drops_between_the_conflict_and_the_patch_is_made_again(
        emulator: tuple, served_archive: tuple[str, str]) -> None:
    """Runs preparing one dataset on one volume share its Job and Secret, and a run whose Job has ended drops the
    Secret: here it goes while this run's patch is on its way (held, then its connection reset), so the patch
    the client sends again meets a 404 — the Secret is made again, with this run's sources (make soak SEED=4
    ended a run on that 404)."""
    emu, cluster = emulator
    cluster.load(rendered("base"))
    platform = cluster_platform(emu, namespace="laneflow")
    volume = platform.ensure_volume("shared")
    artifact = Artifact(*served_archive)
    job = dataset_job_name(volume.name, [artifact])
    labels = platform.job_labels(job, {"volume": volume.name})
    put_sources(platform, render_sources_secret(job, platform.layout(), [Artifact(artifact.url + "?old=1",
                                                                                  artifact.sha256)], labels))
    held = threading.Event()
    cluster.faults[("PATCH", "secrets")] = [ApiFault(hang=held)]
    errors: list[BaseException] = []

    def put() -> None:
        try:
            put_sources(platform, render_sources_secret(job, platform.layout(), [artifact], labels))
        except BaseException as exc:
            errors.append(exc)

    putting = threading.Thread(target=put)
    putting.start()
    wait_until("the patch to arrive", lambda: any(r.method == "PATCH" and r.resource == "secrets"
                                                  for r in cluster.requests), timeout_s=60, every_s=0.1)
    admin_core(emu).delete_namespaced_secret(sources_secret_name(job), "laneflow")  # the other run's drop
    held.set()
    putting.join(timeout=120)
    assert not putting.is_alive() and not errors, errors
    stored = cluster.objects["secrets"][("laneflow", sources_secret_name(job))]
    assert "old=1" not in base64.b64decode(stored["data"]["sources"]).decode()


@needs_kubectl
def test_a_secret_of_that_name_laneflow_did_not_make_is_refused_and_left_as_it_was(
        emulator: tuple, served_archive: tuple[str, str]) -> None:
    emu, cluster = emulator
    cluster.load(rendered("base"))
    platform = cluster_platform(emu, namespace="laneflow")
    volume = platform.ensure_volume("theirs")
    artifact = Artifact(*served_archive)
    name = sources_secret_name(dataset_job_name(volume.name, [artifact]))
    theirs = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": {"sources": "dGhlaXJz"}}
    admin_core(emu).create_namespaced_secret("laneflow", theirs)
    with pytest.raises(FileExistsError, match=f"secret '{name}' already exists .* not created by laneflow"):
        platform.prepare_dataset(volume, [artifact], lambda _: None)
    kept = cluster.objects["secrets"][("laneflow", name)]
    assert kept["data"] == {"sources": "dGhlaXJz"} and not cluster.objects["jobs"]


@needs_kubectl
def test_a_failure_on_the_flows_side_leaves_the_running_job_its_secret_and_the_retry_adopts_both(
        emulator: tuple, synthetic_archive: tuple[Path, str]) -> None:
    """The flow's side failed while the Job ran on (here its log sink; an API error alike): the Job's pod
    may not have started yet and would then never find its sources, so the Secret stays until the Job is over."""
    emu, cluster = emulator
    cluster.load(rendered("base"))
    platform = cluster_platform(emu, namespace="laneflow")
    volume = platform.ensure_volume("retry")
    archive, sha256 = synthetic_archive

    def failing_sink(line: str) -> None:
        raise OSError("the flow's log store refused the line")

    with RunningServer(host=node_address()) as server:
        server.files[archive.name] = archive.read_bytes()
        # 12 s between 64 KiB chunks: the Job is still downloading when its first line (at the latest the
        # download's progress, every 10 s) reaches the failing sink.
        server.faults.append(Fault("slow", delay=12.0))
        artifact = Artifact(server.url(archive.name), sha256)
        job = dataset_job_name(volume.name, [artifact])
        with pytest.raises(OSError, match="log store refused"):
            platform.prepare_dataset(volume, [artifact], failing_sink)
        assert ("laneflow", job) in cluster.objects["jobs"]
        assert ("laneflow", sources_secret_name(job)) in cluster.objects["secrets"]
        summary = platform.prepare_dataset(volume, [artifact], lambda _: None)  # the retry adopts the Job
    assert len(server.requests) == 1  # adopted, not started again
    assert (cluster.claim_dir("laneflow", "retry") / summary["dataset_dir"] / "seg_label").is_dir()
    assert ("laneflow", sources_secret_name(job)) not in cluster.objects["secrets"]
