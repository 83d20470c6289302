"""A dataset URL's query string (an Azure SAS, a presigned signature) kept in a Prefect Secret block and named by the
artifact's ``query_secret``: the run downloads with it, and the run's parameters — which the UI shows and Prefect's
database keeps — never hold it. A URL given with its credential still works, with a warning saying where it is kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect import get_client
from prefect.blocks.system import Secret
from pydantic import ValidationError

from flows.dataset_watch import dataset_watch
from flows.params import DatasetArtifact, DataSource, TrainParams, credentials_in_parameters
from flows.train import train_pipeline
from tasks.dataset_index import DatasetIndexError, parse_index
from tests.http_server import RunningServer
from tests.test_cluster_pipeline import flow_run_messages

SAS = "sv=2024-11-04&se=2026-12-31T00%3A00%3A00Z&sr=b&sp=r&sig=c2VjcmV0LXNpZ25hdHVyZQ%3D%3D"
URL = "https://acct.blob.core.windows.net/data/train_set.zip"


def test_a_url_with_a_query_string_and_a_secret_for_it_is_refused_naming_both() -> None:
    with pytest.raises(ValidationError, match=r"has a query string and query_secret 'tusimple-sas' names another"
                                              r": keep the query string in the Secret block only") as refused:
        DatasetArtifact(url=f"{URL}?{SAS}", sha256="0" * 64, query_secret="tusimple-sas")
    assert "sig=" not in str(refused.value)


def test_credentials_in_the_parameters_are_named_redacted() -> None:
    source = DataSource(artifacts=[{"url": f"{URL}?{SAS}", "sha256": "0" * 64},
                                   {"url": "https://user:pw@mirror.example/test_set.zip", "sha256": "1" * 64},
                                   {"url": URL, "sha256": "2" * 64, "query_secret": "tusimple-sas"}])
    assert credentials_in_parameters(source) == [f"{URL}?<redacted>", "https://<redacted>@mirror.example/test_set.zip"]


def test_a_missing_or_empty_secret_block_is_a_clear_error(prefect_server: dict) -> None:
    source = DataSource(artifacts=[{"url": URL, "sha256": "0" * 64, "query_secret": "no-such-block"}])
    with pytest.raises(ValueError, match=r"no Prefect Secret block named 'no-such-block' \(query_secret of a dataset "
                                         r"artifact\): create it with the URL's query string as its value"):
        source.to_artifacts()
    Secret(value="  ").save("empty-sas", overwrite=True)
    empty = DataSource(artifacts=[{"url": URL, "sha256": "0" * 64, "query_secret": "empty-sas"}])
    with pytest.raises(ValueError, match=r"the Prefect Secret block 'empty-sas' .* is empty"):
        empty.to_artifacts()


def test_the_download_gets_the_secret_query_and_the_parameters_never_hold_it(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str]) -> None:
    archive, _ = synthetic_archive
    Secret(value=f"?{SAS}").save("tusimple-sas", overwrite=True)  # as copied from the portal, with its "?"
    with RunningServer() as server:
        server.files[archive.name] = archive.read_bytes()
        # A wrong checksum: the run fails right after its download, which is all this test needs.
        params = TrainParams(source={"artifacts": [{"url": server.url(archive.name), "sha256": "0" * 64,
                                                    "query_secret": "tusimple-sas"}]},
                             epochs=1, workers=1, volume="secret-sas", package=False)
        with_secret = train_pipeline(**params.flow_parameters(), return_state=True)
        given = params.model_copy(update={"source": DataSource(artifacts=[
            {"url": f"{server.url(archive.name)}?{SAS}", "sha256": "0" * 64}])})
        in_clear = train_pipeline(**given.flow_parameters(), return_state=True)
        asked = [request["query"] for request in server.requests]
    assert with_secret.is_failed() and "sha256 mismatch" in (with_secret.message or "")
    assert asked and all("sig=c2VjcmV0" in query for query in asked), asked  # the Secret's query string, whole
    with get_client(sync_client=True) as client:
        stored = client.read_flow_run(with_secret.state_details.flow_run_id).parameters
    assert "sig=" not in json.dumps(stored) and "c2VjcmV0" not in json.dumps(stored)
    assert stored["source"]["artifacts"][0]["query_secret"] == "tusimple-sas"
    # Given in clear, the URL still works, and the run says where its credential now sits and what to do.
    said = "\n".join(flow_run_messages(str(in_clear.state_details.flow_run_id)))
    assert f"{server.url(archive.name)}?<redacted> carries a credential in this run's parameters" in said, said
    assert "query_secret" in said and "sig=" not in said
    assert not [line for line in flow_run_messages(str(with_secret.state_details.flow_run_id))
                if "carries a credential" in line]


# --- A dataset index behind a SAS, and an index whose artifacts need one -------------------------------------------

INDEX = "https://acct.blob.core.windows.net/data/index.json"


def test_an_index_url_with_a_query_string_and_a_secret_for_it_is_refused_and_a_secret_needs_an_index() -> None:
    with pytest.raises(ValidationError, match=r"has a query string and index_query_secret 'index-sas' names another"):
        DataSource(index=f"{INDEX}?{SAS}", index_query_secret="index-sas")
    with pytest.raises(ValidationError, match=r"index_query_secret names the query string of an index: give the index"):
        DataSource(artifacts=[{"url": URL, "sha256": "0" * 64}], index_query_secret="index-sas")
    assert credentials_in_parameters(DataSource(index=f"{INDEX}?{SAS}")) == [f"{INDEX}?<redacted>"]
    assert credentials_in_parameters(DataSource(index=INDEX, index_query_secret="index-sas")) == []


def test_an_index_may_name_a_secret_block_for_an_artifacts_query_string_never_both() -> None:
    entry = {"version": "v1", "published": "2026-11-30T18:00:00Z",
             "artifacts": [{"url": URL, "sha256": "a" * 64, "query_secret": "tusimple-sas"}]}
    (release,) = parse_index(json.dumps({"datasets": [entry]}), INDEX)
    source = DataSource(**release.source())  # what a run started on this version gets as its parameters
    assert source.artifacts[0].query_secret == "tusimple-sas" and "sig=" not in json.dumps(release.source())
    both = {**entry, "artifacts": [{"url": f"{URL}?{SAS}", "sha256": "a" * 64, "query_secret": "tusimple-sas"}]}
    with pytest.raises(DatasetIndexError, match=r"artifacts\[0\]: url '[^']*/train_set.zip' has a query string and "
                                                r"query_secret 'tusimple-sas' names another") as refused:
        parse_index(json.dumps({"datasets": [both]}), INDEX)
    assert "sig=" not in str(refused.value)
    blank = {**entry, "artifacts": [{"url": URL, "sha256": "a" * 64, "query_secret": " "}]}
    with pytest.raises(DatasetIndexError, match=r"query_secret: ' ' is not the name of a Prefect Secret block"):
        parse_index(json.dumps({"datasets": [blank]}), INDEX)


def test_the_watch_reads_its_index_with_the_secret_query_which_its_parameters_never_hold(
        prefect_server: dict, tmp_path: Path) -> None:
    """A file:// index (the watch reads its path; a query string is the server's business), read with the query of
    its Secret block: the flow run's parameters keep only the block's name. A block that is not there fails the run
    naming it, before anything is read."""
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"datasets": [{"version": "v1", "published": "2026-11-30T18:00:00Z", "artifacts": [
        {"url": URL, "sha256": "a" * 64, "query_secret": "tusimple-sas"}]}]}))
    Secret(value=SAS).save("index-sas", overwrite=True)
    watched = dataset_watch(index=index.as_uri(), index_query_secret="index-sas", return_state=True)
    assert watched.is_completed(), watched.message
    assert DataSource(index=index.as_uri(), index_query_secret="index-sas").index_url() == f"{index.as_uri()}?{SAS}"
    missing = dataset_watch(index=index.as_uri(), index_query_secret="no-such-block", return_state=True)
    assert missing.is_failed() and "no Prefect Secret block named 'no-such-block' (index_query_secret)" in \
        (missing.message or ""), missing.message
    with get_client(sync_client=True) as client:
        stored = client.read_flow_run(watched.state_details.flow_run_id).parameters
    assert stored == {"index": index.as_uri(), "index_query_secret": "index-sas"}
