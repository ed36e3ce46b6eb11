"""BENCHMARKS.md's tables from one device run's raw outputs: per stage (encoder, DiT step, decoder) and the
whole picture, each row ours vs the torch baseline vs the floor where the run measured one.

    bash scripts/gpu_run.sh encoder dit decoder load picture tables     # on the H200, one call
    python scripts/bench_tables.py DIR [--out tables.md]                 # DIR: that run's $OUT

Reads whichever of encoder_9b.json, dit.json, decoder.json, vae_encoder.json, load.json, picture.json, call_cost*.json,
server.json and budget.json DIR holds; a missing
one leaves its table out. Figures are printed as measured (no rounding beyond the column's digits).
"""

import argparse
import json
from pathlib import Path


def _load(folder, name):
    path = Path(folder) / name
    return json.loads(path.read_text()) if path.exists() else None


def _table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _ratio(base, ours):
    return f"{base / ours:.2f}" if isinstance(base, (int, float)) and ours else ""


def encoder(d, fla=None, plain=None):
    """The encode rows; with `fla` (encoder_baseline_fla.json: transformers with flash-linear-attention's
    delta rule, beside ours in that process) a second baseline and its ratio to ours as measured beside it;
    where a baseline run (`plain`: encoder_baseline_torch.json, transformers with its torch fallbacks; `fla`)
    timed torch.compile of its forward, that run's best mode and its ratio to ours in that process."""
    rows = []
    compiled = [run for run in (plain, fla) if run and any("torch_compile" in s for s in run["speed"].values())]
    for n, s in sorted(d["speed"].items(), key=lambda kv: int(kv[0])):
        base = s.get("transformers_bf16_ms")
        row = [f"encode, {n} tokens", f"{s['ours_into_pinned_ms']:.2f} ms", f"{base:.1f} ms" if base else "",
               f"{s['floor_ms']:.2f} ms" if "floor_ms" in s else "", _ratio(base, s["ours_into_pinned_ms"])]
        if fla:
            f = fla["speed"].get(str(n), {})
            row += [f"{f['transformers_bf16_ms']:.1f} ms" if f else "",
                    _ratio(f.get("transformers_bf16_ms"), f.get("ours_into_pinned_ms"))]
        for run in compiled:
            r = run["speed"].get(str(n), {})
            row += [f"{r['torch_compile_ms']:.1f} ms ({r['torch_compile_best']})" if "torch_compile_ms" in r else "",
                    _ratio(r.get("torch_compile_ms"), r.get("ours_into_pinned_ms"))]
        rows.append(row)
    head = ["figure", "ours", "transformers bf16 (torch fallbacks)", "floor", "baseline / ours"]
    if fla:
        head += ["transformers bf16 + flash-linear-attention", "that / ours (same process)"]
    for run in compiled:
        which = "+ flash-linear-attention" if run is fla else "(torch fallbacks)"
        head += [f"{_compile_name(run)} of transformers {which}, best mode", "that / ours"]
    return ["### Encoder (Qwen3.5-9B)", ""] + _table(head, rows)


def _compile_name(d):
    """torch.compile as the run ran it: 'torch.compile (inductor, torch 2.11.0, triton 3.5.0)'."""
    tc = d.get("torch_compile", {})
    parts = [tc.get("backend", "inductor")] + [f"{k} {tc[k]}" for k in ("torch", "triton") if k in tc]
    return f"torch.compile ({', '.join(parts)})"


def _behind(d, what, label=str):
    """One plain sentence per size where torch.compile's best mode was faster than ours (`what`: 'a step';
    `label`: the size key as the sentence names it)."""
    return [f"At {label(size)} ours is behind torch.compile ({s['torch_compile_best']}): {s['ours_ms']:.1f} ms {what} "
            f"against {s['torch_compile_ms']:.1f} ms."
            for size, s in d["sizes"].items() if "ours_ms" in s and s.get("torch_compile_ms", 1e30) < s["ours_ms"]]


def dit_compile(d):
    """Each torch.compile mode at each size: ms a step, its compile time, the ratio to ours; or why it has none."""
    rows = []
    for size, s in sorted(d["sizes"].items(), key=lambda kv: int(kv[0])):
        for mode, c in s.get("torch_compile", {}).items():
            best = " (best)" if mode == s.get("torch_compile_best") else ""
            rows.append([f"{size}x{size}", f"{mode}{best}", f"{c['ms']:.1f} ms" if "ms" in c else c.get("error", ""),
                         f"{c['compile_s']:.1f} s" if "compile_s" in c else "", _ratio(c.get("ms"), s["ours_ms"])])
    if not rows:
        return []
    return [f"The DiT step under {_compile_name(d)}, static shapes, each mode compiled afresh per size:", ""] + _table(
        ["size", "mode", "ms a step", "compile (first call)", "that / ours"], rows)


def dit(d):
    rows = []
    compiled = any("torch_compile_ms" in s for s in d["sizes"].values())
    for size, s in sorted(d["sizes"].items(), key=lambda kv: int(kv[0])):
        row = [f"step with CFG, {size}x{size}", f"{s['ours_ms']:.1f} ms", f"{s['torch_bf16_ms']:.1f} ms",
               f"{s['floor_ms']:.1f} ms", _ratio(s["torch_bf16_ms"], s["ours_ms"])]
        if compiled:
            row += [f"{s['torch_compile_ms']:.1f} ms ({s['torch_compile_best']})" if "torch_compile_ms" in s else "",
                    _ratio(s.get("torch_compile_ms"), s["ours_ms"])]
        rows.append(row)
    acc = d.get("accuracy_1024")
    if acc:
        rows.append(["CFG velocity vs float64, 1024x1024 (rel. L2)", f"{acc['ours_rel_l2']:.3g}",
                     f"{acc['torch_bf16_rel_l2']:.3g}", "", _ratio(acc["torch_bf16_rel_l2"], acc["ours_rel_l2"])])
    att = d.get("attention_4396")
    if att:
        ours = att.get("ours_cudnn_frontend_graph_ms", att.get("ours_cudnn_frontend_ms"))
        best = min(t for t in att["torch"].values() if isinstance(t, (int, float)))
        rows.append(["attention alone, 4396 tokens", f"{ours:.3f} ms", f"{best:.3f} ms (torch's fastest)", "",
                     _ratio(best, ours)])
        alt = att.get("alternating_medians_ms")
        if alt:        # the two in turn, so that both see the same clocks
            rows.append(["attention alone, ours in a graph and torch's cuDNN in turn", f"{alt['ours_graph']:.3f} ms",
                         f"{alt['torch_cudnn']:.3f} ms", "", _ratio(alt["torch_cudnn"], alt["ours_graph"])])
    head = ["figure", "ours", f"torch {d.get('torch', '')} bf16 eager", "floor (products at the measured rate)",
            "baseline / ours"]
    if compiled:
        head += [f"{_compile_name(d)}, best mode", "that / ours"]
        rows = [row + [""] * (len(head) - len(row)) for row in rows]
    out = [f"### DiT ({d.get('text_tokens', '?')}-token prompts)", ""] + _table(head, rows)
    behind = _behind(d, "a step", lambda n: f"{n}x{n}")
    extra = dit_compile(d)
    return out + ([""] + behind if behind else []) + ([""] + extra if extra else [])


def _decode_cell(s, who):
    """'X ms, Y % off', or where the float64 decode was not made (it does not fit the H100 at 2048) why not."""
    off = s.get(f"{who}_vs_float64")
    return f"{s[who + '_ms']:.1f} ms, " + (f"{off['percent_off']:.3g} % off" if off
                                          else f"float64 {s.get('float64', 'not run')}")


def _compiled(d, s, ours):
    """The best torch.compile mode's cells (its ms and mode, that / ours) where the run has any, else None."""
    if not any("torch_compile" in r for r in d["sizes"].values()):
        return None
    if "torch_compile_ms" not in s:
        return ["", ""]
    return [f"{s['torch_compile_ms']:.1f} ms ({s['torch_compile_best']})", _ratio(s["torch_compile_ms"], ours)]


def decoder(d):
    """Ours vs torch fp32 and TF32 (and torch.compile of the TF32 statement, where the run timed it) vs the floor:
    the decode's FLOPs three times over (the split's three fp16 products) at the fp16 rate torch.matmul reached in
    the same run."""
    rows = []
    for size, s in d["sizes"].items():
        if "ours_ms" not in s:
            rows.append([size, s.get("error", "not measured"), "", "", "", ""])
            continue
        floor = f"{s['floor_ms']:.1f} ms" if "floor_ms" in s else ""
        rows.append([f"decode, {size}"] + [_decode_cell(s, who) for who in ("ours", "torch_fp32", "torch_tf32")]
                    + [floor, _ratio(s["torch_tf32_ms"], s["ours_ms"])] + (_compiled(d, s, s["ours_ms"]) or []))
    rate = d.get("fp16_product_tflops")
    floor = f"floor (3 fp16 products at {rate:.0f} TFLOP/s)" if rate else "floor"
    head = ["figure", "ours", "torch fp32", "torch TF32", floor, "TF32 / ours"]
    if any("torch_compile" in s for s in d["sizes"].values()):
        head += [f"{_compile_name(d)} of the TF32 statement, best mode", "that / ours"]
        rows = [row + [""] * (len(head) - len(row)) for row in rows]
    behind = _behind(d, "a decode")
    return ["### Decoder (pixels off by one vs float64)", ""] + _table(head, rows) + ([""] + behind if behind else [])


def vae_encoder(d):
    """Ours vs diffusers' encoder in fp32 and TF32 (and torch.compile of the TF32 one, where timed), with each
    one's latents against float64."""
    rows = []
    for size, s in d["sizes"].items():
        err = lambda key: f"{s[key]['rel_l2']:.2g}" if key in s else ""
        rows.append([f"encode, {size}", f"{s['ours_ms']:.1f} ms ({err('ours_vs_float64')})",
                     f"{s['diffusers_fp32_ms']:.1f} ms ({err('diffusers_fp32_vs_float64')})",
                     f"{s['diffusers_tf32_ms']:.1f} ms ({err('diffusers_tf32_vs_float64')})",
                     _ratio(s["diffusers_tf32_ms"], s["ours_ms"])] + (_compiled(d, s, s["ours_ms"]) or []))
    head = ["figure (rel. L2 vs float64)", "ours", "diffusers fp32", "diffusers TF32", "TF32 / ours"]
    if any("torch_compile" in s for s in d["sizes"].values()):
        head += [f"{_compile_name(d)} of the TF32 encode, best mode", "that / ours"]
    behind = _behind(d, "an encode")
    return ["### VAE encoder", ""] + _table(head, rows) + ([""] + behind if behind else [])


def load(d):
    """Every run but the link's, with the floor: its bytes at the pinned host-to-device rate of the link run."""
    link = next((r for r in d["runs"] if r.get("mode") == "link" and "error" not in r), None)
    rows = []
    for r in d["runs"]:
        if "error" in r or r.get("mode") == "link":
            continue
        floor = f"{r['gb'] / link['gb_per_s']:.2f} s" if link else ""
        rows.append([r["mode"], r.get("how", ""), f"{r['since_process_start_s']:.2f} s", f"{r['gb']:.2f} GB",
                     f"{r['gb_per_s']:.1f} GB/s", floor])
    head = f"floor (the bytes at the link's {link['gb_per_s']:.1f} GB/s, pinned)" if link else "floor"
    return ["### Loading (process start to every weight on the GPU)", ""] + _table(
        ["run", "path", "seconds", "moved", "upload rate", head], rows)


def _memory_parts(d):
    """' (after the load X GB, the shared pool Y GB)' where the run reported them."""
    parts = []
    if "device_memory_after_load_GB" in d:
        parts.append(f"after the load {d['device_memory_after_load_GB']:.1f} GB")
    if "pool_GB" in d:
        parts.append(f"the shared pool {d['pool_GB']:.2f} GB")
    return f" ({', '.join(parts)})" if parts else ""


def _picture_floor(p, dit_json, decoder_json):
    """Seconds of the picture's products at the run's measured rates (the denoise's at the DiT step's bf16
    rate, the decode's floor), or None where the run lacks one of them."""
    rate = (dit_json or {}).get("bf16_product_tflops")
    dec = (decoder_json or {}).get("sizes", {}).get(f"{p['size']}x{p['size']}", {})
    if "denoise_tflop" not in p or not rate or "floor_ms" not in dec:
        return None
    return p["denoise_tflop"] / rate + dec["floor_ms"] / 1e3


def picture(d, dit_json=None, decoder_json=None):
    rows = []
    for p in d["pictures"]:
        size = p["size"]
        base = ""
        if dit_json and str(size) in dit_json.get("sizes", {}):
            base = f"DiT {dit_json['sizes'][str(size)]['torch_bf16_ms']:.0f} ms a step"
        if decoder_json and f"{size}x{size}" in decoder_json.get("sizes", {}):
            dec = decoder_json["sizes"][f"{size}x{size}"]
            if "torch_fp32_ms" in dec:
                base += f"{', ' if base else ''}decoder fp32 {dec['torch_fp32_ms']:.0f} ms"
        floor = _picture_floor(p, dit_json, decoder_json)
        rows.append([f"{size}x{size} #{p['repeat']}", f"{p['encode_s']:.2f} s", f"{p['denoise_s']:.2f} s",
                     f"{p['decode_s']:.3f} s", f"{p['picture_s']:.2f} s",
                     f"{floor:.2f} s" if floor is not None else "", base])
    head = ["picture", "encode", "denoise", "decode", "total", "floor (denoise + decode products)",
            "baseline (same run)"]
    lines = ["### Whole picture", "", f"Weights on the GPU {d['start_to_loaded_s']:.1f} s after process start; "
             f"first denoising step at {d.get('start_to_first_step_s', float('nan')):.1f} s; "
             f"{d['device_memory_in_use_GB']:.1f} GB of device memory in use{_memory_parts(d)}.", ""]
    if d.get("decode_errors"):
        lines += [f"Decode failed: {d['decode_errors'][0]}", ""]
    return lines + _table(head, rows)


COST_PARTS = ("checkpoint open", "transformer upload", "kernels: compiled", "kernels: prebuilt lookups",
              "cuBLASLt plans", "cuDNN plans", "graph captures", "encode", "denoise", "decode", "PNG")


def call_cost(d, name="call_cost"):
    """One row per command, size and kernel cache (medians of the runs): from the command to its exit, its
    imports, the parts timed inside it, its teardown; then each size's chained commands against one call. `name`:
    the output's name, shown where it is not the default one (e.g. call_cost_no_prebuilt)."""
    rows = []
    order = {"image": 0, "encode": 1, "denoise": 2, "decode": 3}
    for key, m in sorted(d["medians"].items(), key=lambda kv: (int(kv[0].split()[1]), kv[0].split()[2],
                                                                order.get(kv[0].split()[0], 4))):
        command, size, cache = key.split()
        rows.append([f"moss-{command} {size}x{size}", cache, str(m["runs"]), f"{m['wall_s']:.2f} s",
                     f"{m['imports_s']:.2f} s"] + [f"{m[p]:.2f} s" if p in m else "" for p in COST_PARTS]
                    + [f"{m['teardown_s']:.2f} s"])
    title = "### One call, from the command to its exit" + ("" if name == "call_cost" else f" ({name})")
    lines = [title, "", "Kernel cache `first`: an empty folder (the kernels "
             "come from the prebuilt files where there are any, else they compile); `warm`: filled by an earlier "
             "process. Medians; the parts overlap where the command runs them on other threads.", ""]
    lines += _table(["command", "kernel cache", "runs", "command to exit", "imports", *COST_PARTS, "teardown"], rows)
    for size in sorted({int(k.split()[1]) for k in d["medians"]}):
        parts = [d["medians"].get(f"{c} {size} warm") for c in ("encode", "denoise", "decode")]
        one = d["medians"].get(f"image {size} warm")
        if all(parts) and one:
            lines += ["", f"Chained at {size}x{size}: " + " + ".join(f"{p['wall_s']:.2f}" for p in parts)
                      + f" = {sum(p['wall_s'] for p in parts):.2f} s, against {one['wall_s']:.2f} s in one call."]
    return lines


def budget(d):
    """One row per emulated card (budget.json from scripts/gpu_budget.py): the plan, seconds from the command to its
    exit against the all-resident call, the peak, the bytes streamed a picture and their floor at the link rate
    measured in the same run, and whether the PNG is the all-resident one."""
    rows, resident = [], next((r["seconds"] for r in d["rows"] if r["run"] == "all"), None)
    for r in d["rows"]:
        if r["run"] == "warm-up":
            continue
        if "error" in r:
            rows.append([r["run"], f"**failed**: {r['error']}", "", "", "", "", ""])
            continue
        plan = r["plan"].split(": ", 1)[-1]
        streamed = f"{r['streamed_GB']:.1f} GB ({r['stream_floor_s']:.2f} s)" if "streamed_GB" in r else ""
        rows.append([r["run"] if r["run"] != "all" else "everything free", plan, f"{r['seconds']:.2f} s",
                     _ratio(r["seconds"], resident) if r["run"] != "all" else "1.00", f"{r['peak_GB']:.1f} GB",
                     streamed, "yes" if r["equal_to_resident"] else "**no**"])
    lines = [f"Host to device (pinned 1 GiB): {d['link_GBps']} GB/s; {d['steps']} steps at 1024x1024.", ""]
    lines += _table(["GB free", "plan", "command to exit", "/ resident", "peak", "streamed a picture (floor)",
                     "PNG = resident"], rows)
    chain = next((r["chain"] for r in d["rows"] if "chain" in r), None)
    if chain:
        lines += ["", "At the smallest budget, the stage commands: " + ", ".join(
            f"moss-{k} {v['seconds']:.2f} s (peak {v['peak_GB']:.1f} GB)" if "error" not in v
            else f"moss-{k} **failed**: {v['error']}" for k, v in chain.items() if isinstance(v, dict)) + f"; the chain's PNG {'equals' if chain['equal_to_resident'] else 'differs from'}"
            " the resident one."]
    return lines


def server(d):
    """moss-server's requests (server.json from scripts/server_bench.py): seconds at the client beside the server's
    own seconds for the picture, the first request after start apart, one client and four at once."""
    mean = lambda xs: sum(xs) / len(xs)          # noqa: E731
    one, four = d["one_client"], d["four_clients"]
    rows = [["first request after ready", f"{d['first']['request_s']:.2f} s", f"{d['first']['picture_s']:.2f} s",
             f"{d['first']['request_s'] - d['first']['picture_s']:.3f} s"],
            [f"1 client, {len(one['request_s'])} requests", f"{mean(one['request_s']):.2f} s",
             f"{mean(one['picture_s']):.2f} s", f"{mean(one['request_s']) - mean(one['picture_s']):.3f} s"],
            [f"4 clients, {len(four['request_s'])} requests", f"{four['per_picture_s']:.2f} s a picture (wall / count)",
             f"{mean(four['picture_s']):.2f} s", f"{four['per_picture_s'] - mean(four['picture_s']):.3f} s"]]
    lines = [f"moss-server at {d['size']}x{d['size']}, {d['steps']} steps: start to ready {d['ready_s']:.1f} s; the first "
             f"PNG {'equals' if d['png_equals_moss_image'] else '**differs from**'} moss-image's.", ""]
    return lines + _table(["requests", "at the client", "the server's picture", "serving adds"], rows)


def tables(folder):
    parts = []
    enc, dj, dec, ld, pic = (_load(folder, n) for n in ("encoder_9b.json", "dit.json", "decoder.json", "load.json",
                                                         "picture.json"))
    costs = {path.stem: json.loads(path.read_text()) for path in sorted(Path(folder).glob("call_cost*.json"))}
    if enc:
        fla = _load(folder, "encoder_baseline_fla.json")
        bound = fla and any(str(m).startswith("fla") for m in fla.get("kernels", {}).values())
        parts += encoder(enc, fla if bound else None, _load(folder, "encoder_baseline_torch.json")) + [""]
    if dj:
        parts += dit(dj) + [""]
    if dec:
        parts += decoder(dec) + [""]
    venc = _load(folder, "vae_encoder.json")
    if venc:
        parts += vae_encoder(venc) + [""]
    if ld:
        parts += load(ld) + [""]
    if pic:
        parts += picture(pic, dj, dec) + [""]
    for name, cost in costs.items():
        parts += call_cost(cost, name) + [""]
    served = _load(folder, "server.json")
    if served:
        parts += server(served) + [""]
    held = _load(folder, "budget.json")
    if held:
        parts += budget(held) + [""]
    return "\n".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--out")
    args = ap.parse_args()
    text = tables(args.folder)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
