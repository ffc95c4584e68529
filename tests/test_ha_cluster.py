"""Two routers on a three-member etcd while etcd itself fails: its leader killed and
restarted, then the member every router asks first stopped and resumed, with traffic
throughout. Real processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import EtcdCluster, Server, start_router, stats

pytestmark = pytest.mark.slow

TTL = 2


@pytest.fixture()
def cluster() -> Iterator[EtcdCluster]:
    try:
        c = EtcdCluster(3)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    yield c
    c.stop()


class Traffic:
    """A client behind a load balancer that retries a router's 503 on the other one:
    every answer, with when it came."""

    def __init__(self, routers: list[Server]) -> None:
        self.routers = routers
        self.answers: list[tuple[float, int, bool]] = []  # (at, status, retry-after given)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            k = 0
            while not self._stop.is_set():
                r = self.routers[k % 2]
                try:
                    resp = c.post(r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                    resp.read()
                    self.answers.append(
                        (time.monotonic(), resp.status_code, "retry-after" in resp.headers)
                    )
                    if resp.status_code != 200:
                        k += 1  # the balancer tries the other router
                except httpx.HTTPError as e:
                    self.errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def longest_without_200(self, since: float) -> float:
        last, worst = since, 0.0
        for at, status, _ in self.answers:
            if at >= since and status == 200:
                worst = max(worst, at - last)
                last = at
        return worst


def test_etcd_leader_killed_and_a_member_stopped_under_traffic(
    cluster: EtcdCluster, scripted: Server, tmp_path: Path
) -> None:
    leader = cluster.leader()
    follower = next(m for m in cluster.members if m is not leader)
    # The routers ask a follower first: the one that will hang.
    urls = [follower.url] + [m.url for m in cluster.members if m is not follower]
    endpoints = ", ".join(f"'{u}'" for u in urls)
    text = (
        "listen: {port: $PORT}\nadmission: open\nhealth: {interval_s: 0.2}\n"
        f"ha: {{etcd: [{endpoints}], key: /c/leader, lease_ttl_s: {TTL}}}\n"
        f"engines:\n  - {{name: s, url: '{scripted.url}'}}\n"
    )
    a = start_router(tmp_path, text)
    b = start_router(tmp_path, text, wait_ready=False)
    before = stats(scripted)
    seen_before = len(before["fences"])
    traffic = Traffic([a, b])
    gaps = {}
    try:
        time.sleep(1)
        # A follower that hangs (stopped, not refusing) while the cluster keeps its quorum
        # and its leader: each call to it costs a whole timeout.
        t0 = time.monotonic()
        follower.pause()
        time.sleep(4)
        follower.resume()
        time.sleep(2)
        gaps["follower stopped"] = traffic.longest_without_200(t0)
        t0 = time.monotonic()
        m = cluster.leader()
        m.kill()
        time.sleep(3)
        m.spawn()
        time.sleep(3)
        gaps["leader killed"] = traffic.longest_without_200(t0)
    finally:
        traffic.stop()
        a.stop()
        b.stop()
    after = stats(scripted)
    assert not traffic.errors, traffic.errors[:3]
    served = sum(1 for _, status, _ in traffic.answers if status == 200)
    refused = [(s, ra) for _, s, ra in traffic.answers if s != 200]
    assert all(s in (429, 503) and ra for s, ra in refused), refused[:5]
    # Everything placed reached the engine once, and the engine saw tokens only rise: never
    # a deposed leader's request after its successor's.
    tokens = [int(t) for t in after["fences"][seen_before:]]
    assert len(tokens) == served == after["requests"] - before["requests"]
    assert tokens == sorted(tokens)
    # A hanging follower costs one timeout once, not one per call: no outage.
    assert gaps["follower stopped"] < 0.5, gaps
    # etcd elects a new leader within about a second (its election timeout); a router whose
    # renewals failed meanwhile is fenced and leads again once etcd answers.
    assert gaps["leader killed"] <= TTL + 0.75 + 1.5, gaps
    print(f"served {served}, refused {len(refused)}, longest gaps {gaps}")
