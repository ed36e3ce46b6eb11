"""A moss-server on 127.0.0.1 for the tests: uvicorn in a thread over an engine, or the command in a process."""

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

WAIT_S = 120          # the most any test waits for a server or a request


def until(check, what, seconds=WAIT_S, every=0.05):
    """Poll CHECK until it is true; fail naming WHAT after SECONDS."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(every)
    raise AssertionError(f"gave up waiting for {what}")


@contextlib.contextmanager
def serving(app):
    """uvicorn serving APP on a free loopback port, in a thread; yields the base URL."""
    import uvicorn
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    until(lambda: server.started, "uvicorn to start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(*args, env=None):
    """`moss-server ARGS` in a process (python -m moss_cli.server), its stderr in a pipe."""
    return subprocess.Popen([sys.executable, "-m", "moss_cli.server", *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


@contextlib.contextmanager
def ready_process(*args, env=None):
    """(url, process) of `moss-server ARGS --port P` started on a free port and ready; killed on the way out if it
    is still running (a test that stops it checks its exit itself)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_process(*args, "--port", port, env=env)
    try:
        wait_ready(url, server)
        yield url, server
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(WAIT_S)


def run_process(*args, env=None, timeout=WAIT_S):
    """`moss-server ARGS` run to its end: a cli_util.Result."""
    from cli_util import Result
    p = subprocess.run([sys.executable, "-m", "moss_cli.server", *map(str, args)], capture_output=True,
                       env={**os.environ, **(env or {})}, timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr.decode("utf-8", "replace"))


def wait_ready(url, process):
    """The /health statuses seen, in order, until the server at URL is ready."""
    seen = []

    def ready():
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}: {process.stderr.read().decode()}")
        try:
            status = httpx.get(f"{url}/health", timeout=WAIT_S).json()["status"]
        except httpx.TransportError:
            return False
        if not seen or seen[-1] != status:
            seen.append(status)
        return status == "ready"

    until(ready, f"{url} to be ready", every=0.1)
    return seen


class Background:
    """CALL on a thread; `result()` waits for what it returned."""

    def __init__(self, call):
        self.value, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call):
        try:
            self.value = call()
        except Exception as e:
            self.error = e

    def result(self):
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the request did not end"
        if self.error:
            raise self.error
        return self.value
