"""The MOSS-Image schedule (denoiser.md §5.1, §5.4) against a torch statement of it and diffusers' Euler."""

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from moss_cli import schedule
from moss_cli.errors import UsageError
from reference.schedule import sigmas as reference_sigmas


def torch_scheduler(steps, shift=5.0, training_shift=1.0, total=1000):
    """MOSSImageScheduler.set_timesteps as the spec states it (scripts/reference/schedule.py, torch),
    handed to the diffusers base class."""
    snapped = reference_sigmas(steps, shift, training_shift, total)[:-1]
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=total, shift=1.0)
    sched.set_timesteps(sigmas=snapped.tolist())
    return sched


def same_bits(a, b):
    return a.dtype == np.float32 and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_five_steps_give_the_published_schedule():
    assert np.round(schedule.sigmas(5).astype(float), 3).tolist() == [1.0, 0.938, 0.835, 0.630, 0.024, 0.0]


def test_fifty_steps_match_the_spec_table():
    table = [1.000, .996, .992, .987, .983, .978, .973, .968, .963, .957, .952, .946, .939, .933, .926, .919, .912,
             .905, .897, .888, .880, .871, .861, .851, .840, .829, .817, .805, .791, .777, .762, .746, .729, .711,
             .692, .671, .648, .623, .597, .568, .536, .501, .463, .421, .373, .321, .261, .193, .115, .024, 0]
    assert np.round(schedule.sigmas(50).astype(float), 3).tolist() == table


@pytest.mark.parametrize("steps", [1, 2, 5, 28, 50, 100])
def test_sigmas_and_timesteps_equal_the_torch_statement(steps):
    ref = torch_scheduler(steps)
    sig = schedule.sigmas(steps)
    assert same_bits(sig, ref.sigmas.numpy())
    assert same_bits(schedule.timesteps(sig), ref.timesteps.numpy())


@pytest.mark.parametrize("steps,shift", [(30, 3.0), (40, 2.7), (1000, 5.0)])
def test_other_shifts_and_duplicate_dropping_equal_the_torch_statement(steps, shift):
    # 1000 steps at shift 5 snap several neighbours to one grid value: duplicates are dropped
    sig = schedule.sigmas(steps, shift=shift)
    assert same_bits(sig, torch_scheduler(steps, shift).sigmas.numpy())
    assert len(sig) == steps + 1 if steps < 1000 else len(sig) < steps


@pytest.mark.parametrize("count,end", [(1, 0.005), (2, 0.005), (7, -3.25), (1000, 0.001), (1001, 0.7)])
def test_linspace32_equals_torch_linspace(count, end):
    assert same_bits(schedule.linspace32(1.0, end, count), torch.linspace(1.0, end, count).numpy())


def test_euler_step_equals_diffusers_step_in_float32():
    sched = torch_scheduler(5)
    sig = schedule.sigmas(5)
    rng = np.random.default_rng(0)
    x, v = rng.normal(size=(2, 1, 128, 4, 4)).astype(np.float32)
    for i, t in enumerate(sched.timesteps):
        ref = sched.step(torch.from_numpy(v), t, torch.from_numpy(x)).prev_sample.numpy()
        x = schedule.euler_step(x, v, sig[i], sig[i + 1])
        assert same_bits(x, ref)


def test_spec_constants_and_bad_steps():
    assert (schedule.DEFAULT_SHIFT, schedule.TRAINING_SHIFT, schedule.NUM_TRAIN_TIMESTEPS) == (5.0, 1.0, 1000)
    for bad in (0, -3):
        with pytest.raises(UsageError):
            schedule.sigmas(bad)
    with pytest.raises(UsageError):
        schedule.sigmas(5, shift=0.0)
