"""A request and a reply as the loopback store sees them, whatever front end parsed them.

:class:`Ticket` is a request (method, target, headers), :class:`Reply` the answer to it (status,
headers, body, and the fault to act out while sending it); :func:`parse_range` reads ``Range``.
The S3 error bodies are here too: they are replies the store gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import unquote

__all__ = [
    "OCTETS",
    "S3_SIGNATURE_ERROR",
    "S3_SLOWDOWN",
    "TEXT",
    "XML",
    "Reply",
    "Ticket",
    "parse_range",
]

# What S3 answers a request whose signature does not match; the secrets are fake but distinct.
S3_SIGNATURE_ERROR = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SignatureDoesNotMatch</Code>'
    "<Message>The request signature we calculated does not match the signature you provided."
    "</Message><AWSAccessKeyId>AKIAFAKEACCESSKEY01</AWSAccessKeyId>"
    "<StringToSign>AWS4-HMAC-SHA256\n20260101T000000Z\nfake-string-to-sign-77</StringToSign>"
    "<SignatureProvided>fakesignatureprovided99</SignatureProvided>"
    "<RequestId>4442587FB7D0A2F9</RequestId></Error>"
)

# What S3 answers a request over its prefix's request rate (the client retries after a backoff).
S3_SLOWDOWN = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    "<Message>Please reduce your request rate.</Message>"
    "<RequestId>7A5FC1D2E3B4A596</RequestId><HostId>loopback</HostId></Error>"
)

TEXT = "text/plain; charset=utf-8"
OCTETS = "application/octet-stream"
XML = "application/xml"


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The ``[start, end)`` a ``Range`` header asks of *size* bytes; ``None``: unsatisfiable.

    Args:
        header: ``bytes=START-END`` (END inclusive), ``bytes=START-`` or ``bytes=-SUFFIX``;
            only the first range of a list is served.
        size: The object's size.

    Raises:
        ValueError: The header is malformed or not in bytes (served whole, as RFC 9110 says).
    """
    if not header.startswith("bytes="):
        raise ValueError(header)
    first, _, last = header[6:].split(",")[0].strip().partition("-")
    if first == "":
        suffix = int(last)
        return (max(0, size - suffix), size) if suffix > 0 and size > 0 else None
    start = int(first)
    end = int(last) + 1 if last else size
    if start < 0 or (last and end <= start):
        raise ValueError(header)
    # Starting at or past the end (an open range too) is unsatisfiable: 416, not the whole.
    return (start, min(end, size)) if start < size else None


class Reply:
    """What to answer: a status, headers besides ``Content-Type`` and ``Content-Length``, a body.

    A front end sends no body to ``HEAD`` but announces its length. When :attr:`fault` is set
    (one of ``short``, ``reset``, ``short-replace``, ``stall:S``, ``trickle:S``), it sends the
    headers and then acts the fault out on the body.
    """

    __slots__ = ("body", "content_type", "fault", "headers", "status")

    def __init__(
        self,
        status: int,
        headers: list[tuple[str, str]] | None = None,
        body: bytes | memoryview = b"",
        content_type: str = TEXT,
        fault: str | None = None,
    ) -> None:
        self.status, self.headers, self.body = status, headers or [], body
        self.content_type, self.fault = content_type, fault

    def __repr__(self) -> str:
        return f"Reply({self.status}, {self.headers!r}, {len(self.body)} bytes, {self.fault!r})"


class Ticket:
    """One request as the store sees it; a front end may subclass it to keep its own state."""

    __slots__ = ("done", "headers", "method", "path", "target")

    def __init__(self, method: str, target: str, headers: Mapping[str, str]) -> None:
        """Args:
        method: ``GET``, ``HEAD``, ...
        target: The request target as received (``/a%20b?x=1``).
        headers: The request's headers; looked up by lower-case name.
        """
        self.method, self.target, self.headers = method, target, headers
        self.path = unquote(target.partition("?")[0].lstrip("/"))
        self.done = False  # ended or cancelled: a line skips it
