"""The runtime-only install: the wheel built from this tree, installed with no extra into a fresh venv,
runs generate, chat, inspect, passes, --version and --help without torch or rich; commands
that need an extra say which in one line (exit 2). Then the serve extra, in the same venv, answers a
request. One venv for the module: building and installing take a minute or two (pip reaches the index).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


@dataclass
class Venv:
    root: Path
    wheel: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def foldline(self, *args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.root / "bin" / "foldline"), *args], input=stdin, capture_output=True,
                              text=True, timeout=timeout)

    def importable(self, *modules: str) -> list[str]:
        probe = f"import importlib.util as u; print([m for m in {list(modules)!r} if u.find_spec(m)])"
        out = subprocess.run([str(self.python), "-c", probe], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.replace("'", '"'))

    def pip_install(self, requirement: str) -> None:
        subprocess.run([str(self.python), "-m", "pip", "install", "-q", requirement], check=True,
                       capture_output=True, text=True, timeout=900)


def _copy_tree(dest: Path) -> None:
    """The working tree's files as git sees them (tracked and new, not ignored): what a checkout builds."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():  # a tracked file deleted in the working tree is not there
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory) -> Venv:
    """A fresh venv with the wheel of this tree installed, no extras."""
    work = tmp_path_factory.mktemp("install")
    _copy_tree(work / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(work / "wheel"), str(work / "src")], check=True, capture_output=True, timeout=600)
    [wheel] = (work / "wheel").glob("foldline-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True, timeout=300)
    venv = Venv(work / "venv", wheel)
    venv.pip_install(str(wheel))
    return venv


def _one_line_error(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def _dev(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """The same command in the development environment (the compiler extra and all)."""
    return subprocess.run([sys.executable, "-m", "foldline.tools.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_runtime_only_install_runs_the_runtime_commands(runtime_venv, gguf_bundles, tmp_path):
    venv = runtime_venv
    assert venv.importable("torch", "rich", "gguf", "iree.compiler", "starlette") == []
    assert venv.importable("jinja2", "iree.runtime", "tokenizers") == ["jinja2", "iree.runtime", "tokenizers"]
    site = next((venv.root / "lib").glob("python3*/site-packages"))
    size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file())
    print(f"runtime-only install: {size / 2**20:.0f} MiB in {site}")

    version = venv.foldline("--version")
    assert version.returncode == 0 and version.stdout == f"foldline {metadata.version('foldline')}\n"
    usage = venv.foldline("--help")
    assert usage.returncode == 0 and all(c in usage.stdout for c in ("generate", "inspect", "compile", "serve"))
    passes = venv.foldline("passes")
    assert passes.returncode == 0 and passes.stdout == _dev("passes").stdout

    bundle = str(gguf_bundles("smollm2-135m"))  # a tokenizer and a chat template
    inspect = venv.foldline("inspect", bundle)
    assert inspect.returncode == 0 and "tokenizer tokenizer.json" in inspect.stdout, inspect.stderr
    for extra in ([], ["--chat"]):  # greedy: the text the development install generates
        args = ["generate", bundle, "--prompt", PROMPT, "--max-new-tokens", "8", "--threads", "1", *extra]
        ours = venv.foldline(*args)
        assert ours.returncode == 0, ours.stderr
        assert ours.stdout.strip() and ours.stdout == _dev(*args).stdout
    chat_args, typed = ["chat", bundle, "--max-new-tokens", "8", "--threads", "1"], "What is the capital of France?\n"
    chat = venv.foldline(*chat_args, stdin=typed)  # lines from a pipe: one turn, then end of input
    assert chat.returncode == 0, chat.stderr
    assert len(chat.stdout.strip("> \n")) > 8 and chat.stdout == _dev(*chat_args, stdin=typed).stdout

    _one_line_error(venv.foldline("compile", "llama-tiny", "-o", str(tmp_path / "out")),
                    "pip install 'foldline[compiler]'")
    assert not (tmp_path / "out").exists()
    _one_line_error(venv.foldline("plan", "llama-tiny"), "pip install 'foldline[compiler]'")
    _one_line_error(venv.foldline("verify", "llama-tiny"), "pip install 'foldline[compiler]'")
    _one_line_error(venv.foldline("serve", bundle), "pip install 'foldline[serve]'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_serve_extra_answers_a_request(runtime_venv, gguf_bundles):
    venv = runtime_venv
    venv.pip_install(f"{venv.wheel}[serve]")
    assert venv.importable("torch", "rich") == []
    port = _free_port()
    server = subprocess.Popen([str(venv.root / "bin" / "foldline"), "serve", str(gguf_bundles("smollm2-135m")),
                               "--port", str(port), "--model-id", "smol"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "foldline serve did not come up in 120 s"
            time.sleep(0.5)
        answer = _post(f"http://127.0.0.1:{port}/v1/completions",
                       {"model": "smol", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert answer["model"] == "smol" and answer["choices"][0]["text"].strip()
        assert answer["usage"]["completion_tokens"] == 8 or answer["choices"][0]["finish_reason"] == "stop"
    finally:
        server.terminate()
        server.wait(timeout=60)
