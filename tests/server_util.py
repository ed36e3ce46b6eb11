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


def wait_ready(url, process=None):
    def ready():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}: {process.stderr.read().decode()}")
        try:
            return httpx.get(f"{url}/health", timeout=5).json()["status"] == "ready"
        except httpx.TransportError:
            return False
    until(ready, f"{url} to be ready", every=0.2)
