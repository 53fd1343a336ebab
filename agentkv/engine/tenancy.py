"""Who is calling the server: API-key authentication and tenant namespaces.

Like vLLM's ``--api-key`` / ``VLLM_API_KEY``: when keys are configured, every ``/v1`` route
needs ``Authorization: Bearer <key>``. Each key is one tenant. A tenant and the request's
optional ``cache_salt`` (vLLM's request field, also read by SGLang) make one *namespace*:
the prefix cache, session ids, method state and session telemetry are kept per namespace,
so one tenant can neither hit nor observe another's cached prompts. Without keys, every
caller is the same (anonymous) tenant and only ``cache_salt`` separates them.

Namespaces are opaque ids: a keyed hash (a per-process random key) of the tenant and the
salt, never shown to clients.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from typing import Literal

API_KEY_ENV = "AGENTKV_API_KEY"
ADMIN_API_KEY_ENV = "AGENTKV_ADMIN_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: far above any prompt the model's context holds
#: what the embedded (text-only) engine does with image content parts
ImageParts = Literal["drop", "reject"]


@dataclass(frozen=True)
class ServerOptions:
    """Per-server security and limits (``agentkv serve`` flags).

    Attributes:
        api_keys: accepted bearer tokens, one tenant each; empty: no authentication.
        admin_api_key: bearer token for admin routes (prefix-cache flush). ``None``: admin
            routes are open when ``api_keys`` is empty, closed otherwise.
        max_request_bytes: request bodies above this many bytes are rejected (HTTP 413)
            before they are parsed or tokenized.
        image_parts: what a text-only model does with image content parts: ``"drop"`` them
            from the prompt and count them in ``usage.agentkv.dropped_image_parts``, or
            ``"reject"`` the request (HTTP 400 naming the part).
    """

    api_keys: tuple[str, ...] = ()
    admin_api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    image_parts: ImageParts = "drop"

    @classmethod
    def from_env(
        cls,
        api_keys: list[str] | None = None,
        admin_api_key: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        image_parts: ImageParts = "drop",
    ) -> ServerOptions:
        """Options from flags, falling back to ``AGENTKV_API_KEY`` (comma-separated keys) and
        ``AGENTKV_ADMIN_API_KEY``."""
        keys = list(api_keys or [])
        if not keys and os.environ.get(API_KEY_ENV):
            keys = [k.strip() for k in os.environ[API_KEY_ENV].split(",") if k.strip()]
        admin = admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None
        return cls(tuple(keys), admin, max_request_bytes, image_parts)


class Tenancy:
    """Resolves a request's ``Authorization`` header to a tenant and its namespaces."""

    def __init__(self, options: ServerOptions):
        self.options = options
        self._secret = secrets.token_bytes(32)
        self._keys = [k.encode() for k in options.api_keys]

    @property
    def auth_required(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> str | None:
        """The caller's tenant id, or ``None`` when authentication is required and fails.
        Anonymous (no keys configured): ``""``."""
        if not self._keys:
            return ""
        token = _bearer(authorization)
        if token is None:
            return None
        hit = None
        for key in self._keys:  # compare against every key: time does not say which matched
            if hmac.compare_digest(token, key):
                hit = key
        return None if hit is None else hashlib.sha256(hit).hexdigest()

    def is_admin(self, authorization: str | None) -> bool:
        admin = self.options.admin_api_key
        if admin is None:
            return not self._keys
        token = _bearer(authorization)
        return token is not None and hmac.compare_digest(token, admin.encode())

    def namespace(self, tenant: str, cache_salt: str | None = None) -> str:
        """The opaque namespace of ``tenant`` with ``cache_salt`` (16 hex characters)."""
        data = f"{tenant}\x00{cache_salt or ''}".encode()
        return hashlib.blake2b(data, key=self._secret, digest_size=8).hexdigest()


def _bearer(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode()
