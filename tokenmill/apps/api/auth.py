"""Bearer API keys and their tenants. Keys are compared as SHA-256 hashes, so a key file never holds a key."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from tokenmill.apps.api.errors import APIError
from tokenmill.apps.api.settings import ServeSettings

#: The one tenant of a server started with `--insecure-no-auth`.
OPEN_TENANT = "default"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Keys:
    """Key hash -> tenant, from `TOKENMILL_API_KEYS` and `TOKENMILL_API_KEYS_FILE`; empty with `insecure`."""

    def __init__(self, settings: ServeSettings, insecure: bool = False) -> None:
        self.insecure = insecure
        self.tenants: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in (settings.api_keys or "").split(","))):
            tenant, sep, key = item.partition("=")
            key = key if sep else tenant
            self.tenants[key_hash(key)] = tenant if sep else key_hash(key)[:16]
        if settings.api_keys_file:
            self._read_file(Path(settings.api_keys_file))

    def _read_file(self, path: Path) -> None:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            digest = parts[-1].removeprefix("sha256:").lower()
            if len(parts) > 2 or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"{path}:{number}: expected 'TENANT sha256:<64 hex digits>'")
            self.tenants[digest] = parts[0] if len(parts) == 2 else digest[:16]

    def __bool__(self) -> bool:
        return bool(self.tenants)

    def tenant(self, authorization: str | None) -> str:
        """The tenant of an `Authorization: Bearer <key>` header; 401 in OpenAI's shape otherwise."""
        if self.insecure and not self.tenants:
            return OPEN_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "You didn't provide an API key (Authorization: Bearer <key>).", code="invalid_api_key")
        digest = key_hash(key.strip())
        for known, tenant in self.tenants.items():
            if hmac.compare_digest(known, digest):
                return tenant
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
