"""Remove secrets from URLs and error bodies before they reach an error message or a log line.

Object-store URLs carry credentials in two places: the userinfo part (``user:pass@host``) and the
query string of presigned URLs (``X-Amz-Signature=...``, ``sig=...``, ``access_key=...``). Since a
signed URL may put its secret under any key, every query value is redacted unless its key is
known to be harmless (an allow-list: expiry times, algorithm names, versions, part numbers).

Error bodies are scrubbed too: an S3 ``SignatureDoesNotMatch`` answer echoes the access key id,
the signature and the string that was signed (``<AWSAccessKeyId>``, ``<SignatureProvided>``,
``<StringToSign>``...), and an ``Authorization`` header echoed in a debug message carries
``Credential=`` and ``Signature=``. Every message that names a URL or quotes a body goes through
[`redact_url`][asyncload.redact_url].
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["redact_url", "split_authority"]

_MASK = "REDACTED"

# Query keys whose value is never a secret (compared in lower case). Everything else is
# redacted: a new signing scheme must not leak because nobody listed its key.
_HARMLESS_KEYS = frozenset(
    {
        # AWS SigV4 / SigV2 presigning: what was signed, when, for how long.
        "x-amz-algorithm",
        "x-amz-date",
        "x-amz-expires",
        "x-amz-signedheaders",
        "expires",
        # GCS signed URLs.
        "x-goog-algorithm",
        "x-goog-date",
        "x-goog-expires",
        "x-goog-signedheaders",
        # Azure SAS: version, resource, permissions, start/expiry, protocol.
        "sv",
        "sr",
        "sp",
        "ss",
        "srt",
        "st",
        "se",
        "spr",
        # Object versions, parts and listing parameters.
        "versionid",
        "generation",
        "partnumber",
        "part",
        "uploadid",
        "prefix",
        "delimiter",
        "max-keys",
        "list-type",
        "alt",
        "format",
        "page",
        "offset",
        "limit",
    }
)

# A URL-looking substring inside free text (error messages from libraries).
_URL_IN_TEXT = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")

# XML elements of S3-style error bodies that echo credentials or signing material. The closing
# tag is optional: a message cut at N characters may end inside one.
_SECRET_ELEMENTS = re.compile(
    r"<(AWSAccessKeyId|SignatureProvided|StringToSign|StringToSignBytes|CanonicalRequest"
    r"|CanonicalRequestBytes|Signature|Credential|SecurityToken|X-Amz-Security-Token"
    r"|AccessKeyId|SecretAccessKey|SessionToken|Token)>[^<]*(</\1>)?",
    re.IGNORECASE,
)
# `Credential=AKIA.../...`, `Signature=...` in an Authorization header quoted in free text.
_SECRET_PARAMS = re.compile(
    r"\b(Credential|Signature|X-Amz-Security-Token|AWSAccessKeyId|SharedKey|sig)=[^\s,&\"'<]+",
    re.IGNORECASE,
)
_AUTH_HEADER = re.compile(r"\b(Authorization:\s*)(Bearer|Basic|AWS)\s+[^\s,\"'<]+", re.IGNORECASE)


def _redact_query(query: str) -> str:
    pieces = []
    for piece in query.split("&"):
        key, eq, value = piece.partition("=")
        if unquote(key).lower() in _HARMLESS_KEYS or not (eq or key):
            pieces.append(piece)
        elif eq:
            pieces.append(f"{key}={_MASK}" if value else piece)
        else:
            pieces.append(_MASK)  # a bare token (`?AKIA...`) is a value too
    return "&".join(pieces)


def split_authority(url: str) -> tuple[str, str, str]:
    """``(scheme + "://", netloc, rest)`` of *url*, split by hand: ``urlsplit`` rejects broken
    IPv6 literals and drops TABs, and such URLs must still be checked and shown."""
    scheme_end = url.find("://") + 3
    rest = url[scheme_end:]
    cut = len(rest)
    for sep in "/?#":
        at = rest.find(sep)
        if at != -1:
            cut = min(cut, at)
    return url[:scheme_end], rest[:cut], rest[cut:]


def _redact_one(url: str) -> str:
    # The URL of an InvalidURL error must still be shown, minus its secrets.
    head, netloc, tail = split_authority(url)
    if "@" in netloc:
        netloc = f"{_MASK}@{netloc.rpartition('@')[2]}"
    tail, hash_, fragment = tail.partition("#")
    path, question, query = tail.partition("?")
    if query:
        query = _redact_query(query)
    if fragment and "=" in fragment:  # OAuth-style `#access_token=...`
        fragment = _redact_query(fragment)
    return f"{head}{netloc}{path}{question}{query}{hash_}{fragment}"


def redact_url(text: str) -> str:
    """Return *text* with credentials in every URL and error body it contains replaced by
    ``REDACTED``.

    Works on a bare URL or on free text that contains URLs or an S3 XML error body (a library's
    error message). Lone surrogates are shown as ``\\udcXX`` escapes, so the result can always be
    printed.

    Examples:
        >>> redact_url("https://user:pw@host/a?X-Amz-Signature=abc&X-Amz-Expires=60")
        'https://REDACTED@host/a?X-Amz-Signature=REDACTED&X-Amz-Expires=60'
        >>> redact_url("denied: <AWSAccessKeyId>AKIA123</AWSAccessKeyId>")
        'denied: <AWSAccessKeyId>REDACTED</AWSAccessKeyId>'
    """
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda m: _redact_one(m.group(0)), text)
    if "<" in text:
        text = _SECRET_ELEMENTS.sub(lambda m: f"<{m.group(1)}>{_MASK}</{m.group(1)}>", text)
    if "=" in text:
        text = _SECRET_PARAMS.sub(lambda m: f"{m.group(1)}={_MASK}", text)
    if ":" in text:
        text = _AUTH_HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)} {_MASK}", text)
    return text
