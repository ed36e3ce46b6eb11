"""The device memory pool every GPU component of a process shares (encoder, DiT, decoder).

A request for n bytes is lent the smallest free block of at least n bytes (the oldest of equal size), or a
new block of exactly n bytes when none is free; the block comes back when the array lent on it dies.
Requests under SMALL bytes are lent only blocks of exactly their size, so a scalar never holds a large
block that a later large request would need.

Lending larger blocks than asked is what lets graphs of different sizes share memory: the 512x512 decode
runs in the blocks the 1024x1024 decode left free, the DiT's step in the decoder's, the decoder's
convolutions of different widths in one set of column buffers. A block is never freed: captured graphs
keep the addresses of every block they used. Sharing blocks between graphs is safe because the
components' work never overlaps: every stage (an encode, a trajectory, a decode) waits for its stream
before it returns, and the next stage's first use of a block is queued after that.
"""

import bisect

SMALL = 1 << 20


class Block:
    """nbytes of device memory (`base`, what the allocator returned) and its place in the pool's order."""

    __slots__ = ("base", "nbytes", "order")

    def __init__(self, base, nbytes, order):
        self.base, self.nbytes, self.order = base, nbytes, order


class Pool:
    """Best-fit lending of blocks made by `allocate(nbytes)`; `bytes` is what the pool has allocated."""

    def __init__(self, allocate):
        self._allocate = allocate
        self._free = []       # (nbytes, order, block) of the free blocks, sorted
        self.bytes = 0
        self.blocks = 0

    def take(self, nbytes):
        """A block of at least nbytes (exactly nbytes under SMALL)."""
        nbytes = max(1, int(nbytes))
        i = bisect.bisect_left(self._free, (nbytes, -1))
        if i < len(self._free) and (nbytes >= SMALL or self._free[i][0] == nbytes):
            return self._free.pop(i)[2]
        block = Block(self._allocate(nbytes), nbytes, self.blocks)
        self.blocks += 1
        self.bytes += nbytes
        return block

    def give(self, block):
        """Take back a block lent by `take`."""
        bisect.insort(self._free, (block.nbytes, block.order, block))

    @property
    def free_bytes(self):
        return sum(n for n, _, _ in self._free)
