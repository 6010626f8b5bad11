"""``fedsim.records.array_values``: the values of ``Array.numpy()`` without its ``np.load``."""

import io

import numpy as np
import pytest
from flwr.app import Array

from fedsim.records import array_values, to_numpy, to_record

RNG = np.random.default_rng(0)
CASES = {
    "float32 matrix": RNG.normal(size=(3, 4)).astype(np.float32),
    "0-d float64": np.array(3.5),
    "0-d int64": np.array(7, dtype=np.int64),
    "empty": np.zeros((0, 5), np.float32),
    "big-endian": RNG.normal(size=(2, 3, 4)).astype(">f4"),
    "bool": np.array([True, False, True]),
    "strided uint8": np.arange(10, dtype=np.uint8)[::2],
    "float16": RNG.normal(size=(40, 7)).astype(np.float16),
    "Fortran order": np.asfortranarray(RNG.normal(size=(3, 4))),  # through Array.numpy()
}


@pytest.mark.parametrize("x", CASES.values(), ids=CASES.keys())
def test_same_values_dtype_and_shape_as_flowers_own_parse(x):
    a = Array(np.asarray(x))
    want = a.numpy()
    for writable in (True, False):
        got = array_values(a, writable=writable)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_writable_values_are_a_copy_and_the_view_copies_nothing():
    x = RNG.normal(size=(5, 6)).astype(np.float32)
    a = Array(x)
    got = array_values(a)
    got += 1  # the caller's own array: the record's bytes are untouched
    np.testing.assert_array_equal(a.numpy(), x)
    view = array_values(a, writable=False)
    assert not view.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        view[0, 0] = 0
    assert view.base is not None and not np.shares_memory(view, got)


def test_a_version_2_header_and_a_foreign_payload():
    x = RNG.normal(size=(4, 3))
    buf = io.BytesIO()
    np.lib.format.write_array(buf, x, version=(2, 0))
    v2 = Array(dtype=str(x.dtype), shape=x.shape, stype="numpy.ndarray", data=buf.getvalue())
    np.testing.assert_array_equal(array_values(v2), x)
    foreign = Array(dtype="float32", shape=(2,), stype="torch.Tensor", data=b"\0" * 8)
    with pytest.raises(TypeError, match="Unsupported serialization type"):  # what Array.numpy() says
        array_values(foreign)


def test_bytes_that_do_not_match_their_header_are_left_to_numpy():
    x = np.arange(6, dtype=np.float64)
    good = Array(x).data
    short = Array(dtype="float64", shape=(6,), stype="numpy.ndarray", data=good[:-8])
    with pytest.raises(ValueError):  # np.load's own complaint, not a silently shorter array
        array_values(short)


def test_a_record_round_trips():
    arrays = {k: np.asarray(v) for k, v in CASES.items()}
    back = to_numpy(to_record(arrays))
    assert list(back) == list(arrays)
    for k, v in arrays.items():
        np.testing.assert_array_equal(back[k], v)
        assert back[k].flags.writeable
