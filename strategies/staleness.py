"""Staleness weights s(t - tau) of asynchronous FL: how much an update computed on an old model still counts.

Staleness is the number of server model versions published between the version a client started from and
the version its update meets. Three forms (Xie et al. 2019, FedAsync; FedBuff uses the polynomial with
``a = 0.5``, i.e. ``1 / sqrt(1 + s)``):

* ``constant``:   s(t) = 1
* ``polynomial``: s(t) = (1 + t) ** -a
* ``hinge``:      s(t) = 1 if t <= b else 1 / (a_h (t - b) + 1)

The polynomial's exponent ``a`` (``staleness_a``, default 0.5) and the hinge's slope ``a_h`` (``hinge_a``,
default 10 as in Xie et al. 2019) are separate parameters: at staleness 6 with ``b = 4`` the paper's hinge
weighs an update 1/21, not the 1/2 that the polynomial's 0.5 would give.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from fedsim.checks import number
from fedsim.errors import ConfigError

KINDS = ("constant", "polynomial", "hinge")


def _check(staleness: int) -> None:
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")


def constant(staleness: int) -> float:
    """Every update counts fully: 1."""
    _check(staleness)
    return 1.0


def polynomial(staleness: int, a: float = 0.5) -> float:
    """``(1 + staleness) ** -a``: 1 for a fresh update, decaying polynomially (``a >= 0``)."""
    _check(staleness)
    return float((1.0 + staleness) ** -a)


def hinge(staleness: int, a: float = 10.0, b: float = 4.0) -> float:
    """1 up to staleness ``b``, then ``1 / (a (staleness - b) + 1)``."""
    _check(staleness)
    return 1.0 if staleness <= b else float(1.0 / (a * (staleness - b) + 1.0))


def staleness_fn(
    kind: str, a: float = 0.5, b: float = 4.0, hinge_a: float | None = None
) -> Callable[[int], float]:
    """The weight function ``kind`` with its parameters bound; ``ConfigError`` names a bad one.

    ``a`` is the polynomial's exponent, ``hinge_a`` the hinge's slope (None: 10, the paper's), ``b`` the
    hinge's knee. Keys in errors are the strategies' YAML keys: ``staleness``, ``staleness_a``, ``hinge_a``,
    ``staleness_b``.
    """
    if kind not in KINDS:
        raise ConfigError("staleness", kind, f"one of {', '.join(KINDS)}")
    if kind == "constant":
        return constant
    if kind == "polynomial":
        a = number("staleness_a", a, 0.0, what="a finite number >= 0")
        return partial(polynomial, a=float(a))
    b = number("staleness_b", b, 0.0, what="a finite number >= 0 (staleness up to b counts fully)")
    hinge_a = number("hinge_a", 10.0 if hinge_a is None else hinge_a, 0.0, what="a finite number >= 0")
    return partial(hinge, a=float(hinge_a), b=float(b))
