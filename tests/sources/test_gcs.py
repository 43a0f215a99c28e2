"""gs:// through obstore against fake-gcs-server on 127.0.0.1: the matrix, plus GCS specifics."""

from __future__ import annotations

import pytest

import asyncload

from .._gcs_server import GcsServer
from ._cloud_matrix import *  # noqa: F403 - the shared behaviour matrix runs here for gs://
from ._cloud_matrix import DATA


@pytest.fixture(scope="module")
def cloud_session(_gcs_session: GcsServer) -> GcsServer:
    return _gcs_session


@pytest.fixture
def cloud(gcs_server: GcsServer) -> GcsServer:
    return gcs_server


@pytest.mark.asyncio
async def test_endpoint_option_is_the_base_url(gcs_server: GcsServer) -> None:
    # The issue's reproduction: endpoint= used to reach obstore under S3's key name.
    bucket = gcs_server.bucket("asyncload-conf", {"x.bin": DATA})
    asyncload.configure(bucket, endpoint=gcs_server.endpoint, allow_http=True)
    assert await asyncload.read(f"{bucket}/x.bin") == DATA


@pytest.mark.asyncio
@pytest.mark.parametrize("bare", [False, True])
async def test_storage_emulator_host_variable(
    gcs_server: GcsServer, monkeypatch: pytest.MonkeyPatch, bare: bool
) -> None:
    # As google-cloud-storage reads it: a URL, or a bare host:port; requests go unsigned.
    bucket = gcs_server.bucket("asyncload-env", {"x.bin": DATA})
    value = gcs_server.endpoint.removeprefix("http://") if bare else gcs_server.endpoint
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", value)
    assert await asyncload.read(f"{bucket}/x.bin", start=1, end=4) == DATA[1:4]
    assert (await asyncload.stat(f"{bucket}/x.bin")).size == len(DATA)


@pytest.mark.asyncio
async def test_anonymous_access_is_explicit_too(gcs_server: GcsServer) -> None:
    bucket = gcs_server.bucket("asyncload-anon", {"x.bin": DATA})
    asyncload.configure(bucket, endpoint=gcs_server.endpoint, extra={"skip_signature": True})
    assert await asyncload.read(f"{bucket}/x.bin") == DATA
