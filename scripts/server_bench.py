"""Seconds per request of moss-server: the first request after it is ready apart, then REQUESTS more from one
client and from four concurrent clients; the first PNG checked against moss-image's with the same options.

    python scripts/server_bench.py --model DIR --device cuda [--size 1024] [--steps 50] [--requests 4] [--out J]

Beside each request's seconds at the client, the server's own seconds for the picture (X-Moss-Seconds: denoise,
decode and PNG with the weights resident, as a second picture of one moss-image call makes it): their difference
is what serving costs a request. Prints one line per measurement and writes them to --out as JSON.
"""

import argparse
import json
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
    return time.perf_counter() - began, r.content, float(r.headers["X-Moss-Seconds"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--out", help="the measurements as JSON")
    args = parser.parse_args()
    result = {"size": args.size, "steps": args.steps, "requests": args.requests}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    began = time.perf_counter()
    server = start_process("--model", args.model, "--device", args.device, "--port", port, "--max-queue", 64,
                           "--quiet")
    try:
        wait_ready(url, server)
        result["ready_s"] = time.perf_counter() - began
        print(f"start to ready: {result['ready_s']:.2f} s")
        first, png, made = request(url, 0, args)
        result["first"] = {"request_s": first, "picture_s": made}
        print(f"first request: {first:.2f} s (the server's picture {made:.2f} s)")
        one = [request(url, 1 + i, args) for i in range(args.requests)]
        wait, made = [r[0] for r in one], [r[2] for r in one]
        result["one_client"] = {"request_s": wait, "picture_s": made}
        print(f"1 client, {args.requests} requests: {statistics.mean(wait):.2f} s a request "
              f"(min {min(wait):.2f}, max {max(wait):.2f}); the server's picture {statistics.mean(made):.2f} s; "
              f"serving adds {statistics.mean(w - m for w, m in zip(wait, made)):.3f} s")
        times, pictures, clients = [], [], []
        began = time.perf_counter()
        for c in range(4):
            def client(c=c):
                for i in range(args.requests):
                    wait, _, made = request(url, 100 + c * args.requests + i, args)
                    times.append(wait)
                    pictures.append(made)
            clients.append(threading.Thread(target=client))
            clients[-1].start()
        for t in clients:
            t.join(WAIT_S * args.requests * 4)
        wall = time.perf_counter() - began
        result["four_clients"] = {"wall_s": wall, "per_picture_s": wall / (4 * args.requests),
                                  "request_s": times, "picture_s": pictures}
        print(f"4 clients, {4 * args.requests} requests: {wall / (4 * args.requests):.2f} s a picture "
              f"(each client waits {statistics.mean(times):.2f} s on average; the server's picture "
              f"{statistics.mean(pictures):.2f} s)")
    finally:
        server.terminate()
        server.wait(WAIT_S)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "p.png"
        subprocess.run([sys.executable, "-c", "from moss_cli.cli import image_command as c; c()", "--model",
                        args.model, "--device", args.device, "--prompt", PROMPT, "--seed", "0", "--steps",
                        str(args.steps), "--width", str(args.size), "--height", str(args.size), "--picture",
                        str(out), "--quiet"], check=True)
        result["png_equals_moss_image"] = out.read_bytes() == png
        print(f"first PNG equals moss-image's: {result['png_equals_moss_image']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
