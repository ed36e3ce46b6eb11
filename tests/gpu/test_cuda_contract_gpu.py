"""On a GPU: every kernel (cuBLAS products and attention too) passes its gate at real shapes and every
planted control is caught."""

import pytest

import cuda_kernels

OK, WHY = cuda_kernels.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"needs a CUDA GPU with the GPU extra: {WHY}")


def test_contract_at_real_shapes():
    from cuda_kernels import contract
    lines = []
    kernels, passed, controls, caught = contract.run("real", write=lines.append)
    print("\n".join(lines))
    assert kernels >= 23
    assert (passed, controls, caught) == (kernels, kernels, kernels), "\n".join(lines)
