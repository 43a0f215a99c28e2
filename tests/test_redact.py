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
