"""LoRA / LoKr adapters (moss_cli.lora) held against peft's own merge, kohakumoss's key styles and LyCORIS's LoKr
formula in float64, on the tiny checkpoint; the --lora commands end to end."""

import hashlib
import importlib.util
import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cli_util import FAST, run, single_error
from moss_cli import lora, safetensors_io
from moss_cli.checkpoint import open_checkpoint
from moss_cli.errors import LoraError, UsageError
from moss_cli.png import decode_png

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def base():
    return open_checkpoint()


def linear_names(base, component):
    """The module paths of the component's 2-D weights that adapters may target (the embedding table is not)."""
    return [n[:-len(".weight")] for n, s in base.shapes()[component].items()
            if len(s) == 2 and n.endswith(".weight") and n not in lora.HOST_ONLY]


def torch_tree(base, component):
    """A torch module tree with the component's linears under their official paths, bf16 weights equal to the
    tiny checkpoint's."""
    tensors = base.component(component).tensors
    root = torch.nn.Module()
    for path in linear_names(base, component):
        *parents, leaf = path.split(".")
        m = root
        for p in parents:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        w = np.asarray(tensors[path + ".weight"])
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        linear.weight.data.copy_(torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16))
        m.add_module(leaf, linear)
    return root


def peft_model(base, component, seed, **config):
    """peft's LoRA on every linear of the component, its A and B random bf16-representable values held in float32
    (as peft keeps adapters beside a bf16 base), with rank and alpha patterns."""
    names = linear_names(base, component)
    model = peft.get_peft_model(torch_tree(base, component), peft.LoraConfig(target_modules=names, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=g) * 0.3).to(torch.bfloat16).float())
    return model


def ulps(a, b):
    """|a - b| in bf16 units in the last place (a and b bf16 arrays of finite values)."""
    ia = np.asarray(a).view(np.int16).astype(np.int32)
    ib = np.asarray(b).view(np.int16).astype(np.int32)
    ia = np.where(ia < 0, -32768 - ia, ia)        # sign-magnitude to a monotonic integer line
    ib = np.where(ib < 0, -32768 - ib, ib)
    return np.abs(ia - ib)


def merged_tensors(component, *adapters):
    """The component's tensors with these (file, scale) adapters merged, through open_checkpoint."""
    return open_checkpoint(lora=list(adapters)).component(component).tensors


PEFT_CONFIG = dict(r=4, lora_alpha=8, rank_pattern={"proj.q": 2, "ffn_up_gate": 8, "time_embedding.2": 1},
                   alpha_pattern={"ffn_down": 3, "proj.o": 16})


@pytest.fixture(scope="module")
def peft_dit(base, tmp_path_factory):
    """(peft's adapter folder as save_pretrained writes it, the weights peft's merge_and_unload makes)."""
    folder = tmp_path_factory.mktemp("peft")
    model = peft_model(base, "transformer", 0, **PEFT_CONFIG)
    model.save_pretrained(folder)
    merged = model.merge_and_unload()
    weights = {n: p.detach().to(torch.float32).numpy().astype(BF16) for n, p in merged.state_dict().items()}
    return folder / "adapter_model.safetensors", weights


def count_off(ours, theirs):
    """(tensors compared, elements differing, largest difference in bf16 ulps)."""
    off, worst = 0, 0
    for name, want in theirs.items():
        d = ulps(ours[name], want)
        off += int(np.count_nonzero(d))
        worst = max(worst, int(d.max()))
    return len(theirs), off, worst


# --- the key mapping, written once ----------------------------------------------------------------------------

def test_index_names_every_official_linear_of_both_components_once_per_style(base):
    stems = lora.index(base.shapes())
    for component in ("transformer", "text_encoder"):
        names = linear_names(base, component)
        # the tiny DiT: 24 blocks of 6, 7 outside them, 2 text blocks of 5; the tiny encoder: 6 linear-attention
        # layers of 5 + 3 MLP, 2 full-attention layers of 4 + 3
        assert len(names) == {"transformer": 24 * 6 + 7 + 2 * 5, "text_encoder": 6 * 8 + 2 * 7}[component]
        for path in names:
            under = path.replace(".", "_")
            styles = ([path, "transformer." + path, "diffusion_model." + path, "base_model.model." + path,
                       "lora_unet_" + under, "lycoris_" + under]
                      if component == "transformer" else
                      [path, "text_encoder." + path, "text_encoder.model." + path, "lora_te_" + under,
                       "lora_te_model_language_model_" + under, "base_model.model.model.language_model." + path])
            for stem in styles:
                t = stems[stem]
                assert (t.component, t.names) == (component, (path + ".weight",)), stem
    # ComfyUI's fused layout: block 5's q, k, v rows under one stem
    assert stems["lora_unet_layers_5_proj_qkv"].names == tuple(f"layers.5.proj.{p}.weight" for p in "qkv")


def test_peft_keys_of_every_linear_map_back_to_their_tensor(base):
    """peft's own saved keys (get_peft_model_state_dict) for every linear of both components."""
    from peft import get_peft_model_state_dict
    stems = lora.index(base.shapes())
    for component in ("transformer", "text_encoder"):
        model = peft_model(base, component, 1, r=2)
        keys = get_peft_model_state_dict(model)
        assert len(keys) == 2 * len(linear_names(base, component))
        for key in keys:
            stem, suffix = lora._split(key)
            assert suffix in ("lora_A.weight", "lora_B.weight")
            assert stems[stem].component == component
            assert stems[stem].names == (stem.removeprefix("base_model.model.") + ".weight",)


def _kohakumoss(module):
    """One of kohakumoss's adapter modules, loaded from its file: the package's __init__ wants lycoris-lora,
    which these modules (key styles and key grouping) do not use."""
    spec = importlib.util.find_spec("kohakumoss")
    if spec is None:
        pytest.skip("kohakumoss is not installed")
    path = Path(spec.origin).parent / "adapters" / f"{module}.py"
    loaded = importlib.util.spec_from_file_location(f"kohakumoss_{module.replace('/', '_')}", path)
    out = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(out)
    return out


def test_kohakumoss_export_styles_and_its_key_grouping_agree_with_ours(base):
    """kohakumoss's layer_key (both export styles) names each DiT linear; its stem_index + group (how it loads a
    file) and our index send every such key to the same module."""
    files, formats = _kohakumoss("export/files"), _kohakumoss("infer/formats")
    stems = lora.index(base.shapes())
    model = torch_tree(base, "transformer")
    theirs = formats.stem_index(model)
    paths = linear_names(base, "transformer")
    keys = {files.layer_key(p, style) + ".lora_down.weight": p
            for p in paths for style in files.KEY_STYLES}
    assert len(keys) == 2 * len(paths)
    groups, unmatched = formats.group(dict.fromkeys(keys, 0), theirs)
    assert unmatched == []
    assert {p: sorted(g) for p, g in groups.items()} == {p: ["lora_down.weight"] for p in paths}
    for key, path in keys.items():
        assert stems[lora._split(key)[0]].names == (path + ".weight",)


def test_kohakumoss_fused_qkv_export_merges_as_its_three_parts(base, tmp_path, monkeypatch):
    """kohakumoss's fused_lora (its FUSED_QKV export: one LoRA over q;k;v, each part's alpha / r folded into a
    block-diagonal up, alpha = total rank) merges into the weights the three separate LoRAs give, and both
    equal the float64 statement of each part."""
    import sys
    import types
    formats = _kohakumoss("infer/formats")
    for name in ("kohakumoss.adapters", "kohakumoss.adapters.infer"):     # skip the packages' __init__
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "kohakumoss.adapters.infer.formats", formats)
    fused = _kohakumoss("export/fused")
    g = torch.Generator().manual_seed(9)
    parts, separate = {}, {}
    for p, rank, alpha in (("q", 2, 1.0), ("k", 3, 6.0), ("v", 4, 4.0)):
        up = (torch.randn(32, rank, generator=g) * 0.3).bfloat16().float()
        down = (torch.randn(rank, 32, generator=g) * 0.3).bfloat16().float()
        parts[p] = {"lora_up.weight": up, "lora_down.weight": down, "alpha": torch.tensor(alpha)}
        separate.update({f"lora_unet_layers_4_proj_{p}.{k}": v.numpy() for k, v in parts[p].items()})
    joint = fused.fused_lora(parts, {"q": 32, "k": 32, "v": 32})
    safetensors_io.save(tmp_path / "fused.safetensors",
                        {f"lora_unet_layers_4_proj_qkv.{k}": v.numpy() for k, v in joint.items()})
    safetensors_io.save(tmp_path / "separate.safetensors", separate)
    a = merged_tensors("transformer", (tmp_path / "fused.safetensors", 1.0))
    b = merged_tensors("transformer", (tmp_path / "separate.safetensors", 1.0))
    w = base.component("transformer").tensors
    for p, t in parts.items():
        name = f"layers.4.proj.{p}.weight"
        delta = t["lora_up.weight"].double().numpy() @ t["lora_down.weight"].double().numpy() \
            * float(t["alpha"]) / t["lora_down.weight"].shape[0]
        want = (np.asarray(w[name], np.float64) + delta).astype(BF16)
        assert ulps(a[name], want).max() <= 1 and ulps(b[name], want).max() <= 1
        assert np.count_nonzero(ulps(a[name], w[name])) > 900


# --- merged weights against peft ------------------------------------------------------------------------------

def test_merge_equals_peft_merge_and_unload_from_its_own_saved_folder(peft_dit):
    """alpha and the rank pattern come from peft's adapter_config.json beside the file; peft adds a float32 delta
    to the bf16 weight and rounds once, as we do. Its B @ A is torch's float32 matmul and ours numpy's, so an
    element whose float32 sum sits at a bf16 rounding boundary could round the other way: none does here."""
    file, theirs = peft_dit
    ours = merged_tensors("transformer", (file, 1.0))
    compared, off, worst = count_off(ours, theirs)
    assert (compared, off, worst) == (161, 0, 0)


def test_diffusers_file_with_adapter_metadata_merges_as_peft(peft_dit, tmp_path):
    """The same adapter as diffusers saves it: `transformer.` keys, the LoraConfig fields in the file's
    lora_adapter_metadata, prefixed with the component's name; nothing beside the file."""
    file, theirs = peft_dit
    tensors, _ = safetensors_io.load(file)
    fields = {f"transformer.{k}": v for k, v in PEFT_CONFIG.items()}
    out = tmp_path / "pytorch_lora_weights.safetensors"
    safetensors_io.save(out, {"transformer." + k.removeprefix("base_model.model."): np.array(v)
                              for k, v in tensors.items()},
                        {"format": "pt", "lora_adapter_metadata": json.dumps(fields)})
    assert count_off(merged_tensors("transformer", (out, 1.0)), theirs) == (161, 0, 0)


def test_scale_multiplies_the_delta_as_peft_scales_its_adapter(base, tmp_path):
    """peft's set_scale(adapter, s) makes its factor s * alpha / r: the merge at --lora FILE:0.5 equals it."""
    model = peft_model(base, "transformer", 2, r=4, lora_alpha=4)
    model.save_pretrained(tmp_path)
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.set_scale("default", 0.5)
    theirs = {n: p.detach().float().numpy().astype(BF16) for n, p in model.merge_and_unload().state_dict().items()}
    ours = merged_tensors("transformer", (tmp_path / "adapter_model.safetensors", 0.5))
    assert count_off(ours, theirs) == (161, 0, 0)


def test_rslora_folder_merges_as_peft(base, tmp_path):
    """use_rslora: peft's factor is alpha / sqrt(r); the adapter given as peft's folder itself."""
    model = peft_model(base, "transformer", 8, r=4, lora_alpha=3, use_rslora=True, rank_pattern={"proj.k": 9})
    model.save_pretrained(tmp_path)
    theirs = {n: p.detach().float().numpy().astype(BF16) for n, p in model.merge_and_unload().state_dict().items()}
    assert count_off(merged_tensors("transformer", (tmp_path, 1.0)), theirs) == (161, 0, 0)


def test_two_adapters_sum_in_float32_and_round_once(base, tmp_path):
    """W' = bf16(W + 0.7 d1 - 0.3 d2): against the same sum in float64, rounded once to bf16. Our float32 sum can
    land on the other side of a bf16 rounding boundary only when the float64 value lies within float32 rounding
    of it: at most one ulp, and rare."""
    files, deltas = [], []
    rng = np.random.default_rng(3)
    for k, rank in enumerate((3, 6)):
        tensors, expect = {}, {}
        for path in linear_names(base, "transformer"):
            out, inn = base.shapes()["transformer"][path + ".weight"]
            up = (rng.standard_normal((out, rank)) * 0.3).astype(BF16)
            down = (rng.standard_normal((rank, inn)) * 0.3).astype(BF16)
            alpha = float(rank + k)
            stem = "lora_unet_" + path.replace(".", "_")
            tensors.update({stem + ".lora_up.weight": up, stem + ".lora_down.weight": down,
                            stem + ".alpha": np.array(alpha, np.float32)})
            expect[path + ".weight"] = up.astype(np.float64) @ down.astype(np.float64) * (alpha / rank)
        files.append(tmp_path / f"a{k}.safetensors")
        safetensors_io.save(files[-1], tensors)
        deltas.append(expect)
    ours = merged_tensors("transformer", (files[0], 0.7), (files[1], -0.3))
    w = base.component("transformer").tensors
    total, off, worst = 0, 0, 0
    for name in deltas[0]:
        want = (np.asarray(w[name], np.float64) + 0.7 * deltas[0][name] - 0.3 * deltas[1][name]).astype(BF16)
        d = ulps(ours[name], want)
        total, off, worst = total + d.size, off + int(np.count_nonzero(d)), max(worst, int(d.max()))
    assert worst <= 1
    assert off / total < 0.002, (off, total)


def test_lokr_equals_lycoris_formula_in_float64(base, tmp_path):
    """LyCORIS LoKr: delta = kron(w1, w2) * alpha / r, w1 or w2 given whole or as a product of rank r; with both
    whole the factor is 1 whatever alpha says. Written here in float64 and rounded once."""
    rng = np.random.default_rng(4)
    mats = lambda *s: (rng.standard_normal(s) * 0.4).astype(BF16)
    kron = lambda w1, w2: np.kron(w1, w2)
    layers = {   # path: (stored parts, float64 delta)
        "layers.0.proj.q": (
            {"lokr_w1": mats(4, 4), "lokr_w2_a": mats(8, 2), "lokr_w2_b": mats(2, 8),
             "alpha": np.array(1.0, np.float32)},
            lambda p: kron(p["lokr_w1"], p["lokr_w2_a"] @ p["lokr_w2_b"]) * 1.0 / 2),
        "layers.3.proj.ffn_up_gate": (
            {"lokr_w1_a": mats(8, 3), "lokr_w1_b": mats(3, 4), "lokr_w2_a": mats(16, 3), "lokr_w2_b": mats(3, 8),
             "alpha": np.array(6.0, np.float32)},
            lambda p: kron(p["lokr_w1_a"] @ p["lokr_w1_b"], p["lokr_w2_a"] @ p["lokr_w2_b"]) * 6.0 / 3),
        "layers.7.proj.ffn_down": (      # both whole: factor 1, alpha 5 ignored
            {"lokr_w1": mats(2, 8), "lokr_w2": mats(16, 8), "alpha": np.array(5.0, np.float32)},
            lambda p: kron(p["lokr_w1"], p["lokr_w2"])),
    }
    tensors = {}
    for path, (parts, _) in layers.items():
        tensors.update({f"lycoris_{path.replace('.', '_')}.{k}": v for k, v in parts.items()})
    file = tmp_path / "lokr.safetensors"
    safetensors_io.save(file, tensors)
    ours = merged_tensors("transformer", (file, 0.75))
    w = base.component("transformer").tensors
    for path, (parts, formula) in layers.items():
        p64 = {k: np.asarray(v, np.float64) for k, v in parts.items()}
        want = (np.asarray(w[path + ".weight"], np.float64) + 0.75 * formula(p64)).astype(BF16)
        d = ulps(ours[path + ".weight"], want)
        assert d.max() <= 1 and np.count_nonzero(d) <= d.size // 200, (path, np.count_nonzero(d))
        assert np.count_nonzero(ulps(ours[path + ".weight"], w[path + ".weight"])) > d.size // 2


def test_fused_qkv_layer_splits_into_q_k_and_v_rows(base, tmp_path):
    """ComfyUI's `layers.N.proj.qkv` LoRA: its delta's three row blocks are q's, k's and v's."""
    rng = np.random.default_rng(5)
    up, down = (rng.standard_normal((96, 4)) * 0.3).astype(BF16), (rng.standard_normal((4, 32)) * 0.3).astype(BF16)
    file = tmp_path / "qkv.safetensors"
    safetensors_io.save(file, {"diffusion_model.layers.2.proj.qkv.lora_up.weight": up,
                               "diffusion_model.layers.2.proj.qkv.lora_down.weight": down})
    ours = merged_tensors("transformer", (file, 1.0))
    w = base.component("transformer").tensors
    delta = up.astype(np.float64) @ down.astype(np.float64)
    for i, p in enumerate("qkv"):
        name = f"layers.2.proj.{p}.weight"
        want = (np.asarray(w[name], np.float64) + delta[32 * i:32 * (i + 1)]).astype(BF16)
        assert ulps(ours[name], want).max() <= 1


def test_text_encoder_adapter_merges_into_the_encoder_only(base, tmp_path):
    rng = np.random.default_rng(6)
    path = "layers.3.self_attn.q_proj"
    out, inn = base.shapes()["text_encoder"][path + ".weight"]
    up, down = (rng.standard_normal((out, 2)) * 0.3).astype(BF16), (rng.standard_normal((2, inn)) * 0.3).astype(BF16)
    file = tmp_path / "te.safetensors"
    safetensors_io.save(file, {"lora_te_" + path.replace(".", "_") + ".lora_up.weight": up,
                               "lora_te_" + path.replace(".", "_") + ".lora_down.weight": down})
    ckpt = open_checkpoint(lora=[(file, 1.0)])
    assert ckpt.adapters[0].components == ("text_encoder",)
    te = ckpt.component("text_encoder").tensors
    w = base.component("text_encoder").tensors
    want = (np.asarray(w[path + ".weight"], np.float64) + up.astype(np.float64) @ down.astype(np.float64)).astype(BF16)
    assert ulps(te[path + ".weight"], want).max() <= 1
    assert all(np.array_equal(np.asarray(te[k]).view(np.uint8), np.asarray(w[k]).view(np.uint8))
               for k in w if k != path + ".weight")
    assert ckpt.component("transformer").tensors.keys() == base.component("transformer").tensors.keys()


def test_float32_weight_merges_without_rounding():
    t = lora.Target("transformer", ("w.weight",), (2,), 2, "w")
    layer = lora.Layer(t, "lora", {"up": np.array([[1.0], [2.0]], np.float32),
                                   "down": np.array([[1e-9, 3.0]], np.float32)}, 0.5, "w")
    adapter = lora.Adapter(Path("a"), 2.0, "0" * 64, "kohya", (layer,))
    w = np.array([[1.0, 1.0], [1.0, 1.0]], np.float32)
    out = lora.merge("transformer", {"w.weight": w}, [adapter])["w.weight"]
    assert out.dtype == np.float32
    assert out.tolist() == [[np.float32(1.0 + np.float32(1e-9)), 4.0], [np.float32(1 + np.float32(2e-9)), 7.0]]


def test_scale_zero_merges_to_the_base_bits(base, peft_dit):
    file, _ = peft_dit
    adapter = lora.read(file, 0.0, base.shapes())
    w = base.component("transformer").tensors
    merged = lora.merge("transformer", w, [adapter])
    assert all(np.array_equal(np.asarray(merged[k]).view(np.uint16), np.asarray(w[k]).view(np.uint16))
               for k in w if np.asarray(w[k]).ndim == 2)


# --- planted controls: the peft comparison catches each ----------------------------------------------------------

def test_planted_alpha_ignored_is_caught(peft_dit, monkeypatch):
    file, theirs = peft_dit
    monkeypatch.setattr(lora, "_alpha", lambda *args: None)
    _, off, _ = count_off(merged_tensors("transformer", (file, 1.0)), theirs)
    assert off > 10000


def test_planted_a_and_b_swapped_is_caught(base, peft_dit, tmp_path, monkeypatch):
    """Swapped A and B: the shape check refuses the file, and where the shapes allow the swap (rank 32 on the
    32 x 32 q weights: B A and A B are both [32, 32]) the comparison with peft catches every such weight."""
    file, _ = peft_dit
    q = [p for p in linear_names(base, "transformer") if p.endswith("proj.q")]
    model = peft.get_peft_model(torch_tree(base, "transformer"), peft.LoraConfig(target_modules=q, r=32))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(torch.bfloat16).float())
    model.save_pretrained(tmp_path)
    merged = model.merge_and_unload()
    theirs = {n + ".weight": merged.get_submodule(n).weight.detach().float().numpy().astype(BF16) for n in q}
    assert count_off(merged_tensors("transformer", (tmp_path, 1.0)), theirs) == (24, 0, 0)
    swapped = dict(lora.SUFFIXES, **{"lora_A.weight": ("peft", "up"), "lora_B.weight": ("peft", "down")})
    monkeypatch.setattr(lora, "SUFFIXES", swapped)
    with pytest.raises(LoraError, match="delta|rank mismatch"):
        merged_tensors("transformer", (file, 1.0))
    ours = merged_tensors("transformer", (tmp_path, 1.0))
    assert all(np.count_nonzero(ulps(ours[n], theirs[n])) > 500 for n in theirs)


def test_planted_neighbour_key_is_caught(peft_dit, monkeypatch):
    """Block 0's q key read as its k (and k as q): exactly those two weights differ from peft's."""
    file, theirs = peft_dit
    index = lora.index

    def shifted(shapes):
        out = index(shapes)
        q, k = "base_model.model.layers.0.proj.q", "base_model.model.layers.0.proj.k"
        out[q], out[k] = out[k], out[q]
        return out

    monkeypatch.setattr(lora, "index", shifted)
    ours = merged_tensors("transformer", (file, 1.0))
    wrong = sorted(n for n in theirs if np.count_nonzero(ulps(ours[n], theirs[n])))
    assert wrong == ["layers.0.proj.k.weight", "layers.0.proj.q.weight"]


# --- fingerprints and records ------------------------------------------------------------------------------------

def test_fingerprint_of_a_merged_model(base, peft_dit):
    file, _ = peft_dit
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    ckpt = open_checkpoint(lora=[(file, 0.5)])
    line = f"{digest} 0.5\n"
    assert ckpt.fingerprint == hashlib.sha256(b"moss-cli lora fingerprint v1\n" + base.fingerprint.encode() + b"\n"
                                              + line.encode()).hexdigest()
    assert ckpt.base_fingerprint == base.fingerprint != ckpt.fingerprint
    assert open_checkpoint(lora=[(file, 0.0)]).fingerprint == base.fingerprint     # scale 0: the base model
    assert lora.record(ckpt.adapters) == f'[{{"scale":0.5,"sha256":"{digest}"}}]'


@pytest.mark.parametrize("text, want", [("a.safetensors", ("a.safetensors", 1.0)),
                                        ("a.safetensors:0.5", ("a.safetensors", 0.5)),
                                        ("dir/x:y.safetensors:-1", ("dir/x:y.safetensors", -1.0)),
                                        ("C:/x.safetensors", ("C:/x.safetensors", 1.0))])
def test_parse_spec(text, want):
    path, scale = lora.parse_spec(text)
    assert (str(path), scale) == want


# --- the commands --------------------------------------------------------------------------------------------------

def kohya_file(base, path, seed=7, rank=4):
    rng = np.random.default_rng(seed)
    tensors = {}
    for name in linear_names(base, "transformer"):
        if name.startswith("layers."):
            out, inn = base.shapes()["transformer"][name + ".weight"]
            stem = "lora_unet_" + name.replace(".", "_")
            tensors[stem + ".lora_up.weight"] = (rng.standard_normal((out, rank)) * 0.5).astype(BF16)
            tensors[stem + ".lora_down.weight"] = rng.standard_normal((rank, inn)).astype(BF16)
            tensors[stem + ".alpha"] = np.array(2.0, np.float32)
    safetensors_io.save(path, tensors)
    return path


def test_scale_zero_picture_is_the_base_models_byte_for_byte(base, tmp_path):
    adapter = kohya_file(base, tmp_path / "k.safetensors")
    a = run("moss-image", "--prompt", "fox", "--seed", "3", *FAST, "--picture", tmp_path / "base.png", "--quiet")
    b = run("moss-image", "--prompt", "fox", "--seed", "3", *FAST, "--picture", tmp_path / "zero.png",
            "--lora", f"{adapter}:0", "--quiet")
    c = run("moss-image", "--prompt", "fox", "--seed", "3", *FAST, "--picture", tmp_path / "one.png",
            "--lora", adapter, "--quiet")
    assert (a.code, b.code, c.code) == (0, 0, 0), a.stderr + b.stderr + c.stderr
    assert (tmp_path / "zero.png").read_bytes() == (tmp_path / "base.png").read_bytes()
    assert (tmp_path / "one.png").read_bytes() != (tmp_path / "base.png").read_bytes()


def test_chain_records_the_adapter_and_refuses_other_models(base, tmp_path):
    adapter = kohya_file(base, tmp_path / "k.safetensors")
    digest = hashlib.sha256(adapter.read_bytes()).hexdigest()
    spec = f"{adapter}:0.8"
    image = run("moss-image", "--prompt", "fox", "--seed", "3", *FAST, "--picture", tmp_path / "img.png",
                "--lora", spec, "--keep", tmp_path / "keep", "--quiet")
    assert image.code == 0, image.stderr
    _, meta = safetensors_io.load(tmp_path / "keep" / "latents.lat")
    assert json.loads(meta["moss.lora"]) == [{"scale": 0.8, "sha256": digest}]
    _, enc_meta = safetensors_io.load(tmp_path / "keep" / "prompt.enc")
    assert enc_meta["moss.lora"] == meta["moss.lora"]
    params = json.loads(decode_png((tmp_path / "img.png").read_bytes())[1]["parameters"])
    assert params["lora"] == [{"scale": 0.8, "sha256": digest}]
    lat = tmp_path / "keep" / "latents.lat"
    refused = run("moss-decode", lat, "--out", tmp_path / "d.png")
    assert refused.code == 1
    assert "give every command of a chain the same --lora" in single_error(refused)
    other = run("moss-decode", lat, "--lora", f"{adapter}:0.5", "--out", tmp_path / "d.png")
    assert other.code == 1 and "made with another model" in single_error(other)
    ok = run("moss-decode", lat, "--lora", spec, "--out", tmp_path / "d.png")
    assert ok.code == 0, ok.stderr
    lines = ok.stderr.splitlines()
    assert lines[0].startswith("moss-decode: model ") and lines[0].endswith(", device cpu")
    assert lines[1] == "moss-decode: LoRA k.safetensors (kohya, 144 transformer layers) at scale 0.8"
    assert (tmp_path / "d.png").read_bytes() == (tmp_path / "img.png").read_bytes()
    plain = run("moss-encode", "--prompt", "fox", "--out", tmp_path / "plain.enc", "--quiet")
    assert plain.code == 0
    denoise = run("moss-denoise", tmp_path / "plain.enc", "--seed", "3", *FAST, "--lora", spec,
                  "--out", tmp_path / "x.lat")
    assert denoise.code == 1 and "same --lora" in single_error(denoise)


def test_encode_merges_text_encoder_adapters_and_records_every_adapter(base, tmp_path):
    """A text-encoder adapter changes the rows; a DiT-only one leaves them as they were, and both are recorded
    (the ENC belongs to the adapted model, so moss-denoise with the same --lora takes it)."""
    rng = np.random.default_rng(10)
    stem = "lora_te_layers_3_self_attn_q_proj"
    out, inn = base.shapes()["text_encoder"]["layers.3.self_attn.q_proj.weight"]
    safetensors_io.save(tmp_path / "te.safetensors",
                        {stem + ".lora_up.weight": rng.standard_normal((out, 4)).astype(BF16),
                         stem + ".lora_down.weight": rng.standard_normal((4, inn)).astype(BF16)})
    dit = kohya_file(base, tmp_path / "dit.safetensors")
    rows = {}
    for name, extra in (("base", []), ("te", ["--lora", tmp_path / "te.safetensors"]), ("dit", ["--lora", dit])):
        r = run("moss-encode", "--prompt", "fox", "--out", tmp_path / f"{name}.enc", "--quiet", *extra)
        assert r.code == 0, r.stderr
        rows[name] = safetensors_io.load(tmp_path / f"{name}.enc")
    assert not np.array_equal(rows["te"][0]["prompt_rows"], rows["base"][0]["prompt_rows"])
    assert np.array_equal(rows["dit"][0]["prompt_rows"], rows["base"][0]["prompt_rows"])
    assert json.loads(rows["dit"][1]["moss.lora"])[0]["sha256"] == hashlib.sha256(dit.read_bytes()).hexdigest()
    assert len({meta["moss.model"] for _, meta in rows.values()}) == 3
    r = run("moss-denoise", tmp_path / "dit.enc", "--seed", "1", *FAST, "--lora", dit, "--out", tmp_path / "x.lat",
            "--quiet")
    assert r.code == 0, r.stderr


def test_picture_with_peft_adapter_equals_the_picture_of_peft_merged_checkpoint(peft_dit, tmp_path):
    """The graph reads the merged weights: a copy of the tiny checkpoint holding peft's merge_and_unload weights
    makes, without --lora, the pixels the embedded checkpoint makes with --lora and peft's saved folder."""
    from cli_util import copy_model
    from moss_cli.png import decode_png
    file, theirs = peft_dit
    model = copy_model(tmp_path)
    for shard in sorted((model / "transformer").glob("*.safetensors")):
        tensors, meta = safetensors_io.load(shard)
        tensors = {k: theirs.get(k, v) for k, v in tensors.items()}
        safetensors_io.save(shard, tensors, meta)
    args = ["--prompt", "fox", "--seed", "5", *FAST, "--quiet"]
    a = run("moss-image", *args, "--model", model, "--picture", tmp_path / "merged.png")
    b = run("moss-image", *args, "--lora", file.parent, "--picture", tmp_path / "lora.png")
    c = run("moss-image", *args, "--picture", tmp_path / "base.png")
    assert (a.code, b.code, c.code) == (0, 0, 0), a.stderr + b.stderr + c.stderr
    pixels_a, text_a = decode_png((tmp_path / "merged.png").read_bytes())
    pixels_b, text_b = decode_png((tmp_path / "lora.png").read_bytes())
    assert np.array_equal(pixels_a, pixels_b)
    assert not np.array_equal(pixels_b, decode_png((tmp_path / "base.png").read_bytes())[0])
    assert "lora" in json.loads(text_b["parameters"]) and "lora" not in json.loads(text_a["parameters"])


def test_base_artifacts_and_png_carry_no_lora_field(tmp_path):
    r = run("moss-image", "--prompt", "fox", "--seed", "3", *FAST, "--picture", tmp_path / "p.png",
            "--keep", tmp_path / "keep", "--quiet")
    assert r.code == 0
    assert "moss.lora" not in safetensors_io.load(tmp_path / "keep" / "latents.lat")[1]
    assert "lora" not in json.loads(decode_png((tmp_path / "p.png").read_bytes())[1]["parameters"])


def _bad(base, tmp_path, case):
    path = tmp_path / f"{case}.safetensors"
    good = kohya_file(base, tmp_path / "good.safetensors")
    tensors, _ = safetensors_io.load(good)
    tensors = dict(tensors)
    if case == "unmatched":
        tensors["lora_unet_layers_99_proj_q.lora_up.weight"] = np.zeros((32, 4), BF16)
        tensors["lora_unet_layers_99_proj_q.lora_down.weight"] = np.zeros((4, 32), BF16)
    elif case == "rank":
        tensors["lora_unet_layers_1_proj_k.lora_down.weight"] = np.zeros((3, 32), BF16)
    else:
        tensors = {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": np.zeros((4, 320), BF16),
                   "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": np.zeros((320, 4), BF16)}
    safetensors_io.save(path, tensors, {"ss_base_model_version": "sdxl_base_v1-0"} if case == "other" else None)
    return path


@pytest.mark.parametrize("case, words", [
    ("unmatched", "2 keys match no weight of this model: lora_unet_layers_99_proj_q.lora_down.weight, "
                  "lora_unet_layers_99_proj_q.lora_up.weight"),
    ("rank", "rank mismatch in lora_unet_layers_1_proj_k: up/B [32, 4], down/A [3, 32]"),
    ("other", "made for another model (its metadata says sdxl_base_v1-0): no key names a MOSS-Image weight, "
              "e.g. lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight, "
              "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight"),
])
def test_bad_adapter_is_one_line_and_exit_1(base, tmp_path, case, words):
    path = _bad(base, tmp_path, case)
    r = run("moss-image", "--prompt", "fox", "--seed", "1", *FAST, "--picture", tmp_path / "p.png",
            "--lora", path)
    assert r.code == 1
    line = single_error(r)
    assert line == f"moss-image: error: --lora {path}: {words}"
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("config, words", [
    (b'{"r": 4, "lora_alpha": 8, "note": "\xff"}', "adapter_config.json cannot be read as UTF-8 text"),
    (b'{"r": 4, "lora_alpha": "eight"}', "lora_alpha 'eight' in its LoRA config is not a finite number"),
    (b'{"r": 4, "lora_alpha": [8]}', "lora_alpha [8] in its LoRA config is not a finite number"),
    (b'{"r": 4, "lora_alpha": NaN}', "lora_alpha nan in its LoRA config is not a finite number"),
    (b'{"r": 4, "lora_alpha": 1e999}', "lora_alpha inf in its LoRA config is not a finite number"),
    (b'{"r": 4, "lora_alpha": true}', "lora_alpha True in its LoRA config is not a finite number"),
    (b'{"r": 4, "alpha_pattern": ["x"]}', "alpha_pattern in its LoRA config is not an object"),
    (b'{"r": 4, "alpha_pattern": {"(": 2}}', "alpha_pattern '(' is not a regular expression"),
    (b'{"r": 4, "alpha_pattern": {".*": "2"}}', "alpha_pattern '.*' '2' in its LoRA config is not a finite"),
])
def test_a_bad_peft_config_is_one_line_when_the_adapter_is_read(peft_dit, tmp_path, config, words):
    """Each was an internal error (or, for NaN, a picture of NaN latents after all the work): now a LoraError
    naming the field as the adapters are read, before any weight is merged."""
    file, _ = peft_dit
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(file.read_bytes())
    (folder / "adapter_config.json").write_bytes(config)
    with pytest.raises(LoraError, match="--lora .*" + re.escape(words)):
        merged_tensors("transformer", (folder / "adapter_model.safetensors", 1.0))


def test_the_same_adapter_twice_is_a_usage_error(base, tmp_path):
    adapter = kohya_file(base, tmp_path / "k.safetensors")
    (tmp_path / "link.safetensors").symlink_to(adapter)
    r = run("moss-image", "--prompt", "fox", "--seed", "1", *FAST, "--picture", tmp_path / "p.png",
            "--lora", adapter, "--lora", f"{tmp_path / 'link.safetensors'}:0.5")
    assert "the same adapter as --lora" in single_error(r) and r.code == 2
    assert not (tmp_path / "p.png").exists()


def test_a_scale_that_is_not_a_number_after_an_existing_file_is_named(tmp_path):
    good = tmp_path / "good.safetensors"
    good.write_bytes(b"")
    for tail in ("abc", "0x10", "1_0"):
        with pytest.raises(UsageError, match=f"the scale '{tail}' is not a number"):
            lora.parse_spec(f"{good}:{tail}")
    assert lora.parse_spec(f"{good}:0.5") == (good, 0.5)
    assert lora.parse_spec(f"{tmp_path}/missing.safetensors:abc")[1] == 1.0     # a name with ':' in it, then


def test_the_gpu_takes_the_base_weights_and_the_memory_plan_merges_nothing(base, peft_dit):
    """With --lora the GPU's weights start as the folder's own: stages.preload_gpu_weights and the GPU components
    read base_component, and gpu/lora_merge.py merges them on the device (tests/test_lora_gpu_sim.py). The memory
    plan reads shapes only, so no host merge runs before the GPU's; every view of the folder shares one base."""
    from moss_cli import stages
    file, theirs = peft_dit
    ckpt = open_checkpoint(lora=[(file, 1.0)])
    plan = stages.memory_plan(ckpt, ("encode", "denoise", "decode"), gpu_memory=80, memory=False)
    assert plan.resident and not ckpt._loaded
    held = ckpt.base_component("transformer").tensors
    w = base.component("transformer").tensors
    assert all(np.array_equal(np.asarray(held[k]).view(np.uint8), np.asarray(w[k]).view(np.uint8)) for k in w)
    merged = ckpt.component("transformer").tensors
    assert all(np.array_equal(np.asarray(merged[n]).view(np.uint16), theirs[n].view(np.uint16)) for n in theirs)
    assert ckpt.with_adapters(()).base_component("transformer").tensors is held
    assert ckpt.with_adapters(()).fingerprint == base.fingerprint
