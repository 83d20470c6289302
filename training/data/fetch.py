"""Download a dataset archive: resumable, checksum-verified, atomic, with bounded memory.

The public TuSimple train archive is ~10 GB and its original bucket is gone, so the source URL and
its sha256 are parameters. A download is written to ``<dest>.part``, resumed with an HTTP Range
request after a cut, verified, and only then renamed to ``dest``. Transient failures (connection
resets, timeouts, HTTP 429/5xx) are retried with exponential backoff and jitter; anything else
fails at once with a message that says what to do.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from training.data.space import allocated, block_bytes, ensure_free, names_a_full_volume

log = logging.getLogger("laneflow.data.fetch")

CHUNK_BYTES = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class FetchError(RuntimeError):
    """A download that cannot succeed as asked (bad URL, 404, wrong checksum, ...)."""


#: The largest download ``fetch`` takes unless told otherwise: far above any lane dataset's archive (TuSimple's
#: train_set.zip is ~10 GB, CULane's largest part ~40 GB), low enough that a server streaming without end stops.
MAX_DOWNLOAD_BYTES = 256 * 2**30


class DownloadTooLarge(FetchError):
    """A download larger than the limit it was allowed (announced, or seen as it streamed); its bytes are removed."""

    def __init__(self, url: str, limit: int, size: int, announced: bool):
        how = "announces" if announced else "sent more than"
        super().__init__(
            f"{url} {how} {size:,} bytes, over the download limit of {limit:,} bytes; nothing of it is kept. If the "
            f"file really is that large, raise the limit (python -m training.data.prepare --max-download-gib); "
            f"otherwise check the URL: a server that streams without end (no Content-Length) is cut off here")
        self.limit, self.size = limit, size


class TransientFetchError(FetchError):
    """A failure worth retrying: connection reset, timeout, HTTP 429 or 5xx."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class ChecksumMismatch(FetchError):
    """The downloaded bytes do not have the expected sha256."""

    def __init__(self, url: str, expected: str, actual: str, kept_at: Path):
        super().__init__(
            f"sha256 mismatch for {url}: expected {expected}, actual {actual}. The download is corrupt or not "
            f"the file meant; it is set aside at {kept_at} for inspection only. Do not pin its checksum: a "
            f"download resumed after a cut, or written by two preparations at once, holds bytes no published "
            f"file has, and nothing here proves this one was not. Delete {kept_at} and run again to download "
            f"it afresh; if the mismatch repeats, check the source URL and the checksum its publisher lists "
            f"(pass theirs, never the actual one above)."
        )
        self.expected = expected
        self.actual = actual
        self.kept_at = kept_at


@dataclass(frozen=True)
class FetchResult:
    path: Path
    sha256: str
    size: int
    downloaded_bytes: int  # bytes this call added (a resumed download counts only the rest)
    attempts: int
    cached: bool


def validate_sha256(value: str) -> str:
    """Normalise a sha256 hex digest or raise naming the problem."""
    digest = (value or "").strip().lower()
    if digest.startswith("sha256:"):
        digest = digest[len("sha256:") :]
    if not _SHA256.match(digest):
        raise FetchError(f"checksum '{value}' is not a sha256 hex digest (64 hex characters)")
    return digest


def validate_url(url: str) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https", "file"):
        raise FetchError(f"source URL '{url}' must start with https://, http:// or file://")
    if parts.scheme != "file" and not parts.netloc:
        raise FetchError(f"source URL '{url}' has no host")
    return parts


def sha256_of(path: Path, chunk_bytes: int = CHUNK_BYTES) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def backoff_delay(attempt: int, base: float, cap: float, jitter: float, rng: random.Random) -> float:
    """Exponential backoff (base * 2**attempt, capped) with +/- ``jitter`` fraction of randomness."""
    delay = min(cap, base * (2**attempt))
    return max(0.0, delay * (1.0 + jitter * (2.0 * rng.random() - 1.0)))


class _Progress:
    """Logs bytes, percentage and rate every ``interval`` seconds, also while the transfer stalls."""

    def __init__(self, label: str, interval: float, total: int | None, done: int):
        self.label, self.interval, self.total, self.done = label, interval, total, done
        self._started = time.monotonic()
        self._start_bytes = done
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fetch-progress", daemon=True)

    def __enter__(self) -> _Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.report()

    def report(self) -> None:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = (self.done - self._start_bytes) / elapsed / 2**20
        of_total = f" of {self.total / 2**20:.1f} MiB ({100 * self.done / self.total:.1f}%)" if self.total else ""
        log.info("%s: %.1f MiB%s at %.1f MiB/s", self.label, self.done / 2**20, of_total, rate)


def fetch(
    url: str,
    dest: str | Path,
    sha256: str,
    *,
    max_attempts: int = 6,
    backoff_base: float = 1.0,
    backoff_cap: float = 60.0,
    jitter: float = 0.25,
    timeout: float = 60.0,
    progress_interval: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
    volume: Path | None = None,
    max_bytes: int = MAX_DOWNLOAD_BYTES,
) -> FetchResult:
    """Fetch ``url`` to ``dest`` and verify its sha256; reuse ``dest`` when it already verifies.

    A download whose size is announced is refused before it writes when ``volume`` (the folder errors
    name; default: ``dest``'s) lacks the space; one that fills it anyway fails naming the file. One larger than
    ``max_bytes`` (announced, or as it streams) fails and leaves nothing; so does one of unannounced size that
    fills the volume (the volume is shared: its other users need the space back more than a resume does).
    """
    expected = validate_sha256(sha256)
    parts = validate_url(url)
    dest = Path(dest)
    volume = volume or dest.parent
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".part")
    unverified = dest.with_name(dest.name + ".unverified")

    for candidate in (dest, unverified):
        if candidate.exists() and sha256_of(candidate) == expected:
            if candidate != dest:
                os.replace(candidate, dest)
            log.info("%s already present and verified (sha256 %s)", dest, expected)
            return FetchResult(dest, expected, dest.stat().st_size, 0, 0, cached=True)

    rng = random.Random()
    already_there = partial.stat().st_size if partial.exists() else 0
    attempt = 0
    while True:
        attempt += 1
        try:
            if parts.scheme == "file":
                _copy_file(url, parts, partial, progress_interval, volume, max_bytes)
            else:
                _download_http(url, partial, timeout, progress_interval, volume, max_bytes)
            break
        except DownloadTooLarge:
            partial.unlink(missing_ok=True)
            raise
        except TransientFetchError as exc:
            if attempt >= max_attempts:
                raise FetchError(
                    f"giving up on {url} after {attempt} attempts: {exc}. The partial download is kept at "
                    f"{partial} and resumes on the next run."
                ) from exc
            delay = backoff_delay(attempt - 1, backoff_base, backoff_cap, jitter, rng)
            if exc.retry_after is not None:
                delay = max(delay, exc.retry_after)
            log.warning("transient error fetching %s (attempt %d/%d): %s; retrying in %.1fs",
                        url, attempt, max_attempts, exc, delay)
            sleep(delay)

    actual = sha256_of(partial)
    if actual != expected:
        os.replace(partial, unverified)
        raise ChecksumMismatch(url, expected, actual, unverified)
    size = partial.stat().st_size
    os.replace(partial, dest)
    log.info("fetched %s -> %s (%.1f MiB, sha256 verified, %d attempt(s))", url, dest, size / 2**20, attempt)
    return FetchResult(dest, expected, size, max(0, size - already_there), attempt, cached=False)


def _step(partial: Path) -> str:
    return f"download {partial.name.removesuffix('.part')}"


def _make_room(partial: Path, total: int, volume: Path) -> str:
    """Refuse to write ``partial`` up to ``total`` bytes when the volume lacks the space; the step's name.

    The partial file's current blocks count as room: they are either kept (a resumed download) or
    truncated (a restart)."""
    step = _step(partial)
    block = block_bytes(partial.parent)
    current = allocated(partial.stat().st_size, block) if partial.exists() else 0
    ensure_free(step, volume, partial.parent, allocated(total, block) - current)
    return step


def _copy_file(url: str, parts: urllib.parse.SplitResult, partial: Path, progress_interval: float, volume: Path,
               max_bytes: int) -> None:
    """A ``file://`` source copied, under the same download limit as HTTP (a file that grows while it is read
    is cut off at the limit too)."""
    source = Path(urllib.request.url2pathname(parts.path))
    if not source.is_file():
        raise FetchError(f"source file {source} does not exist")
    total = source.stat().st_size
    if total > max_bytes:
        raise DownloadTooLarge(url, max_bytes, total, announced=True)
    step = _make_room(partial, total, volume)
    with names_a_full_volume(step, volume, partial), source.open("rb") as src, partial.open("wb") as out, \
            _Progress(f"copying {source.name}", progress_interval, total, 0) as progress:
        while chunk := src.read(CHUNK_BYTES):
            if progress.done + len(chunk) > max_bytes:
                raise DownloadTooLarge(url, max_bytes, progress.done + len(chunk), announced=False)
            out.write(chunk)
            progress.done += len(chunk)


def _parse_retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


@contextmanager
def _classified_errors() -> Iterator[None]:
    """Turn httpx's network errors into transient ones; leave everything else alone."""
    try:
        yield
    except (httpx.TransportError, ConnectionError) as exc:
        raise TransientFetchError(f"{type(exc).__name__}: {exc or 'connection lost'}") from exc


def _download_http(url: str, partial: Path, timeout: float, progress_interval: float, volume: Path,
                   max_bytes: int) -> None:
    """One attempt: stream ``url`` into ``partial``, resuming from its current size."""
    offset = partial.stat().st_size if partial.exists() else 0
    # Identity encoding: byte offsets in Range must mean the same bytes the checksum covers.
    headers = {"Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    received = 0
    with _classified_errors(), httpx.Client(timeout=timeout, follow_redirects=True) as client, client.stream(
        "GET", url, headers=headers
    ) as response:
        status = response.status_code
        if status == 416 and offset:
            # The partial file already holds everything the server has; verification decides.
            return
        if status == 429 or status >= 500:
            raise TransientFetchError(
                f"HTTP {status} from {url}", retry_after=_parse_retry_after(response.headers.get("Retry-After"))
            )
        if status >= 400:
            raise FetchError(f"HTTP {status} from {url}; check the source URL (it is not retried)")
        if status == 200 and offset:
            log.info("server ignored the Range request for %s; downloading from the start", url)
            offset = 0
        total = _total_size(response, offset)
        if total is not None and total > max_bytes:
            raise DownloadTooLarge(url, max_bytes, total, announced=True)
        step = _make_room(partial, total, volume) if total is not None else _step(partial)
        mode = "ab" if status == 206 else "wb"
        with names_a_full_volume(step, volume, partial, keep=total is not None), partial.open(mode) as out, \
                _Progress(f"downloading {partial.name.removesuffix('.part')}", progress_interval, total,
                          offset) as progress:
            # iter_raw hands over every byte as it arrives, so a cut loses nothing already received.
            for chunk in response.iter_raw():
                if offset + received + len(chunk) > max_bytes:
                    raise DownloadTooLarge(url, max_bytes, offset + received + len(chunk), announced=False)
                out.write(chunk)
                received += len(chunk)
                progress.done += len(chunk)
        if total is not None and offset + received < total:
            raise TransientFetchError(f"connection closed after {offset + received} of {total} bytes")


def _total_size(response: httpx.Response, offset: int) -> int | None:
    content_range = response.headers.get("Content-Range", "")
    match = re.match(r"bytes \d+-\d+/(\d+)", content_range)
    if match:
        return int(match.group(1))
    length = response.headers.get("Content-Length")
    return offset + int(length) if length and response.status_code == 206 else (int(length) if length else None)
