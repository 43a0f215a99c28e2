"""az:// through obstore against Azurite on 127.0.0.1: the matrix, plus Azure specifics."""

from __future__ import annotations

import pytest

import asyncload
from asyncload._exceptions import PermissionDenied

from .._azurite import ACCOUNT, KEY, AzuriteServer
from ._cloud_matrix import *  # noqa: F403 - the shared behaviour matrix runs here for az://
from ._cloud_matrix import DATA


@pytest.fixture(scope="module")
def cloud_session(_azurite_session: AzuriteServer) -> AzuriteServer:
    return _azurite_session


@pytest.fixture
def cloud(azurite: AzuriteServer) -> AzuriteServer:
    return azurite


@pytest.mark.asyncio
async def test_connection_string_variable(
    azurite: AzuriteServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    container = azurite.bucket("asyncload-env", {"x.bin": DATA})
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    assert await asyncload.read(f"{container}/x.bin", start=2, end=9) == DATA[2:9]
    assert (await asyncload.stat(f"{container}/x.bin")).size == len(DATA)


@pytest.mark.asyncio
async def test_account_variables_with_endpoint_option(
    azurite: AzuriteServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    container = azurite.bucket("asyncload-env", {"x.bin": DATA})
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", KEY)
    asyncload.configure(container, endpoint=azurite.endpoint)
    assert await asyncload.read(f"{container}/x.bin") == DATA


@pytest.mark.asyncio
async def test_anonymous_access_to_a_public_container(azurite: AzuriteServer) -> None:
    public = azurite.bucket("asyncload-public", {"x.bin": DATA}, public=True)
    private = azurite.bucket("asyncload-private-anon", {"x.bin": DATA})
    for container in (public, private):
        asyncload.configure(
            container,
            endpoint=azurite.endpoint,
            credentials={"account_name": ACCOUNT},
            extra={"skip_signature": True},
        )
    assert await asyncload.read(f"{public}/x.bin") == DATA
    # Unsigned requests to a private container are refused by the emulator itself.
    with pytest.raises((PermissionDenied, FileNotFoundError)):
        await asyncload.read(f"{private}/x.bin")
