"""Flow-matching Euler sampler with classifier-free guidance and the unconditional block-22 skip.

Per step i of N: c = model(x, t_i, cond); when guidance != 1.0 also u = model(x, t_i, uncond) with
`uncond_skip_layers` bypassed while skip_start <= i/N < skip_stop, and v = u + g (c - u); then
x <- x + (sigma_{i+1} - sigma_i) v. Everything host-side is float32, as the official pipeline.
"""

import numpy as np

from .errors import UsageError
from .schedule import euler_step, keep_region, timesteps
from .transformer import check_layers

DEFAULT_GUIDANCE = 3.0
DEFAULT_SKIP_LAYERS = (22,)   # joint block bypassed in the unconditional pass only
DEFAULT_SKIP_START = 0.01     # [M] S1 / SGLang cookbook (S2, S3 start at 0.0): step 0 runs the full uncond pass
DEFAULT_SKIP_STOP = 1.0


def skipped(i, n, layers, skip_start=DEFAULT_SKIP_START, skip_stop=DEFAULT_SKIP_STOP):
    """The blocks step i of n skips on its negative pass: `layers` inside the window [start, stop), else none."""
    return frozenset(layers) if skip_start <= i / n < skip_stop else frozenset()


def guided(c, u, guidance):
    """u + g * (c - u) in float32, in that order."""
    return u + np.float32(guidance) * (c - u)


def sample(model, noise, sigmas, cond, uncond, guidance, uncond_skip_layers=DEFAULT_SKIP_LAYERS,
           skip_start=DEFAULT_SKIP_START, skip_stop=DEFAULT_SKIP_STOP, on_step=None, keep=None):
    """Denoise `noise` [1, C, h, w] along `sigmas` [N+1]; returns float32 latents.

    `cond` / `uncond` are `model.prepare_text` handles (uncond unused, may be None, when guidance is 1.0).
    `on_step(i, sigma, latents_in, velocity)` is called once per step, before the Euler update.
    `keep`: (image latents, latent mask, noise) of inpainting, applied after each update (schedule.keep_region).
    """
    sigmas = np.asarray(sigmas, dtype=np.float32)
    n = len(sigmas) - 1
    cfg = float(guidance) != 1.0          # exact compare: guidance 0 or 0.5 still runs both passes
    if cfg and uncond is None:
        raise UsageError(f"guidance {guidance} needs the negative prompt's rows; use guidance 1.0 without one")
    skip = check_layers(uncond_skip_layers, model.num_layers)
    ts = timesteps(sigmas)
    x = np.array(noise, dtype=np.float32)
    for i in range(n):
        c = np.asarray(model.velocity(x, float(ts[i]), cond), dtype=np.float32)
        if cfg:
            u = np.asarray(model.velocity(x, float(ts[i]), uncond, skipped(i, n, skip, skip_start, skip_stop)),
                           dtype=np.float32)
            v = guided(c, u, guidance)
        else:
            v = c
        if on_step is not None:
            on_step(i, sigmas[i], x, v)
        x = euler_step(x, v, sigmas[i], sigmas[i + 1])
        if keep is not None:
            x = keep_region(x, *keep, sigmas[i + 1], last=i == n - 1)
    return x
