"""Gated DeltaNet ops (Qwen3.5 linear attention): causal depthwise conv, L2 norm, delta rule."""


class GdnOps:
    pass
