"""Model factories that adapt to a data set's input shape and class count.

Each factory takes ``input_shape`` and ``num_classes`` (filled in by fedsim from the data set) plus its own
hyperparameters, and returns an ``nn.Module`` mapping ``(batch, *input_shape)`` to ``(batch, num_classes)``
logits. Any ``_target_`` with this signature can be used as ``model=``, and so can one that takes only some of
them, or none: a Flower app's own ``Net`` class (``model._target_=mytask.Net``) is built as ``Net()``
(:func:`build_model` passes only the arguments the factory's signature names).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from fedsim.errors import ConfigError


def _widths(key: str, value, one: bool = False) -> list[int]:
    """Layer widths as positive integers (``one``: a single width), else one ``ConfigError`` naming ``key``."""
    items = [value] if one else value
    ok = (one or isinstance(value, (list, tuple, Sequence))) and not isinstance(value, (str, bytes))
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in items)
    if not ok:
        what = "a positive integer" if one else "a list of positive integer layer widths, e.g. [64, 32]"
        listed = isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and not one
        raise ConfigError(key, list(value) if listed else value, what)
    return [int(v) for v in items]


def logreg(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """Multinomial logistic regression (FedProx's ``mclr``)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def mlp(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (64,)) -> nn.Module:
    """Fully connected ReLU network with the given hidden widths."""
    widths = [math.prod(input_shape), *_widths("hidden", hidden)]
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, int(b)), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], num_classes))
    return nn.Sequential(*layers)


def cnn(
    input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (16, 32), hidden: int = 64
) -> nn.Module:
    """Small CNN: conv3x3-ReLU-maxpool blocks, then one hidden dense layer.

    Works on 1-channel or 3-channel images of any size >= 2**len(channels) (digits 8x8, MNIST 28x28,
    CIFAR 32x32). Inputs without a channel axis, ``(h, w)``, are treated as one channel.
    """
    shape = tuple(input_shape)
    if len(shape) == 2:
        shape = (1, *shape)
    if len(shape) != 3:
        raise ConfigError(
            "model", "cnn", "image inputs (C, H, W)", f"This data set's inputs have shape {shape}."
        )
    c, h, w = shape
    channels, (hidden,) = _widths("channels", channels), _widths("hidden", hidden, one=True)
    layers: list[nn.Module] = [nn.Unflatten(1, shape)] if len(input_shape) != 3 else []
    for out in channels:
        layers += [nn.Conv2d(c, int(out), 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c, h, w = int(out), h // 2, w // 2
    if h < 1 or w < 1:
        raise ConfigError(
            "model.channels", list(channels), f"at most {int(math.log2(min(shape[1:])))} blocks"
        )
    layers += [nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)]
    return nn.Sequential(*layers)


def factory_arguments(factory: Callable, **given) -> dict:
    """The entries of ``given`` that ``factory`` takes: those its signature names, all of them when it takes
    ``**kwargs`` or has no signature to read (a builtin)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return given
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return given
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in given.items() if k in names}


def build_model(factory, input_shape: Sequence[int], num_classes: int, seed: int) -> nn.Module:
    """Build a model with weights drawn from ``seed`` without touching the global torch RNG.

    ``factory`` gets ``input_shape`` and ``num_classes`` where its signature takes them (a Flower app's ``Net``,
    which takes neither, is called as ``Net()``). A hyperparameter the factory does not take (``model.hidden``
    left over from ``model=mlp`` when ``model._target_`` names another class) is one ``ConfigError`` naming it.
    """
    given = factory_arguments(factory, input_shape=tuple(input_shape), num_classes=num_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return factory(**given)
        except TypeError as e:
            unexpected = _unexpected_keyword(factory, e)
            if unexpected is None:
                raise
            key, value = unexpected
            target = getattr(getattr(factory, "func", factory), "__name__", "the model factory")
            raise ConfigError(
                key,
                value,
                f"a parameter of {target}",
                f"{target} takes no {key!r}: drop it with ~model.{key}.",
            ) from None


def _unexpected_keyword(factory, e: TypeError) -> tuple[str, object] | None:
    """The hyperparameter (``functools.partial`` keyword) that ``e`` says the factory does not take, if any."""
    import re

    m = re.search(r"unexpected keyword argument '(\w+)'", str(e))
    keywords = getattr(factory, "keywords", None) or {}
    if m is None or m.group(1) not in keywords:
        return None
    return m.group(1), keywords[m.group(1)]
