"""Run ``launch/serve.py`` as a subprocess on a free loopback port (tests and ``benchmarks/bench_serve.py``).

``ServerProcess`` starts ``python launch/serve.py`` (tp 1) or ``torchrun
--nproc-per-node N launch/serve.py`` (gloo), waits for ``/health`` and
always stops the server it started, by its process id: SIGTERM first (the
graceful path), then SIGKILL to the process group it created.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                TPGUIDE_BACKEND="gloo", PYTHONUNBUFFERED="1", **(extra or {}))


def _launch(tp_size: int, script: str, args: Sequence[str]) -> List[str]:
    """``python launch/SCRIPT`` at tp 1, else ``torchrun --nproc-per-node tp_size`` on a free port."""
    path = [os.path.join(ROOT, "launch", script), *args]
    if tp_size == 1:
        return [sys.executable, *path]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp_size),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *path]


def run_generate(tp_size: int, lines: Sequence[Dict[str, Any]], args: Sequence[str] = (),
                 timeout_s: float = 900.0, env: Optional[Dict[str, str]] = None,
                 expect_status: int = 0) -> Tuple[List[Dict[str, Any]], str]:
    """Run ``launch/generate.py`` on request lines; (output lines in input order, its stdout).

    ``env``: extra environment variables.  ``expect_status``: the exit
    status to expect (1 when every request fails).

    Raises
    ------
    RuntimeError
        generate.py exited with another status (its stderr is in the message).
    """
    import json

    with tempfile.TemporaryDirectory() as d:
        req, out = os.path.join(d, "requests.jsonl"), os.path.join(d, "outputs.jsonl")
        with open(req, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
        cmd = _launch(tp_size, "generate.py", ["--requests", req, "--output", out, *args])
        res = subprocess.run(cmd, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=timeout_s)
        if res.returncode != expect_status:
            raise RuntimeError(f"generate.py exited {res.returncode}:\n{res.stderr[-4000:]}")
        with open(out, encoding="utf-8") as f:
            return [json.loads(x) for x in f if x.strip()], res.stdout


class ServerProcess:
    """A tpguide server subprocess.

    Parameters
    ----------
    tp_size : int
    args : sequence of str
        Extra ``serve.py`` flags.
    env : dict, optional
        Extra environment variables (``TPGUIDE_REQUEST_FAULT`` in the fault tests).
    startup_timeout_s : float
        Longest wait for ``/health`` (model loading on a busy machine is slow).
    """

    def __init__(self, tp_size: int = 1, args: Sequence[str] = (), startup_timeout_s: float = 600.0,
                 env: Optional[Dict[str, str]] = None) -> None:
        self.tp_size, self.args, self.startup_timeout_s = tp_size, list(args), startup_timeout_s
        self.env = env
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        #: after :meth:`stop`: whether processes of the server's group outlived it (then SIGKILLed)
        self.orphans_left: Optional[bool] = None
        #: True when :meth:`stop` had to SIGKILL a server that outlived its timeout (a hang)
        self.stop_timed_out = False
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tpguide-serve-", suffix=".log", delete=False)

    def command(self) -> List[str]:
        return _launch(self.tp_size, "serve.py", ["--port", str(self.port), *self.args])

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=_env(self.env), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.wait_healthy()
        return self

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before it was healthy:\n"
                                   f"{self.log_text()[-4000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"no healthy server after {self.startup_timeout_s:g} s:\n{self.log_text()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> Optional[int]:
        """Send ``sig`` to the server's pid, wait; SIGKILL its process group if it is still there.

        Sets :attr:`stop_timed_out` when the server had not exited after ``timeout_s``.
        """
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.stop_timed_out = True
        try:
            os.killpg(self.proc.pid, 0)  # anyone left in the group this object created?
            self.orphans_left = True
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.orphans_left = self.orphans_left or False
        self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
