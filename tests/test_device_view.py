"""cuda_kernels.core.DeviceView: the array interface it gives for another shape, strides or element type of
the same memory (what the op table's views, the pool's leases and the packed kernels' word views are)."""

import pytest

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")


class _Base:
    """Stands in for a device array: only its __cuda_array_interface__ is read."""

    def __init__(self):
        self.__cuda_array_interface__ = {"shape": (4, 6), "typestr": "<f4", "strides": (96, 4),
                                         "data": (0x7F0000001000, False), "version": 3, "stream": None}


def test_a_view_keeps_the_base_its_address_and_by_default_its_element_type():
    from cuda_kernels.core import DeviceView
    base = _Base()
    view = DeviceView(base, [4, 3, 2], [96, 8, 4])
    assert view.base is base
    assert view.__cuda_array_interface__ == {"shape": (4, 3, 2), "typestr": "<f4", "strides": (96, 8, 4),
                                             "data": (0x7F0000001000, False), "version": 3, "stream": None}


def test_a_view_may_change_the_element_type_and_be_c_contiguous():
    from cuda_kernels.core import DeviceView
    face = DeviceView(_Base(), (12,), None, "<u8").__cuda_array_interface__
    assert face["shape"] == (12,) and face["typestr"] == "<u8" and face["strides"] is None
    assert face["data"] == (0x7F0000001000, False)
