"""Event-driven thread blocks for the numba CUDA simulator (installed by cuda_kernels.core when simulated).

The simulator runs each CUDA thread of a block as a Python thread; its BlockManager finds out that every live
thread waits at a barrier by polling all of them in a loop that never sleeps, so it holds the GIL most of the
time the simulated threads need (on a 64-thread block of the flash kernel, 70 % of the wall time went to that
loop). Here the barrier counts its arrivals under one lock instead: the last live thread to arrive, or to
finish, releases the others, and the block's runner sleeps until every thread has finished or one has failed.

The semantics are the simulator's: a barrier (syncthreads, and syncwarp, which the simulator makes a block
barrier) waits for every thread of the block that has not returned; an exception in a thread is raised by the
launch with the thread's and block's indices in its message, and the other threads are aborted at their next
barrier. MOSS_SIM_BARRIER=poll keeps numba's own scheduler (tests/test_sim_barrier.py runs both).
"""

import os
import sys
import threading

import numpy as np


def _syncthreads(self):
    block = self._manager
    with block._lock:
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        block._arrived += 1
        generation = block._generation
        block._release_if_all_waiting()
        while block._generation == generation and not self.abort:
            block._released.wait()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _release_if_all_waiting(self):
    """(Under the lock.) Every thread still running waits at the barrier: let them all go on."""
    if self._arrived and self._arrived == self._threads - self._finished:
        self._arrived = 0
        self._generation += 1
        self._released.notify_all()


def _run(self, grid_point, *args):
    from numba.cuda.simulator.kernel import BlockThread

    self._lock = threading.Lock()
    self._released = threading.Condition(self._lock)     # the barrier's waiters
    self._changed = threading.Condition(self._lock)      # the runner: a thread finished or failed
    self._threads = int(np.prod(self._block_dim))
    self._arrived = self._finished = self._generation = 0
    failed = []

    def target():
        try:
            self._f(*args)
        except Exception as e:        # as BlockThread.run words it, recorded before the others are told
            me = threading.current_thread()
            where = f"tid={list(me.threadIdx)} ctaid={list(me.blockIdx)}"
            me.exception = (type(e)(f"{where}: {e}" if str(e) else where), sys.exc_info()[2])
            with self._lock:
                failed.append(me)
        finally:
            with self._lock:
                self._finished += 1
                self._release_if_all_waiting()
                self._changed.notify()

    threads = [BlockThread(target, self, grid_point, point, self._debug) for point in np.ndindex(*self._block_dim)]
    for t in threads:
        t.start()
    with self._lock:
        while self._finished < self._threads and not failed:
            self._changed.wait()
        if failed:
            for t in threads:
                t.abort = True
            self._generation += 1
            self._released.notify_all()
            raise failed[0].exception[0].with_traceback(failed[0].exception[1])
    for t in threads:         # one whose exception could not be worded above (BlockThread.run records it)
        t.join()
        if t.exception:
            raise t.exception[0].with_traceback(t.exception[1])


def install():
    """Replace the simulator's polling block scheduler with the barrier above (unless MOSS_SIM_BARRIER=poll)."""
    if os.environ.get("MOSS_SIM_BARRIER", "") == "poll":
        return
    from numba.cuda.simulator import kernel
    kernel.BlockThread.syncthreads = _syncthreads
    kernel.BlockManager.run = _run
    kernel.BlockManager._release_if_all_waiting = _release_if_all_waiting
