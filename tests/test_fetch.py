"""Downloads against a real HTTP server on 127.0.0.1: resume, verification, retries, atomicity."""

from __future__ import annotations

import hashlib
import logging
import os
import random

import pytest

from tests.http_server import Fault, FileServer
from training.data.fetch import (
    ChecksumMismatch,
    DownloadTooLarge,
    FetchError,
    backoff_delay,
    fetch,
    validate_sha256,
)

PAYLOAD = os.urandom(3 * (1 << 20) + 12345)
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()
WRONG_SHA = "0" * 64


def no_sleep(_: float) -> None:
    """Retries are real; only the waiting between them is skipped to keep the suite fast."""


@pytest.fixture
def served(file_server: FileServer) -> FileServer:
    file_server.files["train_set.zip"] = PAYLOAD
    return file_server


def test_download_verifies_and_renames_atomically(served: FileServer, tmp_path):
    dest = tmp_path / "downloads" / "train_set.zip"
    result = fetch(served.url("train_set.zip"), dest, PAYLOAD_SHA, sleep=no_sleep)
    assert dest.read_bytes() == PAYLOAD
    assert result.sha256 == PAYLOAD_SHA and not result.cached and result.attempts == 1
    assert sorted(p.name for p in dest.parent.iterdir()) == ["train_set.zip"]  # no .part left


def test_download_cut_mid_file_resumes_with_range_and_verifies(served: FileServer, tmp_path):
    cut = 1_500_000
    served.faults.append(Fault("cut", cut_after=cut))
    dest = tmp_path / "train_set.zip"
    result = fetch(served.url("train_set.zip"), dest, PAYLOAD_SHA, sleep=no_sleep)
    assert dest.read_bytes() == PAYLOAD
    assert result.attempts == 2
    assert [r["range"] for r in served.requests] == [None, f"bytes={cut}-"]
    # Only the missing tail was transferred again.
    assert result.downloaded_bytes == len(PAYLOAD)


def test_partial_file_from_an_earlier_run_is_resumed(served: FileServer, tmp_path):
    dest = tmp_path / "train_set.zip"
    (tmp_path / "train_set.zip.part").write_bytes(PAYLOAD[:1000])
    fetch(served.url("train_set.zip"), dest, PAYLOAD_SHA, sleep=no_sleep)
    assert dest.read_bytes() == PAYLOAD
    assert served.requests[0]["range"] == "bytes=1000-"


def test_server_ignoring_range_restarts_from_zero(served: FileServer, tmp_path):
    (tmp_path / "train_set.zip.part").write_bytes(b"garbage that must not survive")
    served.faults.append(Fault("ignore_range"))
    dest = tmp_path / "train_set.zip"
    fetch(served.url("train_set.zip"), dest, PAYLOAD_SHA, sleep=no_sleep)
    assert dest.read_bytes() == PAYLOAD


def test_wrong_checksum_names_expected_and_actual_and_keeps_the_bytes(served: FileServer, tmp_path):
    dest = tmp_path / "train_set.zip"
    with pytest.raises(ChecksumMismatch) as info:
        fetch(served.url("train_set.zip"), dest, WRONG_SHA, sleep=no_sleep)
    message = str(info.value)
    assert f"expected {WRONG_SHA}" in message and f"actual {PAYLOAD_SHA}" in message
    assert not dest.exists()
    kept = tmp_path / "train_set.zip.unverified"
    assert kept.read_bytes() == PAYLOAD
    # Given the right checksum, the kept file is adopted without a new download.
    requests_before = len(served.requests)
    result = fetch(served.url("train_set.zip"), dest, PAYLOAD_SHA, sleep=no_sleep)
    assert result.cached and dest.read_bytes() == PAYLOAD
    assert len(served.requests) == requests_before


def test_a_mismatch_advises_a_fresh_download_never_pinning_the_mixed_bytes(served: FileServer, tmp_path):
    """A .part another writer left (here: bytes the source never had) is resumed into a file no published
    archive has. The advice must not invite pinning its checksum; following it (delete, run again) gives the
    right file."""
    dest = tmp_path / "train_set.zip"
    (tmp_path / "train_set.zip.part").write_bytes(b"x" * 1000)  # what another writer appended
    with pytest.raises(ChecksumMismatch) as info:
        fetch(served.url("train_set.zip"), dest, PAYLOAD_SHA, sleep=no_sleep)
    message, kept = str(info.value), tmp_path / "train_set.zip.unverified"
    assert kept.read_bytes() == b"x" * 1000 + PAYLOAD[1000:]
    assert f"Delete {kept} and run again" in message and "publisher" in message
    assert "Do not pin its checksum" in message and "adopted" not in message
    kept.unlink()
    result = fetch(served.url("train_set.zip"), dest, PAYLOAD_SHA, sleep=no_sleep)
    assert not result.cached and dest.read_bytes() == PAYLOAD


def test_verified_file_is_not_downloaded_again(served: FileServer, tmp_path):
    dest = tmp_path / "train_set.zip"
    fetch(served.url("train_set.zip"), dest, PAYLOAD_SHA, sleep=no_sleep)
    result = fetch(served.url("train_set.zip"), dest, PAYLOAD_SHA, sleep=no_sleep)
    assert result.cached and len(served.requests) == 1


@pytest.mark.parametrize(
    "fault",
    [Fault("status", status=503), Fault("status", status=500), Fault("status", status=429, retry_after="0")],
    ids=["503", "500", "429"],
)
def test_transient_http_errors_are_retried(served: FileServer, tmp_path, fault: Fault):
    served.faults.extend([fault, fault])
    delays: list[float] = []
    result = fetch(served.url("train_set.zip"), tmp_path / "f.zip", PAYLOAD_SHA, sleep=delays.append)
    assert result.attempts == 3 and len(delays) == 2
    assert (tmp_path / "f.zip").read_bytes() == PAYLOAD


def test_retry_after_is_honoured(served: FileServer, tmp_path):
    served.faults.append(Fault("status", status=429, retry_after="7"))
    delays: list[float] = []
    fetch(served.url("train_set.zip"), tmp_path / "f.zip", PAYLOAD_SHA, sleep=delays.append, backoff_base=0.1)
    assert delays == [7.0]


@pytest.mark.parametrize("status", [404, 403, 401])
def test_client_errors_fail_at_once(served: FileServer, tmp_path, status: int):
    served.faults.append(Fault("status", status=status))
    with pytest.raises(FetchError, match=f"HTTP {status}.*not retried"):
        fetch(served.url("train_set.zip"), tmp_path / "f.zip", PAYLOAD_SHA, sleep=no_sleep)
    assert len(served.requests) == 1


def test_missing_file_404_is_not_retried(served: FileServer, tmp_path):
    with pytest.raises(FetchError, match="HTTP 404"):
        fetch(served.url("nope.zip"), tmp_path / "nope.zip", PAYLOAD_SHA, sleep=no_sleep)
    assert len(served.requests) == 1


def test_gives_up_after_max_attempts_and_keeps_the_partial(served: FileServer, tmp_path):
    served.faults.extend(Fault("cut", cut_after=1000) for _ in range(3))
    with pytest.raises(FetchError, match=r"after 3 attempts.*resumes on the next run"):
        fetch(served.url("train_set.zip"), tmp_path / "f.zip", PAYLOAD_SHA, max_attempts=3, sleep=no_sleep)
    assert (tmp_path / "f.zip.part").stat().st_size == 3000
    # The next run picks up where the last one stopped.
    fetch(served.url("train_set.zip"), tmp_path / "f.zip", PAYLOAD_SHA, sleep=no_sleep)
    assert served.requests[-1]["range"] == "bytes=3000-"


def test_connection_refused_is_transient(tmp_path):
    delays: list[float] = []
    with pytest.raises(FetchError, match="after 2 attempts"):
        fetch("http://127.0.0.1:9/train_set.zip", tmp_path / "f.zip", PAYLOAD_SHA, max_attempts=2,
              sleep=delays.append)
    assert len(delays) == 1


def test_progress_is_logged_while_downloading(served: FileServer, tmp_path, caplog):
    served.faults.append(Fault("slow", delay=0.01))
    caplog.set_level(logging.INFO, logger="laneflow.data.fetch")
    fetch(served.url("train_set.zip"), tmp_path / "f.zip", PAYLOAD_SHA, progress_interval=0.05, sleep=no_sleep)
    progress = [r.getMessage() for r in caplog.records if "MiB/s" in r.getMessage()]
    assert progress, "expected periodic progress lines"
    assert "downloading train_set.zip" in progress[0] or "downloading f.zip" in progress[0]
    assert "%" in progress[-1]


def test_file_url_source(tmp_path):
    source = tmp_path / "src" / "train set.zip"
    source.parent.mkdir()
    source.write_bytes(PAYLOAD)
    result = fetch(source.as_uri(), tmp_path / "out.zip", PAYLOAD_SHA)
    assert (tmp_path / "out.zip").read_bytes() == PAYLOAD and result.attempts == 1


def test_missing_file_url_source_is_a_clear_error(tmp_path):
    with pytest.raises(FetchError, match="does not exist"):
        fetch((tmp_path / "absent.zip").as_uri(), tmp_path / "out.zip", PAYLOAD_SHA)


@pytest.mark.parametrize("url", ["ftp://example.org/a.zip", "s3://bucket/a.zip", "train_set.zip", "http:///a.zip"])
def test_unsupported_urls_are_refused_before_any_io(tmp_path, url: str):
    with pytest.raises(FetchError, match="source URL"):
        fetch(url, tmp_path / "a.zip", PAYLOAD_SHA)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["", "abc", "z" * 64, "0" * 63])
def test_bad_checksums_are_refused(value: str):
    with pytest.raises(FetchError, match="not a sha256"):
        validate_sha256(value)


def test_checksum_normalisation():
    assert validate_sha256(f"sha256:{PAYLOAD_SHA.upper()}") == PAYLOAD_SHA


def test_backoff_grows_exponentially_with_bounded_jitter():
    rng = random.Random(1)
    delays = [backoff_delay(n, base=1.0, cap=30.0, jitter=0.25, rng=rng) for n in range(8)]
    for n, delay in enumerate(delays):
        nominal = min(30.0, 2.0**n)
        assert 0.75 * nominal <= delay <= 1.25 * nominal


@pytest.mark.parametrize("announced", [True, False])
def test_a_download_over_the_limit_fails_and_leaves_nothing(file_server: FileServer, tmp_path, announced: bool):
    """A server that streams without end (no Content-Length) is cut off at the limit instead of filling the volume;
    one that announces too much is refused before a byte is written. Neither is retried."""
    file_server.zeros["endless.zip"] = 8 << 20
    if not announced:
        file_server.faults.append(Fault("chunked"))
    dest = tmp_path / "downloads" / "endless.zip"
    with pytest.raises(DownloadTooLarge, match="over the download limit of 2,097,152 bytes; nothing of it is kept") \
            as refused:
        fetch(file_server.url("endless.zip"), dest, WRONG_SHA, sleep=no_sleep, max_bytes=2 << 20)
    assert ("announces 8,388,608 bytes" in str(refused.value)) == announced
    assert len(file_server.requests) == 1 and list(dest.parent.iterdir()) == []


def test_a_local_file_over_the_limit_is_refused_as_a_download_is(tmp_path) -> None:
    source = tmp_path / "big.zip"
    source.write_bytes(b"\0" * (3 << 20))
    dest = tmp_path / "downloads" / "big.zip"
    with pytest.raises(DownloadTooLarge, match="announces 3,145,728 bytes, over the download limit of 2,097,152"):
        fetch(source.as_uri(), dest, WRONG_SHA, sleep=no_sleep, max_bytes=2 << 20)
    assert list(dest.parent.iterdir()) == []


@pytest.mark.parametrize("limit", ["inf", "nan", "0", "-1"])
def test_a_download_limit_that_is_no_number_of_gib_is_refused_with_its_reason(limit: str, tmp_path,
                                                                              capsys: pytest.CaptureFixture) -> None:
    from training.data.prepare import main

    assert main(["--archive", "https://example.org/a.zip", "0" * 64, "--volume", str(tmp_path),
                 f"--max-download-gib={limit}"]) == 2
    assert f"--max-download-gib must be a positive number of GiB, not {float(limit)}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing fetched, nothing written
