"""How ``StorageOptions`` become an obstore store's configuration, per cloud.

The same option means the same thing on every backend: ``endpoint=`` is S3's ``endpoint``,
GCS's ``base_url`` and Azure's ``endpoint``; ``allow_http`` defaults to on for an ``http://``
endpoint; ``ca_bundle`` (or ``SSL_CERT_FILE``) adds a trusted root as on the HTTP backend.
Beyond what obstore reads from the environment itself (``AWS_*``, ``GOOGLE_*``,
``AZURE_STORAGE_*``), two variables the clouds' own SDKs use are honoured:

- ``STORAGE_EMULATOR_HOST`` (GCS emulators, as google-cloud-storage reads it): the base URL,
  with unsigned requests unless credentials are given;
- ``AZURE_STORAGE_CONNECTION_STRING``: ``AccountName``, ``AccountKey``, ``BlobEndpoint``,
  ``SharedAccessSignature`` or ``UseDevelopmentStorage=true`` (Azurite).

Option keys in ``credentials=`` and ``extra=`` are checked at ``configure`` time
against the keys obstore knows for that cloud (``check_options``), so a misspelt key fails
where it was written, not in a worker at the first read.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from typing import Any

from .base import StorageOptions

__all__ = [
    "VALID_KEYS",
    "check_options",
    "env_endpoint",
    "store_config",
    "unmatched_refusal",
]

# obstore 0.12's config keys (S3Config, GCSConfig, AzureConfig). Keys may also be spelt as
# obstore's aliases: upper case and/or with the cloud's prefix (``aws_``, ``google_``, ...).
VALID_KEYS: dict[str, frozenset[str]] = {
    "s3": frozenset(
        (
            "access_key_id bucket checksum_algorithm conditional_put "
            "container_credentials_relative_uri container_credentials_full_uri "
            "container_authorization_token_file copy_if_not_exists default_region "
            "disable_tagging disable_bulk_delete endpoint imdsv1_fallback metadata_endpoint "
            "region request_payer role_arn role_session_name s3_express secret_access_key "
            "server_side_encryption session_token skip_signature sse_bucket_key_enabled "
            "sse_kms_key_id token unsigned_payload virtual_hosted_style_request "
            "web_identity_token_file"
        ).split()
    ),
    "gs": frozenset(
        (
            "service_account service_account_key base_url bearer_token bucket "
            "application_credentials skip_signature"
        ).split()
    ),
    "az": frozenset(
        (
            "account_name account_key client_id client_secret tenant_id "
            "authority_host sas_key token use_emulator use_fabric_endpoint encryption_key "
            "endpoint msi_endpoint object_id msi_resource_id federated_token_file "
            "use_azure_cli skip_signature container_name bearer_token access_key "
            "authority_id disable_tagging fabric_token_service_url fabric_workload_host "
            "fabric_session_token fabric_cluster_identifier"
        ).split()
    ),
}
_PREFIXES = {
    "s3": ("aws_",),
    "gs": ("google_",),
    "az": ("azure_storage_", "azure_"),
}
_ENV_ENDPOINTS = {
    "s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
    "gs": ("GOOGLE_BASE_URL", "STORAGE_EMULATOR_HOST"),
    "az": ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT"),
}
_GCS_CREDENTIAL_ENV = (
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_BEARER_TOKEN",
)
_GCS_CREDENTIAL_KEYS = frozenset(
    ("service_account", "service_account_key", "bearer_token", "application_credentials")
)
# Where obstore's use_emulator sends requests (Azurite's default blob port).
_AZURITE = "http://127.0.0.1:10000"
_CONNECTION_STRING_KEYS = {
    "accountname": "account_name",
    "accountkey": "account_key",
    "blobendpoint": "endpoint",
    "sharedaccesssignature": "sas_key",
}


def canonical_key(scheme: str, key: str) -> str:
    """``"AWS_SECRET_ACCESS_KEY"`` → ``"secret_access_key"`` (the name in ``VALID_KEYS``)."""
    name = key.lower()
    if name in VALID_KEYS[scheme]:
        return name
    for prefix in _PREFIXES[scheme]:
        if name.startswith(prefix) and name[len(prefix) :] in VALID_KEYS[scheme]:
            return name[len(prefix) :]
    return name


def check_options(prefix: str, scheme: str, options: StorageOptions) -> None:
    """Raise ``TypeError`` naming the valid keys when a config key is unknown to *scheme*.

    Examples:
        >>> check_options("s3://b", "s3", StorageOptions(credentials={"secret_acess_key": "x"}))
        Traceback (most recent call last):
        TypeError: unknown s3 option 'secret_acess_key' in credentials= for 's3://b' ...
    """
    if scheme not in VALID_KEYS:
        return
    for where, keys in (("credentials", options.credentials or {}), ("extra", options.extra)):
        for key in keys:
            if not isinstance(key, str) or canonical_key(scheme, key) not in VALID_KEYS[scheme]:
                close = difflib.get_close_matches(str(key).lower(), VALID_KEYS[scheme], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(
                    f"unknown {scheme} option {key!r} in {where}= for {prefix!r}{hint}; "
                    f"valid: {', '.join(sorted(VALID_KEYS[scheme]))}"
                )


def env_endpoint(scheme: str) -> str | None:
    """The endpoint the environment sets for *scheme*, if any."""
    for name in _ENV_ENDPOINTS.get(scheme, ()):
        value = os.environ.get(name)
        if value:
            return value
    if scheme == "az":
        from_string = _connection_string()
        if from_string.get("endpoint"):
            return str(from_string["endpoint"])
        if from_string.get("use_emulator") or _truthy(os.environ.get("AZURE_STORAGE_USE_EMULATOR")):
            return _AZURITE
    return None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _connection_string() -> dict[str, Any]:
    """Azure's ``AZURE_STORAGE_CONNECTION_STRING`` as obstore config keys."""
    raw = os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "")
    config: dict[str, Any] = {}
    for part in raw.split(";"):
        name, sep, value = part.partition("=")
        if not sep:
            continue
        name = name.strip().lower()
        if name == "usedevelopmentstorage" and _truthy(value):
            config["use_emulator"] = True
        elif name in _CONNECTION_STRING_KEYS and value:
            config[_CONNECTION_STRING_KEYS[name]] = value.strip()
    return config


def _http_endpoint(endpoint: str | None) -> bool:
    return bool(endpoint and endpoint.lower().startswith("http://"))


def _gcs_base_url(value: str) -> str:
    # google-cloud-storage accepts a bare "host:port" for STORAGE_EMULATOR_HOST.
    return value if "://" in value else f"http://{value}"


def store_config(scheme: str, options: StorageOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, client_options)`` for obstore's ``from_url`` (timeouts and retries aside)."""
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    endpoint = options.endpoint
    if scheme == "s3":
        if endpoint:
            config["endpoint"] = endpoint
        if options.region:
            config["region"] = options.region
    elif scheme == "gs":
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if not endpoint and emulator and not os.environ.get("GOOGLE_BASE_URL"):
            endpoint = _gcs_base_url(emulator)
        if endpoint:
            config["base_url"] = endpoint.rstrip("/")
    elif scheme == "az":
        config.update(_connection_string())
        if endpoint:
            config["endpoint"] = endpoint
            config.pop("use_emulator", None)
    config.update(options.credentials or {})
    config.update(options.extra)
    config = {canonical_key(scheme, k) if scheme in VALID_KEYS else k: v for k, v in config.items()}
    if scheme == "gs" and endpoint and "skip_signature" not in config:
        # An emulator (or a private endpoint) with no credentials anywhere: send unsigned
        # requests, as Google's SDKs do with STORAGE_EMULATOR_HOST, rather than ask a metadata
        # server that is not there.
        has_creds = _GCS_CREDENTIAL_KEYS & set(config) or any(
            os.environ.get(name) for name in _GCS_CREDENTIAL_ENV
        )
        if not has_creds:
            config["skip_signature"] = True
    effective = endpoint or env_endpoint(scheme)
    allow_http = options.allow_http
    if allow_http is None:
        allow_http = _http_endpoint(effective) or (
            scheme == "az" and bool(config.get("use_emulator"))
        )
    if allow_http:
        client["allow_http"] = True
    if not options.verify:
        client["allow_invalid_certificates"] = True
    ca_bundle = options.ca_bundle or os.environ.get("SSL_CERT_FILE")
    if ca_bundle and options.verify:
        with open(ca_bundle, "rb") as f:
            client["root_certificate"] = f.read()
    if options.headers:
        client["default_headers"] = dict(options.headers)
    return config, client


def unmatched_refusal(
    scheme: str, bucket: str, configured: Iterable[tuple[str, StorageOptions]]
) -> str | None:
    """Why a URL that matched no configured prefix must not be sent, or ``None`` if it may.

    A bucket name one letter off a bucket configured with a private endpoint would otherwise
    go, with the same credentials from the environment, to the cloud's public endpoint.
    """
    if env_endpoint(scheme):
        return None  # the environment names a default endpoint: that is where it goes
    private = sorted(
        prefix
        for prefix, options in configured
        if prefix.lower().startswith(f"{scheme}://") and options.endpoint
    )
    if not private:
        return None
    return (
        f"{scheme}://{bucket} matches no configured prefix, while {', '.join(private)} "
        f"{'is' if len(private) == 1 else 'are'} configured with a custom endpoint: this request "
        f"would go to the public {scheme}:// endpoint instead. A typo in the bucket name? If the "
        f"public endpoint is meant, say so: asyncload.configure('{scheme}://{bucket}') (or "
        f"asyncload.configure('{scheme}://') for every other bucket)"
    )
