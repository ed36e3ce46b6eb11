"""Planted bugs shared by the tests that must catch them (each test asserts its gate fails with the bug in)."""

import math

import numpy as np


def final_norm_eps_x10(ops, tensors):
    """Plant a bug in `ops`: the encoder's final norm (the one reading norm.weight) uses 10x its epsilon."""
    rms_norm = ops.rms_norm

    def planted(x, w, eps, *args, **kw):
        if w is ops.param(tensors, "norm.weight"):
            eps = 10 * eps
        return rms_norm(x, w, eps, *args, **kw)

    ops.rms_norm = planted
    return ops


def time_sinusoid_float32(timestep, freq_dim):
    """For moss_cli.transformer.time_sinusoid: frequencies and phase in float32 (kohakumoss' own form)."""
    half = freq_dim // 2
    freqs = np.exp(-np.float32(math.log(10000.0)) * np.arange(half, dtype=np.float32) / np.float32(half))
    phase = np.float32(timestep) * freqs
    return np.concatenate([np.cos(phase), np.sin(phase)])[None, :].astype(np.float64)
