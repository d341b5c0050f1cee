"""Which tenant (training job) a caller is: its bearer token, looked up in the server's tenant table.

The YAML file's `tenants:` section names each tenant with its token (a file, or an environment variable), its
weight and its limits; callers without a tenant's token (no auth, or the shared REWARDMESH_AUTH_TOKEN) are the
`default` tenant, which the section may configure too (it has no token of its own):

    tenants:
      job-a: {token_file: /var/run/secrets/rewardmesh/job-a, weight: 2, max_in_flight: 8192}
      job-b: {token_env: JOB_B_TOKEN, weight: 1, max_queue_share: 0.5}
      default: {weight: 0.5}

With auth on (a shared token, server/auth.py), a tenant's token passes it too and any other token is refused;
with auth off, tokens only tell tenants apart, and a caller with no tenant's token is the default tenant.
Tokens are held as SHA-256 digests and looked up by digest, so a lookup's time says nothing about a token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from rewardmesh.common.channels import read_token
from rewardmesh.reward_engine.fair_queue import Tenant

DEFAULT = "default"
_OPTIONS = sorted({f.name for f in fields(Tenant) if f.init} - {"name"} | {"token_file", "token_env"})


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


class TenantTable:
    """token -> tenant, and the default tenant for every other caller."""

    def __init__(self, tenants: Iterable[tuple[Tenant, str]] = (), default: Tenant | None = None) -> None:
        self.default = default or Tenant(DEFAULT)
        self._by_digest: dict[bytes, Tenant] = {}
        self.tokens: list[str] = []
        self.tenants: list[Tenant] = [self.default]
        for tenant, token in tenants:
            if tenant.name == self.default.name or any(t.name == tenant.name for t in self.tenants):
                raise ValueError(f"tenants.{tenant.name}: defined twice")
            digest = _digest(token)
            if digest in self._by_digest:
                raise ValueError(f"tenants.{tenant.name}: has the same token as tenants.{self._by_digest[digest].name}")
            self._by_digest[digest] = tenant
            self.tokens.append(token)
            self.tenants.append(tenant)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> TenantTable:
        """The table of the YAML `tenants:` mapping (None or empty: only the default tenant)."""
        if config is None:
            return cls()
        if not isinstance(config, Mapping):
            raise ValueError("tenants: must be a mapping of tenant name -> {token_file | token_env, weight, ...}")
        default: Tenant | None = None
        named: list[tuple[Tenant, str]] = []
        for name, spec in config.items():
            where = f"tenants.{name}"
            spec = dict(spec or {})
            unknown = sorted(set(spec) - set(_OPTIONS))
            if unknown:
                raise ValueError(f"{where}: unknown option(s) {unknown} (known: {_OPTIONS})")
            token_file, token_env = str(spec.pop("token_file", "")), str(spec.pop("token_env", ""))
            try:
                tenant = Tenant(str(name), **spec)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{where}: {exc}") from None
            if name == DEFAULT:
                if token_file or token_env:
                    raise ValueError(f"{where}: the default tenant has no token (it is whoever has no tenant token)")
                default = tenant
                continue
            if not token_file and not token_env:
                raise ValueError(f"{where}: needs token_file or token_env (the bearer token its callers send)")
            token = read_token(token_file, token_env, f"{where}.token_file")
            if not token:
                raise ValueError(f"{where}: token_env {token_env} is not set or empty")
            named.append((tenant, token))
        return cls(named, default)

    def of_metadata(self, metadata: Iterable[tuple[str, Any]] | None) -> Tenant:
        """The tenant of a call's invocation metadata (its `authorization: Bearer <token>`)."""
        if not self._by_digest or not metadata:
            return self.default
        for key, value in metadata:
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                if given.startswith(b"Bearer "):
                    return self._by_digest.get(_digest(given[7:]), self.default)
        return self.default

    def of(self, context: Any) -> Tenant:
        """The tenant of a gRPC call (its ServicerContext; None for an in-process caller: the default)."""
        if context is None or not self._by_digest:
            return self.default
        return self.of_metadata(context.invocation_metadata())
