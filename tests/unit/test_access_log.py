"""uvicorn's own log lines (its access log, its start line) come out in the proxy's
format, one format in the log, not uvicorn's ``INFO:     ...`` beside the proxy's
``TIME LEVEL LOGGER: ...``."""

from __future__ import annotations

import re
import subprocess
import sys

SCRIPT = """
import logging
from proxy.config import settings_from_dict
from proxy.logs import configure_logging
from proxy.process.uvicorn_server import uvicorn_config

configure_logging("info")
settings = settings_from_dict({"engines": [{"url": "http://127.0.0.1:9", "models": ["m"]}]})
uvicorn_config(lambda scope, receive, send: None, settings, "info")
logging.getLogger("uvicorn.access").info(
    '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "POST", "/v1/chat/completions", "1.1", 200
)
logging.getLogger("uvicorn.error").info("Uvicorn running")
logging.getLogger("proxy.server").info("the proxy's own line")
"""

PROXY_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO [\w.]+: ")


def test_uvicorns_lines_use_the_proxys_format() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 3, done.stderr
    assert all(PROXY_LINE.match(line) for line in lines), done.stderr
    assert "uvicorn.access: 127.0.0.1:5" in done.stderr
