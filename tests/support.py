"""What the tests and the benches share: real servers on loopback ports, started and always
stopped, and the HTTP helpers that read what they answer."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def simulated_engine(*args: str) -> Iterator[str]:
    """One simulated GPU engine (bench/fleet/server.py, the vLLM dialect, a prefix cache)
    on a free port, `args` its cost model's; its URL, for as long as the block runs."""
    with simulated_engines(1, *args) as urls:
        yield urls[0]


@contextlib.contextmanager
def simulated_engines(n: int, *args: str) -> Iterator[list[str]]:
    """`n` simulated GPU engines in one process, each on its own port; their URLs."""
    while True:  # n free ports in a row
        port = free_port()
        if all(_port_free(port + i) for i in range(1, n)):
            break
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.fleet.server",
            "--engines",
            str(n),
            "--port",
            str(port),
            *args,
        ],
        cwd=ROOT,
        start_new_session=True,
    )
    urls = [f"http://127.0.0.1:{port + i}" for i in range(n)]
    try:
        for url in urls:
            wait_http(url + "/health", sim, 30)
        yield urls
    finally:
        sim.terminate()
        sim.wait(10)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until(cond: Callable[[], bool], within: float) -> None:
    """Until `cond()` holds, polling; an AssertionError after `within` seconds."""
    end = time.monotonic() + within
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {within}s")
        time.sleep(0.05)


def wait_http(
    url: str, proc: subprocess.Popen[bytes], timeout: float = 60, status: int = 200
) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {url}")
        try:
            if httpx.get(url, timeout=1).status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


class Server:
    # Every server started and not yet stopped: a fixture that fails after starting one
    # (its warm-up asserting) never reaches its own stop, and the process outlived the run.
    live: set[Server] = set()

    def __init__(self, args: list[str], health: str, port: int, timeout: float = 60) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        # A file, not a pipe: a pipe nobody reads fills up (64 KiB of log lines) and then
        # blocks the server on its next write.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(
            args, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=self.log
        )
        Server.live.add(self)
        try:
            wait_http(self.url + health, self.proc, timeout)
        except Exception:
            self.stop()
            raise

    def stderr(self) -> str:
        """What the server wrote to stderr so far."""
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def stop(self) -> None:
        Server.live.discard(self)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@atexit.register
def _stop_the_rest() -> None:
    for server in list(Server.live):
        server.stop()


def start_engine(model: str, *extra: str) -> Server:
    port = free_port()
    return Server(
        [
            str(BIN / "lexi-engine"),
            "serve",
            "-m",
            model,
            "--port",
            str(port),
            "--ctx-size",
            "2048",
            *extra,
        ],
        "/health",
        port,
        timeout=120,
    )


def start_router(tmp: Path, yaml_text: str, wait_ready: bool = True, *args: str) -> Server:
    """`narwhal serve`, waited for until `/ready` (or, `wait_ready=False`, `/health`) is 200."""
    port = free_port()
    cfg = tmp / f"narwhal-{port}.yaml"
    cfg.write_text(yaml_text.replace("$PORT", str(port)))
    return Server(
        [str(BIN / "narwhal"), "serve", "--config", str(cfg), *args],
        "/ready" if wait_ready else "/health",
        port,
        timeout=120,
    )


def refused_config(tmp: Path, yaml_text: str) -> str:
    """`narwhal serve` with a config it must refuse at start (exit 2): its stderr."""
    cfg = tmp / "bad.yaml"
    cfg.write_text(yaml_text)
    p = subprocess.run(
        [str(BIN / "narwhal"), "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2, p.stderr
    return p.stderr


def start_test_engine(module: str, *args: str) -> Server:
    """One of the tests' own engines (`tests.scripted_engine`, `tests.faulty_engine`)."""
    port = free_port()
    return Server([sys.executable, "-m", module, "--port", str(port), *args], "/health", port)


# -- the router in front of the scripted engine ---------------------------------------
ROUTER_CONFIG = """
model: main
listen: {host: 127.0.0.1, port: $PORT}
admission: open
serving: {max_request_bytes: 4096, http_retention_limit: 64, request_timeout_s: 30}
queue: {size: 8, wait_s: 5}
health: {interval_s: 0.2, timeout_s: 1}
engines:
  - name: s
    url: URL
    dialect: lexi
"""


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": "main", "messages": [{"role": "user", "content": content}], **kw}


def stats(s: Server) -> dict[str, Any]:
    return httpx.get(s.url + "/stats").json()


def sse_frames(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def metric(router: Server, name: str) -> float:
    """A counter or gauge from the router's /metrics (its first series), 0 when absent."""
    for line in httpx.get(router.url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def relayed_streams(router: Server) -> dict[str, float]:
    out = {}
    for line in httpx.get(router.url + "/metrics").text.splitlines():
        if line.startswith("narwhal_relayed_streams_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def leave_before_first_byte(url: str, content: str) -> None:
    """A client that sends a streaming request and hangs up before any answer."""
    body = orjson.dumps(chat(content, stream=True))
    u = httpx.URL(url)
    with socket.create_connection((u.host, u.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        time.sleep(0.3)


def wait_idle(router: Server, within: float = 5) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end:
        m = httpx.get(router.url + "/metrics").text
        if (
            "narwhal_retained 0.0" in m
            and 'phase="prefill"} 0.0' in m
            and 'phase="decode"} 0.0' in m
        ):
            return
        time.sleep(0.05)
    raise AssertionError("router did not return to idle:\n" + m)


def wait_ready(router: Server) -> None:
    end = time.monotonic() + 5
    while httpx.get(router.url + "/ready").status_code != 200:
        assert time.monotonic() < end
        time.sleep(0.05)


# -- LexiEngine's answers --------------------------------------------------------------
def post(s: Server, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=120, **kw)


def frames(r: httpx.Response) -> list[Any]:
    out = []
    for block in r.text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                d = line[6:]
                out.append(d if d == "[DONE]" else orjson.loads(d))
    return out


# -- etcd, for several routers --------------------------------------------------------
class EtcdServer:
    """A real etcd on loopback, free ports, a temporary data dir; one member of `cluster`
    (etcd's `--initial-cluster`) when given, else a cluster of its own."""

    def __init__(
        self,
        name: str = "default",
        ports: tuple[int, int] | None = None,
        cluster: str | None = None,
        wait: bool = True,
    ) -> None:
        import shutil

        exe = shutil.which("etcd")
        if exe is None:
            raise RuntimeError("etcd is not installed (make setup installs etcd-server)")
        self.exe, self.name = exe, name
        self.port, self.peer = ports or (free_port(), free_port())
        self.url = f"http://127.0.0.1:{self.port}"
        self.cluster = cluster or f"{name}=http://127.0.0.1:{self.peer}"
        self.dir = tempfile.mkdtemp(prefix="etcd-")
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
        self.spawn()
        if wait:
            self.wait_ready()

    def spawn(self) -> None:
        """Starts the member (again, after `kill`: from its data dir, as a restart does)."""
        peer = f"http://127.0.0.1:{self.peer}"
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--name",
                self.name,
                "--data-dir",
                self.dir,
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                self.cluster,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            start_new_session=True,
        )

    def wait_ready(self, within: float = 30) -> None:
        end = time.monotonic() + within
        while True:
            try:
                if httpx.post(
                    self.url + "/v3/kv/range", json={"key": "eA=="}, timeout=1
                ).is_success:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError("etcd did not start")
            time.sleep(0.1)

    def kill(self) -> None:
        """kill -9; the data dir stays for `spawn`."""
        self.resume()
        self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        import shutil

        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class EtcdCluster:
    """Three etcd members on loopback, one cluster."""

    def __init__(self, n: int = 3) -> None:
        ports = [(free_port(), free_port()) for _ in range(n)]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, (_, p) in enumerate(ports))
        self.members = [EtcdServer(f"m{i}", ports[i], cluster, wait=False) for i in range(n)]
        for m in self.members:
            m.wait_ready()
        self.urls = [m.url for m in self.members]

    def leader(self) -> EtcdServer:
        """The member the cluster's leader is now (asked of every member that answers)."""
        end = time.monotonic() + 10
        while time.monotonic() < end:
            for m in self.members:
                try:
                    st = httpx.post(m.url + "/v3/maintenance/status", json={}, timeout=1).json()
                except (httpx.HTTPError, ValueError):
                    continue
                if st.get("leader") and st["leader"] == st["header"]["member_id"]:
                    return m
            time.sleep(0.1)
        raise RuntimeError("no etcd leader")

    def stop(self) -> None:
        for m in self.members:
            m.stop()


def measured(prof: Any, prefill_tps: float, bytes_per_token: float) -> None:
    """A predictor profile as if learned from enough prefills, of every size, to vouch for
    any prompt (`Profile.vouches`): what a router that has run for a while knows."""
    prof.prefill_tps, prof.bytes_per_token = prefill_tps, bytes_per_token
    prof.prefill_samples, prof.largest_measured = 10, 10**9
