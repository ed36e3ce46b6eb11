"""Error types. Library code raises these; the CLI turns each into one line on stderr."""


class MossError(Exception):
    """Base of every error the commands report as one line."""


class UsageError(MossError):
    """A bad option value (size, steps, guidance, ...)."""


class OptionError(UsageError):
    """Options missing or in conflict, beyond what click's declarations say: a usage error, as click's own are
    (the commands exit 2 for it)."""


class CheckpointError(MossError):
    """The model folder is missing, incomplete, corrupt, or not MOSS-Image."""


class ArtifactError(MossError):
    """An ENC/LAT/TRACE file is truncated, corrupt, of the wrong stage or from another model."""


class DeviceError(MossError):
    """The requested device cannot be used (no GPU, GPU extra not installed)."""


class PictureError(MossError):
    """A picture or mask cannot be read (not PNG/JPEG/WebP, truncated) or does not fit its use."""


class LoraError(MossError):
    """An adapter file is unreadable, names tensors this model lacks, or does not fit their shapes."""


# how the driver, cuBLAS(Lt), cuDNN, cuda.core and numba say that an allocation failed
_OUT_OF_MEMORY = ("OUT_OF_MEMORY", "out of memory", "ALLOC_FAILED", "CUDNN_STATUS_ALLOC", "cudaErrorMemoryAllocation")


def out_of_memory(error, memory=None):
    """The one line for an exception that is a failed GPU (or pinned host) allocation, else None. `memory`:
    () -> (free, total) bytes of the GPU, asked after the failure."""
    text = f"{type(error).__name__}: {error}"
    if not any(mark in text for mark in _OUT_OF_MEMORY):
        return None
    what = "pinned host memory" if "HOST" in text.upper() and "MEMORY" in text.upper() else "GPU memory"
    try:
        free, total = memory() if memory else (None, None)
    except Exception:         # the context itself may be unusable by then
        free = None
    room = f" ({free / 1e9:.1f} of {total / 1e9:.1f} GB free now)" if free is not None else ""
    return (f"out of {what}{room}: {str(error).splitlines()[0][:160]}; give a smaller budget with --gpu-memory GB "
            "(more weights then stream from host memory), free GPU memory, or make a smaller picture")
