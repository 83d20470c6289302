"""A dataset URL's credential (an Azure SAS, a presigned signature, user:password@) never reaches what people and
log stores see: the pure redaction, then a real local pipeline whose download fails on such a URL (its command line
read from /proc while the download is held, as ``ps`` shows it to every user)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flows.train import train_pipeline
from tests.conftest import PROJECT_ROOT
from tests.http_server import Fault, RunningServer
from tests.test_cluster_pipeline import flow_run_messages
from tests.test_pipeline import params_for
from training.data.redact import redact_exception, redact_text

SAS = "sv=2024-11-04&se=2026-12-31T00%3A00%3A00Z&sr=b&sp=r&sig=c2VjcmV0LXNpZ25hdHVyZQ%3D%3D"


@pytest.mark.parametrize(("text", "shown"), [
    (f"fetched https://acct.blob.core.windows.net/data/train_set.zip?{SAS} -> /data/x",
     "fetched https://acct.blob.core.windows.net/data/train_set.zip?<redacted> -> /data/x"),
    ("GET https://b.s3.amazonaws.com/k.zip?X-Amz-Algorithm=AWS4&X-Amz-Signature=abc123 failed",
     "GET https://b.s3.amazonaws.com/k.zip?<redacted> failed"),
    ("from https://user:pa55@example.org/a.zip and 'http://h:8080?sig=zz'",
     "from https://<redacted>@example.org/a.zip and 'http://h:8080?<redacted>'"),
    ("https://example.org/plain/train_set.zip (no credential) stays", None),
    ("sha256 mismatch for file:///tmp/a.zip#frag", "sha256 mismatch for file:///tmp/a.zip#<redacted>"),
])
def test_every_url_keeps_scheme_host_and_path_and_loses_its_credentials(text: str, shown: str | None) -> None:
    assert redact_text(text) == (text if shown is None else shown)
    # A line redacted where it was logged and again where it is forwarded reads the same.
    assert redact_text(redact_text(text)) == redact_text(text)


def test_an_exception_keeps_its_type_and_loses_the_credential_of_its_message_and_cause() -> None:
    try:
        try:
            raise OSError(f"reset by https://x.example/a?{SAS}")
        except OSError as inner:
            raise ValueError(f"giving up on https://x.example/a?{SAS}", 3) from inner
    except ValueError as exc:
        redacted = redact_exception(exc)
    assert type(redacted) is ValueError and redacted.args == ("giving up on https://x.example/a?<redacted>", 3)
    assert redacted.__cause__ is None and redacted.__suppress_context__


def command_lines() -> dict[int, str]:
    """Every process's command line, as ``ps`` shows it to any user of the machine."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile
                continue
    return found


def test_a_failed_download_of_a_sas_url_leaves_no_signature_in_argv_logs_or_the_state_message(
        prefect_server: dict, laneflow_home: Path, synthetic_archive: tuple[Path, str]) -> None:
    archive, _ = synthetic_archive
    asked, ended = threading.Event(), threading.Event()
    seen: dict[int, str] = {}

    def read_while_held() -> None:  # the flow runs in this test's thread, where its Prefect settings are
        while not server.requests and not ended.is_set():
            time.sleep(0.05)
        seen.update(command_lines())
        asked.set()

    with RunningServer() as server:
        server.files[archive.name] = archive.read_bytes()
        server.faults.append(Fault("hold", gate=asked))  # the download waits while every command line is read
        url = f"{server.url(archive.name)}?{SAS}"
        reader = threading.Thread(target=read_while_held)
        reader.start()
        try:
            state = train_pipeline(**params_for((url, "0" * 64), volume="sas"), return_state=True)
        finally:
            ended.set()
            asked.set()
            reader.join()
    preparing = [line for line in seen.values() if "training.data.prepare" in line]
    assert preparing, "the dataset stage's process was not found while its download was held"
    assert not [line for line in seen.values() if "sig=" in line or "c2VjcmV0" in line]
    assert state.is_failed()
    message = state.message or ""
    assert "sha256 mismatch" in message and f"{archive.name}?<redacted>" in message, message
    said = "\n".join([message, *flow_run_messages(str(state.state_details.flow_run_id))])
    assert "sig=" not in said and "c2VjcmV0" not in said and "se=2026" not in said
    assert f"{archive.name}?<redacted>" in said


def test_the_dataset_process_itself_prints_no_signature_it_fetches_or_fails_with(
        synthetic_archive: tuple[Path, str], tmp_path: Path) -> None:
    """What a data Job's pod log shows (``kubectl logs`` needs only ``get pods/log``): prepare's own lines, as it
    logs a download and as it reports one it could not make."""
    archive, sha = synthetic_archive
    with RunningServer() as server:
        server.files[archive.name] = archive.read_bytes()

        def prepare(url: str, volume: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "training.data.prepare", "--archive", url, sha,
                 "--volume", str(tmp_path / volume), "--workers", "1"],
                cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)

        fetched = prepare(f"{server.url(archive.name)}?{SAS}", "ok")
        missing = prepare(f"{server.url('absent.zip')}?{SAS}", "missing")
    assert fetched.returncode == 0, fetched.stderr
    assert f"fetched {server.url(archive.name)}?<redacted>" in fetched.stderr
    assert missing.returncode == 2
    assert f"HTTP 404 from {server.url('absent.zip')}?<redacted>" in missing.stderr, missing.stderr
    for said in (fetched.stdout + fetched.stderr, missing.stdout + missing.stderr):
        assert "sig=" not in said and "c2VjcmV0" not in said and "se=2026" not in said
