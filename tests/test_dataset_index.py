"""The dataset index format (tasks/dataset_index.py) and the watch's choice of what to announce: pure rules."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from flows.alerts import AlertSetupError, read_settings
from flows.dataset_watch import to_announce, watch_variable
from flows.params import DataSource
from tasks.dataset_index import DatasetIndexError, DatasetRelease, index_json, newest, parse_index

HTTPS = "https://data.example.com/index.json"


def entry(version: str, published: str, url: str = "https://data.example.com/{v}/train_set.zip", **artifact) -> dict:
    return {"version": version, "published": published,
            "artifacts": [{"url": url.format(v=version), "sha256": "ab" * 32, "kind": "archive", **artifact}]}


def test_the_newest_version_is_the_one_published_last_whatever_the_order_or_time_zone() -> None:
    text = json.dumps({"datasets": [entry("b", "2026-11-30T18:00:00+01:00"), entry("a", "2026-11-30T17:30:00Z")]})
    releases = parse_index(text, HTTPS)
    assert [r.version for r in releases] == ["b", "a"]  # 17:00Z, then 17:30Z
    assert newest(releases).version == "a"
    assert newest(releases).source() == {"artifacts": [{"url": "https://data.example.com/a/train_set.zip",
                                                        "sha256": "ab" * 32, "kind": "archive"}]}
    # What it lists is a source a training run accepts, and the index round-trips through its writer.
    DataSource.model_validate(newest(releases).source())
    assert [(r.version, r.published) for r in parse_index(index_json(releases), HTTPS)] == \
        [(r.version, r.published) for r in releases]


@pytest.mark.parametrize(("text", "named"), [
    ("{", "not JSON"),
    ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
    ('{"datasets": [' + "9" * 5000 + "]}", "not JSON this parser reads (Exceeds the limit"),
    ("[]", 'expected an object with a "datasets" list'),
    ('{"datasets": []}', "lists no datasets"),
    (json.dumps({"datasets": [entry("v 1", "2026-11-30T18:00:00Z")]}), "datasets[0].version: 'v 1'"),
    (json.dumps({"datasets": [entry("v1", "2026-11-30T18:00:00")]}), "(v1).published: '2026-11-30T18:00:00' is not"),
    (json.dumps({"datasets": [{**entry("v1", "2026-11-30T18:00:00Z"), "artifacts": []}]}), "(v1).artifacts: expected"),
    (json.dumps({"datasets": [entry("v1", "2026-11-30T18:00:00Z", sha256="abc")]}), ".sha256: 'abc' is not 64 hex"),
    (json.dumps({"datasets": [entry("v1", "2026-11-30T18:00:00Z", url="http://x.example.com/{v}.zip")]}),
     "artifacts[0].url: 'http://x.example.com/v1.zip' must be https://"),
    (json.dumps({"datasets": [entry("v1", "2026-11-30T18:00:00Z", url="file:///data/{v}.zip")]}), "must be https://"),
    (json.dumps({"datasets": [entry("v1", "2026-11-30T18:00:00Z", kind="tarball")]}), ".kind: 'tarball' is not"),
    (json.dumps({"datasets": [entry("v1", "2026-11-30T18:00:00Z"), entry("v1", "2026-12-01T18:00:00Z")]}),
     "version 'v1' is listed more than once"),
])
def test_a_bad_index_is_refused_naming_the_entry_and_the_problem(text: str, named: str) -> None:
    with pytest.raises(DatasetIndexError) as refused:
        parse_index(text, HTTPS)
    assert str(refused.value).startswith(f"dataset index {HTTPS}: ") and named in str(refused.value), refused.value


def test_a_missing_sha256_and_a_signed_index_url_are_named_without_the_signature() -> None:
    item = entry("v1", "2026-11-30T18:00:00Z")
    del item["artifacts"][0]["sha256"]
    with pytest.raises(DatasetIndexError, match=r"datasets\[0\] \(v1\).artifacts\[0\].sha256: missing") as refused:
        parse_index(json.dumps({"datasets": [item]}), HTTPS + "?sig=SECRET")
    assert "SECRET" not in str(refused.value)


def test_a_local_index_may_list_local_artifacts_and_an_index_must_be_https_or_a_file() -> None:
    local = json.dumps({"datasets": [entry("v1", "2026-11-30T18:00:00Z", url="file:///data/{v}.zip")]})
    assert parse_index(local, "file:///data/index.json")[0].artifacts[0]["url"] == "file:///data/v1.zip"
    for url in ("http://data.example.com/index.json", "/data/index.json"):
        with pytest.raises(ValueError, match="must be an https:// URL"):
            DataSource(index=url)
    with pytest.raises(ValueError, match="not both and not neither"):
        DataSource.model_validate({})


def release(version: str, day: int) -> DatasetRelease:
    return DatasetRelease(version, datetime(2030, 1, day, tzinfo=UTC), ({"url": "https://x/a.zip", "sha256": "ab" * 32,
                                                                         "kind": "archive"},))


def test_the_watch_announces_only_what_was_published_after_the_newest_it_saw() -> None:
    releases = [release("a", 1), release("b", 2), release("c", 3)]
    assert to_announce(releases, None) == []  # the first look is the baseline
    seen = release("b", 2).record(HTTPS)
    assert [r.version for r in to_announce(releases, seen)] == ["c"]
    assert to_announce(releases, release("c", 3).record(HTTPS)) == []
    # One memory per index, whatever credentials its URL carries.
    assert watch_variable(HTTPS + "?sig=1") == watch_variable(HTTPS + "?sig=2") != watch_variable(HTTPS + "x")


def test_alert_settings_refuse_a_time_that_is_not_positive(monkeypatch: pytest.MonkeyPatch,
                                                           prefect_server: dict) -> None:
    monkeypatch.setenv("LANEFLOW_ALERT_BLOCK", "slack-webhook/ml-alerts")
    monkeypatch.setenv("LANEFLOW_ALERT_RUNNING_HOURS", "0")
    with pytest.raises(AlertSetupError, match="LANEFLOW_ALERT_RUNNING_HOURS='0': must be a positive number"):
        read_settings()
    monkeypatch.setenv("LANEFLOW_ALERT_RUNNING_HOURS", "3")
    assert read_settings().running_hours == 3 and read_settings().block == "slack-webhook/ml-alerts"
