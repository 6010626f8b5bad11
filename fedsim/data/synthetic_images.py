"""Seeded synthetic images with learnable class structure (Fashion-MNIST's shape by default), offline.

Every class has a smooth random template; an example is its class template shifted by a few pixels plus
pixel noise. The noise of pixel ``j`` of example ``i`` is a counter-based hash of ``(seed, i, j)``, so any
example can be made on its own, in any order, with the same values. That gives two storage modes with
identical data:

* ``lazy=False``: all training images are materialised up front (``n * C * H * W * 4`` bytes).
* ``lazy=True``: ``x_train`` is a :class:`ProceduralImages` array-like holding only labels and shift codes
  (9 bytes per example); images are made when indexed, so a population of millions of clients costs memory
  for the clients actually touched, not for the whole population.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fedsim.checks import integer, is_integer, is_number
from fedsim.data.base import Dataset, check_memory
from fedsim.errors import ConfigError

__all__ = ["ProceduralImages", "synthetic_images"]

_M1, _M2, _GOLDEN = (
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
    np.uint64(0x9E3779B97F4A7C15),
)
_ROWS_PER_CHUNK = 4096  # bounds the uint64 temporaries of the hash


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (in place; wrap-around arithmetic is intended)."""
    z += _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def _noise(key: int, rows: np.ndarray, npix: int) -> np.ndarray:
    """Unit-variance uniform noise of shape ``(len(rows), npix)``, a pure function of ``(key, row, pixel)``."""
    z = rows.astype(np.uint64)[:, None] * np.uint64(npix) + np.arange(npix, dtype=np.uint64)[None, :]
    z ^= np.uint64(key)
    u = (_splitmix64(z) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)  # [0, 1)
    return (u - np.float32(0.5)) * np.float32(math.sqrt(12.0))


class ProceduralImages:
    """Read-only array-like of images made on demand: ``x[idx]`` returns a float32 ``np.ndarray``.

    Supports ``len``, ``shape``, ``dtype``, ``ndim`` and indexing by an int, a slice, a list or an integer
    array. ``nbytes`` is what it holds in memory (labels and shift codes), not the size of the images.
    """

    def __init__(
        self,
        table: np.ndarray,
        labels: np.ndarray,
        codes: np.ndarray,
        noise: float,
        key: int,
        row_offset: int = 0,
    ) -> None:
        self._table = table  # (classes, shifts, C, H, W) shifted templates
        self._labels, self._codes = labels, codes
        self._noise, self._key, self._offset = np.float32(noise), int(key), int(row_offset)
        self.shape = (len(labels), *table.shape[2:])
        self.dtype = np.dtype(np.float32)
        self.ndim = len(self.shape)

    @property
    def nbytes(self) -> int:
        return self._labels.nbytes + self._codes.nbytes + self._table.nbytes

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx) -> np.ndarray:
        if isinstance(idx, (int, np.integer)):
            return self[np.array([idx])][0]
        rows = np.arange(len(self))[idx] if isinstance(idx, slice) else np.asarray(idx, dtype=np.int64)
        if rows.ndim != 1:
            raise IndexError("ProceduralImages supports an int, a slice or a 1-d index array")
        rows = np.where(rows < 0, rows + len(self), rows)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"index out of range for {len(self)} images")
        out = np.empty((rows.size, *self.shape[1:]), dtype=np.float32)
        npix = math.prod(self.shape[1:])
        flat = out.reshape(rows.size, npix)
        for s in range(0, rows.size, _ROWS_PER_CHUNK):
            r = rows[s : s + _ROWS_PER_CHUNK]
            flat[s : s + r.size] = self._table[self._labels[r], self._codes[r]].reshape(r.size, npix)
            flat[s : s + r.size] += self._noise * _noise(self._key, r + self._offset, npix)
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[slice(None)]
        return out if dtype is None else out.astype(dtype)


def _templates(
    rng: np.random.Generator, num_classes: int, shape: tuple[int, int, int], max_shift: int
) -> np.ndarray:
    """Smooth unit-std class templates, pre-shifted: shape ``(classes, (2s+1)**2, C, H, W)``."""
    c, h, w = shape
    lh, lw = max(2, h // 4), max(2, w // 4)
    low = rng.standard_normal((num_classes, c, lh, lw))
    rows, cols = np.arange(h) * lh // h, np.arange(w) * lw // w
    big = low[:, :, rows][:, :, :, cols]  # nearest-neighbour upsampling
    pad = np.pad(big, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="edge")
    smooth = sum(pad[:, :, i : i + h, j : j + w] for i in range(3) for j in range(3)) / 9.0  # 3x3 box blur
    smooth = (smooth - smooth.mean(axis=(1, 2, 3), keepdims=True)) / smooth.std(axis=(1, 2, 3), keepdims=True)
    shifts = [(dy, dx) for dy in range(-max_shift, max_shift + 1) for dx in range(-max_shift, max_shift + 1)]
    table = np.stack([np.roll(smooth, (dy, dx), axis=(2, 3)) for dy, dx in shifts], axis=1)
    return table.astype(np.float32)


def synthetic_images(
    seed: int,
    num_train: int = 60000,
    num_test: int = 10000,
    shape: Sequence[int] = (1, 28, 28),
    num_classes: int = 10,
    noise: float = 6.0,
    max_shift: int = 2,
    lazy: bool = False,
) -> Dataset:
    """Generate a seeded image classification set: shifted class templates plus pixel noise.

    Parameters
    ----------
    seed : int
        Seed of the templates, labels, shifts and noise; the same seed gives the same images.
    num_train, num_test : int
        Number of training and test images (>= 1).
    shape : sequence of int
        ``(C, H, W)`` of one image (Fashion-MNIST: ``(1, 28, 28)``).
    num_classes : int
        Number of classes (>= 2); labels are uniform.
    noise : float
        Std of the pixel noise relative to the unit-std templates (>= 0); larger is harder. With 6, a
        logistic regression reaches about 0.75 test accuracy after 20000 examples, a small CNN about 0.9.
    max_shift : int
        Each image is its template rolled by up to this many pixels in each direction (>= 0).
    lazy : bool
        Make training images when indexed instead of up front (same values; see the module docstring).

    Returns
    -------
    Dataset
        ``x`` float32 of shape ``(n, C, H, W)``, scaled to zero mean and unit std overall.
    """
    for key, val, lo in (
        ("num_train", num_train, 1),
        ("num_test", num_test, 1),
        ("num_classes", num_classes, 2),
        ("max_shift", max_shift, 0),
    ):
        integer(key, val, lo)
    dims = list(shape) if isinstance(shape, Sequence) and not isinstance(shape, str) else None
    if dims is None or len(dims) != 3 or not all(is_integer(s) and s >= 1 for s in dims):
        raise ConfigError("shape", shape if dims is None else dims, "three positive integers [C, H, W]")
    shape = tuple(int(s) for s in dims)
    if not is_number(noise) or not math.isfinite(noise) or noise < 0:
        raise ConfigError("noise", noise, "a finite number >= 0")
    pixels = int(np.prod(shape))
    check_memory(
        {
            ("num_classes", num_classes): int(num_classes)
            * pixels
            * (4 * (2 * int(max_shift) + 1) ** 2 + 40),
            ("num_train", num_train): 0 if lazy else int(num_train) * pixels * 4,
            ("num_test", num_test): int(num_test) * pixels * 4,
        },
        "templates and images",
    )
    scale = 1.0 / math.sqrt(1.0 + float(noise) ** 2)  # unit std overall, like a normalised image set
    table = _templates(np.random.default_rng([seed, 0]), num_classes, shape, max_shift) * np.float32(scale)
    key = int(np.random.default_rng([seed, 1]).integers(0, 2**63))

    def split(n: int, stream: int, offset: int) -> ProceduralImages:
        rng = np.random.default_rng([seed, stream])
        labels = rng.integers(0, num_classes, n)
        codes = rng.integers(0, table.shape[1], n).astype(np.uint8 if table.shape[1] < 256 else np.int64)
        return ProceduralImages(table, labels, codes, float(noise) * scale, key, offset)

    train, test = split(int(num_train), 2, 0), split(int(num_test), 3, int(num_train))
    return Dataset(
        name="synthetic_images",
        x_train=train if lazy else np.asarray(train),
        y_train=train._labels,
        x_test=np.asarray(test),
        y_test=test._labels,
        num_classes=int(num_classes),
        input_shape=shape,
    )
