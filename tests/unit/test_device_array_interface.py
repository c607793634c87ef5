"""A value's ``__cuda_array_interface__`` is its producer's word: each malformed field is an
InvalidValue naming it. Before, most escaped as AttributeError, KeyError or TypeError from deep in
the GPU module, a missing typestr was read as float64, and a negative shape gave a negative size.
All of this is checked before cupy is imported, so it runs on a machine without a GPU too."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_store.errors import InvalidValue
from mooncake_store.tiers.gpu_arrays import describe_device_array


def device_array(iface: Any) -> object:
    return type("Dev", (), {"__cuda_array_interface__": iface})()


GOOD = {"shape": (4,), "typestr": "<f4", "data": (1 << 20, False), "version": 3}


@pytest.mark.parametrize(
    ("iface", "message"),
    [
        ("garbage", "must be a dict, got str"),
        ({k: v for k, v in GOOD.items() if k != "shape"}, "no valid 'shape'"),
        ({**GOOD, "shape": 4}, "no valid 'shape'"),
        ({**GOOD, "shape": (2.5,)}, "no valid 'shape'"),
        ({**GOOD, "shape": (-4,)}, r"negative dimension in shape \(-4,\)"),
        ({**GOOD, "typestr": None}, "no valid 'typestr'"),
        ({**GOOD, "typestr": "zz9"}, "typestr 'zz9' is not storable"),
        ({k: v for k, v in GOOD.items() if k != "data"}, "no valid 'data'"),
        ({**GOOD, "data": None}, "no valid 'data'"),
        ({**GOOD, "data": ("x", False)}, "no valid 'data'"),
        ({**GOOD, "data": (0, False)}, "no device address"),
        ({**GOOD, "data": (1 << 64, False)}, r"at 18446744073709551616, no device address \(1\.\.2\*\*63-1\)"),
        # cupy's runtime takes a signed intptr_t: 2**63 raised OverflowError past the checks
        ({**GOOD, "data": (1 << 63, False)}, r"at 9223372036854775808, no device address \(1\.\.2\*\*63-1\)"),
        ({**GOOD, "stream": 1 << 63}, r"'stream' of 9223372036854775808, no stream handle"),
        ({**GOOD, "shape": (1,) * 33}, "device array has 33 dimensions; the limit is 32"),
        ({**GOOD, "shape": (2, 2), "strides": (8,)}, r"'strides' \(8,\)"),
        ({**GOOD, "shape": (2, 2), "strides": (4, 8)}, "not C-contiguous"),
        ({**GOOD, "stream": "s"}, "'stream' that is no stream handle"),
        ({**GOOD, "mask": object()}, "masked device arrays"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_malformed_interface_is_an_invalid_value_naming_the_field(iface: Any, message: str) -> None:
    with pytest.raises(InvalidValue, match=message):
        describe_device_array(device_array(iface))


def test_a_read_only_destination_is_refused_before_anything_is_written() -> None:
    """A read-only host buffer is refused as get_into's out; a device array whose interface says
    read-only (data[1]) was filled all the same. As a source it is fine: a put only reads it."""
    with pytest.raises(InvalidValue, match=r"out \(Dev\) is read-only"):
        describe_device_array(device_array({**GOOD, "data": (1 << 20, True)}), for_writing=True)
