"""Registers, shared memory, stack and spills of every kernel compiled for sm_90, without a GPU.

    python -m cuda_kernels.resources            # print the record
    python -m cuda_kernels.resources --write    # rewrite cuda_kernels/RESOURCES.json

Needs numba-cuda's cu13 extra (NVVM, NVRTC, nvJitLink) but no GPU: kernels are compiled to PTX with the
argument types they are launched with, then linked for sm_90 by nvJitLink, whose ptxas log is parsed; the
cubin is disassembled by nvdisasm (the nvidia-cuda-nvdisasm wheel) to count its instructions and its
float64 ones (every kernel is meant to compute in float32: a Python float constant in a kernel makes
float64 arithmetic that nothing else shows).
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RECORD = Path(__file__).with_name("RESOURCES.json")
ARCH = (9, 0)


def _signatures():
    from numba.core import types as t
    from . import (conv, dit, elementwise, embedding, flash, gdn, gdn_chunk, gdn_inputs, gdn_setup, layout, lora, mma,
                   norms, rope_attention)
    from .core import row_team

    def a(dtype, ndim, layout="C"):
        return t.Array(dtype, ndim, layout)
    f1, f2, f3 = a(t.float32, 1), a(t.float32, 2), a(t.float32, 3)
    s2, s3, b2, b3 = a(t.float32, 2, "A"), a(t.float32, 3, "A"), a(t.uint16, 2), a(t.uint16, 3)
    tup = t.UniTuple(t.int64, 4)
    u1 = a(t.uint32, 1)
    w2 = a(t.uint64, 2, "A")                                   # 8-byte words (elementwise._words)
    w2c, u8v = a(t.uint64, 2), a(t.uint64, 1)                  # dit's contiguous word views
    split_image_args = (f3, f1, f1, u1, *(t.int64,) * 4, f2, f1, f1, t.int64)
    packed_team = elementwise._tiles(1, 2 * 12288 // elementwise.PACK)[1]
    return {
        "cast_bf16": (elementwise._cast[False], (f1, a(t.uint16, 1))),
        "unary": (elementwise._unary[False], (f1, f1, t.int64, t.float32)),
        "binary": (elementwise._binary[False], (f1, f1, f1, t.int64)),
        "strided_copy": (layout._copy[False], (f1, t.int64, tup, f1, t.int64, tup, tup)),
        "copy_rows": (layout._rows[False], (f1, t.int64, t.int64, f1, t.int64, t.int64, t.int64, t.int64)),
        "random_bf16": (layout._random[False], (a(t.uint16, 1), t.uint32, t.float32, t.float32)),
        "embedding": (embedding._embedding[False], (a(t.uint16, 2), a(t.int32, 1), f2)),
        "rms_norm_d256": (norms._rms(False, False, *row_team(256), True), (s3, f1, f3, t.float32, t.float32)),
        "rms_norm_d4096": (norms._rms(False, False, *row_team(4096), True), (f3, f1, f3, t.float32, t.float32)),
        "rms_norm_bf16_out_d4096": (norms._rms(False, True, *row_team(4096), True), (f3, f1, b3, t.float32, t.float32)),
        "l2_norm_d128": (norms._l2(False, *row_team(128), True), (s3, f3, t.float32, t.float32)),
        "gated_rms_norm_bf16_out_d128": (norms._gated(False, True, *row_team(128), True), (f3, s3, f1, b3, t.float32)),
        "swiglu_bf16_out": (elementwise._swiglu(False, True, elementwise._tiles(1, 12288)[1]), (s2, s2, b2)),
        "swiglu_bf16_in_out": (elementwise._swiglu(False, True, elementwise._tiles(1, 12288)[1], True),
                               (a(t.uint16, 2, "A"), a(t.uint16, 2, "A"), b2)),
        "swiglu_packed_bf16_out": (elementwise._swiglu_packed(False, True, packed_team, False), (w2, w2, w2, t.int64)),
        "swiglu_packed_bf16_in_out": (elementwise._swiglu_packed(False, True, packed_team, True),
                                      (w2, w2, w2, t.int64)),
        "rms_norm_rope_d256_r32": (norms._rms_rope(False, *row_team(256), 32 // row_team(256)[0]),
                                   (s3, f1, f2, f2, f3, t.float32, t.float32)),
        "sigmoid_gate_bf16_out": (elementwise._sigmoid_gate(False, True, elementwise._tiles(1, 256)[1]), (f3, s3, b3)),
        "gdn_inputs_dk128": (gdn_inputs._make(False, 4, 128, 32), (s2, f2, s2, s2, f1, f1, f2, f2, f2, f2, f2,
                                                                 t.float32, t.float32)),
        "gdn_gates": (gdn._gates[False], (s2, s2, f1, f1, f2, f2)),
        "rope": (rope_attention._rope[False], (f3, f2, f2, f3)),
        "softmax_causal_s1024": (rope_attention._softmax(False, *row_team(1024)), (f3, t.float32, t.boolean)),
        "causal_conv1d_k4": (gdn._make_conv(False, 4), (s2, f2, f2, t.boolean)),
        "gated_delta_rule_dk128": (gdn._make_delta_rule(False, 128, *gdn.GEOMETRY),
                                   (f3, f3, s3, f2, f2, f3, a(t.int64, 2))),
        "delta_chunk_setup": (gdn_setup._make_setup(False, 2, 128, 128),
                              (f1, f1, s3, f2, f2, f1, f1, f3, a(t.int64, 2))),
        "delta_chunk_walk": (gdn_chunk._make_walk(False, *gdn_chunk.WALK, 128), (f1, f1, f1, f1, f3, f3)),
        "flash_prep_d256": (flash.prep_kernel(256), (s3, s3, s3, u1, u1, u1)),
        "flash_attention_d256_causal": (flash.kernel(256, True)[0], (u1, u1, u1, f3, t.int64, t.float32)),
        "flash_prep_d128": (flash.prep_kernel(128), (s3, s3, s3, u1, u1, u1)),
        "flash_attention_d128": (flash.kernel(128, False)[0], (u1, u1, u1, f3, t.int64, t.float32)),
        "dit_norm_modulate_pairs_d3072": (dit._norm_modulate_pairs(True, True, False, *row_team(1536)),
                                          (w2c, a(t.uint32, 2), u8v, u8v, u8v, u8v, a(t.uint32, 2), t.float32)),
        "dit_norm_modulate_d3071": (dit._norm_modulate(True, True, False, *row_team(3071)),
                                    (f2, b2, f1, f1, f1, f1, b2, t.float32)),
        "dit_qk_norm_rope_d128": (dit._qk_norm_rope(False, *dit._qk_geometry(128), 2, dit.QK_GROUP),
                                  (a(t.uint32, 3, "A"), f1, f1, t.int64, f2, f2, a(t.uint32, 3), a(t.uint32, 3),
                                   t.float32)),
        "dit_qk_norm_rope_words8_d128": (dit._qk_norm_rope(False, *dit._qk_geometry(128, 4), 4, dit.QK_GROUP),
                                         (a(t.uint64, 3, "A"), f1, f1, t.int64, f2, f2, a(t.uint64, 3),
                                          a(t.uint64, 3), t.float32)),
        "dit_situ_packed": (dit._situ_packed(False), (w2, w2, a(t.uint64, 2))),
        "dit_situ": (dit._situ(False), (a(t.uint16, 2, "A"), a(t.uint16, 2, "A"), b2)),
        "dit_widen_heads": (dit._widen(False), (a(t.uint16, 3, "A"), f3)),
        "dit_patchify": (dit._patchify_kernel(False), (f2, b2)),
        "dit_cfg_euler": (dit._cfg_euler(True, False), (f2, f2, f2, f2, f1)),
        "mma_bf16_product": (mma._product[False], (b2, b2, f2)),
        "mma_tf32_product": (mma._product_tf32[False], (f2, f2, f2)),
        "conv_absmax": (conv._absmax[False], (f2, f1)),
        "conv_split_rows": (conv._split_rows[False], (f2, f1, b2, t.boolean)),
        "conv_split_image": (conv._make_split_image(False, False), split_image_args),
        "conv_split_image_up": (conv._make_split_image(False, True), split_image_args),
        "conv_split_image_norm": (conv._make_split_image(False, False, True), split_image_args),
        "conv_split_image_taps": (conv._make_split_image(False, False, False, True), split_image_args),
        "conv_split_image_taps_up": (conv._make_split_image(False, True, False, True), split_image_args),
        "conv_split_image_taps_norm": (conv._make_split_image(False, False, True, True), split_image_args),
        "conv_split_image_taps_down": (conv._make_split_image(False, False, False, True, True), split_image_args),
        "conv_finish": (conv._finish[False], (f2, f1, f1, f1, f2, f2, t.int64, t.boolean, t.int64)),
        "group_norm_sums": (conv._gn_sums[False], (f2, f2, f2, f3)),
        "group_norm_stats": (conv._gn_stats[False], (f3, t.int64, t.float32, f1, f1, f1)),
        "group_norm_apply": (conv._gn_apply, (f2, f2, f1, f1, f2, t.boolean)),
        "unpack_latents": (conv._unpack[False], (f3, f1, f1, f3)),
        "pack_latents": (conv._pack[False], (f3, f1, f1, f3)),
        "to_pixels": (conv._pixels[False], (f3, a(t.uint8, 3))),
        "lora_merge": (lora._merge[False], (a(t.uint16, 1), f1, f1, t.boolean, t.boolean)),
    }


def _no_gpu_shim():
    """Compiling a kernel that calls device functions asks the current device for its compute
    capability (numba_cuda.md 7.5); without a GPU, answer sm_90."""
    from numba import cuda
    from numba.cuda import dispatcher
    try:
        if cuda.is_available():
            return
    except Exception:
        pass

    class _Device:
        compute_capability = ARCH
    dispatcher.get_current_device = lambda: _Device()


def toolchain():
    import numba
    import numba_cuda
    from cuda.bindings import nvjitlink
    return {"numba": numba.__version__, "numba-cuda": numba_cuda.__version__,
            "nvjitlink": ".".join(map(str, nvjitlink.version()))}


FP64 = re.compile(r"\b(DFMA|DADD|DMUL|DSETP|DMNMX|F2F\.F64|F2F\.F32\.F64|I2F\.F64|F2I\.F64)")


def nvdisasm():
    """The nvdisasm executable: the nvidia-cuda-nvdisasm wheel's, else one on PATH, else None."""
    try:
        import nvidia
        for root in nvidia.__path__:
            for found in Path(root).glob("cu*/bin/nvdisasm"):
                return str(found)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def count_instructions(cubin, tool):
    """(instructions, float64 instructions) in a cubin's SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([tool, "-c", str(path)], capture_output=True, text=True, check=True).stdout
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    return len(lines), sum(1 for line in lines if FP64.search(line))


def compile_cubin(py_func, sig, launch_bounds=None):
    """(cubin bytes, ptxas log): a kernel's Python function compiled for sm_90 with argument types `sig`."""
    from cuda.core import Linker, LinkerOptions, ObjectCode
    from numba import cuda
    _no_gpu_shim()
    ptx, _ = cuda.compile_ptx(py_func, sig, cc=ARCH, launch_bounds=launch_bounds)
    linker = Linker(ObjectCode.from_ptx(ptx.encode()), options=LinkerOptions(arch="sm_%d%d" % ARCH, verbose=True))
    cubin = bytes(linker.link("cubin").code)
    return cubin, linker.get_info_log()


def measure():
    """{kernel: {registers, shared_bytes, stack_bytes, spill_stores, spill_loads, local_bytes, instructions,
    fp64_instructions}}."""
    tool = nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found: pip install 'nvidia-cuda-nvdisasm==13.*'")
    out = {}
    for name, (kernel, sig) in _signatures().items():
        # launch_bounds changes the register allocation
        cubin, log = compile_cubin(kernel.py_func, sig, kernel.targetoptions.get("launch_bounds"))
        props = re.search(r"used (\d+) registers.*?(\d+) stack, (\d+) bytes smem.*?(\d+) bytes lmem", log)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        if not props or not spills:
            raise RuntimeError(f"{name}: could not read the ptxas log:\n{log}")
        out[name] = {"registers": int(props[1]), "stack_bytes": int(props[2]), "shared_bytes": int(props[3]),
                     "local_bytes": int(props[4]), "spill_stores": int(spills[1]), "spill_loads": int(spills[2])}
        out[name]["instructions"], out[name]["fp64_instructions"] = count_instructions(cubin, tool)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    record = {"arch": "sm_%d%d" % ARCH, "toolchain": toolchain(), "kernels": measure()}
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    if args.write:
        RECORD.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
