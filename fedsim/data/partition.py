"""Partitioners: pure functions that split training indices among simulated clients.

Every partitioner has the same call shape, so Hydra can bind its parameters with ``_partial_: true`` and the
caller finishes the call::

    fn(labels, num_clients, rng, groups=None, **params) -> list[np.ndarray]

The result holds one sorted ``int64`` index array per client; the arrays are disjoint, none is empty, and
together they cover ``arange(len(labels))`` (the ``flwr_datasets`` adapter may drop rows if the chosen
flwr-datasets partitioner does). All randomness comes from ``rng``; no global RNG is touched. Bad
parameters raise :class:`~fedsim.errors.ConfigError` with the parameter name as the key.
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Callable, Sequence

import numpy as np

from fedsim.checks import number
from fedsim.errors import ConfigError

__all__ = [
    "dirichlet",
    "flwr_datasets",
    "iid",
    "natural",
    "quantity",
    "shards",
    "similarity",
    "split_train_val",
    "ClientSplits",
]


# ---------------------------------------------------------------------------------------------- helpers
def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int(key: str, value: object, low: int, allowed: str | None = None) -> int:
    if not _is_int(value) or value < low:
        raise ConfigError(key, value, allowed or f"an integer >= {low}")
    return int(value)


def _check_positive(key: str, value: object) -> float:
    return number(key, value, 0.0, lo_open=True, what="a finite number > 0")


def _check_labels(labels: np.ndarray, num_clients: object) -> tuple[np.ndarray, int]:
    """Validate the arguments every partitioner shares; return labels as an array and ``num_clients``."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise ConfigError("labels", f"array of shape {labels.shape}", "a non-empty 1-D array of class ids")
    k = _check_int("num_clients", num_clients, 1)
    if k > labels.size:
        raise ConfigError(
            "num_clients",
            num_clients,
            f"at most {labels.size}, the number of training examples",
            "Every client needs at least one example.",
        )
    return labels, k


def _split_counts(p: np.ndarray, m: int) -> np.ndarray:
    """Cut ``m`` items into ``len(p)`` consecutive runs with fractions ``p`` (floor of the cumulative sums)."""
    edges = np.floor(np.cumsum(p) * m).astype(np.int64)
    np.clip(edges, 0, m, out=edges)
    edges[-1] = m
    return np.diff(edges, prepend=0)


def _equal_sizes(n: int, k: int) -> np.ndarray:
    """Sizes of ``k`` parts of ``n`` items that differ by at most one (larger parts first)."""
    sizes = np.full(k, n // k, dtype=np.int64)
    sizes[: n % k] += 1
    return sizes


def _parts_from_owner(owner: np.ndarray, num_clients: int, key: str, value: object) -> list[np.ndarray]:
    """Turn a per-example client id into sorted index arrays; every client must own an example."""
    counts = np.bincount(owner, minlength=num_clients)
    if counts.min() == 0:
        empty = int(np.count_nonzero(counts == 0))
        raise ConfigError(
            key, value, "a value that gives every client at least one example", f"{empty} clients got none."
        )
    order = np.argsort(owner, kind="stable").astype(np.int64, copy=False)  # stable: indices stay sorted
    return np.split(order, np.cumsum(counts)[:-1])


def _grouped_by_label(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """All indices ordered by label, in random order within each label."""
    perm = rng.permutation(labels.size)
    return perm[np.argsort(labels[perm], kind="stable")]


# ------------------------------------------------------------------------------------------ partitioners
def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups=None) -> list[np.ndarray]:
    """Split the examples uniformly at random into parts whose sizes differ by at most one.

    Parameters
    ----------
    labels : np.ndarray
        Class id of each training example, shape ``(n,)``.
    num_clients : int
        Number of parts, ``1 <= num_clients <= n``.
    rng : np.random.Generator
        Source of all randomness.
    groups : np.ndarray, optional
        Ignored; accepted for the uniform signature.

    Returns
    -------
    list of np.ndarray
        One sorted ``int64`` index array per client.
    """
    labels, k = _check_labels(labels, num_clients)
    owner = np.empty(labels.size, dtype=np.int64)
    owner[rng.permutation(labels.size)] = np.repeat(np.arange(k), _equal_sizes(labels.size, k))
    return _parts_from_owner(owner, k, "num_clients", num_clients)


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups=None,
    alpha: float = 0.5,
    min_size: int = 2,
    max_tries: int = 100,
    self_balancing: bool = False,
) -> list[np.ndarray]:
    """Label skew: each class is spread over the clients with proportions drawn from Dirichlet(alpha).

    After Yurochkin et al. 2019 (arXiv 1905.12022) and Hsu et al. 2019 (arXiv 1909.06335): for every class
    ``c`` draw ``p_c ~ Dir(alpha * 1_K)`` and give client ``k`` a fraction ``p_ck`` of that class's
    (shuffled) examples. The whole draw is repeated until every client has at least ``min_size`` examples.
    Small ``alpha`` gives each client few classes; large ``alpha`` approaches an IID split.

    Parameters
    ----------
    labels, num_clients, rng, groups
        As in :func:`iid`; ``groups`` is ignored.
    alpha : float
        Dirichlet concentration, > 0.
    min_size : int
        Smallest allowed client, >= 1.
    max_tries : int
        Draws to attempt before giving up with a :class:`ConfigError`.
    self_balancing : bool
        If true, a client that already holds more than ``n / num_clients`` examples gets no share of the
        classes that follow (the balancing trick of Yurochkin et al.'s code and flwr-datasets).

    Returns
    -------
    list of np.ndarray
        One sorted ``int64`` index array per client.
    """
    labels, k = _check_labels(labels, num_clients)
    alpha = _check_positive("alpha", alpha)
    min_size = _check_int("min_size", min_size, 1)
    max_tries = _check_int("max_tries", max_tries, 1)
    n = labels.size
    if k * min_size > n:
        raise ConfigError(
            "min_size", min_size, f"at most {n // k} (= {n} examples // {k} clients)", "Lower num_clients."
        )
    _, y = np.unique(labels, return_inverse=True)
    class_sizes = np.bincount(y)
    best = -1
    for _ in range(max_tries):
        props = rng.dirichlet(np.full(k, alpha), size=class_sizes.size)  # (classes, clients)
        counts = np.empty(props.shape, dtype=np.int64)
        sizes = np.zeros(k, dtype=np.int64)
        for c, m in enumerate(class_sizes):
            p = props[c]
            if self_balancing:
                p = np.where(sizes < n / k, p, 0.0)
                total = p.sum()
                p = p / total if total > 0 else props[c]
            counts[c] = _split_counts(p, int(m))
            sizes += counts[c]
        best = max(best, int(sizes.min()))
        if best >= min_size:
            break
    else:
        raise ConfigError(
            "min_size",
            min_size,
            f"a size Dirichlet(alpha={alpha}) can give all {k} clients",
            f"After {max_tries} draws the smallest client still had {best} examples (mean {n / k:.1f}). "
            "Raise alpha, lower min_size or num_clients, or raise max_tries.",
        )
    owner = np.empty(n, dtype=np.int64)
    owner[_grouped_by_label(y, rng)] = np.repeat(np.tile(np.arange(k), class_sizes.size), counts.ravel())
    return _parts_from_owner(owner, k, "min_size", min_size)


def shards(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups=None,
    shards_per_client: int = 2,
) -> list[np.ndarray]:
    """Pathological label skew of the FedAvg paper (McMahan et al. 2017, arXiv 1602.05629).

    Sort the examples by label (random order within a label), cut them into ``num_clients *
    shards_per_client`` contiguous shards whose sizes differ by at most one, and deal each client
    ``shards_per_client`` shards at random. Every example lands in a shard, so nothing is left over. When
    class sizes are multiples of the shard size, each client sees at most ``shards_per_client`` classes.

    Parameters
    ----------
    labels, num_clients, rng, groups
        As in :func:`iid`; ``groups`` is ignored.
    shards_per_client : int
        Shards per client, >= 1 and at most ``n // num_clients``.

    Returns
    -------
    list of np.ndarray
        One sorted ``int64`` index array per client.
    """
    labels, k = _check_labels(labels, num_clients)
    spc = _check_int("shards_per_client", shards_per_client, 1)
    n = labels.size
    if k * spc > n:
        raise ConfigError(
            "shards_per_client", shards_per_client, f"at most {n // k} (= {n} examples // {k} clients)"
        )
    num_shards = k * spc
    shard_of_position = np.repeat(np.arange(num_shards), _equal_sizes(n, num_shards))
    client_of_shard = np.empty(num_shards, dtype=np.int64)
    client_of_shard[rng.permutation(num_shards)] = np.arange(num_shards) // spc
    owner = np.empty(n, dtype=np.int64)
    owner[_grouped_by_label(labels, rng)] = client_of_shard[shard_of_position]
    return _parts_from_owner(owner, k, "shards_per_client", shards_per_client)


def similarity(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups=None,
    similarity: float = 0.1,
) -> list[np.ndarray]:
    """The similarity split of SCAFFOLD's EMNIST experiment (Karimireddy et al. 2020, arXiv 1910.06378).

    A share ``similarity`` (s) of each client's data is drawn IID; the rest comes from the data sorted by
    label. Client sizes are equal to within one (as :func:`iid`); client ``k`` of size ``n_k`` gets
    ``round(s * n_k)`` examples from a uniformly shuffled pool and the other ``n_k - round(s * n_k)`` as one
    contiguous run of the remaining examples sorted by label (random order within a label), the runs dealt to
    the clients in random order. s = 1 is an IID split, s = 0 the most label-skewed one (a client sees one or
    two classes when clients hold fewer examples than a class).

    Parameters
    ----------
    labels, num_clients, rng, groups
        As in :func:`iid`; ``groups`` is ignored.
    similarity : float
        Share of each client's data drawn IID, in [0, 1].

    Returns
    -------
    list of np.ndarray
        One sorted ``int64`` index array per client.
    """
    labels, k = _check_labels(labels, num_clients)
    s = number("similarity", similarity, 0.0, 1.0)
    n = labels.size
    sizes = _equal_sizes(n, k)
    shared = np.rint(s * sizes).astype(np.int64)
    perm = rng.permutation(n)
    pool, rest = perm[: shared.sum()], perm[shared.sum() :]
    owner = np.empty(n, dtype=np.int64)
    owner[pool] = np.repeat(np.arange(k), shared)
    rest = rest[np.argsort(labels[rest], kind="stable")]  # sorted by label, random order within a label
    order = rng.permutation(k)  # which client gets which run of the sorted data
    owner[rest] = np.repeat(order, (sizes - shared)[order])
    return _parts_from_owner(owner, k, "similarity", similarity)


def quantity(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups=None,
    exponent: float = 1.5,
    min_size: int = 2,
) -> list[np.ndarray]:
    """Quantity skew: power-law client sizes, examples dealt at random (IID labels within a client).

    Each client draws a weight ``w_k ~ Pareto(x_m=1, a=exponent)``; client ``k`` gets ``min_size`` examples
    plus a share ``w_k / sum(w)`` of the rest. Smaller ``exponent`` means a heavier tail, i.e. a few very
    large clients and many small ones.

    Parameters
    ----------
    labels, num_clients, rng, groups
        As in :func:`iid`; ``groups`` is ignored.
    exponent : float
        Pareto tail index, > 0 (1.5 is strongly skewed, 5 is mild).
    min_size : int
        Examples every client gets before the power-law share, >= 1.

    Returns
    -------
    list of np.ndarray
        One sorted ``int64`` index array per client.
    """
    labels, k = _check_labels(labels, num_clients)
    exponent = _check_positive("exponent", exponent)
    min_size = _check_int("min_size", min_size, 1)
    n = labels.size
    if k * min_size > n:
        raise ConfigError(
            "min_size", min_size, f"at most {n // k} (= {n} examples // {k} clients)", "Lower num_clients."
        )
    # Pareto(1, a) is exp(E / a) with E ~ Exp(1); work in log space so tiny exponents cannot overflow.
    log_w = rng.standard_exponential(k) / exponent
    w = np.exp(log_w - log_w.max())
    sizes = min_size + _split_counts(w / w.sum(), n - k * min_size)
    owner = np.empty(n, dtype=np.int64)
    owner[rng.permutation(n)] = np.repeat(np.arange(k), sizes)
    return _parts_from_owner(owner, k, "min_size", min_size)


def natural(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: np.ndarray | None = None,
    merge: bool = False,
) -> list[np.ndarray]:
    """One client per natural owner (user or writer id) in ``groups``.

    Client ``j`` holds the examples of the ``j``-th smallest group id. ``num_clients`` must equal the number
    of distinct groups, unless ``merge`` is true: then fewer clients are allowed and group ``j`` goes to
    client ``j % num_clients`` (round-robin over the sorted group ids). No randomness is used.

    Parameters
    ----------
    labels, num_clients, rng
        As in :func:`iid`; ``rng`` is unused.
    groups : np.ndarray
        Owner id of each training example, shape ``(n,)``; required.
    merge : bool
        Allow ``num_clients`` below the number of groups by merging groups round-robin.

    Returns
    -------
    list of np.ndarray
        One sorted ``int64`` index array per client.
    """
    labels, k = _check_labels(labels, num_clients)
    if groups is None:
        raise ConfigError(
            "groups",
            None,
            "a data set with natural owner ids (e.g. dataset=synthetic)",
            "This data set has no users; choose another partitioner, e.g. partitioner=dirichlet.",
        )
    groups = np.asarray(groups)
    if groups.shape != labels.shape:
        raise ConfigError(
            "groups", f"array of shape {groups.shape}", f"one id per example, shape {labels.shape}"
        )
    _, group_index = np.unique(groups, return_inverse=True)
    num_groups = int(group_index.max()) + 1
    if k > num_groups or (k < num_groups and not merge):
        allowed = f"{num_groups}, the number of groups in this data set"
        hint = f"Set num_clients={num_groups}"
        if not merge:
            hint += ", or partitioner.merge=true to merge groups round-robin into fewer clients"
        raise ConfigError("num_clients", num_clients, allowed + (" or fewer" if merge else ""), hint + ".")
    owner = (group_index % k).astype(np.int64)
    return _parts_from_owner(owner, k, "num_clients", num_clients)


# ---------------------------------------------------------------------------------------------- adapter
def flwr_datasets(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    groups: np.ndarray | None = None,
    name: str = "DirichletPartitioner",
    **kwargs,
) -> list[np.ndarray]:
    """Partition with any flwr-datasets partitioner class, on an in-memory Hugging Face dataset.

    The dataset has the columns ``label``, ``idx`` (row number) and, when ``groups`` is given, ``group``.
    ``num_partitions``, ``partition_by="label"`` (``"group"`` for the natural-id partitioners) and a
    ``seed`` drawn from ``rng`` are filled in when the class accepts them and ``kwargs`` does not set them.
    Some flwr-datasets partitioners drop rows (e.g. ``ShardPartitioner`` without
    ``keep_incomplete_shard``); the parts are then disjoint but need not cover every example.

    Parameters
    ----------
    labels, num_clients, rng, groups
        As in :func:`iid`.
    name : str
        Class name in ``flwr_datasets.partitioner``, e.g. ``"DirichletPartitioner"``.
    **kwargs
        Passed to the class, e.g. ``alpha=0.3, min_partition_size=10``.

    Returns
    -------
    list of np.ndarray
        One sorted ``int64`` index array per client.
    """
    labels, k = _check_labels(labels, num_clients)
    try:
        import datasets
        from flwr_datasets import partitioner as fp
    except ImportError as exc:
        raise ConfigError(
            "name", name, "an installed flwr-datasets", 'Install it with `pip install -e ".[hf]"`.'
        ) from exc
    cls = getattr(fp, name, None)
    if not isinstance(cls, type) or not issubclass(cls, getattr(fp, "Partitioner", object)):
        raise ConfigError("name", name, "a class name from flwr_datasets.partitioner, e.g. IidPartitioner")
    columns = {"label": labels.astype(np.int64), "idx": np.arange(labels.size, dtype=np.int64)}
    if groups is not None:
        columns["group"] = np.asarray(groups)
    params = inspect.signature(cls).parameters
    defaults = {
        "num_partitions": k,
        "partition_by": "group" if "NaturalId" in name else "label",
        "seed": int(rng.integers(2**31 - 1)),
    }
    kwargs = {**{key: v for key, v in defaults.items() if key in params}, **kwargs}
    unknown = (
        sorted(set(kwargs) - set(params)) if not any(p.kind == p.VAR_KEYWORD for p in params.values()) else []
    )
    if unknown:
        raise ConfigError(
            unknown[0],
            kwargs[unknown[0]],
            f"one of the parameters of {name}: {', '.join(params)}",
            "Remove it with ~partitioner.<key> on the command line.",
        )
    if kwargs.get("partition_by") == "group" and groups is None:
        raise ConfigError("name", name, "a label-based partitioner", "This data set has no natural groups.")
    try:
        part = cls(**kwargs)
        part.dataset = datasets.Dataset.from_dict(columns)
        made = part.num_partitions
        parts = [
            np.sort(np.asarray(part.load_partition(i)["idx"], dtype=np.int64)) for i in range(min(made, k))
        ]
    except (
        TypeError,
        ValueError,
        KeyError,
    ) as e:  # the partitioner's own check of its parameters or the data
        reason = " ".join(str(e).split())[:300]
        raise ConfigError(
            "name",
            name,
            f"parameters {name} accepts for this data (flwr-datasets says: {reason})",
            "Set them with +partitioner.<key>=VALUE, remove them with ~partitioner.<key>.",
        ) from None
    if made != k:
        raise ConfigError("num_clients", num_clients, f"{made}, the number of partitions {name} made")
    if min(p.size for p in parts) == 0:
        raise ConfigError("name", name, "a partitioner that gives every client at least one example")
    return parts


# -------------------------------------------------------------------------------------- per-client split
def _check_val_fraction(val_fraction: object) -> None:
    ok = isinstance(val_fraction, (int, float, np.integer, np.floating)) and not isinstance(
        val_fraction, bool
    )
    if not ok or not 0 <= val_fraction < 1:
        raise ConfigError("val_fraction", val_fraction, "a number in [0, 1)")


def _empty_client() -> ConfigError:
    return ConfigError("indices", "[]", "at least one index", "A client needs at least one example.")


def split_train_val(
    indices: np.ndarray, val_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's indices into a training part and a validation part.

    The validation part has ``floor(val_fraction * n)`` examples, capped at ``n - 1`` so training is never
    empty; for tiny clients it may be empty.

    Parameters
    ----------
    indices : np.ndarray
        The client's example indices, non-empty.
    val_fraction : float
        Fraction for validation, in ``[0, 1)``.
    rng : np.random.Generator
        Source of the shuffle.

    Returns
    -------
    (np.ndarray, np.ndarray)
        Sorted ``int64`` train and validation indices.
    """
    idx = np.asarray(indices, dtype=np.int64)
    _check_val_fraction(val_fraction)
    if idx.size == 0:
        raise _empty_client()
    n_val = min(math.floor(val_fraction * idx.size + 1e-9), idx.size - 1)
    shuffled = rng.permutation(idx)
    return np.sort(shuffled[n_val:]), np.sort(shuffled[:n_val])


class ClientSplits:
    """Every client's (train, validation) split, made when that client is first used.

    ``splits.train[k], splits.val[k]`` equal ``split_train_val(parts[k], val_fraction, rng_of(k))``, but only
    the clients a run samples pay for their split (a seeded generator and a shuffle, ~40 us each): at 10^6
    clients, splitting all of them up front took longer than partitioning. Sizes need no split
    (``sizes("train")``), and bad input is refused at construction as ``split_train_val`` would.

    Parameters
    ----------
    parts : list of np.ndarray
        One index array per client (a partitioner's output).
    val_fraction : float
        Fraction of each client's examples for validation, in ``[0, 1)``.
    rng_of : callable
        ``rng_of(k)`` is client ``k``'s generator for the shuffle.
    """

    def __init__(
        self, parts: list[np.ndarray], val_fraction: float, rng_of: Callable[[int], np.random.Generator]
    ) -> None:
        _check_val_fraction(val_fraction)
        n = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        if (n == 0).any():
            raise _empty_client()
        # the same float arithmetic as split_train_val's, element-wise
        n_val = np.minimum(np.floor(float(val_fraction) * n + 1e-9).astype(np.int64), n - 1)
        self.parts, self.val_fraction, self._rng_of = parts, float(val_fraction), rng_of
        self._sizes = {"train": n - n_val, "val": n_val}
        self._done: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.train: Sequence[np.ndarray] = _SplitHalf(self, 0)
        self.val: Sequence[np.ndarray] = _SplitHalf(self, 1)

    def __len__(self) -> int:
        return len(self.parts)

    def sizes(self, half: str = "train") -> np.ndarray:
        """Every client's number of ``"train"`` or ``"val"`` examples (``int64``), without splitting."""
        return self._sizes[half]

    def split(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``k``'s sorted (train, val) indices, split on first use and kept."""
        got = self._done.get(k)
        if got is None:  # two threads may both split: same result, one kept
            got = self._done[k] = split_train_val(self.parts[k], self.val_fraction, self._rng_of(k))
        return got


class _SplitHalf(Sequence):
    """``ClientSplits.train`` or ``.val``: a read-only list of index arrays, split on access."""

    def __init__(self, splits: ClientSplits, which: int) -> None:
        self._splits, self._which = splits, which

    def __len__(self) -> int:
        return len(self._splits)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = operator.index(k)
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"client {k} of {len(self)}")
        return self._splits.split(k)[self._which]
