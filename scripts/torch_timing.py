"""GPU time of a torch callable: the median of CUDA-event-timed calls after warm-up (the GPU scripts' baselines)."""

import statistics

import torch


def median_ms(fn, reps, warm=2):
    """Median milliseconds of `reps` calls of fn, each between two CUDA events on the current stream, after `warm`
    calls and a synchronisation."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)
