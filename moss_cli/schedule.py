"""MOSS-Image sampling schedule (denoiser.md §5.1, §5.4), in torch's float32 semantics.

The inference sigmas are a shifted linspace snapped to the nearest value of the 1000-step training
grid; sampling is plain flow-matching Euler on them.
"""

import math

import numpy as np

from .errors import UsageError
from .float32 import fma32

DEFAULT_STEPS = 50
DEFAULT_SHIFT = 5.0             # MOSSImageScheduler shift
TRAINING_SHIFT = 1.0            # MOSSImageScheduler training_shift: the training grid is unshifted
NUM_TRAIN_TIMESTEPS = 1000

F32 = np.float32


def linspace32(start: float, end: float, count: int) -> np.ndarray:
    """torch.linspace(start, end, count, dtype=float32) on the CPU.

    The first half counts up from start, the second half down from end, each value one FMA.
    """
    start, end = F32(start), F32(end)
    if count == 1:
        return np.array([start], dtype=F32)
    step = F32((end - start) / F32(count - 1))
    half = count // 2
    up = fma32(step, np.arange(half, dtype=F32), start)
    down = fma32(-step, np.arange(count - half - 1, -1, -1, dtype=F32), end)
    return np.concatenate([up, down])


def shifted_grid(count: int, shift: float, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> np.ndarray:
    """count descending sigmas from 1 to the shifted image of 1/num_train_timesteps."""
    lower = shift / (num_train_timesteps + shift - 1)
    u = linspace32(1.0, lower, count)
    return (F32(shift) * u) / (F32(1) + F32(shift - 1) * u)


def sigmas(steps: int, shift: float = DEFAULT_SHIFT, training_shift: float = TRAINING_SHIFT,
           num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> np.ndarray:
    """float32 sigmas of the sampler: snapped, consecutive duplicates dropped, then a final 0."""
    if int(steps) != steps or steps < 1:
        raise UsageError(f"steps must be a positive integer, got {steps}")
    for name, value in (("shift", shift), ("training_shift", training_shift)):
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"{name} must be a positive number, got {value}")
    if int(num_train_timesteps) != num_train_timesteps or num_train_timesteps < 1:
        raise UsageError(f"num_train_timesteps must be a positive integer, got {num_train_timesteps}")
    wanted = shifted_grid(int(steps), shift, num_train_timesteps)
    grid = shifted_grid(num_train_timesteps, training_shift, num_train_timesteps)[::-1]   # ascending
    above = np.minimum(np.searchsorted(grid, wanted, side="left"), num_train_timesteps - 1)
    below = np.maximum(above - 1, 0)
    # nearest grid value; a tie goes to the lower one
    take_below = np.abs(wanted - grid[below]) <= np.abs(grid[above] - wanted)
    snapped = grid[np.where(take_below, below, above)]
    keep = np.concatenate([[True], snapped[1:] != snapped[:-1]])
    return np.concatenate([snapped[keep], [F32(0)]]).astype(F32)


def timesteps(sigmas: np.ndarray, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> np.ndarray:
    """The transformer's timestep input for each step: sigma * 1000 in float32 (the final 0 has none)."""
    return (np.asarray(sigmas, dtype=F32)[:-1] * F32(num_train_timesteps)).astype(F32)


def euler_step(x, v, sigma, sigma_next) -> np.ndarray:
    """x + (sigma_next - sigma) * v, all float32, dt the float32 difference (diffusers step)."""
    dt = F32(sigma_next) - F32(sigma)
    return (np.asarray(x, dtype=F32) + dt * np.asarray(v, dtype=F32)).astype(F32)


def cut(sigmas: np.ndarray, strength: float) -> np.ndarray:
    """The sigmas an image-to-image run takes, as FluxImg2ImgPipeline.get_timesteps cuts the schedule: of its N
    steps the last min(N * strength, N), counted in Python floats and truncated as it does."""
    if not (math.isfinite(strength) and 0 < strength <= 1):
        raise UsageError(f"--strength {strength}: must be in (0, 1]")
    n = len(sigmas) - 1
    init_timestep = min(n * strength, n)
    t_start = int(max(n - init_timestep, 0))
    if t_start >= n:         # only where n * strength is below half an ulp of n
        raise UsageError(f"--strength {strength:g} leaves none of the {n} steps to run; raise it")
    return np.asarray(sigmas, dtype=F32)[t_start:]


def scale_noise(sample, sigma, noise) -> np.ndarray:
    """sigma * noise + (1 - sigma) * sample in float32: the flow-matching forward process (scale_noise)."""
    s = F32(sigma)
    return (s * np.asarray(noise, dtype=F32) + (F32(1) - s) * np.asarray(sample, dtype=F32)).astype(F32)


def keep_region(latents, image, mask, noise, sigma_next, last) -> np.ndarray:
    """Inpainting after a step (FluxInpaintPipeline): where the mask is 0 the latents become the image's latents
    noised to the next sigma (the image itself after the last step), as (1 - mask) * image + mask * latents."""
    proper = image if last else scale_noise(image, sigma_next, noise)
    m = np.asarray(mask, dtype=F32)
    return ((F32(1) - m) * proper + m * np.asarray(latents, dtype=F32)).astype(F32)
