"""Credentials never reach messages: redact_url and the errors built on it."""

from __future__ import annotations

import pickle

import pytest

import asyncload
from asyncload._exceptions import NotFound, StorageError
from asyncload._redact import redact_url


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("https://user:pa55@host/x", "pa55"),
        ("https://bucket.s3.amazonaws.com/k?X-Amz-Signature=abc123&X-Amz-Expires=60", "abc123"),
        ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA1%2F2&x=1", "AKIA1"),
        ("https://acct.blob.core.windows.net/c/b?sv=2021&sig=s3cr3t", "s3cr3t"),
        ("https://storage.googleapis.com/b/o?X-Goog-Signature=ffee", "ffee"),
        ("https://api.example.com/f?token=tok-99", "tok-99"),
    ],
)
def test_secrets_are_removed(url: str, secret: str) -> None:
    out = redact_url(url)
    assert secret not in out
    assert "REDACTED" in out


def test_non_secret_parts_survive() -> None:
    out = redact_url("https://host:8443/a/b.bin?X-Amz-Expires=60&part=2")
    assert out == "https://host:8443/a/b.bin?X-Amz-Expires=60&part=2"


def test_urls_inside_free_text() -> None:
    text = "Error performing GET https://u:p@h/k?sig=zz in 3ms"
    assert redact_url(text) == "Error performing GET https://REDACTED@h/k?sig=REDACTED in 3ms"


def test_storage_error_redacts_url_and_message_and_survives_pickle() -> None:
    url = "https://u:hunter2@h/k?X-Amz-Signature=abc"
    exc = NotFound(f"could not get {url}", url=url, status=404, attempts=2)
    assert "hunter2" not in str(exc)
    assert "abc" not in str(exc)
    assert exc.url is not None
    assert "hunter2" not in exc.url
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is NotFound
    assert (back.url, back.status, back.attempts) == (exc.url, 404, 2)
    assert str(back) == str(exc)
    assert isinstance(back, (FileNotFoundError, StorageError, asyncload.LoadError))


def test_storage_options_repr_hides_credentials() -> None:
    opts = asyncload.StorageOptions(
        credentials={"secret_access_key": "very-secret"}, headers={"Authorization": "Bearer t0k"}
    )
    assert "very-secret" not in repr(opts)
    assert "t0k" not in repr(opts)


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("https://h/f?access_key=AK-1234", "AK-1234"),
        ("https://h/f?auth=abc-9", "abc-9"),
        ("https://h/f?Policy=eyJwb2xpY3ki&Key-Pair-Id=APKA77", "APKA77"),
        ("https://h/f?X-Something-New=zz-secret-zz", "zz-secret-zz"),
        ("https://h/f?bare-token-value-123", "bare-token-value-123"),
        ("https://h/f#access_token=frag-77", "frag-77"),
        ("https://u:p4ss@[::1/x", "p4ss"),  # broken IPv6: still shown, minus the secret
    ],
)
def test_every_query_value_is_redacted_unless_its_key_is_harmless(url: str, secret: str) -> None:
    out = redact_url(url)
    assert secret not in out
    assert "REDACTED" in out


def test_harmless_keys_and_the_url_shape_survive() -> None:
    url = "https://h:1/p%20q?X-Amz-Date=20260101T000000Z&versionId=3&partNumber=2&sv=2021-08-06"
    assert redact_url(url) == url
    assert redact_url("https://[::1/x?sig=1") == "https://[::1/x?sig=REDACTED"


def test_s3_xml_error_bodies_are_scrubbed() -> None:
    body = (
        "<Error><Code>SignatureDoesNotMatch</Code><Message>no</Message>"
        "<AWSAccessKeyId>AKIAEXAMPLE1</AWSAccessKeyId>"
        "<StringToSign>AWS4-HMAC-SHA256\n20260101T000000Z\nscope-x</StringToSign>"
        "<SignatureProvided>abcdef0123</SignatureProvided>"
        "<CanonicalRequest>GET\n/k\nX-Amz-Credential=AKIAEXAMPLE1</CanonicalRequest>"
        "<StringToSignBytes>41 57 53 34</StringToSignBytes></Error>"
    )
    out = redact_url("access denied: " + body)
    for secret in ("AKIAEXAMPLE1", "scope-x", "abcdef0123", "41 57 53 34"):
        assert secret not in out
    assert "SignatureDoesNotMatch" in out
    # A message cut off inside an element (obstore summaries are truncated) is scrubbed too.
    assert "AKIAEX" not in redact_url("denied: <AWSAccessKeyId>AKIAEX…")


def test_authorization_header_in_free_text_is_scrubbed() -> None:
    text = (
        "Authorization: AWS4-HMAC-SHA256 Credential=AKIA9/20260101/us-east-1/s3/aws4_request, "
        "SignedHeaders=host, Signature=0badc0de; Authorization: Bearer eyJtok"
    )
    out = redact_url(text)
    for secret in ("AKIA9", "0badc0de", "eyJtok"):
        assert secret not in out


def test_lone_surrogates_are_escaped_so_messages_print() -> None:
    out = redact_url("https://h/x\udcff?sig=1")
    out.encode("utf-8")
    assert "\\udcff" in out


def test_obstore_style_message_through_storage_error() -> None:
    message = (
        "Client error with status 403 Forbidden: <?xml version='1.0'?><Error>"
        "<Code>SignatureDoesNotMatch</Code><AWSAccessKeyId>AKIAOBSTORE</AWSAccessKeyId>"
        "<SignatureProvided>5eed</SignatureProvided></Error>"
    )
    exc = StorageError(message, url="s3://bucket/key", status=403)
    assert "AKIAOBSTORE" not in str(exc)
    assert "5eed" not in str(exc)
    assert "SignatureDoesNotMatch" in str(exc)
