"""What an engine that joins at runtime (admin API, etcd, DNS) may name: an API-key
variable only from the config file's list (`engines_from.api_key_envs`), and an address
the destination policy allows (`engines_from.allow`).

Whoever can write under the etcd prefix (or learns the admin token) chooses these engines'
URLs, and the router then connects to them, probes them, and sends them the engine key.
Without the first rule a registrant names the admin token's variable as its key and
receives the secret; without the second it points the router at the cloud's metadata
service (link-local), at the router's own etcd, or at any port the router can reach.

Addresses are checked where the connection is made, on every address a name resolves to
(a name that resolves elsewhere later is checked again), and an IP literal already when the
engine is described, so that the admin API refuses it at once. Config-file engines are the
operator's own and are not checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from urllib.parse import urlsplit

Address = IPv4Address | IPv6Address
Network = IPv4Network | IPv6Network

# Refused by default: the metadata services (169.254.169.254, fd00:ec2::254 sits in ULA
# space and is the operator's to allow), link-local neighbours, and addresses that are no
# single host.
LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))


class Refused(ValueError):
    """Why an engine's key variable or address is not allowed (`field`: which)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """CIDRs as networks; ValueError naming the first that is none."""
    out = []
    for c in cidrs:
        try:
            out.append(ipaddress.ip_network(c, strict=False))
        except ValueError:
            raise ValueError(f"{c[:64]!r} is not a CIDR (10.0.0.0/8, fd00::/8)") from None
    return tuple(out)


@dataclass(frozen=True)
class Rules:
    key_envs: frozenset[str] = frozenset()
    allow: tuple[Network, ...] = ()  # empty: any address but the refused ones
    # host:port the router itself uses (its etcd endpoints, its own listener): never an engine.
    own: tuple[tuple[str, int], ...] = ()
    _own: dict[tuple[str, int], list[Address]] = field(default_factory=dict, compare=False)

    def key_env(self, name: str) -> None:
        if name not in self.key_envs:
            raise Refused(
                f"'api_key_env' {name[:128]!r} is not one the config file lists for engines "
                "added at runtime (engines_from.api_key_envs)",
                "api_key_env",
            )

    def literal(self, url: str) -> None:
        """A URL whose host is an IP literal, checked now (a name is checked on connect)."""
        host, port = _host_port(url)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return
        why = self._refused(ip, port, self._own_literals())
        if why is not None:
            raise Refused(f"'url' points at {why}", "url")

    async def resolve(self, host: str, port: int) -> list[str]:
        """The addresses `host` resolves to that an engine may be at, in the resolver's
        order; Refused when there is none, naming why."""
        loop = asyncio.get_running_loop()
        own = await self._own_addresses()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise Refused(f"{host}: {e.strerror or e}", "url") from None
        allowed, why = [], None
        for info in infos:
            ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
            refused = self._refused(ip, port, own)
            if refused is None:
                allowed.append(str(ip))
            else:
                why = refused
        if not allowed:
            raise Refused(f"{host}:{port} is {why or 'no address'}", "url")
        return allowed

    def _refused(self, ip: Address, port: int, own: list[tuple[Address, int]]) -> str | None:
        if ip.is_unspecified or ip.is_multicast:
            return f"{ip}: not one host"
        for o, p in own:
            if p == port and (o == ip or (ip.is_loopback and (o.is_loopback or o.is_unspecified))):
                return f"{ip}:{port}, which the router itself uses (etcd, or its own listener)"
        if self.allow:
            if not any(ip.version == n.version and ip in n for n in self.allow):
                return f"{ip}: outside engines_from.allow"
            return None
        if any(ip.version == n.version and ip in n for n in LINK_LOCAL):
            return f"{ip}: link-local (a metadata service); list it in engines_from.allow"
        return None

    def _own_literals(self) -> list[tuple[Address, int]]:
        """The router's own endpoints that need no resolver to compare."""
        out: list[tuple[Address, int]] = []
        for host, port in self.own:
            if host == "localhost":
                out += [
                    (ipaddress.ip_address("127.0.0.1"), port),
                    (ipaddress.ip_address("::1"), port),
                ]
                continue
            with contextlib.suppress(ValueError):  # a name: resolved when it is compared
                out.append((ipaddress.ip_address(host), port))
        return out

    async def _own_addresses(self) -> list[tuple[Address, int]]:
        out = []
        loop = asyncio.get_running_loop()
        for host, port in self.own:
            got = self._own.get((host, port))
            if got is None:
                try:
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                    got = [ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos]
                except OSError:
                    got = []  # tried again next time
                if got:
                    self._own[(host, port)] = got
            out += [(a, port) for a in got]
        return out


def own_endpoints(urls: Iterable[str], listen: tuple[str, int]) -> tuple[tuple[str, int], ...]:
    """The host:port pairs of the router's etcd endpoints and its own listener."""
    out = [_host_port(u) for u in urls]
    return (*out, listen)


def _host_port(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    try:
        port = u.port
    except ValueError:
        port = None
    return u.hostname or "", port or (443 if u.scheme == "https" else 80)
