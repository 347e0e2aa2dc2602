import os
import socket
from pathlib import Path

import pytest

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture
def corpus_file(tmp_path) -> Path:
    """A small corpus with some non-ASCII text, written by the test itself."""
    lines = [f"Line {i}: the quick brown fox jumps over the lazy dog. Café, naïve, 東京 {i % 7}\n" for i in range(400)]
    path = tmp_path / "corpus.txt"
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.fixture
def closed_port() -> int:
    """A loopback port with nothing listening: connecting to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_env(tmp_path: Path, closed_port: int) -> dict:
    """An environment in which HTTP(S) goes to a closed loopback port, so no download can succeed
    and no packet leaves the machine."""
    proxy = f"http://127.0.0.1:{closed_port}"
    env = dict(os.environ)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env[name] = proxy
    env["NO_PROXY"] = env["no_proxy"] = ""
    env["TIKTOKEN_CACHE_DIR"] = str(tmp_path / "empty-tiktoken-cache")
    return env
