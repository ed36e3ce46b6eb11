"""The GPU op table: the numpy table's op names over numba device arrays.

CudaOps holds the core ops (memory, shapes, elementwise, products, norms, attention) and takes the model
families' ops from one mixin each, as the numpy table does: ops.cuda.gdn (the encoder's Gated DeltaNet),
ops.cuda.dit (the DiT's), ops.cuda.conv (the decoder's).

Activations are float32 device arrays; matrices (linear weights, the embedding) stay bf16, held as
uint16 bits, and each linear rounds its input to bf16 for the tensor-core product (float32 accumulate),
unless the op before it already wrote bf16 bits (`operand=True`: norms, swiglu). Weights read together
(`params`) are stacked once into one matrix, so projections of one input are one product whose column
blocks the next kernels read in place (strided views); residual adds are the product's beta = 1 epilogue.
Intermediates come from the process's one pool (memory.pool: best fit, shared by every component) and go
back when no array refers to them, so the same sequence of ops reuses the same buffers: that is what lets
a forward pass be captured as a CUDA graph once per prompt-length bucket and replayed (stream order keeps
reuse safe inside one graph).
Importing this module needs numba-cuda and nvmath-python (the GPU extra).
"""

import weakref

import numpy as np
from numba import cuda

from cuda_kernels import dit, elementwise, embedding as emb, flash, layout, norms, rope_attention
from cuda_kernels.core import SIMULATED, DeviceView, columns, to_bf16_bits
from cuda_kernels.gemm import blas, stream_handle

from .conv import ConvCudaOps
from .dit import DitCudaOps
from .gdn import GdnCudaOps
from ...memory.driver import DeviceBuffer
from ...memory.pool import Pool
from ...memory.host_weights import is_bf16 as _is_bf16, stack_forms, stored_form

# Prompt length from which the delta rule runs in chunks on tensor cores (gdn_chunk) rather than token
# by token (gdn). On the H200 at the 9B shapes the token recurrence is the faster at 112 tokens and the
# chunked form at 1024 (scripts/gpu_bench_delta.py); measured at 256 tokens too, they cross near
# 150 tokens.
CHUNK_FROM = 160


class Stacked:
    """Weights stacked along their output rows [sum N, K] (bf16 bits) and each one's row count."""

    def __init__(self, weight, sizes):
        self.weight, self.sizes = weight, tuple(sizes)


def _dense(x):
    """Whether x is C-contiguous (its strides those of its shape)."""
    item = x.dtype.itemsize
    return all(n == 1 or s == c * item for n, s, c in zip(x.shape, x.strides, _strides(x.shape)))


def _view_strides(x, shape):
    """Byte strides of x viewed with `shape` without a copy, or None where that is impossible."""
    probe = np.lib.stride_tricks.as_strided(np.empty(1, x.dtype), x.shape, x.strides)
    try:
        return np.reshape(probe, shape, copy=False).strides
    except ValueError:
        return None


def _strides(shape):
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


class CudaOps(DitCudaOps, ConvCudaOps, GdnCudaOps):
    """Same methods as NumpyOps (float32 compute), on one stream; see the module docstring."""

    name = "cuda"

    def __init__(self):
        self.dtype = np.dtype(np.float32)
        self.stream = 0
        self.capturing = False
        self._params = {}
        self._landing = {}      # param key -> the uploader's future of a weight not yet taken (preload)
        self.pool = shared_pool()
        self.kept = []          # host uploads made while capturing: the graph reads them later
        self.gathered = None    # the last device buffer embedding() read: held until the next one, so it
                                # outlives the kernels queued on it
        self.rows_host = None   # pinned bf16 rows [n, D] whose copy a capture puts in the graph (embedding)
        self.chunk_from = CHUNK_FROM
        self.delta_geometry = None     # the recurrence's (parts, threads, tile, group[, cols]); gdn.GEOMETRY when None
        # "flash" (flash.py: a bf16 pre-pass, then bf16 tensor cores with cp.async double buffering, no
        # scores buffer) or "products" (TF32 cuBLAS + a softmax kernel). Flash measured the faster whole
        # encode on the H200 at 100 and at 1000 tokens
        self.attention_form = "flash"
        self._last_cast = None
        # products whose outputs only feed elementwise kernels (linears(narrow=True): the MLP's gate and
        # up) may write bf16 rather than float32, as transformers' bf16 does. With swiglu reading 8-byte
        # words (4 bf16 at a time) that is no slower at 100 or 1000 tokens, and the final rows' error stays
        # about half of transformers' bf16 (scripts/gpu_encoder_9b.py's variants): on
        self.narrow_products = True
        self.fuse_norm_rope = True     # q/k norm and rope in one kernel (norms.rms_norm_rope) where rows fit
        self.packed_swiglu = True      # swiglu on 8-byte words where rows allow (elementwise._words)
        # conv, q/k norms and gates in one kernel (gdn_inputs) where heads fit: the whole encode on the H200
        # is no slower than with the three kernels it replaces (scripts/gpu_encoder_9b.py's variants): on
        self.fuse_gdn_inputs = True
        self.window = None             # memory.window.Window of the layers the memory plan streams, if any

    # --- memory -------------------------------------------------------------------------------
    @property
    def pool_bytes(self):
        """Device bytes the shared pool has allocated (activations, workspaces of every component)."""
        return self.pool.bytes

    def new(self, shape, dtype=np.float32):
        """An uninitialised device array from the pool."""
        shape = tuple(int(n) for n in shape)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        block = self.pool.take(nbytes)
        if SIMULATED:        # the block is host memory: lent as the device path lends it, views of the lease
            return _simulated_lease(block, nbytes, shape, dtype, self.pool)
        lease = DeviceView(block.base, shape, None, np.dtype(dtype).str)   # lent out: its death returns the block
        weakref.finalize(lease, self.pool.give, block)
        return cuda.as_cuda_array(lease, sync=False)

    def _upload(self, host):
        out = cuda.to_device(np.ascontiguousarray(host))
        if self.capturing:
            self.kept.append(out)
        return out

    # --- data movement ------------------------------------------------------------------------
    def preload(self, tensors, names):
        """Hand every weight in `names` (a name: `param`; a tuple of names: `params`) to the uploader's feeder
        thread and return at once; each op that reads one later waits only until its own copies are queued,
        so a first pass computes while the weights after its current one are still being read from disk."""
        for name in names:
            if self.window is not None and name in self.window.layout:
                continue                 # streamed: read from the host through the window
            if isinstance(name, tuple):
                self.params(tensors, name, later=True)
            else:
                self.param(tensors, name, later=True)

    def _landed(self, key):
        """The preloaded weight `key` may be read now: its copies queued (ordered before later stream 0 work),
        and done when capturing (a graph's stream is not ordered after the uploader's)."""
        queued = self._landing.pop(key, None)
        if queued is not None:
            queued.result()
            if self.capturing:
                from ...memory.upload import uploader
                uploader().finish()

    def param(self, tensors, name, later=False):
        """A weight on the device, uploaded once: 2-D matrices as bf16 bits, everything else float32.
        `later`: handed to the uploader's feeder without waiting (`preload`)."""
        if self.window is not None:
            streamed = self.window.view(tensors, name, self)
            if streamed is not None:
                return streamed[0]
        key = (id(tensors), name)
        return self._held(key, lambda: self._upload_param(tensors, name, key), later)

    def _held(self, key, make, later):
        """The weight kept under `key`, made by make() on first need; unless `later`, readable now (_landed)."""
        if key not in self._params:
            self._params[key] = make()
        if not later:
            self._landed(key)
        return self._params[key]

    def _upload_param(self, tensors, name, key):
        """param's device array, made once (its copies handed to the uploader under `key` in _landing)."""
        value = tensors[name]
        if not isinstance(value, np.ndarray) and hasattr(value, "__cuda_array_interface__"):
            out = cuda.as_cuda_array(value)
            if out.dtype != np.uint16 and out.dtype != np.float32:
                raise TypeError(f"{name}: device tensors must be uint16 (bf16 bits) or float32, not {out.dtype}")
        else:
            handed = _handed(tensors, name)       # sent at process start (memory.preload), else sent now
            if handed is None:
                from ...memory.upload import uploader    # pinned staging buffers, async copies (stream 0 waits for them)
                handed = uploader().to_device_later(stored_form(value))
            out, self._landing[key] = _numba_array(handed[0]), handed[1]
        return out

    def params(self, tensors, names, later=False):
        """2-D weights stacked into one bf16 matrix [sum of rows, in] on the device, built once.
        `later`: handed to the uploader's feeder without waiting (`preload`)."""
        names = tuple(names)
        if self.window is not None:
            streamed = self.window.view(tensors, names, self)
            if streamed is not None:
                return Stacked(*streamed)
        key = (id(tensors), names)
        return self._held(key, lambda: self._upload_stack(tensors, names, key), later)

    def _upload_stack(self, tensors, names, key):
        """params' Stacked, made once (the host parts' copies handed to the uploader, the last under `key`)."""
        values = [tensors[n] for n in names]
        sizes = [v.shape[0] for v in values]
        handed = _handed(tensors, names)          # sent at process start (memory.preload)
        if handed is not None:
            weight, self._landing[key] = _numba_array(handed[0]), handed[1]
        elif all(isinstance(v, np.ndarray) or not hasattr(v, "__cuda_array_interface__") for v in values):
            bits = stack_forms(values, names)
            from ...memory.upload import uploader    # each part straight into its rows, no host concatenation
            weight = cuda.device_array((sum(sizes), bits[0].shape[1]), np.uint16)
            row = 0
            for part in bits:          # the feeder takes them in order: the last one queued, all are
                _, self._landing[key] = uploader().to_device_later(part, out=weight[row:row + part.shape[0]])
                row += part.shape[0]
        else:
            weight = cuda.device_array((sum(sizes), values[0].shape[1]), np.uint16)
            row = 0
            for name in names:
                part = self.param(tensors, name) if isinstance(tensors[name], np.ndarray) else \
                    cuda.as_cuda_array(tensors[name])
                if part.dtype != np.uint16:
                    raise TypeError(f"{name}: a stacked weight must be bf16 bits")
                weight[row:row + part.shape[0]].copy_to_device(part)
                row += part.shape[0]
        return Stacked(weight, sizes)

    def array(self, x):
        # a fresh copy: its strides are canonical (a view's size-1 axes may carry stride 0, which numba's
        # reshape of the device array then refuses)
        return self._upload(np.array(x, dtype=np.float32, order="C"))

    def host(self, x):
        """The array on the host (while capturing a graph: the device array itself, the graph's output)."""
        if self.capturing:
            return x
        if self.stream != 0:
            self.stream.sync()
        return x.copy_to_host()

    # --- shapes -------------------------------------------------------------------------------
    def reshape(self, x, shape):
        """A view; strided arrays (column blocks of a product) too, where the new shape only splits axes."""
        shape = tuple(int(n) for n in shape)
        if _dense(x) or SIMULATED:
            return x.reshape(shape)
        strides = _view_strides(x, shape)
        if strides is None:
            raise ValueError(f"reshape {x.shape} -> {shape} of a strided array needs a copy")
        return cuda.as_cuda_array(DeviceView(x, shape, strides), sync=False)

    def _copy(self, src, src_offset, src_strides, dst, dst_offset, dst_strides, shape):
        layout.strided_copy(src.reshape(src.size), src_offset, src_strides, dst.reshape(dst.size), dst_offset,
                            dst_strides, shape, stream=self.stream)

    def transpose(self, x, axes):
        shape = tuple(x.shape[a] for a in axes)
        strides = _strides(x.shape)
        out = self.new(shape)
        self._copy(x, 0, tuple(strides[a] for a in axes), out, 0, _strides(shape), shape)
        return out

    def concat(self, xs, axis=0):
        axis %= xs[0].ndim
        shape = list(xs[0].shape)
        shape[axis] = sum(x.shape[axis] for x in xs)
        out = self.new(shape)
        dst_strides = _strides(shape)
        offset = 0
        for x in xs:
            self._copy(x, 0, _strides(x.shape), out, offset * dst_strides[axis], dst_strides, x.shape)
            offset += x.shape[axis]
        return out

    def _contiguous(self, x):
        """x itself when it is C-contiguous, else a contiguous copy (one strided copy)."""
        if _dense(x):
            return x
        out = self.new(x.shape, x.dtype)
        flat, strides = self._flat(x)
        self._copy(flat, 0, strides, out, 0, _strides(x.shape), x.shape)
        return out

    def _flat(self, x):
        """A 1-D array over x's memory from its first element, and x's strides in elements."""
        if _dense(x):
            return x.reshape(x.size), _strides(x.shape)
        if SIMULATED:        # no device addresses to view: a contiguous copy through the host
            return cuda.to_device(np.ascontiguousarray(x.copy_to_host()).reshape(-1)), _strides(x.shape)
        item = x.dtype.itemsize
        strides = tuple(s // item for s in x.strides)
        span = 1 + sum((n - 1) * s for n, s in zip(x.shape, strides))
        return cuda.as_cuda_array(DeviceView(x, (span,), (item,)), sync=False), strides

    def slice(self, x, axis, start, stop):
        axis %= x.ndim
        shape = list(x.shape)
        shape[axis] = stop - start
        out = self.new(shape, x.dtype)
        if not _dense(x):        # a column block of a product: one strided copy
            flat, strides = self._flat(x)
            self._copy(flat, start * strides[axis], strides, out, 0, _strides(shape), shape)
            return out
        inner = int(np.prod(shape[axis + 1:]))
        rows = int(np.prod(shape[:axis]))
        # each outer index holds one contiguous run of (stop - start) * inner elements
        layout.copy_rows(x.reshape(x.size), start * inner, x.shape[axis] * inner, out.reshape(out.size), 0,
                         shape[axis] * inner, rows, shape[axis] * inner, stream=self.stream)
        return out

    def split(self, x, sizes):
        """Consecutive blocks of the last axis, as strided views (no copy)."""
        out, start = [], 0
        for n in sizes:
            out.append(columns(x, start, start + n))
            start += n
        return out

    def embedding(self, table, ids):
        """float32 rows [n, D] of a bf16 table for host ints ids. A stored (host) table stays on the host: the
        rows are gathered there and copied over (the 9B's table is 2 GB the GPU need not hold). While
        capturing with `rows_host` set (a pinned uint16 array [n, D]), that copy is a node of the graph: each
        replay reads the rows put there before it (CudaEncoder). A device table (a param) is gathered on
        the device."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        if hasattr(table, "__cuda_array_interface__"):
            self.gathered = self._upload(ids)
            out = self.new((ids.size, table.shape[1]))
            emb.embedding(table, self.gathered, out, stream=self.stream)
            return out
        if self.capturing and self.rows_host is not None:
            if self.rows_host.shape[0] != ids.size:
                raise ValueError(f"rows_host holds {self.rows_host.shape[0]} rows, the prompt has {ids.size}")
            self.gathered = cuda.device_array(self.rows_host.shape, np.uint16)
            self.kept.append(self.gathered)
            self.gathered.copy_to_device(self.rows_host, stream=self._numba_stream())
        else:
            self.gathered = self._upload(table_rows(table, ids))
        n, d = self.gathered.shape
        out = self.new((n, d))
        dit.widen_heads(self.gathered.reshape(n, 1, d), out.reshape(n, 1, d), stream=self.stream)
        return out

    # --- elementwise --------------------------------------------------------------------------
    def _binary(self, a, b, op):
        big, small = (a, b) if a.size >= b.size else (b, a)
        if big.size % small.size or tuple(big.shape[big.ndim - small.ndim:]) != tuple(small.shape):
            raise ValueError(f"{op}: shapes {a.shape} and {b.shape} do not broadcast along trailing axes")
        out = self.new(big.shape)
        elementwise.binary(a.reshape(a.size), b.reshape(b.size), out.reshape(out.size), op, stream=self.stream)
        return out

    def _unary(self, x, op, s=1.0):
        out = self.new(x.shape)
        elementwise.unary(x.reshape(x.size), out.reshape(out.size), op, s, stream=self.stream)
        return out

    def add(self, a, b):
        return self._binary(a, b, "add")

    def sub(self, a, b):
        return self._binary(a, b, "sub")

    def mul(self, a, b):
        return self._binary(a, b, "mul")

    def scale(self, x, s):
        return self._unary(x, "scale", s)

    def sigmoid(self, x):
        return self._unary(x, "sigmoid")

    def silu(self, x):
        return self._unary(x, "silu")

    def tanh(self, x):
        return self._unary(x, "tanh")

    def exp(self, x):
        return self._unary(x, "exp")

    def softplus(self, x):
        return self._unary(x, "softplus")

    def sigmoid_gate(self, x, g, operand=False):
        """x * sigmoid(g), x and g [L, H, d] of any strides; bf16 bits when `operand`."""
        out = self.new(x.shape, np.uint16 if operand else np.float32)
        elementwise.sigmoid_gate(x, g, out, stream=self.stream)
        return out

    def swiglu(self, gate, up, operand=False):
        """silu(gate) * up; bf16 bits when `operand` (the next product's input)."""
        out = self.new(gate.shape, np.uint16 if operand else np.float32)
        elementwise.swiglu(self._rows(gate), self._rows(up), self._rows(out), stream=self.stream,
                           packed=self.packed_swiglu)
        return out

    # --- linear algebra -----------------------------------------------------------------------
    def linear(self, x, w, b=None, residual=None, narrow=False):
        """x @ w.T (+ b) (+ residual): x float32 [.., in] rounded to bf16 (or bf16 bits already), w bf16
        bits [out, in], float32 out (bf16 bits when `narrow` and `narrow_products`: the float32 sums
        rounded once, to nearest even); the residual is added by the product's epilogue."""
        if w.dtype != np.uint16:
            raise TypeError("linear: the weight must be bf16 bits (a 2-D param)")
        last = x.shape[x.ndim - 1]
        rows = x.size // last
        xb = self._bf16(x).reshape(rows, last)
        bits = narrow and self.narrow_products and residual is None
        out = self.new((rows, w.shape[0]), np.uint16 if bits else np.float32)
        res = None if residual is None else residual.reshape(rows, w.shape[0])
        if bits and b is not None:
            b = self._bias_bits(b)
        blas().linear(xb, w, out, bias=b, residual=res, stream=self.stream)
        return out.reshape(tuple(x.shape)[:x.ndim - 1] + (w.shape[0],))

    def _bias_bits(self, b):
        """A float32 bias as bf16 bits (a bf16 product output's epilogue reads those), made once."""
        key = ("bias bits", id(b))
        out = self._params.get(key)
        if out is None:
            out = self.new(b.shape, np.uint16)
            elementwise.cast_bf16(b.reshape(b.size), out.reshape(out.size), stream=self.stream)
            self._params[key] = out = (out, b)
        return out[0]

    def _numba_stream(self):
        return numba_stream(self.stream)

    def linears(self, x, ws, narrow=False):
        """One product with the stacked weight; each projection is a column block of it (a strided view);
        bf16 bits when `narrow` (see linear)."""
        return self.split(self.linear(x, ws.weight, narrow=narrow), ws.sizes)

    def _bf16(self, x):
        """x rounded to bf16 bits (x itself if it is bits already); the last one is kept, as several
        products in a row read the same x."""
        if x.dtype == np.uint16:
            return x
        cached = self._last_cast
        if cached is not None and cached[0]() is x:
            return cached[1]
        xb = self.new((x.size,), np.uint16)
        elementwise.cast_bf16(x.reshape(x.size), xb, stream=self.stream)
        self._last_cast = (weakref.ref(x), xb)
        return xb

    def _rows(self, x):
        """x as [rows, last axis]: a view where strides allow, else a contiguous copy."""
        shape = (x.size // x.shape[x.ndim - 1], x.shape[x.ndim - 1])
        if _dense(x) or SIMULATED or _view_strides(x, shape) is not None:
            return self.reshape(x, shape)
        return self._contiguous(x).reshape(shape)

    def _heads(self, x):
        """x as [L, H, d]: itself when 3-D (any strides), else its rows as [R, 1, d]."""
        if x.ndim == 3:
            return x
        rows = self._rows(x)
        return self.reshape(rows, (rows.shape[0], 1, rows.shape[1]))

    def rms_norm(self, x, w, eps, offset=0.0, operand=False):
        """Over the last axis of x (3-D: any strides); bf16 bits when `operand` (the input of the next
        products), else float32."""
        out = self.new(x.shape, np.uint16 if operand else np.float32)
        x3 = self._heads(x)
        norms.rms_norm(x3, w, out.reshape(x3.shape), eps, offset, stream=self.stream)
        return out

    def rope(self, x, cos, sin):
        out = self.new(x.shape)
        rope_attention.rope(x, cos, sin, out, stream=self.stream)
        return out

    def rms_norm_rope(self, x, w, cos, sin, eps, offset=0.0):
        """rope(rms_norm(x)) in one kernel where the rows fit (norms.rms_norm_rope_fits), else the two;
        bf16 heads (the DiT's) give bf16 heads (ops.cuda.dit)."""
        if x.dtype == np.uint16 and offset == 0.0:
            return self._bf16_norm_rope(x, w, cos, sin, eps)
        if not (self.fuse_norm_rope and norms.rms_norm_rope_fits(x.shape[x.ndim - 1], cos.shape[1])):
            return self.rope(self.rms_norm(x, w, eps, offset), cos, sin)
        out = self.new(x.shape)
        norms.rms_norm_rope(x, w, cos, sin, out, eps, offset, stream=self.stream)
        return out

    def attention(self, q, k, v, scale, causal=False):
        if q.dtype == np.uint16 and not causal:         # the DiT's bf16 heads (ops.cuda.dit)
            return self.bf16_attention(q, k, v, scale)
        if self.attention_form == "flash":      # q, k, v of any strides
            out = self.new(q.shape)
            shapes = flash.workspace_shapes(q.shape[0], q.shape[1], k.shape[1], q.shape[2])
            work = {name: self.new(shape, np.uint32) for name, shape in shapes.items()}
            flash.flash_attention(q, k, v, out, scale, causal, stream=self.stream, work=work)
            return out
        # the batched products take k and v with their row stride (column blocks of a product); q contiguous
        q = self._contiguous(q)
        out = self.new((q.shape[0], q.shape[1], v.shape[2]))
        scores = self.new((q.shape[1], q.shape[0], k.shape[0]))
        rope_attention.attention(q, k, v, out, scale, causal, scores, stream=self.stream)
        return out


def _handed(tensors, name):
    """memory.preload's (device buffer, future) for this weight, or None (none handed over, or the simulator)."""
    if SIMULATED:
        return None
    from ...memory.preload import take
    return take(tensors, name)


def _numba_array(out):
    """A device array as numba's (a memory.driver.DeviceBuffer wrapped without a copy; it stays alive with it)."""
    return cuda.as_cuda_array(out, sync=False) if isinstance(out, DeviceBuffer) else out


def table_rows(table, ids, out=None):
    """bf16 bits (uint16 [n, D]) of a host table's rows for ids (rounded to bf16 where the table is wider),
    into `out` when given. The table is a host array of bf16 or float values (a device array, or bf16 bits
    as uint16, would be read wrong: refused)."""
    if hasattr(table, "__cuda_array_interface__"):
        raise TypeError("the token embedding table stays on the host (stages.HOST_TENSORS), not on the device")
    host = np.asarray(table)
    if _is_bf16(host.dtype):
        return np.take(host.view(np.uint16), ids, axis=0, out=out)
    if not np.issubdtype(host.dtype, np.floating):
        raise TypeError(f"the token embedding table holds {host.dtype}, not bf16 or float values")
    rows = to_bf16_bits(host[ids])
    if out is None:
        return rows
    out[...] = rows
    return out


_POOL = []


def shared_pool():
    """The process's one device pool (made on first use); in the simulator its blocks are host arrays."""
    if not _POOL:
        _POOL.append(Pool((lambda n: np.empty(n, np.uint8)) if SIMULATED else (lambda n: cuda.device_array(n, np.uint8))))
    return _POOL[0]


class _HostLease:
    """The first nbytes of a simulated block, as an array interface: every numpy view made from it holds this
    object (not the block), so its death, like a DeviceView's on the GPU, means no array uses the bytes."""

    def __init__(self, base, nbytes):
        self.base = base
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (base.ctypes.data, False),
                                    "version": 3}


def _simulated_lease(block, nbytes, shape, dtype, pool):
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    lease = _HostLease(block.base, nbytes)
    weakref.finalize(lease, pool.give, block)
    return FakeCUDAArray(np.asarray(lease).view(dtype).reshape(shape))


def numba_stream(stream):
    """The numba stream for 0 (the default stream), a cuda.core Stream or a graph builder (its capturing
    stream): what numba's copies and events take."""
    return cuda.default_stream() if stream == 0 else cuda.external_stream(stream_handle(stream))
