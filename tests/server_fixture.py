"""Run ``python -m infer.server`` in a subprocess for the server tests.

:class:`ServerProcess` starts the server on a free port of 127.0.0.1, waits for ``/health``
(failing with the server's stderr if it dies or does not come up in time) and always kills it
at the end. The server's stdout/stderr go to files, not pipes: a pipe nobody drains would
block the server once its access log filled the pipe buffer.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One ``python -m infer.server`` subprocess.

    Args:
        log_dir: where ``<name>.stdout`` / ``<name>.stderr`` are written.
        args: extra command-line flags (``--max-model-len 1024`` ...).
        name: names the log files.
        env: extra environment variables. ``INFER_API_KEY`` and ``VLLM_API_KEY`` are emptied unless
            given here: a key in the developer's environment would make every server require it.

    ``INFER_TEST_SERVER_ARGS`` (environment) adds flags to every server, e.g. ``--engine-process``.
    """

    def __init__(self, log_dir: Path, args: list[str], name: str = "server", env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stdout_path = Path(log_dir) / f"{name}.stdout"
        self.stderr_path = Path(log_dir) / f"{name}.stderr"
        # INFER_TEST_SERVER_ARGS: flags for every server the tests start, e.g. "--engine-process" to run the
        # server suites against the engine in its own process (the live page's servers keep the thread)
        extra = os.environ.get("INFER_TEST_SERVER_ARGS", "").split()
        if "--live-page" in args:
            extra = [a for a in extra if a != "--engine-process"]
        self.cmd = [sys.executable, "-m", "infer.server", "--host", "127.0.0.1", "--port", str(self.port), *args,
                    *extra]
        self._out = open(self.stdout_path, "wb")  # noqa: SIM115 (closed in stop())
        self._err = open(self.stderr_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(self.cmd, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "INFER_API_KEY": "", "VLLM_API_KEY": "", **(env or {})})

    # ------------------------------------------------------------------ logs

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.stdout_path.read_text(errors="replace")

    def logs(self) -> str:
        return f"--- stderr ---\n{self.stderr()[-6000:]}\n--- stdout ---\n{self.stdout()[-3000:]}"

    # ------------------------------------------------------------------ life cycle

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        """Poll ``/health`` until it answers 200.

        Raises:
            RuntimeError: the process exited, or ``timeout`` passed (with the server's logs).
        """
        deadline = time.monotonic() + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"{' '.join(self.cmd)} exited with {rc} before serving\n{self.logs()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{' '.join(self.cmd)} did not answer /health within {timeout:.0f} s\n"
                                   f"{self.logs()}")
            time.sleep(0.1)

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        """Kill the process (SIGTERM, then SIGKILL after 10 s) and close the log files."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self._out, self._err):
            if not f.closed:
                f.close()

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> str:
        r = httpx.get(f"{self.url}/metrics", timeout=10.0)
        r.raise_for_status()
        return r.text

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of ``/metrics`` (0.0 when the sample is not there yet)."""
        return metric_value(self.metrics(), name, **labels)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` whose labels include ``labels`` in Prometheus text ``text``
    (0.0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate()`` until it returns a truthy value (returned); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
