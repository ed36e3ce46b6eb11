"""moss-image on cards of less memory, emulated: a second process holds all but BUDGET GB of the GPU while one
`moss-image --device cuda` call makes a 1024x1024 picture, its plan made from the free memory it finds.

    python scripts/gpu_budget.py MODEL --out budget.json [--budgets all 24 16 12 8] [--steps 50]

Each row: the budget, the plan's line, seconds from the command to its exit, the process's peak GPU memory
(nvidia-smi, every 0.1 s), the PNG's sha256 (every budget must give the all-resident picture's bytes), and the
bytes the plan streams a picture (the encoder's streamed matrices once a prompt and once for the negative, the
DiT's twice a step) beside the host-to-device rate measured here (a pinned 1 GiB copy): their quotient is the
floor a streamed plan adds. The first call warms the kernel cache and is reported apart. At the smallest budget
the three stage commands run too, chained through files.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPT = "a red fox in the snow, morning light, detailed fur"
HOLD = """
import sys, torch
free, total = torch.cuda.mem_get_info()
keep = int(float(sys.argv[1]) * 1e9)
held = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda")
free, total = torch.cuda.mem_get_info()
print(free, flush=True)
sys.stdin.read()
"""


def link_rate():
    import torch
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    rate = 3 * host.numel() / (time.perf_counter() - began)
    del host, dev
    torch.cuda.empty_cache()
    return rate


class Peak(threading.Thread):
    """The largest GPU memory nvidia-smi reports for one process, polled until stopped."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = str(pid), 0, threading.Event()

    def run(self):
        while not self.done.is_set():
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout
            for line in out.splitlines():
                pid, _, used = line.partition(",")
                if pid.strip() == self.pid:
                    self.peak = max(self.peak, int(used.strip()) * (1 << 20))
            self.done.wait(0.1)


def command(args, stage_args, budget_env=None):
    env = dict(os.environ, **(budget_env or {}))
    began = time.perf_counter()
    proc = subprocess.Popen(args + stage_args, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    peak = Peak(proc.pid)
    peak.start()
    _, err = proc.communicate()
    seconds = time.perf_counter() - began
    peak.done.set()
    peak.join()
    if proc.returncode:      # the row says so and the run goes on: a call cut short keeps what it measured
        raise Failed(f"exit {proc.returncode}: {err.strip().splitlines()[-1] if err.strip() else ''}"[:500])
    plan = next((line.split("] ")[-1].strip() for line in err.splitlines() if "memory plan:" in line), "")
    return seconds, peak.peak, plan[plan.find("memory plan:"):]


class Failed(Exception):
    """A command that exited non-zero: its exit status and the last line of its stderr."""


def tool(name):
    return [sys.executable, "-c", f"import sys; from moss_cli.cli import {name}_command as c; "
            f"sys.argv[0] = 'moss-{name}'; c()"]


def streamed_bytes(model, plan_budget, steps):
    """Bytes the plan streams a picture (host to device), from the plan made for that budget."""
    from moss_cli import stages
    from moss_cli.checkpoint import open_checkpoint
    from moss_cli.memory import plan as mp
    checkpoint = open_checkpoint(model)
    plan = stages.memory_plan(checkpoint, ("encode", "denoise", "decode"), plan_budget / 1e9, (1024, 1024),
                              memory=lambda: (plan_budget, plan_budget))
    enc = mp.component_weights(checkpoint.component("text_encoder"))
    dit = mp.component_weights(checkpoint.component("transformer"))
    return 2 * enc.streamed(plan.layers("text_encoder")) + 2 * steps * dit.streamed(plan.layers("transformer"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budgets", nargs="+", default=["all", "24", "16", "12", "8"])
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    out_dir = Path(a.out).parent
    rate = link_rate()
    print(f"host to device, pinned 1 GiB: {rate / 1e9:.1f} GB/s", flush=True)
    rows, reference = [], None
    picture = ["--model", a.model, "--prompt", PROMPT, "--seed", "1", "--steps", str(a.steps), "--device", "cuda"]
    runs = [("warm-up", "all", "cuda")] + [(b, b, "cuda") for b in a.budgets]
    smallest = min((b for b in a.budgets if b != "all"), key=float, default=None)
    if "24" in a.budgets:
        runs.append(("24 auto", "24", "auto"))
    for label, budget, device in runs:
        holder = None
        try:
            if budget != "all":
                holder = subprocess.Popen([sys.executable, "-c", HOLD, budget], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True)
                free = int(holder.stdout.readline())
            png = out_dir / f"budget-{label.replace(' ', '-')}.png"
            args = picture[:-1] + [device, "--picture", str(png)]
            try:
                seconds, peak, plan = command(tool("image"), args)
            except Failed as e:
                rows.append({"run": label, "budget_GB": budget, "device": device, "error": str(e)})
                print(json.dumps(rows[-1]), flush=True)
                continue
            sha = hashlib.sha256(png.read_bytes()).hexdigest()
            row = {"run": label, "budget_GB": budget, "device": device, "seconds": round(seconds, 2),
                   "peak_GB": round(peak / 1e9, 2), "plan": plan, "png_sha256": sha}
            if budget != "all":
                row["free_GB"] = round(free / 1e9, 2)
                row["streamed_GB"] = round(streamed_bytes(a.model, free, a.steps) / 1e9, 2)
                row["stream_floor_s"] = round(row["streamed_GB"] * 1e9 / rate, 2)
            if label == "all":
                reference = sha
            row["equal_to_resident"] = reference is not None and sha == reference
            if budget == smallest and label == budget:         # the stage commands at the smallest budget
                enc, lat, dec = (out_dir / f"chain.{x}" for x in ("enc", "lat", "png"))
                row["chain"] = {}
                for name, stage_args in (("encode", ["--model", a.model, "--prompt", PROMPT, "--device", "cuda",
                                                     "--out", str(enc)]),
                                         ("denoise", ["--model", a.model, str(enc), "--seed", "1", "--steps",
                                                      str(a.steps), "--device", "cuda", "--out", str(lat)]),
                                         ("decode", ["--model", a.model, str(lat), "--device", "cuda", "--out",
                                                     str(dec)])):
                    try:
                        s, p, pl = command(tool(name), stage_args)
                    except Failed as e:
                        row["chain"][name] = {"error": str(e)}
                        break
                    row["chain"][name] = {"seconds": round(s, 2), "peak_GB": round(p / 1e9, 2), "plan": pl}
                row["chain"]["equal_to_resident"] = dec.exists() and \
                    hashlib.sha256(dec.read_bytes()).hexdigest() == reference
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            # written after every row: a call cut short keeps the rows it made
            Path(a.out).write_text(json.dumps({"link_GBps": round(rate / 1e9, 1), "steps": a.steps, "rows": rows},
                                              indent=1))
            if holder is not None:
                holder.stdin.close()
                holder.wait()


if __name__ == "__main__":
    main()
