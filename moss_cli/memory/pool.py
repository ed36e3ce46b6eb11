"""The device memory pool every GPU component of a process shares (encoder, DiT, decoder).

A request for n bytes is lent the smallest free block of at least n bytes (the oldest of equal size), or a
new block of exactly n bytes when none is free; the block comes back when the array lent on it dies.
Requests under SMALL bytes are lent only blocks of exactly their size, so a scalar never holds a large
block that a later large request would need.

Lending larger blocks than asked is what lets graphs of different sizes share memory: the 512x512 decode
runs in the blocks the 1024x1024 decode left free, the DiT's step in the decoder's, the decoder's
convolutions of different widths in one set of column buffers. Sharing blocks between graphs is safe
because the components' work never overlaps: every stage (an encode, a trajectory, a decode) waits for its
stream before it returns, and the next stage's first use of a block is queued after that.

A graph's blocks are planned (`record`, `plan`, `script`): the eager pass before a capture asks for what the
capture will ask, in the same order, so its requests and lifetimes are recorded, and the capture is lent blocks
packed by size (largest first, each into the smallest block free over its whole life, blocks made before
first). Where the packing needs a block of a size the eager pass made one of, that block is kept for it; the
eager pass's other blocks are let go. Best fit alone strands the small blocks an image's first stages made
when its later stages need larger ones (scripts/pool_plan.py works both out at the real sizes; BENCHMARKS.md
quotes them). A block a captured graph used is never freed: the graph keeps its address.
"""

import bisect
import gc
import threading
import weakref

SMALL = 1 << 20
_NEVER = float("inf")


class Block:
    """nbytes of device memory (`base`, what the allocator returned) and its place in the pool's order."""

    __slots__ = ("base", "nbytes", "order")

    def __init__(self, base, nbytes, order):
        self.base, self.nbytes, self.order = base, nbytes, order


class Pool:
    """Best-fit lending of blocks made by `allocate(nbytes)`; `bytes` is what the pool holds now."""

    def __init__(self, allocate):
        self._allocate = allocate
        self._free = []        # (nbytes, order, block) of the free blocks, sorted
        self._free_orders = set()
        self.bytes = 0
        self.blocks = 0        # blocks made so far (the next block's order)
        self._trace = None     # while recording: (take index, nbytes) of a take, (take index,) of its give
        self._held = {}        # while recording: block order -> the take index it is lent to
        self._takes = 0
        self._recorded_from = 0
        self._script = None    # while scripted: the planned block of each take, in order
        self.misses = 0        # scripted takes that found their planned block lent or too small (best fit then)
        self.plans = []        # per plan(): its takes, the bytes they ask, those still lent when it ran, the
                               # bytes its blocks add, and how many it kept of the recording's and made anew
        self.collector_gives = None   # after watch_collector(): blocks given back while the cyclic collector ran
        self._collecting = False
        # one thread at a time lends, takes back and plans: a graph made on a host thread beside the DiT's steps
        # (gpu.decoder.CudaDecoder.graph_maker) takes blocks while the collector may give some back in another
        self._lock = threading.RLock()

    def take(self, nbytes):
        """A block of at least nbytes (best fit; exactly nbytes under SMALL), or the script's next block."""
        with self._lock:
            return self._take(max(1, int(nbytes)))

    def _take(self, nbytes):
        block = self._scripted(nbytes) if self._script is not None else None
        if block is None:
            i = bisect.bisect_left(self._free, (nbytes, -1))
            if i < len(self._free) and (nbytes >= SMALL or self._free[i][0] == nbytes):
                block = self._free[i][2]
                self._unfree(block)
            else:
                block = self._make(nbytes)
        if self._trace is not None:
            self._held[block.order] = self._takes
            self._trace.append((self._takes, nbytes))
            self._takes += 1
        return block

    def give(self, block):
        """Take back a block lent by `take`."""
        with self._lock:
            self._give(block)

    def _give(self, block):
        if self._collecting:
            self.collector_gives += 1
        if self._trace is not None and block.order in self._held:
            self._trace.append((self._held.pop(block.order),))
        bisect.insort(self._free, (block.nbytes, block.order, block))
        self._free_orders.add(block.order)

    def watch_collector(self):
        """Count, from now on, the blocks that come back while Python's cyclic garbage collector runs: an array
        in a reference cycle dies then, at a moment that can differ between processes, and a plan made after
        it starts from other free blocks (`collector_gives`; a diagnostic, it changes no lending)."""
        if self.collector_gives is not None:
            return
        self.collector_gives = 0
        ref = weakref.ref(self)

        def on_collect(phase, info):
            pool = ref()
            if pool is not None:
                pool._collecting = phase == "start"
        gc.callbacks.append(on_collect)

    @property
    def free_bytes(self):
        return sum(n for n, _, _ in self._free)

    def _make(self, nbytes):
        block = Block(self._allocate(nbytes), nbytes, self.blocks)
        self.blocks += 1
        self.bytes += nbytes
        return block

    def _unfree(self, block):
        i = bisect.bisect_left(self._free, (block.nbytes, block.order))
        del self._free[i]
        self._free_orders.discard(block.order)

    def _scripted(self, nbytes):
        """The script's block for this take where it is free and large enough, else None (best fit decides)."""
        planned = self._script.pop() if self._script else None
        if planned is None or planned.nbytes < nbytes or planned.order not in self._free_orders:
            self.misses += 1
            return None
        self._unfree(planned)
        return planned

    # --- planning a graph's blocks -----------------------------------------------------------
    def record(self):
        """Start recording takes and gives (the eager pass before a capture)."""
        self._trace, self._held, self._takes = [], {}, 0
        self._recorded_from = self.blocks

    def plan(self):
        """End the recording and plan its takes again: the largest take is placed first, each into the smallest
        free block that no take placed there overlaps in time, else into a block of its size (so a block's size
        is that of its largest take): one the recording made and left free, of exactly that size, where there
        is one (no allocation), else a new one. The recording's other free blocks are let go. Returns the
        planned block of each take, in take order."""
        with self._lock:
            return self._plan()

    def _plan(self):
        trace, self._trace = self._trace or [], None
        recorded = [entry for entry in self._free if entry[1] >= self._recorded_from]   # sorted, as _free is
        for _, _, block in recorded:
            self._unfree(block)
        before = self.bytes - sum(n for n, _, _ in recorded)
        start, end, size = {}, {}, {}
        for t, event in enumerate(trace):
            if len(event) == 2:
                start[event[0]], size[event[0]] = t, event[1]
            else:
                end[event[0]] = t
        candidates = list(self._free)               # (nbytes, order, block), sorted
        lives = {order: [] for _, order, _ in candidates}
        out, kept, made = {}, 0, 0
        for take in sorted(start, key=lambda k: (-size[k], start[k])):
            life = (start[take], end.get(take, _NEVER))
            block = next((c[2] for c in candidates if c[0] >= size[take]
                          and all(life[1] <= a or b <= life[0] for a, b in lives[c[1]])), None)
            if block is None:
                i = bisect.bisect_left(recorded, (size[take], -1))      # the oldest of that exact size
                if i < len(recorded) and recorded[i][0] == size[take]:
                    block = recorded.pop(i)[2]
                    kept += 1
                else:
                    block = self._make(size[take])
                    made += 1
                bisect.insort(candidates, (block.nbytes, block.order, block))
                lives[block.order] = []
                self._give(block)
            lives[block.order].append(life)
            out[take] = block
        self.bytes -= sum(n for n, _, _ in recorded)                  # the recording's blocks no take needs
        held = [t for t in start if t not in end]
        self.plans.append({"takes": len(start), "asked_bytes": sum(size.values()), "held_takes": len(held),
                           "held_bytes": sum(size[t] for t in held), "made_bytes": self.bytes - before,
                           "kept_blocks": kept, "new_blocks": made})
        return [out[k] for k in sorted(out)]

    def forget(self):
        """End the recording without a plan (an eager pass no graph follows): the blocks made while recording that
        are free now are let go, as plan() lets them go."""
        with self._lock:
            self._trace = None
            self._let_go_recorded()

    def _let_go_recorded(self):
        for nbytes, order, block in list(self._free):
            if order >= self._recorded_from:
                self._unfree(block)
                self.bytes -= nbytes

    def script(self, planned):
        """Lend the planned blocks to the next takes, in order (None: best fit again)."""
        self._script = None if planned is None else list(reversed(planned))
