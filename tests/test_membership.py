"""Membership in-process (router/fleet/): engines joining and leaving the pool, the
policy's picture and profiles following them, and what runtime sources parse."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.router.config import DnsSourceSpec as DnsConfig
from narwhal.router.config import EngineSpec
from narwhal.router.engines import Engine, Pool
from narwhal.router.fleet import spec as specs
from narwhal.router.fleet.dns_source import (
    MAX_ENGINES,
    A,
    DnsError,
    DnsSource,
    _qname,
    nameserver,
    parse_answer,
    query,
)
from narwhal.router.fleet.membership import Conflict, Hooks, Membership
from narwhal.router.fleet.rules import Refused, Rules, networks, own_endpoints
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.policies.prefix_cache import PrefixCache
from narwhal.router.predict import Predictor
from tests.test_placement import request, words


def _engine(name: str) -> Engine:
    return Engine(EngineSpec(name, url=f"http://{name}"), f"http://{name}", healthy=True)


def _spec(name: str, url: str | None = None) -> EngineSpec:
    return EngineSpec(name, url=url or f"http://{name}")


def test_a_new_engine_starts_from_the_fleets_median_profile_and_is_probed_first() -> None:
    fleet = [_engine(n) for n in ("a", "b", "c")]
    p = Predictor(fleet)
    for e, rate in zip(fleet, (100.0, 200.0, 900.0), strict=True):
        p.profiles[e.name].prefill_tps = rate
        p.profiles[e.name].bytes_per_token = 4.0
    p.add(_engine("d"))
    new = p.profiles["d"]
    assert new.prefill_tps == 200.0 and new.bytes_per_token == 4.0
    assert new.measured_at is None  # the profiler measures it before any other
    assert p.project(4000, _engine("d")).total_s == pytest.approx(1000 / 200.0)


def test_an_engine_that_left_takes_its_picture_and_ledger_with_it() -> None:
    fleet = [_engine(n) for n in ("e0", "e1")]
    predictor = Predictor(fleet)
    for prof in predictor.profiles.values():
        prof.prefill_tps, prof.bytes_per_token = 1000.0, 5.0
    cache = PrefixCache(fleet, tokens_per_engine=100_000, block_bytes=256)
    policy = PredictivePolicy(predictor, fleet, cache, tpot_target_s=0.1)
    system = words("sys", 1000)
    cache.placed("e1", cache.blocks(request(system).prefix_text()))
    plan = policy.judge(request(system + " q"), fleet, 5.0)
    assert plan.prefer is fleet[1]  # its prefix is there
    policy.removed(fleet[1])
    newcomer = _engine("e2")
    policy.added(newcomer)
    assert cache.names == ["e0", "e2"]  # the slot is reused, empty
    live = [fleet[0], newcomer]
    plan = policy.judge(request(system + " q"), live, 5.0)
    assert "e2" not in plan.expected and plan.tokens >= 1000
    assert set(policy.streams) == {"e0", "e2"}


def test_membership_adds_drains_and_removes_and_a_name_comes_back_after_its_drain() -> None:
    async def run() -> None:
        a = _engine("a")
        pool = Pool([a], prefill_limit=4, decode_limit=4)
        hooks = Hooks()
        seen: list[str] = []
        hooks.added.append(lambda e: seen.append(f"+{e.name}"))
        hooks.removed.append(lambda e: seen.append(f"-{e.name}"))
        m = Membership(pool, drain_timeout_s=60, hooks=hooks)
        drains = asyncio.create_task(m.drain_forever())
        b = m.add(_spec("b"), "admin")
        assert b is not None and b in pool.engines and m.add(_spec("b"), "admin") is b
        with pytest.raises(Conflict):
            m.add(_spec("b", "http://elsewhere"), "admin")
        a.prefill = 1  # a request in flight holds `a` in the pool while it drains
        m.drain("a", "test")
        assert a.state == "draining" and a not in pool.eligible()
        assert m.add(_spec("a", "http://a2"), "admin") is None  # waits for the drain
        await asyncio.sleep(0.3)
        assert a in pool.engines
        a.prefill = 0
        for _ in range(50):
            if a not in pool.engines:
                break
            await asyncio.sleep(0.05)
        back = pool.named("a")
        assert back is not None and back is not a and back.url == "http://a2"
        assert seen == ["+b", "-a", "+a"]
        drains.cancel()

    asyncio.run(run())


@given(st.binary(max_size=600))
def test_a_dns_answer_of_any_bytes_parses_or_is_a_dns_error(data: bytes) -> None:
    try:
        out = parse_answer(data, 1)
    except DnsError:
        return
    assert isinstance(out, set)


def test_a_dns_answer_gives_its_addresses() -> None:
    head = bytes.fromhex("abcd818000010002 00000000".replace(" ", ""))
    question = b"\x07engines\x04test\x00\x00\x01\x00\x01"
    records = b"".join(
        b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x05\x00\x04" + bytes(ip)
        for ip in ([10, 0, 0, 1], [10, 0, 0, 2])
    )
    assert parse_answer(head + question + records, 1) == {"10.0.0.1", "10.0.0.2"}
    assert nameserver("10.0.0.53") == ("10.0.0.53", 53)
    assert nameserver("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert nameserver("[fd00::53]:5300") == ("fd00::53", 5300)


@given(st.binary(max_size=300))
def test_an_engine_value_of_any_bytes_parses_or_is_refused_with_a_reason(raw: bytes) -> None:
    try:
        spec = specs.parse(raw, "n")
    except specs.BadSpec as e:
        assert str(e)
        return
    assert spec.name == "n" and spec.url is not None


@given(
    st.dictionaries(
        st.sampled_from(["name", "url", "dialect", "api_key_env", "other"]),
        st.one_of(st.text(max_size=40), st.integers(), st.none(), st.booleans()),
    )
)
def test_an_engine_of_any_shape_parses_or_is_refused_with_a_reason(body: dict[str, object]) -> None:
    try:
        spec = specs.of(body)
    except specs.BadSpec as e:
        assert str(e)
        return
    assert spec.url is not None and spec.url.startswith(("http://", "https://"))


def test_the_kubernetes_example_holds_a_config_the_router_accepts() -> None:
    import yaml

    from narwhal.router.config import parse
    from tests.support import ROOT

    docs = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/fleet.yaml").read_text()))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    config = parse(yaml.safe_load(config_map["data"]["narwhal.yaml"]))
    service = next(d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP"))
    assert config.dns_source is not None and config.ha is not None
    # The routers resolve the engines' headless Service, on its port.
    assert config.dns_source.name.startswith(service["metadata"]["name"] + ".")
    assert config.dns_source.port == service["spec"]["ports"][0]["port"]


class _Dns:
    """A name server on loopback that answers over UDP with the truncation bit and no
    records (as a server must when 40 A records pass 512 bytes) and over TCP in full."""

    def __init__(self, addresses: list[str], udp_reply: Callable[[bytes], bytes] | None = None):
        self.addresses = addresses
        self.udp_reply = udp_reply
        self.queries: list[bytes] = []

    def answer(self, query: bytes, truncated: bool) -> bytes:
        ident, _, _, _, _, _ = struct.unpack(">HHHHHH", query[:12])
        end = query.index(b"\0", 12) + 5
        question = query[12:end]
        records = [] if truncated else self.addresses
        flags = 0x8180 | (0x0200 if truncated else 0)
        head = struct.pack(">HHHHHH", ident, flags, 1, len(records), 0, 0)
        body = b"".join(
            struct.pack(">HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(a) for a in records
        )
        return head + question + body

    async def start(self) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        dns = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                dns.queries.append(data)
                reply = dns.udp_reply(data) if dns.udp_reply else dns.answer(data, True)
                self.transport.sendto(reply, addr)  # type: ignore[attr-defined]

        async def tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            size = struct.unpack(">H", await reader.readexactly(2))[0]
            reply = self.answer(await reader.readexactly(size), False)
            writer.write(struct.pack(">H", len(reply)) + reply)
            await writer.drain()
            writer.close()

        self.tcp = await asyncio.start_server(tcp, "127.0.0.1", 0)
        port = self.tcp.sockets[0].getsockname()[1]
        self.udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=("127.0.0.1", port))
        return "127.0.0.1", port

    def stop(self) -> None:
        self.tcp.close()
        self.udp.close()


def test_a_dns_answer_too_large_for_udp_is_asked_again_over_tcp_with_edns0() -> None:
    many = [f"10.1.0.{i}" for i in range(1, 41)]

    async def run() -> None:
        dns = _Dns(many)
        server = await dns.start()
        try:
            assert await query("engines.test", A, server) == set(many)
            # EDNS0 offered: one additional record, an OPT (type 41) for the root name.
            (q,) = dns.queries
            assert struct.unpack(">H", q[10:12])[0] == 1 and q[-11:-8] == b"\0\0\x29"
        finally:
            dns.stop()

    asyncio.run(run())


def test_an_answer_to_another_question_or_no_response_drains_nothing() -> None:
    def other_question(query: bytes) -> bytes:
        ident = query[:2]
        head = ident + struct.pack(">HHHHH", 0x8180, 1, 0, 0, 0)  # success, no records
        return head + _qname("elsewhere.test") + struct.pack(">HH", 1, 1)

    def not_a_response(query: bytes) -> bytes:
        return query[:2] + struct.pack(">HHHHH", 0x0100, 0, 0, 0, 0)

    async def run(reply: Callable[[bytes], bytes]) -> None:
        dns = _Dns([], reply)
        server = await dns.start()
        try:
            with pytest.raises(DnsError):
                await query("engines.test", A, server)
        finally:
            dns.stop()

    for reply in (other_question, not_a_response):
        asyncio.run(run(reply))


def test_one_dns_answer_adds_at_most_max_engines() -> None:
    async def run() -> None:
        pool = Pool([], 4, 64)
        source = DnsSource(DnsConfig("engines.test", 8000), Membership(pool, 60.0))
        source._match({f"10.2.{i // 250}.{i % 250 + 1}" for i in range(MAX_ENGINES + 100)})
        assert len(pool.engines) == MAX_ENGINES
        serving = {e.name for e in pool.engines}
        # The next answer, as large, keeps those serving rather than trading them.
        source._match(
            {f"10.3.{i // 250}.{i % 250 + 1}" for i in range(50)}
            | {n.removeprefix("engines-") for n in serving}
        )
        assert {e.name for e in pool.engines if not e.draining} == serving

    asyncio.run(run())


def test_a_runtime_engine_is_held_to_the_config_files_rules() -> None:
    rules = Rules(
        frozenset({"ENGINE_KEY"}),
        networks(["10.0.0.0/8"]),
        own_endpoints(["http://10.0.0.5:2379"], ("0.0.0.0", 8000)),
    )
    ok = specs.parse(b'{"url": "http://10.0.0.7:8000", "api_key_env": "ENGINE_KEY"}', "n", rules)
    assert ok.api_key_env == "ENGINE_KEY"
    for body, field in (
        (b'{"url": "http://10.0.0.7:8000", "api_key_env": "NARWHAL_ADMIN_TOKEN"}', "api_key_env"),
        (b'{"url": "http://192.168.1.1:8000"}', "url"),  # outside allow
        (b'{"url": "http://10.0.0.5:2379"}', "url"),  # the router's own etcd
        (b'{"url": "http://u:p@10.0.0.7", "api_key_env": "ENGINE_KEY"}', "url"),  # two keys
    ):
        with pytest.raises(specs.BadSpec) as refused:
            specs.parse(body, "n", rules)
        assert refused.value.field == field, body
    # Without `allow`, anywhere but link-local; the same body without rules (the config
    # file's own engines, `narwhal register`'s value) is not held to them.
    assert specs.parse(b'{"url": "http://192.168.1.1:8000"}', "n", Rules()).url
    with pytest.raises(specs.BadSpec):
        specs.parse(b'{"url": "http://169.254.169.254"}', "n", Rules())

    async def resolved() -> None:
        # A name is checked on every address it resolves to, where the connection is made.
        assert await Rules().resolve("localhost", 80)
        with pytest.raises(Refused):
            await rules.resolve("localhost", 80)  # 127.0.0.1 is outside 10.0.0.0/8

    asyncio.run(resolved())
