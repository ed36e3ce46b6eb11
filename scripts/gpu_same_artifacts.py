"""The tiny checkpoint's artifacts made on the GPU by two source trees, compared tensor for tensor and pixel for
pixel: the chained commands (ENC, LAT with its TRACE of every step, PNG) and one `moss-image` of two seeds.
A restructuring that must not change behaviour passes when every artifact is equal; as a control, the two
seeds' pictures of one tree must differ (the comparison sees a change).

    python scripts/gpu_same_artifacts.py --trees before . --out same.json   (each tree a folder holding moss_cli/)
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from safetensors.numpy import load_file

PROMPT = "a red fox in the snow"
RUN = "import sys; from moss_cli import cli; sys.argv[0] = {name!r}; cli.{func}()"
CHAIN = [
    ("moss-encode", "encode_command", ["--prompt", PROMPT, "--out", "a.enc"]),
    ("moss-denoise", "denoise_command", ["a.enc", "--seed", "7", "--trace", "a.trace", "--out", "a.lat"]),
    ("moss-decode", "decode_command", ["a.lat", "--out", "a.png"]),
    ("moss-image", "image_command", ["--prompt", PROMPT, "--seed", "7,8", "--picture", "b-{seed}.png"]),
]


def make(tree, folder, device):
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tree).resolve()), os.environ.get("PYTHONPATH", "")])}
    env.pop("MOSS_IMAGE_MODEL", None)
    for name, func, args in CHAIN:
        p = subprocess.run([sys.executable, "-c", RUN.format(name=name, func=func), *args, "--device", device,
                            "--quiet"], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
        if p.returncode:
            raise SystemExit(f"{tree}: {name} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")


def content(path):
    """{name: array} of an artifact: its tensors, or a PNG's pixels."""
    if path.suffix == ".png":
        return {"pixels": np.asarray(Image.open(path))}
    return load_file(path)


def differences(a, b):
    """The names whose arrays are not equal bit for bit (shape, dtype and bytes)."""
    ta, tb = content(a), content(b)
    return sorted(n for n in set(ta) | set(tb)
                  if n not in ta or n not in tb or ta[n].dtype != tb[n].dtype or ta[n].shape != tb[n].shape
                  or ta[n].tobytes() != tb[n].tobytes())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs=2, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    work = Path(args.out).with_suffix(".d")
    folders = [work / f"tree{i}" for i in range(2)]
    for tree, folder in zip(args.trees, folders):
        make(tree, folder, args.device)
    files = ["a.enc", "a.trace", "a.lat", "a.png", "b-7.png", "b-8.png"]
    report = {"trees": args.trees, "files": {}}
    for f in files:
        diff = differences(folders[0] / f, folders[1] / f)
        report["files"][f] = {"tensors": len(content(folders[0] / f)), "differ": diff}
    report["control_seeds_differ"] = differences(folders[1] / "b-7.png", folders[1] / "b-8.png") == ["pixels"]
    report["same"] = all(not v["differ"] for v in report["files"].values()) and report["control_seeds_differ"]
    Path(args.out).write_text(json.dumps(report, indent=1))
    for f, v in report["files"].items():
        print(f"{f}: {v['tensors']} tensors, {'equal' if not v['differ'] else 'differ: ' + ', '.join(v['differ'])}")
    print(f"control (seed 7 vs 8 of one tree) differs: {report['control_seeds_differ']}; same: {report['same']}")
    return 0 if report["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
