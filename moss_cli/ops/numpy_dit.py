"""DiT-specific ops (MOSS-Image joint blocks): SiTU-GLU, adaLN modulation, gated residual."""


class DitOps:
    pass
