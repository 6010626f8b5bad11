"""Partitioners: invariants (disjoint, covering, non-empty), determinism, skew behaviour, validation, configs."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from helpers import run_tiny
from omegaconf import OmegaConf

from fedsim.data import partition as P
from fedsim.data.stats import label_entropy, partition_stats, plot_partitions
from fedsim.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf" / "partitioner"


def balanced_labels(per_class: int = 100, num_classes: int = 10, seed: int = 123) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def groups_for(n: int, num_groups: int, seed: int = 5) -> np.ndarray:
    # Non-contiguous, non-zero-based ids, every id used at least once.
    ids = np.arange(num_groups) * 7 + 100
    g = np.concatenate([ids, np.random.default_rng(seed).choice(ids, n - num_groups)])
    return np.random.default_rng(seed + 1).permutation(g)


def assert_valid(parts: list[np.ndarray], n: int, num_clients: int) -> None:
    assert len(parts) == num_clients
    for p in parts:
        assert p.dtype == np.int64
        assert p.size >= 1
        assert np.all(np.diff(p) > 0)  # sorted, no duplicates within a client
    joined = np.concatenate(parts)
    assert joined.size == n  # with the next line: disjoint across clients
    np.testing.assert_array_equal(np.sort(joined), np.arange(n))


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


LABELS = balanced_labels()
GROUPS = groups_for(LABELS.size, 20)
RANDOM_PARTITIONERS = {
    "iid": P.iid,
    "dirichlet": partial(P.dirichlet, alpha=0.5, min_size=2),
    "shards": partial(P.shards, shards_per_client=2),
    "quantity": partial(P.quantity, exponent=1.5, min_size=2),
    "similarity": partial(P.similarity, similarity=0.1),
}


@pytest.mark.parametrize("name", [*RANDOM_PARTITIONERS, "natural"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [1000, 997])
def test_disjoint_covering_nonempty(name, seed, n):
    labels, groups = LABELS[:n], GROUPS[:n]
    fn = RANDOM_PARTITIONERS.get(name, P.natural)
    parts = fn(labels, 20, np.random.default_rng(seed), groups=groups)
    assert_valid(parts, n, 20)


@pytest.mark.parametrize("name", list(RANDOM_PARTITIONERS))
def test_same_seed_same_partition_other_seed_differs(name):
    fn = RANDOM_PARTITIONERS[name]
    a = fn(LABELS, 20, np.random.default_rng(7))
    b = fn(LABELS, 20, np.random.default_rng(7))
    c = fn(LABELS, 20, np.random.default_rng(8))
    assert same(a, b)
    assert not same(a, c)


def test_partitioners_do_not_touch_global_rng():
    np.random.seed(0)
    before = np.random.random()
    np.random.seed(0)
    for fn in RANDOM_PARTITIONERS.values():
        fn(LABELS, 10, np.random.default_rng(0))
    assert np.random.random() == before


def test_iid_sizes_differ_by_at_most_one():
    sizes = [p.size for p in P.iid(LABELS[:997], 10, np.random.default_rng(0))]
    assert max(sizes) - min(sizes) <= 1


def mean_entropy(fn, seeds=range(5), k=20) -> float:
    vals = []
    for s in seeds:
        stats = partition_stats(fn(LABELS, k, np.random.default_rng(s)), LABELS, 10)
        vals.append(stats["mean_label_entropy"])
    return float(np.mean(vals))


def test_dirichlet_small_alpha_is_more_skewed():
    low = mean_entropy(partial(P.dirichlet, alpha=0.1, min_size=1))
    mid = mean_entropy(partial(P.dirichlet, alpha=1.0, min_size=1))
    high = mean_entropy(partial(P.dirichlet, alpha=100.0, min_size=1))
    assert low < mid < high
    assert high > 0.95 * np.log2(10)  # near-uniform label mix per client
    assert low < 0.6 * np.log2(10)


def test_dirichlet_respects_min_size():
    for seed in range(3):
        parts = P.dirichlet(LABELS, 20, np.random.default_rng(seed), alpha=0.3, min_size=25)
        assert min(p.size for p in parts) >= 25
        assert_valid(parts, LABELS.size, 20)


def test_dirichlet_self_balancing_reduces_size_spread():
    def spread(balance: bool) -> float:
        sizes = [
            [
                p.size
                for p in P.dirichlet(LABELS, 20, np.random.default_rng(s), alpha=0.3, self_balancing=balance)
            ]
            for s in range(5)
        ]
        return float(np.mean([np.std(s) for s in sizes]))

    assert spread(True) < spread(False)


def test_dirichlet_impossible_min_size_names_key_and_alpha():
    with pytest.raises(ConfigError, match="min_size") as info:
        P.dirichlet(LABELS, 50, np.random.default_rng(0), alpha=0.01, min_size=15, max_tries=3)
    assert "alpha" in str(info.value)
    with pytest.raises(ConfigError, match="min_size"):  # more than n // num_clients: fails before drawing
        P.dirichlet(LABELS, 50, np.random.default_rng(0), min_size=21)


@pytest.mark.parametrize("alpha", [0, -1.0, float("nan"), float("inf"), "0.5", True])
def test_dirichlet_bad_alpha(alpha):
    with pytest.raises(ConfigError, match="alpha"):
        P.dirichlet(LABELS, 10, np.random.default_rng(0), alpha=alpha)


def test_shards_at_most_shards_per_client_classes():
    for spc, k in ((1, 100), (2, 50), (4, 25), (5, 20)):  # 100 shards of 10: each inside one class of 100
        parts = P.shards(LABELS, k, np.random.default_rng(spc), shards_per_client=spc)
        assert_valid(parts, LABELS.size, k)
        classes = [np.unique(LABELS[p]).size for p in parts]
        assert max(classes) <= spc
        assert max(classes) == spc  # and the split really is label-skewed, not single-class by accident


def test_shards_uneven_sizes_still_cover():
    labels = np.concatenate([LABELS, LABELS[:3]])  # 1003 examples: 21 shards of 47 or 48
    parts = P.shards(labels, 7, np.random.default_rng(0), shards_per_client=3)
    assert_valid(parts, labels.size, 7)


def gini(sizes) -> float:
    s = np.sort(np.asarray(sizes, dtype=float))
    n = s.size
    return float((2 * np.arange(1, n + 1) - n - 1) @ s / (n * s.sum()))


@pytest.mark.parametrize("s", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("n", [1000, 997])
def test_similarity_sizes_iid_share_and_label_skew(s, n):
    labels = LABELS[:n]
    k = 20
    parts = P.similarity(labels, k, np.random.default_rng(3), similarity=s)
    assert_valid(parts, n, k)
    sizes = np.array([p.size for p in parts])
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == n  # the iid split's sizes
    assert same(parts, P.similarity(labels, k, np.random.default_rng(3), similarity=s))
    assert not same(parts, P.similarity(labels, k, np.random.default_rng(4), similarity=s))
    classes = [np.unique(labels[p]).size for p in parts]
    if s == 0.0:  # 50 examples from a run sorted by label: one class, or two where a run spans a boundary
        assert max(classes) <= 2
    if s == 1.0:
        assert np.mean(classes) > 8  # 50 IID draws over 10 classes
    if s == 0.5:
        assert np.mean(classes) > 2


def test_similarity_iid_share_is_exact():
    """Rebuild the draw: the first round(s * n_k) of each client's examples in the shuffled order are IID."""
    labels, k, s = LABELS, 10, 0.3
    parts = P.similarity(labels, k, np.random.default_rng(7), similarity=s)
    perm = np.random.default_rng(7).permutation(labels.size)
    pool = set(perm[: round(s * 100) * k].tolist())  # 1000 / 10 = 100 examples per client
    for p in parts:
        assert len(pool & set(p.tolist())) == round(s * 100)
        rest = sorted(set(p.tolist()) - pool)
        assert np.unique(labels[rest]).size <= 3  # 70 cut from the label-sorted rest (about 70 a class)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "x", float("nan")])
def test_similarity_bad_value_names_its_key(bad):
    with pytest.raises(ConfigError, match="similarity"):
        P.similarity(LABELS, 20, np.random.default_rng(0), similarity=bad)


def test_quantity_sizes_are_skewed_and_labels_mixed():
    labels = balanced_labels(per_class=500)
    g_iid, g_q, g_mild = [], [], []
    for s in range(5):
        q = P.quantity(labels, 50, np.random.default_rng(s), exponent=1.5, min_size=2)
        assert min(p.size for p in q) >= 2
        g_q.append(gini([p.size for p in q]))
        g_mild.append(gini([p.size for p in P.quantity(labels, 50, np.random.default_rng(s), exponent=8.0)]))
        g_iid.append(gini([p.size for p in P.iid(labels, 50, np.random.default_rng(s))]))
        big = max(q, key=len)
        assert np.unique(labels[big]).size == 10  # labels are not skewed
    assert np.mean(g_iid) < 0.01
    assert np.mean(g_q) > 0.3
    assert np.mean(g_mild) < np.mean(g_q)


def test_quantity_tiny_exponent_does_not_overflow():
    parts = P.quantity(LABELS, 20, np.random.default_rng(0), exponent=1e-3, min_size=3)
    assert_valid(parts, LABELS.size, 20)
    assert min(p.size for p in parts) >= 3


def test_natural_maps_groups_exactly():
    parts = P.natural(LABELS, 20, np.random.default_rng(0), groups=GROUPS)
    ids = np.unique(GROUPS)
    for j, p in enumerate(parts):
        np.testing.assert_array_equal(p, np.flatnonzero(ids[j] == GROUPS))


def test_natural_merge_round_robin():
    parts = P.natural(LABELS, 6, np.random.default_rng(0), groups=GROUPS, merge=True)
    assert_valid(parts, LABELS.size, 6)
    ids = np.unique(GROUPS)
    for j, p in enumerate(parts):
        assert set(np.unique(GROUPS[p])) == set(ids[j::6])


def test_natural_errors():
    with pytest.raises(ConfigError, match="num_clients") as info:
        P.natural(LABELS, 10, np.random.default_rng(0), groups=GROUPS)
    assert "20" in str(info.value) and "merge" in str(info.value)
    with pytest.raises(ConfigError, match="num_clients"):
        P.natural(LABELS, 21, np.random.default_rng(0), groups=GROUPS, merge=True)
    with pytest.raises(ConfigError, match="groups"):
        P.natural(LABELS, 10, np.random.default_rng(0), groups=None)
    with pytest.raises(ConfigError, match="groups"):
        P.natural(LABELS, 10, np.random.default_rng(0), groups=GROUPS[:-1])


@pytest.mark.parametrize("name", [*RANDOM_PARTITIONERS, "natural"])
@pytest.mark.parametrize("num_clients", [0, -3, 1001, 2.5, True])
def test_bad_num_clients(name, num_clients):
    fn = RANDOM_PARTITIONERS.get(name, P.natural)
    with pytest.raises(ConfigError, match="num_clients"):
        fn(LABELS, num_clients, np.random.default_rng(0), groups=GROUPS)


@pytest.mark.parametrize(
    ("fn", "params", "key"),
    [
        (P.shards, {"shards_per_client": 0}, "shards_per_client"),
        (P.shards, {"shards_per_client": 51}, "shards_per_client"),  # 20 * 51 shards > 1000 examples
        (P.quantity, {"exponent": 0}, "exponent"),
        (P.quantity, {"min_size": 51}, "min_size"),
        (P.quantity, {"min_size": 0}, "min_size"),
        (P.dirichlet, {"min_size": 0}, "min_size"),
        (P.dirichlet, {"max_tries": 0}, "max_tries"),
    ],
)
def test_bad_params_name_their_key(fn, params, key):
    with pytest.raises(ConfigError, match=key):
        fn(LABELS, 20, np.random.default_rng(0), **params)


def test_one_client_gets_everything():
    for fn in RANDOM_PARTITIONERS.values():
        assert_valid(fn(LABELS, 1, np.random.default_rng(0)), LABELS.size, 1)


@pytest.mark.slow
def test_scale_1e5_clients_over_1e6_labels():
    labels = np.random.default_rng(0).integers(0, 10, 10**6)
    k = 10**5
    assert_valid(P.iid(labels, k, np.random.default_rng(1)), labels.size, k)
    # 10 examples per client on average: only a fairly large alpha gives every client one in few draws.
    assert_valid(P.dirichlet(labels, k, np.random.default_rng(2), alpha=10.0, min_size=1), labels.size, k)


def test_split_train_val():
    idx = np.arange(0, 200, 2)
    train, val = P.split_train_val(idx, 0.1, np.random.default_rng(0))
    assert val.size == 10 and train.size == 90
    np.testing.assert_array_equal(np.sort(np.concatenate([train, val])), idx)
    again = P.split_train_val(idx, 0.1, np.random.default_rng(0))
    assert np.array_equal(again[1], val)
    assert not np.array_equal(P.split_train_val(idx, 0.1, np.random.default_rng(1))[1], val)
    train, val = P.split_train_val(np.array([42]), 0.5, np.random.default_rng(0))
    assert train.tolist() == [42] and val.size == 0
    train, val = P.split_train_val(np.array([3, 4]), 0.9, np.random.default_rng(0))
    assert train.size == 1 and val.size == 1
    for bad in (-0.1, 1.0, "x"):
        with pytest.raises(ConfigError, match="val_fraction"):
            P.split_train_val(idx, bad, np.random.default_rng(0))


@pytest.mark.parametrize("frac", [0.0, 0.1, 0.3, 0.7, 0.99])
def test_lazy_client_splits_equal_eager_ones_and_split_only_what_is_used(frac):
    parts = P.dirichlet(LABELS, 40, np.random.default_rng(1), alpha=0.3)
    parts[3] = parts[3][:1]  # a one-example client: never empty training
    splits = P.ClientSplits(parts, frac, lambda k: np.random.default_rng([7, k]))
    assert splits._done == {}
    eager = [P.split_train_val(p, frac, np.random.default_rng([7, k])) for k, p in enumerate(parts)]
    assert splits.sizes("train").tolist() == [t.size for t, _ in eager]  # sizes need no split
    assert splits.sizes("val").tolist() == [v.size for _, v in eager]
    assert set(splits._done) == set()
    for k in (5, 3, 39):
        assert np.array_equal(splits.train[k], eager[k][0]) and np.array_equal(splits.val[k], eager[k][1])
    assert set(splits._done) == {5, 3, 39}
    assert np.array_equal(splits.train[-1], eager[-1][0]) and len(splits.val) == 40
    assert [v.tolist() for v in splits.val[2:4]] == [eager[2][1].tolist(), eager[3][1].tolist()]
    assert all(np.array_equal(t, e[0]) for t, e in zip(splits.train, eager, strict=True))
    with pytest.raises(IndexError):
        splits.train[40]


def test_lazy_client_splits_refuse_bad_input_up_front():
    rng_of = lambda k: np.random.default_rng(k)
    with pytest.raises(ConfigError, match="val_fraction"):
        P.ClientSplits([np.arange(3)], 1.0, rng_of)
    with pytest.raises(ConfigError, match="at least one index"):
        P.ClientSplits([np.arange(3), np.array([], dtype=np.int64)], 0.1, rng_of)


def test_stats_and_plot(tmp_path):
    parts = P.shards(LABELS, 50, np.random.default_rng(0), shards_per_client=2)
    stats = partition_stats(parts, LABELS, 10)
    counts = np.array(stats["label_counts"])
    assert counts.shape == (50, 10)
    assert stats["sizes"] == [p.size for p in parts] == counts.sum(axis=1).tolist()
    np.testing.assert_array_equal(counts.sum(axis=0), np.bincount(LABELS))
    assert stats["mean_classes_per_client"] <= 2
    np.testing.assert_allclose(label_entropy(np.array([[5, 5, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0]])), [1, 0, 0])
    out = plot_partitions(stats, tmp_path / "sub" / "parts.png", max_clients=30)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pictures_drawn_by_the_figure_worker_are_the_same_pictures(tmp_path):
    import json

    from fedsim.figures import FigureWorker, plot_curves

    stats = partition_stats(P.dirichlet(LABELS, 12, np.random.default_rng(1), alpha=0.3), LABELS, 10)
    (tmp_path / "partitions.json").write_text(json.dumps(stats))
    records = [
        {
            "round": r,
            "sim_time": 2.0 * r,
            "eval_loss": 2 / (r + 1),
            "eval_accuracy": r / 10,
            "train_loss": 1 / (r + 1),
        }
        for r in range(6)
    ]
    plot_partitions(stats, tmp_path / "p-here.png")
    plot_curves(records, tmp_path / "c-here.png", "a title")
    worker = FigureWorker()
    assert worker.draw("partitions", tmp_path / "p-there.png", stats=str(tmp_path / "partitions.json"))
    assert worker.draw(
        "curves", tmp_path / "c-there.png", records=records, title="a title", metric="accuracy"
    )
    assert worker.finish(timeout=120) == {
        str(tmp_path / "p-there.png"): None,
        str(tmp_path / "c-there.png"): None,
    }
    for name in ("p", "c"):
        assert (tmp_path / f"{name}-there.png").read_bytes() == (tmp_path / f"{name}-here.png").read_bytes()
    assert not worker.draw(
        "curves", tmp_path / "late.png", records=records
    )  # a finished worker takes no more


def test_a_picture_the_worker_cannot_draw_says_why_in_one_line(tmp_path):
    from fedsim.figures import FigureWorker

    worker = FigureWorker()
    worker.draw("partitions", tmp_path / "p.png", stats=str(tmp_path / "missing.json"))
    why = worker.finish(timeout=120)[str(tmp_path / "p.png")]
    assert why.startswith("FileNotFoundError") and "missing.json" in why and "\n" not in why
    assert not (tmp_path / "p.png").exists()


def test_a_worker_that_does_not_answer_in_time_is_ended(tmp_path, monkeypatch):
    """A run waits for its pictures at most ``timeout`` seconds: then the worker is ended and the pictures are
    left to the run (``unanswered``: fedsim.run draws those itself)."""
    from fedsim import figures

    monkeypatch.setattr(figures, "_SERVE", "import sys\nfor line in sys.stdin:\n    pass\n")  # never answers
    pictures = figures.RunPictures(figures.FigureWorker())
    assert pictures.draw("curves", tmp_path / "c.png", records=[])
    assert pictures.finish(timeout=1) == {str(tmp_path / "c.png"): "drawing took more than 1 s"}
    assert pictures.unanswered == [str(tmp_path / "c.png")]
    assert pictures.worker.proc.returncode is not None and not pictures.worker.alive()


def test_flwr_datasets_missing_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flwr_datasets", None)  # makes the import fail
    with pytest.raises(ConfigError, match=r"pip install -e \"\.\[hf\]\""):
        P.flwr_datasets(LABELS, 10, np.random.default_rng(0))


def test_flwr_datasets_adapter(tmp_path, monkeypatch):
    pytest.importorskip("flwr_datasets")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    for name, kw in [
        ("IidPartitioner", {}),
        ("DirichletPartitioner", {"alpha": 0.5, "min_partition_size": 5}),
    ]:
        a = P.flwr_datasets(LABELS, 10, np.random.default_rng(0), name=name, **kw)
        assert_valid(a, LABELS.size, 10)
    b = P.flwr_datasets(LABELS, 10, np.random.default_rng(0), name="DirichletPartitioner", alpha=0.5)
    c = P.flwr_datasets(LABELS, 10, np.random.default_rng(0), name="DirichletPartitioner", alpha=0.5)
    assert same(b, c)
    nat = P.flwr_datasets(LABELS, 20, np.random.default_rng(0), groups=GROUPS, name="NaturalIdPartitioner")
    assert_valid(nat, LABELS.size, 20)
    with pytest.raises(ConfigError, match="name"):
        P.flwr_datasets(LABELS, 10, np.random.default_rng(0), name="NoSuchPartitioner")
    # the partitioner's own refusals (a missing parameter, an unreachable minimum size) become config errors
    with pytest.raises(ConfigError, match="^name='ShardPartitioner' .*flwr-datasets says"):
        P.flwr_datasets(LABELS, 10, np.random.default_rng(0), name="ShardPartitioner")
    with pytest.raises(ConfigError, match="^name='DirichletPartitioner' .*flwr-datasets says"):
        P.flwr_datasets(
            LABELS,
            10,
            np.random.default_rng(0),
            name="DirichletPartitioner",
            alpha=0.01,
            min_partition_size=len(LABELS) // 10,
        )


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_partitioner_config_instantiates_and_runs(path):
    from hydra.utils import instantiate

    text = path.read_text()
    assert text.startswith("# ") and "fedsim" in text.splitlines()[0]
    cfg = OmegaConf.load(path)
    assert cfg._partial_ is True and cfg._target_.startswith("fedsim.data.partition.")
    if path.stem == "flwr_datasets":
        pytest.importorskip("flwr_datasets")
    fn = instantiate(cfg)
    k = 20
    parts = fn(LABELS, k, np.random.default_rng(0), groups=GROUPS)
    assert_valid(parts, LABELS.size, k)


def test_expected_partitioner_configs_exist():
    assert {p.stem for p in CONF.glob("*.yaml")} >= {
        "iid",
        "dirichlet",
        "shards",
        "quantity",
        "natural",
        "flwr_datasets",
        "similarity",
    }


def test_a_partitioner_key_it_does_not_take_is_one_line(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^partitioner.alpha=0.1 is not allowed: expected a parameter of shards"
    ):
        run_tiny(tmp_path, "partitioner=shards", "+partitioner.alpha=0.1")
