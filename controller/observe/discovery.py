"""Which workers and routers to observe, and in which role.

- static lists from the config: ``[prefill_pool].nodes``, ``[decode_pool].nodes`` (the PPD
  file operators already write) and ``[routers].metrics_targets``;
- a DNS name that resolves to several addresses (a Kubernetes headless service):
  ``dns+NAME:PORT`` in any of those lists expands to one target per address;
- Prometheus' own targets (``/api/v1/targets``): the role comes from a target label
  (``role`` by default: ``prefill`` | ``decode`` | ``router``), else from the job name.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from controller.config import DNS_PREFIX
from controller.errors import ConfigError, TransientError
from controller.observe.source import Target, TargetRole

ROLES: tuple[TargetRole, ...] = ("prefill", "decode", "router")


class NameUnresolved(TransientError):
    """A ``dns+`` name does not resolve (yet): a headless service with no ready pod has no
    address, and the workers may start after the controller. Asked again, not fatal."""


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"target {address!r} must be HOST:PORT")
    return host.strip("[]"), int(port)


def resolve_all(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, as ``HOST:PORT`` (IPv6 in brackets), sorted."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise NameUnresolved(f"cannot resolve {host!r}: {e}") from None
    out = set()
    for family, _, _, _, sockaddr in infos:
        addr = str(sockaddr[0])
        out.add(f"[{addr}]:{port}" if family == socket.AF_INET6 else f"{addr}:{port}")
    return sorted(out)


def expand(address: str) -> list[str]:
    if not address.startswith(DNS_PREFIX):
        split_host_port(address)
        return [address]
    host, port = split_host_port(address[len(DNS_PREFIX):])
    return resolve_all(host, port)


def static_targets(
    prefill: Iterable[str], decode: Iterable[str], routers: Iterable[str]
) -> list[Target]:
    """Targets from static lists; ``dns+`` names expand; duplicates keep their first role."""
    out: list[Target] = []
    seen: set[str] = set()
    for role, addresses in (("prefill", prefill), ("decode", decode), ("router", routers)):
        for address in addresses:
            for name in expand(address):
                if name not in seen:
                    seen.add(name)
                    out.append(Target(name=name, role=role))  # type: ignore[arg-type]
    return out


def targets_from_settings(settings: Any) -> list[Target]:
    """The static targets of a loaded :class:`controller.config.Settings`."""
    return static_targets(
        settings.prefill_pool.nodes, settings.decode_pool.nodes,
        settings.routers.metrics_targets,
    )


async def static_targets_async(
    prefill: Iterable[str], decode: Iterable[str], routers: Iterable[str]
) -> list[Target]:
    """:func:`static_targets` off the event loop (DNS lookups block)."""
    return await asyncio.to_thread(static_targets, list(prefill), list(decode), list(routers))


def role_of(labels: Mapping[str, str], role_label: str = "role") -> TargetRole | None:
    value = labels.get(role_label, "").lower()
    if value in ROLES:
        return value
    job = labels.get("job", "").lower()
    for role in ROLES:
        if role in job:
            return role
    return None


def targets_from_prometheus(
    active_targets: Sequence[Mapping[str, Any]], role_label: str = "role"
) -> list[Target]:
    """Targets from ``/api/v1/targets`` ``activeTargets``; those with no role are skipped."""
    out: dict[str, Target] = {}
    for t in active_targets:
        labels = t.get("labels", {})
        instance = labels.get("instance")
        role = role_of(labels, role_label)
        if instance and role and instance not in out:
            out[instance] = Target(name=instance, role=role, url=str(t.get("scrapeUrl", "")))
    return sorted(out.values(), key=lambda x: (ROLES.index(x.role), x.name))
