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
