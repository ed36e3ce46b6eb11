"""Error types. Library code raises these; the CLI turns each into one line on stderr."""


class MossError(Exception):
    """Base of every error the commands report as one line."""


class UsageError(MossError):
    """A bad option value (size, steps, guidance, ...)."""


class CheckpointError(MossError):
    """The model folder is missing, incomplete, corrupt, or not MOSS-Image."""


class ArtifactError(MossError):
    """An ENC/LAT/TRACE file is truncated, corrupt, of the wrong stage or from another model."""


class DeviceError(MossError):
    """The requested device cannot be used (no GPU, GPU extra not installed)."""


class PictureError(MossError):
    """A picture or mask cannot be read (not PNG/JPEG/WebP, truncated) or does not fit its use."""
