"""Every random draw in fedsim comes from ``(seed, purpose, *keys)``: the purposes, named once.

No draw depends on a running generator, so a resumed run, another engine or another worker draws the same
numbers (keys are the round or task index and the partition id). The integers are part of fedsim's results:
changing one changes every run that draws for that purpose, so new purposes take new numbers.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch


class Purpose(IntEnum):
    """What a draw is for (the second entry of its seed sequence)."""

    COHORT = 1  # the synchronous round's sampled clients: (seed, 1, round)
    EVALUATORS = 2  # the part of the cohort that evaluates (federated_eval): (seed, 2, round)
    LOCAL_SHUFFLE = 3  # a client's minibatch order in local training: (seed, 3, round or task, partition)
    DP_NOISE = (
        5  # the clipping wrapper's count noise without DP; DP draws use the server-only clipping.noise_seed
    )
    PARTITION = 7  # the partitioner's split of the training set: (seed, 7)
    TRAIN_VAL_SPLIT = 8  # each client's train/validation split: (seed, 8, partition)
    FAULTS = 9  # injected faults: (seed, 9, round or task, partition)
    CLIENT_SPEED = 11  # the heterogeneity model's per-client speeds: (seed, 11)
    DROPOUT = 12  # a client dropping out of a task: (seed, 12, partition, task)
    STRAGGLER = 13  # a client straggling on a task: (seed, 13, partition, task)
    ASYNC_TASK = 21  # the asynchronous loop's choice of the next client: (seed, 21, task)
    MALICIOUS = 31  # the attack's fixed set of malicious clients: (seed, 31)
    ATTACK_NOISE = 32  # the gaussian attack's random updates: (seed, 32, round, partition)
    SELECTION = 33  # client selection's candidates (power of choice): (seed, 33, round)
    COMPRESSION = 34  # QSGD's stochastic rounding: (seed, 34, round, partition)


def rng(seed: int, purpose: Purpose, *keys: int) -> np.random.Generator:
    """The numpy generator of ``purpose`` for ``keys`` under the run's ``seed``."""
    return np.random.default_rng([int(seed), int(purpose), *(int(k) for k in keys)])


def torch_generator(seed: int, purpose: Purpose, *keys: int) -> torch.Generator:
    """A CPU torch generator seeded from the same sequence as :func:`rng` would be."""
    state = np.random.SeedSequence([int(seed), int(purpose), *(int(k) for k in keys)]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(state))


def torch_generators(rows: list[tuple[int, ...]]) -> list[torch.Generator]:
    """``[torch_generator(*row) for row in rows]`` (a row: seed, purpose, keys), the seeds computed together.

    numpy's ``SeedSequence`` costs about 8 us a sequence, most of it making the object; at least
    :data:`TOGETHER` rows of equal length with every entry in ``[0, 2^32)`` take its hash (:func:`_seed_words`)
    on arrays instead, one column per row (measured: 100 rows 0.40 ms instead of 1.5 ms, 1,000 rows 5.1 ms
    instead of 12.8 ms; 10 rows 0.12 ms either way, so fewer go one by one). Anything else goes through
    :func:`torch_generator`.
    """
    if not rows:
        return []
    width = len(rows[0])
    if (
        len(rows) < TOGETHER
        or width < 4
        or any(len(r) != width or not all(0 <= int(v) < 2**32 for v in r) for r in rows)
    ):
        return [torch_generator(*row) for row in rows]
    return [torch.Generator().manual_seed(int(s)) for s in _seed_words(np.array(rows, dtype=np.uint64))]


TOGETHER = 16  # rows from which torch_generators hashes them together

# numpy's SeedSequence (numpy/random/bit_generator.pyx, pool of 4 words): its constants and 16-bit xorshift.
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _MASK, _SHIFT = 0xCA01F9DD, 0x4973F715, np.uint64(0xFFFFFFFF), np.uint64(16)


def _seed_words(entropy: np.ndarray) -> np.ndarray:
    """``SeedSequence(list(row)).generate_state(1)[0]`` of every row of ``entropy`` (rows of at least 4 entries,
    each one 32-bit word), in uint32 arithmetic held in uint64 arrays. Checked against numpy (test)."""
    hash_const = [np.uint64(_INIT_A)]

    def hashmix(value: np.ndarray) -> np.ndarray:
        value = value ^ hash_const[0]
        hash_const[0] = (hash_const[0] * np.uint64(_MULT_A)) & _MASK
        value = (value * hash_const[0]) & _MASK
        return value ^ (value >> _SHIFT)

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result = (np.uint64(_MIX_L) * x - np.uint64(_MIX_R) * y) & _MASK
        return result ^ (result >> _SHIFT)

    pool = [hashmix(entropy[:, i]) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(4, entropy.shape[1]):
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(entropy[:, src]))
    value = ((pool[0] ^ np.uint64(_INIT_B)) * np.uint64(_INIT_B * _MULT_B & 0xFFFFFFFF)) & _MASK
    return value ^ (value >> _SHIFT)
