"""Credentials inside URLs (SAS tokens, presigned signatures, user:password@) kept out of what people and log stores
see: log lines, exception and state messages (and so alert bodies).

A dataset URL may carry a credential in its query string: an Azure SAS (``sig=``), an S3 or GCS presigned URL
(``X-Amz-Signature``, ``X-Goog-Signature``), or a ``user:password@`` part. Whatever laneflow forwards from a stage
that handles such URLs (the dataset stage's output and failures) goes through ``redact_text`` first: every URL
with a query string or credentials keeps its scheme, host and path, and the rest becomes ``<redacted>``.

Here, in ``training.data``, because the dataset stage's own process prints them too: the data image, which runs
that stage as a Kubernetes Job whose log anyone with ``get pods/log`` reads, has only this package.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable

#: A URL as it appears in text: a scheme, then everything up to white space or a quote/bracket that ends it.
_URL = re.compile(r"""\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'"<>()\[\]{}]+""")
REDACTED = "<redacted>"


def redact_url_in_text(url: str) -> str:
    """``url`` with its query string, fragment and credentials replaced (unchanged when it has none)."""
    scheme, rest = url.split("://", 1)
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = f"{REDACTED}@{authority.rsplit('@', 1)[1]}"
    path_part = f"{slash}{path}"
    for mark in ("?", "#"):
        if mark in path_part:
            path_part = _cut(path_part, mark)
            break
    if "?" in authority or "#" in authority:  # http://host?sig=... (no path)
        authority = _cut(authority, "?" if "?" in authority else "#")
    return f"{scheme}://{authority}{path_part}"


def _cut(text: str, mark: str) -> str:
    """``text`` up to ``mark``, and ``<redacted>`` for what came after it: nothing when nothing did (a URL already
    redacted ends at the mark, its ``<redacted>`` right after), so redacting twice changes nothing more."""
    head, tail = text.split(mark, 1)
    return head + mark + (REDACTED if tail else "")


def redact_text(text: str) -> str:
    """``text`` with every URL's credentials redacted."""
    return _URL.sub(lambda found: redact_url_in_text(found.group(0)), text)


def redacting(sink: Callable[[str], object]) -> Callable[[str], None]:
    """A log sink that passes each line on redacted."""
    def forward(line: str) -> None:
        sink(redact_text(line))
    return forward


def redact_exception(exc: BaseException) -> BaseException:
    """``exc`` with its message's URLs redacted in place (its type kept, so retries and handlers see the same
    error); its cause and context are dropped, since their messages may hold the URL too."""
    exc.args = tuple(redact_text(arg) if isinstance(arg, str) else arg for arg in exc.args)
    for attribute in ("message", "detail"):
        value = getattr(exc, attribute, None)
        if isinstance(value, str):
            with contextlib.suppress(AttributeError):
                setattr(exc, attribute, redact_text(value))
    exc.__cause__ = None
    exc.__suppress_context__ = True
    return exc


class RedactingFormatter(logging.Formatter):
    """A log formatter whose lines (message, arguments and traceback alike) have every URL's credentials
    redacted: for a process that logs the URLs it fetches."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))
