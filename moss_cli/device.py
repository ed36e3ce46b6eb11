"""--device auto|cpu|cuda: which op table a stage runs on."""

from .errors import DeviceError

DEVICES = ("auto", "cpu", "cuda")


def gpu_status():
    """(usable, reason): a usable GPU with the GPU extra installed."""
    try:
        import cuda_kernels
    except ImportError as e:
        return False, f"the GPU extra is not installed ({e})"
    try:
        return cuda_kernels.available()
    except Exception as e:  # driver/toolkit problems surface here as many exception types
        return False, f"CUDA is not usable ({e})"


GPU_STAGES = ("encode", "denoise", "decode")


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
