"""moss-cli: MOSS-Image as single-purpose, byte-comparable stages (encode, denoise, decode)."""

__version__ = "0.1.0"
