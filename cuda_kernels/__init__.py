"""numba.cuda kernels for the MOSS-Image models, one module per op family.

Each module holds its kernels, their float64 references, the gate (a tolerance derived from the
precision and the size of the terms) and a planted control the gate must catch; `contract` runs them.
Importing this package imports nothing from numba-cuda: `available()` says whether the GPU path can run.
"""


def available():
    """(True, "") when numba-cuda, nvmath-python and a CUDA GPU are usable, else (False, reason)."""
    try:
        from numba import config
        from numba import cuda
    except ImportError as exc:
        return False, f"numba-cuda is not installed ({exc}); pip install 'moss-cli[gpu]'"
    if config.ENABLE_CUDASIM:
        return False, "NUMBA_ENABLE_CUDASIM=1 selects the CUDA simulator, not a GPU"
    try:
        import nvmath.bindings.cublasLt  # noqa: F401
    except ImportError as exc:
        return False, f"nvmath-python is not installed ({exc}); pip install 'moss-cli[gpu]'"
    try:
        if not cuda.is_available():
            return False, "no CUDA GPU or driver found"
        cc = cuda.get_current_device().compute_capability
    except Exception as exc:   # driver errors come in several types
        return False, f"CUDA is not usable: {exc}"
    if cc < (8, 0):
        return False, f"the GPU has compute capability {cc[0]}.{cc[1]}; bf16 needs 8.0 or newer"
    return True, ""
