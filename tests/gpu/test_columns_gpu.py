"""On a GPU: cuda_kernels.core.columns, the column-block view the op table hands its kernels, is numba's own
x[..., a:b] (the same address, shape, strides and values) without its per-row walk."""

import numpy as np
import pytest

import cuda_kernels

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")


@pytest.mark.parametrize("shape,start,stop", [((5, 12), 3, 7), ((4, 3, 10), 0, 4), ((6, 8), 0, 8),
                                              ((3, 9), 9, 9), ((7, 6), 5, 6)])
def test_columns_is_numbas_slice(shape, start, stop):
    from numba import cuda

    from cuda_kernels.core import columns
    host = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    x = cuda.to_device(host)
    got, want = columns(x, start, stop), x[(slice(None),) * (x.ndim - 1) + (slice(start, stop),)]
    assert got.shape == want.shape and got.strides == want.strides
    assert got.__cuda_array_interface__["data"] == want.__cuda_array_interface__["data"]
    np.testing.assert_array_equal(got.copy_to_host(), host[..., start:stop])
    # a view of a view (a leading slice, then columns), as the tap convs take them
    np.testing.assert_array_equal(columns(x[1:], start, stop).copy_to_host(), host[1:][..., start:stop])


def test_columns_outside_the_array_are_refused():
    from numba import cuda

    from cuda_kernels.core import columns
    x = cuda.to_device(np.zeros((2, 4), np.float32))
    with pytest.raises(IndexError):
        columns(x, 2, 5)
