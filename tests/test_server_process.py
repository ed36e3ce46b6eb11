"""The moss-server command in its own process: it loads, warms and serves on 127.0.0.1; SIGTERM or SIGINT
mid-picture stops it taking requests, answers the waiting one 503, finishes the picture in flight (moss-image's
PNG) and exits 0; a bad model folder is one line and exit 1."""

import signal
import socket

import httpx
import pytest

from cli_util import run, single_error
from server_util import WAIT_S, Background, free_port, run_process, start_process, until, wait_ready

SLOW = {"prompt": "a red fox", "seed": 3, "width": 256, "height": 256, "steps": 24}   # seconds, even on a fast CPU


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_picture_finishes_it_answers_the_waiting_503_and_exits_0(tmp_path, sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_process("--port", port, "--max-queue", 2, "--quiet", env={"MOSS_API_KEY": "k"})
    try:
        seen = wait_ready(url, server)
        assert set(seen) <= {"loading", "warming", "ready"} and seen[-1] == "ready"
        auth = {"Authorization": "Bearer k"}
        native = f"{url}/v1/moss/image"
        first = Background(lambda: httpx.post(native, json=SLOW, headers=auth, timeout=WAIT_S))
        until(lambda: httpx.get(f"{url}/health", timeout=WAIT_S).json()["busy"], "the picture to start")
        second = Background(lambda: httpx.post(native, json={**SLOW, "seed": 4}, headers=auth, timeout=WAIT_S))
        until(lambda: httpx.get(f"{url}/health", timeout=WAIT_S).json()["queue"] == 1, "the second to wait")
        assert first.thread.is_alive()             # its picture is being made
        server.send_signal(sig)
        assert server.wait(WAIT_S) == 0, server.stderr.read().decode()
        done = first.result()
        waiting = second.result()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(WAIT_S)
    assert done.status_code == 200 and done.headers["x-moss-seed"] == "3"
    assert waiting.status_code == 503
    assert waiting.json()["error"]["message"] == "the server is shutting down"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=WAIT_S)
    r = run("moss-image", "--prompt", SLOW["prompt"], "--seed", 3, "--width", SLOW["width"], "--height",
            SLOW["height"], "--steps", SLOW["steps"], "--picture", tmp_path / "p.png", "--quiet")
    assert r.code == 0 and done.content == (tmp_path / "p.png").read_bytes()


def test_a_missing_model_folder_is_one_line_and_exit_1(tmp_path):
    r = run_process("--model", tmp_path / "nothing", "--port", free_port())
    assert r.code == 1 and "moss-server: error:" in single_error(r)


def test_the_help_names_every_option():
    r = run_process("--help")
    assert r.code == 0
    for option in ("--model", "--host", "--port", "--device", "--gpu-memory", "--max-queue", "--api-key"):
        assert option in r.stdout.decode()



def test_a_device_that_cannot_be_used_is_one_line_and_exit_1_before_listening():
    port = free_port()
    r = run_process("--device", "cuda", "--port", port, env={"NUMBA_ENABLE_CUDASIM": "0", "CUDA_VISIBLE_DEVICES": ""})
    assert r.code == 1 and "--device cuda:" in single_error(r)


def test_a_port_in_use_is_one_line_and_exit_1_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_process("--port", port)
    line = single_error(r)
    assert r.code == 1 and f"--host 127.0.0.1 --port {port}: cannot listen there" in line
    assert "loading" not in r.stderr


def test_only_a_loopback_address_goes_without_the_api_key_warning():
    import ipaddress
    from moss_cli.server.main import _loopback
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("127.0.0.2")
    every = str(ipaddress.IPv4Address(0))           # the any-address a --host may name (nothing listens here)
    assert not _loopback(every) and not _loopback("::") and not _loopback("203.0.113.7")
