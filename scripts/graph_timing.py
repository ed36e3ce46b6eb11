"""GPU timing of our captured graphs, through numba: the median of CUDA-event-timed replays."""

import statistics


def replay_ms(captured, calls, warm=3):
    """Median milliseconds of `calls` replays of a captured graph (gpu.decoder.Captured: graph, stream, queue), each
    between two CUDA events on its stream, after `warm` replays and a synchronisation."""
    from numba import cuda
    for _ in range(warm):
        captured.graph.launch(captured.stream)
    captured.queue.synchronize()
    times = []
    for _ in range(calls):
        start, stop = cuda.event(), cuda.event()
        start.record(captured.queue)
        captured.graph.launch(captured.stream)
        stop.record(captured.queue)
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop))
    return statistics.median(times)
