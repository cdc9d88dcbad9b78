"""Who a peer is, and which tenant it belongs to.

A peer's identity is what its transport proved, never what it says: the unix user of an
``ipc://`` peer (the kernel's peer credentials), ``uid:<n>``; the public key of a CURVE
peer, ``curve:<Z85 key>``; or ``insecure`` for plain tcp the operator allowed. Tenancy is
the operator's config: each tenant lists its identities and owns one key prefix, which
the sidecar forces on every key of its engines. Without tenants the sidecar serves one
tenant, whose engines choose their ``cache_prefix`` as vLLM's do.

Both are read at start; a change takes a restart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.core.config import TenantConfig

__all__ = ["INSECURE", "Peer", "Tenancy", "Tenant"]

INSECURE = "insecure"
"""The identity of every plain-tcp peer, where the operator allows plain tcp."""


@dataclass(frozen=True, slots=True)
class Peer:
    """A connection's proven identity. ``pid`` and ``uid``: the kernel's credentials of
    the peer process, where the transport has them (``ipc://``); None over tcp."""

    principal: str
    pid: int | None = None
    uid: int | None = None


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant. ``key_prefix``: the prefix forced on its keys; None: its engines'
    ``cache_prefix`` stands (the single tenant, and operators outside any tenant)."""

    name: str
    key_prefix: str | None


SINGLE = Tenant("default", None)
OPERATORS = Tenant("operators", None)


class Tenancy:
    """Which identities the sidecar admits, and each one's tenant."""

    def __init__(self, tenants: Mapping[str, TenantConfig], operators: Sequence[str], *,
                 any_curve_key: bool = True, insecure: bool = False) -> None:
        """``any_curve_key``: without tenants, every key CURVE admitted is served.
        ``insecure``: plain-tcp peers are served (the operator allowed them)."""
        self._operators = frozenset(operators)
        self._tenants = {
            identity: Tenant(name, tenant.key_prefix or name)
            for name, tenant in tenants.items() for identity in tenant.identities
        }
        self.multi = bool(tenants)
        self._any_curve_key = any_curve_key and not self.multi
        self._insecure = insecure

    def admits(self, principal: str) -> bool:
        """Whether a peer of this identity is served at all."""
        if principal in self._operators or principal in self._tenants:
            return True
        if self.multi:
            return False
        if principal == INSECURE:
            return self._insecure
        return self._any_curve_key and principal.startswith("curve:")

    def is_operator(self, principal: str) -> bool:
        return principal in self._operators

    def tenant_of(self, principal: str) -> Tenant:
        """The tenant of an admitted identity."""
        tenant = self._tenants.get(principal)
        if tenant is not None:
            return tenant
        return OPERATORS if self.multi else SINGLE
