"""MOSSImageScheduler.set_timesteps (denoiser.md §5.1) stated with torch.linspace in float32."""

import torch


def _grid(count, shift, total):
    u = torch.linspace(1, shift / (total + shift - 1), count, dtype=torch.float32)
    return shift * u / (1 + (shift - 1) * u)


def sigmas(steps, shift=5.0, training_shift=1.0, total=1000):
    """Snapped shifted sigmas (ties to the lower grid value, consecutive duplicates dropped) plus a final 0."""
    sig = _grid(steps, shift, total)
    train = _grid(total, training_shift, total).flip(0)
    above = torch.searchsorted(train, sig).clamp(max=total - 1)
    below = (above - 1).clamp(min=0)
    take_below = (sig - train[below]).abs() <= (train[above] - sig).abs()
    snapped = torch.unique_consecutive(torch.where(take_below, train[below], train[above]))
    return torch.cat([snapped, torch.zeros(1, dtype=torch.float32)])
