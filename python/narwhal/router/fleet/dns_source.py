"""Engines at the addresses a DNS name resolves to (a Kubernetes headless Service: one A or
AAAA record a ready pod).

Every `every_s` the name is resolved; an address that appeared is an engine added
(`LABEL-ADDRESS`, the name's first label), one that went is drained. A failed resolution
changes nothing: the last good set keeps serving and `error` says why (`/ready`). Without
a `nameserver` the system's resolver answers (getaddrinfo, in its thread pool); with one,
a query of our own (`query`), so a test or a cluster's DNS can be named: over UDP with
EDNS0 (answers up to 4,096 bytes), again over TCP when the answer comes truncated, and an
answer that is not a response to our question (its ID, its question, the response bit) is
no answer. A truncated answer never drains anything. One name adds at most `MAX_ENGINES`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import struct

from narwhal.router.config import DnsSourceSpec as Config
from narwhal.router.config import EngineSpec
from narwhal.router.fleet.membership import Conflict, Membership

log = logging.getLogger("narwhal.fleet")

TIMEOUT_S = 2.0
A, AAAA = 1, 28
OPT = 41
EDNS_PAYLOAD = 4096  # what we can take over UDP (RFC 6891); more comes over TCP
MAX_ENGINES = 256  # engines one name may bring: an answer is no way to flood the pool


class DnsError(Exception):
    pass


class Truncated(DnsError):
    """The answer did not fit: it says nothing of the addresses left out."""


class DnsSource:
    def __init__(self, config: Config, membership: Membership) -> None:
        self.config = config
        self.membership = membership
        self.label = config.name.split(".", 1)[0]
        self.error: str | None = "not resolved yet"

    async def follow_forever(self) -> None:
        while True:
            try:
                addresses = await self.resolve()
            except (DnsError, OSError) as e:
                if self.error is None:
                    log.warning("engines from DNS %s: %s", self.config.name, e)
                self.error = f"DNS {self.config.name}: {e} (the last good set serves)"
            else:
                self.error = None
                self._match(addresses)
            await asyncio.sleep(self.config.every_s)

    async def resolve(self) -> set[str]:
        c = self.config
        if c.nameserver is None:
            loop = asyncio.get_running_loop()
            infos = await loop.getaddrinfo(c.name, c.port, type=socket.SOCK_STREAM)
            return {str(info[4][0]) for info in infos}
        server = nameserver(c.nameserver)
        found: set[str] = set()
        for qtype in (A, AAAA):
            found |= await query(c.name, qtype, server)
        return found

    def _match(self, addresses: set[str]) -> None:
        c = self.config
        if len(addresses) > MAX_ENGINES:
            # Those serving stay; new ones fill what is left, in a stable order.
            have = {
                a
                for a in addresses
                if f"{self.label}-{a.replace(':', '_')}" in self.membership.names("dns")
            }
            rest = sorted(addresses - have)
            kept = set(sorted(have)[:MAX_ENGINES])
            addresses = kept | set(rest[: MAX_ENGINES - len(kept)])
            log.warning(
                "engines from DNS %s: the answer lists more than %d addresses; %d taken",
                c.name,
                MAX_ENGINES,
                MAX_ENGINES,
            )
        wanted = {}
        for addr in addresses:
            host = f"[{addr}]" if ":" in addr else addr
            name = f"{self.label}-{addr.replace(':', '_')}"
            wanted[name] = EngineSpec(
                name,
                c.dialect,
                f"http://{host}:{c.port}",
                None,
                c.api_key_env,
                c.models,
                c.discover,
            )
        for spec in wanted.values():
            try:
                self.membership.add(spec, "dns")
            except Conflict as e:
                log.warning("engines from DNS: %s", e)
        for name in self.membership.names("dns") - set(wanted):
            self.membership.drain(name, f"{c.name} no longer resolves to it")


async def query(name: str, qtype: int, server: tuple[str, int]) -> set[str]:
    """The addresses of one A or AAAA query to `server`; DnsError on no answer, a bad
    one, or an error code (NXDOMAIN included: no pod is ready, say)."""
    ident = secrets.randbits(16)
    qname = _qname(name)
    packet = struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 1) + qname
    packet += struct.pack(">HH", qtype, 1)
    # EDNS0: an OPT record (root name, our UDP payload size, no flags, no options).
    packet += b"\0" + struct.pack(">HHIH", OPT, EDNS_PAYLOAD, 0, 0)
    try:
        return parse_answer(await _udp(packet, ident, server), qtype, qname, ident)
    except Truncated:
        return parse_answer(await _tcp(packet, server), qtype, qname, ident)


async def _udp(packet: bytes, ident: int, server: tuple[str, int]) -> bytes:
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[bytes] = loop.create_future()

    class _Client(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: object) -> None:
            if not answer.done() and len(data) >= 2 and struct.unpack(">H", data[:2])[0] == ident:
                answer.set_result(data)

        def error_received(self, exc: Exception) -> None:
            if not answer.done():
                answer.set_exception(exc)

    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    transport, _ = await loop.create_datagram_endpoint(_Client, remote_addr=server, family=family)
    try:
        transport.sendto(packet)
        try:
            data = await asyncio.wait_for(answer, TIMEOUT_S)
        except asyncio.TimeoutError:
            raise DnsError(f"no answer from {server[0]}:{server[1]}") from None
    finally:
        transport.close()
    return data


async def _tcp(packet: bytes, server: tuple[str, int]) -> bytes:
    """The same query over TCP (RFC 7766): each message after its 2-byte length."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(server[0], server[1]), TIMEOUT_S
        )
    except (OSError, asyncio.TimeoutError) as e:
        raise DnsError(
            f"truncated over UDP, and TCP to {server[0]}:{server[1]} failed: {e}"
        ) from None
    try:
        writer.write(struct.pack(">H", len(packet)) + packet)
        size = struct.unpack(">H", await asyncio.wait_for(reader.readexactly(2), TIMEOUT_S))[0]
        return await asyncio.wait_for(reader.readexactly(size), TIMEOUT_S)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
        raise DnsError(f"truncated over UDP, and no answer over TCP: {e!r}") from None
    finally:
        writer.close()


def nameserver(spec: str) -> tuple[str, int]:
    """`host`, `host:port` or `[v6 address]:port` as (host, port); port 53 unless given."""
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif spec.count(":") == 1:
        host, _, port = spec.partition(":")
    else:
        host, port = spec, ""
    return host, int(port) if port.isdigit() and 0 < int(port) < 65536 else 53


def _qname(name: str) -> bytes:
    out = b""
    for label in name.rstrip(".").split("."):
        try:
            raw = label.encode("idna") if label else b""
        except UnicodeError:
            raise DnsError(f"{name!r} is not a DNS name") from None
        if not 0 < len(raw) < 64:
            raise DnsError(f"{name!r} is not a DNS name")
        out += bytes([len(raw)]) + raw
    return out + b"\0"


def parse_answer(
    data: bytes, qtype: int, qname: bytes | None = None, ident: int | None = None
) -> set[str]:
    """The A or AAAA addresses in a DNS response (every other record skipped). With the
    question's `qname` and `ident`: DnsError unless it answers that question (Truncated
    when it did not fit)."""
    try:
        got, flags, qd, an, _, _ = struct.unpack(">HHHHHH", data[:12])
        if not flags & 0x8000:
            raise DnsError("not a response")
        if ident is not None and got != ident:
            raise DnsError("an answer to another query")
        rcode = flags & 0xF
        if rcode:
            raise DnsError(f"the name server answered with code {rcode}")
        if flags & 0x0200:
            raise Truncated("the answer was truncated")
        at = 12
        if qname is not None:
            end = _skip_name(data, at)
            if qd != 1 or data[at:end].lower() != qname.lower():
                raise DnsError("an answer to another question")
            if struct.unpack(">HH", data[end : end + 4]) != (qtype, 1):
                raise DnsError("an answer to another question")
            at = end + 4
        else:
            for _ in range(qd):
                at = _skip_name(data, at) + 4
        found = set()
        for _ in range(an):
            at = _skip_name(data, at)
            rtype, _, _, size = struct.unpack(">HHIH", data[at : at + 10])
            at += 10
            rdata = data[at : at + size]
            if len(rdata) != size:
                raise DnsError("a truncated record")
            at += size
            if rtype == qtype == A and size == 4:
                found.add(str(ipaddress.IPv4Address(rdata)))
            elif rtype == qtype == AAAA and size == 16:
                found.add(str(ipaddress.IPv6Address(rdata)))
        return found
    except (struct.error, IndexError) as e:
        raise DnsError(f"a malformed answer: {e}") from None


def _skip_name(data: bytes, at: int) -> int:
    """The offset after the (possibly compressed) name at `at`."""
    for _ in range(128):  # labels a name may have; a loop of pointers ends here too
        n = data[at]
        if n == 0:
            return at + 1
        if n & 0xC0 == 0xC0:
            return at + 2
        at += 1 + n
    raise DnsError("a name too long")
