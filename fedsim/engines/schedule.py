"""A batched client's local steps: their lengths, the seeded batch orders of a cohort (``fedsim.engines.vectorized``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedsim.training import LocalTraining, batch_size_for, num_local_steps

if TYPE_CHECKING:
    from fedsim.engines.vectorized import _Client


class _Steps:
    """What follows from a client's step lengths alone, computed once per lengths (:func:`_steps`): the
    lengths, their sum, the widest step, the batch-size bucket, each step's offset into the step order, and the
    step, slot and loss weight of every example (the rows of the cohort's gather index, ``cohort_batches``)."""

    __slots__ = ("lens", "total", "width", "bucket", "offsets", "step", "slot", "weight")

    def __init__(self, lens: tuple[int, ...]) -> None:
        counts = np.array(lens, dtype=np.int64)
        first = np.cumsum(counts) - counts
        self.lens, self.total = lens, int(counts.sum())
        self.width = max(lens, default=0)
        self.bucket = self.width.bit_length()
        self.offsets = tuple(int(v) for v in first)
        self.step = np.repeat(np.arange(len(lens), dtype=np.int64), counts)
        self.slot = np.arange(self.total, dtype=np.int64) - np.repeat(first, counts)
        self.weight = np.repeat(1.0 / counts.astype(np.float64), counts)  # a client's mean over its batch


@functools.lru_cache(maxsize=4096)
def _steps(lens: tuple[int, ...]) -> _Steps:
    return _Steps(lens)


class Schedule(Sequence):
    """The example indices of each local step (a sequence of index tensors), held as the permutations of the
    passes over the data (``parts``, the last one cut where the steps end: one after the other, every step's
    indices in order, ``order``) and the steps' lengths (``info``, shared by the clients whose steps have the same
    lengths)."""

    __slots__ = ("parts", "info", "steps", "_order")

    def __init__(self, parts: Sequence[torch.Tensor], info: _Steps) -> None:
        self.parts, self.info, self.steps, self._order = parts, info, len(info.lens), None

    @property
    def order(self) -> torch.Tensor:
        if self._order is None:
            parts = self.parts
            self._order = parts[0] if len(parts) == 1 else torch.cat(list(parts)) if parts else _EMPTY
        return self._order

    @property
    def lens(self) -> tuple[int, ...]:
        return self.info.lens

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self.info.lens))[i]
        start = self.info.offsets[i]
        return self.order[start : start + self.info.lens[i]]


@functools.lru_cache(maxsize=4096)
def _step_lens(n: int, bs: int, steps: int) -> tuple[int, ...]:
    """The batch length of each of ``steps`` steps over ``n`` examples in batches of ``bs`` (a pass ends with
    its partial batch)."""
    one_pass = (bs,) * (n // bs) + ((n % bs,) if n % bs else ())
    return (one_pass * -(-steps // len(one_pass)))[:steps]


def _info(batches) -> _Steps:
    """The step lengths of a client's batches and what follows from them."""
    return batches.info if isinstance(batches, Schedule) else _steps(tuple(len(b) for b in batches))


def _lens(batches) -> tuple[int, ...]:
    """The length of each step's batch."""
    return _info(batches).lens


def _parts(batches) -> Sequence[torch.Tensor]:
    """Tensors that, one after the other, hold every step's example indices in order."""
    return batches.parts if isinstance(batches, Schedule) else batches


_EMPTY = torch.zeros(0, dtype=torch.long)


def _order(batches) -> torch.Tensor:
    """Every step's example indices, one after the other, as one tensor."""
    if isinstance(batches, Schedule):
        return batches.order
    return torch.cat(list(batches)) if len(batches) else _EMPTY


@functools.lru_cache(maxsize=4096)
def _layout(n: int, cfg: LocalTraining, max_steps: int | None) -> tuple[_Steps, int]:
    """The steps of a client with ``n`` examples and the passes over its data they take."""
    bs = batch_size_for(n, cfg)
    steps = num_local_steps(n, cfg, max_steps)
    info = _steps(_step_lens(n, bs, steps) if n > 0 and bs > 0 and steps > 0 else ())
    return info, -(-info.total // n) if info.total else 0


def _draw(n: int, info: _Steps, passes: int, gen: torch.Generator) -> Schedule:
    """The schedule of steps ``info``: one seeded ``randperm`` per pass over the ``n`` examples, as
    ``fedsim.training.train_local`` draws them."""
    parts = [torch.randperm(n, generator=gen) for _ in range(passes)]
    cut = passes * n - info.total  # the last pass ends early
    if cut:
        parts[-1] = parts[-1][: n - cut]
    return Schedule(parts, info)


def schedule(n: int, cfg: LocalTraining, gen: torch.Generator, max_steps: int | None = None) -> Schedule:
    """Example indices of each local step, drawn as ``fedsim.training.train_local`` draws them: one
    ``randperm`` per pass over the data, split into batches, as many passes as the steps need."""
    return _draw(n, *_layout(n, cfg, max_steps), gen)


def cohort_batches(
    members: list[_Client], steps: int, width: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cohort's data in one tensor, and the gather index and loss weight of every (step, client, slot):
    ``x`` ``(examples, *input)``, ``y``, ``gather`` ``(steps, clients, width)`` into them, ``weight``.

    Each client's step, slot and weight of every example come from its step lengths (:class:`_Steps`, computed
    once per lengths); a round adds its batch order, and the index is written with one numpy scatter. When the
    steps take fewer examples than the clients hold (a few steps on large partitions, as in distributed SGD),
    ``x`` holds just the rows they take, in step order, instead of every client's whole partition."""
    k = len(members)
    infos = [_info(c.batches) for c in members]
    counts = np.fromiter((i.total for i in infos), np.int64, k)
    sizes = np.fromiter((c.task.x_train.shape[0] for c in members), np.int64, k)
    where = (np.concatenate([i.step for i in infos]) * k + np.repeat(np.arange(k), counts)) * width
    where += np.concatenate([i.slot for i in infos])
    gather = np.zeros(steps * k * width, dtype=np.int64)
    if counts.sum() < sizes.sum():  # the rows the steps take: example e of the cohort's steps is row e
        rows = [(c.task, _order(c.batches)) for c in members]
        x = torch.cat([t.x_train.index_select(0, r.to(t.x_train.device)) for t, r in rows])
        y = torch.cat(
            [_labels(c).index_select(0, r.to(t.y_train.device)) for c, (t, r) in zip(members, rows)]
        )
        gather[where] = np.arange(int(counts.sum()), dtype=np.int64)
    else:
        x = torch.cat([c.task.x_train for c in members])  # (examples, *input)
        y = torch.cat([_labels(c) for c in members])
        order = torch.cat([t for c in members for t in _parts(c.batches)]).cpu().numpy()
        gather[where] = order + np.repeat(np.cumsum(sizes) - sizes, counts)  # into the cohort's data
    weight = np.zeros(steps * k * width, dtype=np.float64)
    weight[where] = np.concatenate([i.weight for i in infos])
    shape = (steps, k, width)
    gather_t = torch.from_numpy(gather).view(shape).to(device)
    return x, y, gather_t, torch.from_numpy(weight).view(shape).to(device=device, dtype=x.dtype)


def _labels(c: _Client) -> torch.Tensor:
    """The labels client ``c`` trains on (its client halves', else its task's)."""
    return c.task.y_train if c.y is None else c.y
