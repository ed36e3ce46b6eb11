"""--device auto|cpu|cuda: which op table a stage runs on."""

import ctypes
import importlib.util
import os

from .errors import DeviceError

DEVICES = ("auto", "cpu", "cuda")
GPU_EXTRA = ("numba", "nvmath")    # what pip install 'moss-cli[gpu]' brings


def no_gpu():
    """Why this machine has no NVIDIA GPU to use, or None when the CUDA driver loads and counts a device:
    asked of the driver itself, so the answer does not depend on the GPU extra."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA GPU: the CUDA driver (libcuda.so.1) is not installed"
    count = ctypes.c_int()
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return "no NVIDIA GPU: the CUDA driver finds no device"
    return None


def gpu_status():
    """(usable, reason): a usable GPU with the GPU extra installed; the reason names what is missing, the GPU
    or the extra or both."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0"):
        why = no_gpu()
        if why is not None:
            if any(importlib.util.find_spec(m) is None for m in GPU_EXTRA):
                why += "; the GPU extra is not installed either (pip install 'moss-cli[gpu]')"
            return False, why
    try:
        import cuda_kernels
    except ImportError as e:
        return False, f"the GPU extra is not installed ({e})"
    try:
        return cuda_kernels.available()
    except Exception as e:  # driver/toolkit problems surface here as many exception types
        return False, f"CUDA is not usable ({e})"


GPU_STAGES = ("encode", "denoise", "decode", "encode-image")


def resolve(requested, stage, gpu_stages=GPU_STAGES):
    """The device STAGE runs on; auto picks cuda only where the stage has a GPU path."""
    if requested not in DEVICES:
        raise DeviceError(f"--device {requested!r}: choose one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return "cpu"
    if requested == "cuda" and stage not in gpu_stages:
        raise DeviceError(f"{stage} has no GPU path yet; use --device cpu (or auto)")
    if stage not in gpu_stages:
        return "cpu"
    ok, why = gpu_status()
    if requested == "cuda" and not ok:
        raise DeviceError(f"--device cuda: {why}")
    return "cuda" if ok else "cpu"
