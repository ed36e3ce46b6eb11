"""Seconds per request of moss-server: the first request after it is ready apart, then REQUESTS more from one
client and from four concurrent clients; each PNG checked against moss-image's with the same options.

    python scripts/server_bench.py --model DIR --device cuda [--size 1024] [--steps 50] [--requests 4]

Prints one line per measurement; BENCHMARKS.md quotes them beside moss-image's resident picture time.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_util import WAIT_S, free_port, start_process, wait_ready  # noqa: E402

PROMPT = "a red fox in the snow, golden hour"


def request(url, seed, args):
    began = time.perf_counter()
    r = httpx.post(f"{url}/v1/moss/image", timeout=None, json={
        "prompt": PROMPT, "seed": seed, "steps": args.steps, "width": args.size, "height": args.size})
    r.raise_for_status()
    return time.perf_counter() - began, r.content


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--requests", type=int, default=4)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    began = time.perf_counter()
    server = start_process("--model", args.model, "--device", args.device, "--port", port, "--max-queue", 64,
                           "--quiet")
    try:
        wait_ready(url, server)
        print(f"start to ready: {time.perf_counter() - began:.2f} s")
        first, png = request(url, 0, args)
        print(f"first request: {first:.2f} s")
        one = [request(url, 1 + i, args)[0] for i in range(args.requests)]
        print(f"1 client, {args.requests} requests: {statistics.mean(one):.2f} s a request "
              f"(min {min(one):.2f}, max {max(one):.2f})")
        times, clients = [], []
        began = time.perf_counter()
        for c in range(4):
            def client(c=c):
                times.extend(request(url, 100 + c * args.requests + i, args)[0] for i in range(args.requests))
            clients.append(threading.Thread(target=client))
            clients[-1].start()
        for t in clients:
            t.join(WAIT_S * args.requests * 4)
        wall = time.perf_counter() - began
        print(f"4 clients, {4 * args.requests} requests: {wall / (4 * args.requests):.2f} s a picture "
              f"(each client waits {statistics.mean(times):.2f} s on average)")
    finally:
        server.terminate()
        server.wait(WAIT_S)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "p.png"
        subprocess.run([sys.executable, "-c", "from moss_cli.cli import image_command as c; c()", "--model",
                        args.model, "--device", args.device, "--prompt", PROMPT, "--seed", "0", "--steps",
                        str(args.steps), "--width", str(args.size), "--height", str(args.size), "--picture",
                        str(out), "--quiet"], check=True)
        print(f"first PNG equals moss-image's: {out.read_bytes() == png}")


if __name__ == "__main__":
    main()
