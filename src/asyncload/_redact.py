"""Remove secrets from URLs before they reach an error message or a log line.

Object-store URLs carry credentials in two places: the userinfo part (``user:pass@host``) and the
query string of presigned URLs (``X-Amz-Signature=...``, ``sig=...``, ``token=...``). Every
message that names a URL goes through ``redact_url``.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["redact_url"]

_MASK = "REDACTED"

# Query keys whose value is a credential (compared in lower case). Covers AWS SigV4/SigV2
# presigning, GCS signed URLs, Azure SAS and the generic names tokens travel under.
_SECRET_KEYS = frozenset(
    {
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "signature",
        "awsaccesskeyid",
        "x-goog-signature",
        "x-goog-credential",
        "googleaccessid",
        "sig",
        "se",
        "skoid",
        "sktid",
        "token",
        "access_token",
        "api_key",
        "apikey",
        "key",
        "password",
        "secret",
        "code",
    }
)

# A URL-looking substring inside free text (error messages from libraries).
_URL_IN_TEXT = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")


def _redact_one(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return _MASK
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{_MASK}@{host}" if userinfo else host
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_KEYS for k, _ in pairs):
            query = urlencode(
                [(k, _MASK if k.lower() in _SECRET_KEYS else v) for k, v in pairs], safe="/:"
            )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_url(text: str) -> str:
    """Return *text* with credentials in every URL it contains replaced by ``REDACTED``.

    Works on a bare URL or on free text that contains URLs (a library's error message).

    Examples:
        >>> redact_url("https://user:pw@host/a?X-Amz-Signature=abc&x=1")
        'https://REDACTED@host/a?X-Amz-Signature=REDACTED&x=1'
    """
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: _redact_one(m.group(0)), text)
