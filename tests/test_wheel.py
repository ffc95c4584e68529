"""What users get: `pip install` of the built wheel into a fresh virtual environment."""

from __future__ import annotations

import shutil
import subprocess
import venv
from pathlib import Path

import httpx
import pytest

from tests.support import BIN, ROOT, Server, free_port

pytestmark = pytest.mark.slow


def test_release_wheel_installs_and_runs(tmp_path: Path) -> None:
    maturin = shutil.which("maturin", path=str(BIN)) or "maturin"
    out = tmp_path / "dist"
    subprocess.run(
        [maturin, "build", "--release", "--quiet", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=900,
    )
    wheels = list(out.glob("narwhal_serve-*.whl"))
    assert len(wheels) == 1
    assert "abi3" in wheels[0].name
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    py = env / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", str(wheels[0])], check=True, timeout=900
    )
    version = subprocess.run(
        [str(env / "bin" / "narwhal"), "--version"], capture_output=True, text=True, check=True
    )
    # Our own distribution's version, everywhere a user reads it.
    release = wheels[0].name.split("-")[1]  # the version maturin built: Cargo.toml's
    assert version.stdout.strip() == f"narwhal {release}"
    port = free_port()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        f"listen: {{port: {port}}}\nmodel: main\nadmission: open\n"
        'engines: [{name: a, url: "http://127.0.0.1:9", dialect: openai}]\n'
    )
    router = Server([str(env / "bin" / "narwhal"), "serve", "--config", str(cfg)], "/health", port)
    try:
        metrics = httpx.get(router.url + "/metrics").text
        assert f'narwhal_info{{model="main",version="{release}"}} 1.0' in metrics
        assert f"narwhal {release}: model 'main'" in router.stderr()
    finally:
        router.stop()
    probe = subprocess.run(
        [
            str(py),
            "-c",
            "import narwhal._native as n, narwhal; "
            "print(n.__file__); print(n.SseDecoder().feed(b'data: ok\\n\\n')[0].data)",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    # Without the engine extra, both ways to start LexiEngine say in one line what to do.
    for cmd in (["lexi-engine", "serve", "-m", "x.gguf"], ["narwhal", "up", "--model", "x.gguf"]):
        p = subprocess.run(
            [str(env / "bin" / cmd[0]), *cmd[1:]], capture_output=True, text=True, cwd=tmp_path
        )
        assert p.returncode == 2, p.stderr
        assert "pip install 'narwhal-serve[engine]'" in p.stderr
        assert "Traceback" not in p.stderr
    path, data = probe.stdout.split()
    assert str(env) in path  # imported from the installed wheel, not the source tree
    assert data == "ok"
