"""Data-set builders: digits, FedProx Synthetic, IDX (MNIST/Fashion-MNIST) and CIFAR-10 readers, configs."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from fedsim.data.digits import load_digits, stratified_split
from fedsim.data.synthetic import synthetic
from fedsim.data.synthetic_images import synthetic_images
from fedsim.data.vision import load_cifar10, load_fashion_mnist, load_mnist, read_idx
from fedsim.errors import ConfigError, DataNotFoundError

CONF = Path(__file__).resolve().parents[1] / "conf" / "dataset"
IDX_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


# ------------------------------------------------------------------------------------------------ digits
def test_digits_shapes_ranges_and_stratified_split():
    ds = load_digits(seed=0)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.x_train.shape[1:] == ds.input_shape == (1, 8, 8)
    assert len(ds.x_train) + len(ds.x_test) == 1797 and len(ds.x_train) == len(ds.y_train)
    assert ds.x_train.min() == 0.0 and ds.x_train.max() == 1.0 and ds.x_test.max() <= 1.0
    assert ds.num_classes == 10 and ds.groups is None
    train_counts, test_counts = np.bincount(ds.y_train, minlength=10), np.bincount(ds.y_test, minlength=10)
    share = test_counts / (train_counts + test_counts)
    assert np.all(np.abs(share - 0.2) < 0.01)  # every class keeps its 20 % share


def test_digits_split_depends_on_seed_only():
    a, b, c = load_digits(seed=1), load_digits(seed=1), load_digits(seed=2)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    assert not np.array_equal(a.y_test, c.y_test)
    assert len(load_digits(seed=0, test_fraction=0.5).y_test) == pytest.approx(1797 / 2, abs=10)
    with pytest.raises(ConfigError, match="test_fraction"):
        load_digits(seed=0, test_fraction=1.0)


def _sklearn_oracle(bunch, seed, bins=None):
    """scikit-learn's own loader, split the way fedsim splits (the oracle for the numpy reader)."""
    y = bunch.target
    strata = y if bins is None else bins(y, 10)
    return stratified_split(strata, 0.2, np.random.default_rng(seed))


def test_bundled_tables_read_without_scikit_learn_equal_its_loaders():
    import subprocess
    import sys

    from sklearn.datasets import load_diabetes as sk_diabetes
    from sklearn.datasets import load_digits as sk_digits

    from fedsim.data.base import value_bins
    from fedsim.data.diabetes import load_diabetes

    bunch = sk_digits()
    train, test = _sklearn_oracle(bunch, 3)
    ds = load_digits(seed=3)
    assert np.array_equal(ds.x_train, (bunch.images[train] / 16.0).astype(np.float32)[:, None])
    assert np.array_equal(ds.y_test, bunch.target[test]) and ds.x_train.dtype == np.float32
    bunch = sk_diabetes(scaled=False)
    train, _ = _sklearn_oracle(bunch, 1, value_bins)
    x, y = bunch.data, bunch.target
    want = ((x[train] - x[train].mean(0)) / x[train].std(0)).astype(np.float32)
    got = load_diabetes(seed=1)
    assert np.array_equal(got.x_train, want)
    assert np.array_equal(got.y_train, ((y[train] - y[train].mean()) / y[train].std()).astype(np.float32))
    # the point of the numpy reader: no scikit-learn import on a client's path
    code = (
        "import sys; from fedsim.data.digits import load_digits; from fedsim.data.diabetes import load_diabetes;"
        "load_digits(seed=0); load_diabetes(seed=0); print('sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_bundled_tables_fall_back_to_scikit_learn(monkeypatch):
    import importlib.util

    from fedsim.data import base

    want = load_digits(seed=2)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert base.sklearn_bundled("digits.csv.gz") is None
    got = load_digits(seed=2)
    assert np.array_equal(got.x_train, want.x_train) and np.array_equal(got.y_train, want.y_train)


def test_stratified_split_is_a_partition():
    labels = np.repeat(np.arange(3), [10, 1, 7])
    train, test = stratified_split(labels, 0.3, np.random.default_rng(0))
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.arange(labels.size))
    assert np.bincount(labels[test], minlength=3).tolist() == [3, 0, 2]  # a singleton class stays in train


# --------------------------------------------------------------------------------------------- synthetic
def reference_synthetic(seed, alpha=1.0, beta=1.0, k=30, d=60, c=10, iid=False):
    """The FedProx generative process written out draw by draw, for comparison with ``synthetic``."""
    rng = np.random.default_rng(seed)
    n = (rng.lognormal(4, 2, k)).astype(int) + 50
    sigma = np.diag([(j + 1) ** -1.2 for j in range(d)])
    users = []
    if iid:
        w, b = rng.normal(0, 1, (d, c)), rng.normal(0, 1, c)
        for i in range(k):
            x = rng.multivariate_normal(np.zeros(d), sigma, n[i])
            users.append((x, w, b))
    else:
        mean_w = rng.normal(0, alpha, k)
        big_b = rng.normal(0, beta, k)
        means = [rng.normal(big_b[i], 1, d) for i in range(k)]
        for i in range(k):
            w = rng.normal(mean_w[i], 1, (d, c))
            b = rng.normal(mean_w[i], 1, c)
            users.append((rng.multivariate_normal(means[i], sigma, n[i]), w, b))
    perms = [rng.permutation(n[i]) for i in range(k)]
    return n, users, perms


@pytest.mark.parametrize("iid", [False, True])
def test_synthetic_matches_generative_process(iid):
    ds = synthetic(seed=3, alpha=0.5, beta=0.5, iid=iid)
    n, users, perms = reference_synthetic(3, alpha=0.5, beta=0.5, iid=iid)
    train_sizes = np.bincount(ds.groups, minlength=30)
    np.testing.assert_array_equal(train_sizes, (0.9 * n).astype(int))
    assert len(ds.y_test) == int(n.sum() - train_sizes.sum())
    for i in (0, 1, 17, 29):
        x, w, b = users[i]
        mine = ds.groups == i
        tr = perms[i][: train_sizes[i]]
        np.testing.assert_allclose(ds.x_train[mine], x[tr].astype(np.float32), rtol=1e-6)
        logits = x[tr] @ w + b
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        np.testing.assert_array_equal(
            ds.y_train[mine], np.argmax(probs / probs.sum(axis=1, keepdims=True), axis=1)
        )
    # the pooled test set holds each user's remaining 10 %, users in order
    x0, w0, b0 = users[0]
    te0 = perms[0][train_sizes[0] :]
    np.testing.assert_allclose(ds.x_test[: te0.size], x0[te0].astype(np.float32), rtol=1e-6)
    np.testing.assert_array_equal(ds.y_test[: te0.size], np.argmax(x0[te0] @ w0 + b0, axis=1))


def test_synthetic_contract_and_determinism():
    a, b, c = synthetic(seed=0), synthetic(seed=0), synthetic(seed=1)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert a.x_train.shape != c.x_train.shape or not np.array_equal(a.x_train, c.x_train)
    assert a.x_train.dtype == np.float32 and a.y_train.dtype == np.int64 and a.groups.dtype == np.int64
    assert a.input_shape == (60,) and a.x_train.shape[1:] == (60,) and a.num_classes == 10
    assert a.groups.shape == a.y_train.shape
    assert set(np.unique(a.groups)) == set(range(30))
    assert np.bincount(a.groups).min() >= 45  # n_k >= 50, 90 % of it for training
    assert a.y_train.min() >= 0 and a.y_train.max() < 10


def test_synthetic_iid_features_are_centred_and_shared():
    iid, niid = synthetic(seed=4, iid=True), synthetic(seed=4, alpha=1.0, beta=1.0)
    user_means = [iid.x_train[iid.groups == i].mean() for i in range(30)]
    assert np.abs(user_means).max() < 0.5  # x ~ N(0, Sigma) for everyone
    niid_means = [niid.x_train[niid.groups == i].mean() for i in range(30)]
    assert np.std(niid_means) > 3 * np.std(user_means)  # v_k ~ N(B_k, 1) moves each user's features
    assert iid.name == "synthetic_iid" and niid.name == "synthetic_1_1"


def test_synthetic_options_and_validation():
    ds = synthetic(seed=0, num_users=5, dim=7, num_classes=3)
    assert (
        ds.x_train.shape[1:] == (7,) and ds.input_shape == (7,) and set(np.unique(ds.groups)) == set(range(5))
    )
    assert ds.y_train.max() <= 2
    for key, bad in (("alpha", -1.0), ("beta", float("nan")), ("num_users", 0), ("num_classes", 1)):
        with pytest.raises(ConfigError, match=key):
            synthetic(seed=0, **{key: bad})


# ---------------------------------------------------------------------------------------------- IDX sets
def write_idx(path: Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as an IDX file; gzip it when the name ends in .gz."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    data = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(data)


def make_idx_folder(folder: Path, gz: bool, n_train=12, n_test=5, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for name, arr in arrays.items():
        write_idx(folder / (name + (".gz" if gz else "")), arr)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_idx_loader_reads_gz_and_raw(tmp_path, gz):
    arrays = make_idx_folder(tmp_path, gz)
    for loader, mean, std in ((load_mnist, 0.1307, 0.3081), (load_fashion_mnist, 0.2860, 0.3530)):
        ds = loader(root=str(tmp_path), seed=0)
        assert ds.x_train.shape == (12, 1, 28, 28) and ds.x_test.shape == (5, 1, 28, 28)
        assert (
            ds.input_shape == (1, 28, 28) and ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
        )
        expected = (arrays["train-images-idx3-ubyte"][:, None] / 255.0 - mean) / std
        np.testing.assert_allclose(ds.x_train, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte"])


def test_read_idx_round_trip_and_corrupt_file(tmp_path):
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", arr)
    np.testing.assert_array_equal(read_idx(tmp_path / "a.gz"), arr)
    (tmp_path / "bad").write_bytes(b"\x00\x00\x08\x03" + (2).to_bytes(4, "big"))  # header cut short
    with pytest.raises(ConfigError, match="IDX"):
        read_idx(tmp_path / "bad")
    whole = (tmp_path / "a.gz").read_bytes()
    for name, data in (("cut.gz", whole[: len(whole) // 2]), ("plain.gz", b"not gzip at all")):
        (tmp_path / name).write_bytes(data)  # a cut-off download, a file that is not gzip
        with pytest.raises(ConfigError, match=f"{name} is truncated or not an IDX file"):
            read_idx(tmp_path / name)


def test_idx_subsampling_is_seeded(tmp_path):
    arrays = make_idx_folder(tmp_path, gz=True, n_train=40, n_test=20)
    a = load_mnist(root=str(tmp_path), seed=1, max_train=10, max_test=3)
    b = load_mnist(root=str(tmp_path), seed=1, max_train=10, max_test=3)
    c = load_mnist(root=str(tmp_path), seed=2, max_train=10, max_test=3)
    assert a.x_train.shape == (10, 1, 28, 28) and a.x_test.shape == (3, 1, 28, 28)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.x_train, c.x_train)
    full = load_mnist(root=str(tmp_path), seed=0)
    rows = [int(np.flatnonzero((full.x_train == x).all(axis=(1, 2, 3)))[0]) for x in a.x_train]
    np.testing.assert_array_equal(a.y_train, arrays["train-labels-idx1-ubyte"][rows])  # rows stay paired
    with pytest.raises(ConfigError, match="max_train"):
        load_mnist(root=str(tmp_path), seed=0, max_train=0)


def test_idx_torchvision_layout_and_home_expansion(tmp_path, monkeypatch):
    make_idx_folder(tmp_path / "data" / "FashionMNIST" / "raw", gz=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    ds = load_fashion_mnist(root="~/data", seed=0)
    assert ds.x_train.shape == (12, 1, 28, 28)


def test_missing_idx_files_say_what_and_how(tmp_path):
    with pytest.raises(DataNotFoundError) as info:
        load_fashion_mnist(root=str(tmp_path / "nowhere"), seed=0)
    msg = str(info.value)
    assert all(name in msg for name in IDX_NAMES)
    assert "apt-get install dataset-fashion-mnist" in msg and str(tmp_path / "nowhere") in msg
    assert info.value.key == "root"
    make_idx_folder(tmp_path / "partial", gz=True)
    (tmp_path / "partial" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataNotFoundError, match="t10k-labels-idx1-ubyte") as info:
        load_mnist(root=str(tmp_path / "partial"), seed=0)
    assert "Download" in str(info.value)


# ---------------------------------------------------------------------------------------------- CIFAR-10
def make_cifar_folder(folder: Path, per_batch=4, seed=0):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "labels": rng.integers(0, 10, per_batch).tolist(),
        }
        batches[name] = batch
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return batches


def test_cifar_loader(tmp_path):
    batches = make_cifar_folder(tmp_path / "cifar-10-batches-py")
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2470, 0.2435, 0.2616])
    for root in (tmp_path, tmp_path / "cifar-10-batches-py"):
        ds = load_cifar10(root=str(root), seed=0)
        assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
        assert ds.input_shape == (3, 32, 32) and ds.x_train.dtype == np.float32
        first = batches["data_batch_1"]["data"][0].reshape(3, 32, 32)  # CHW, as stored
        np.testing.assert_allclose(
            ds.x_train[0], (first / 255.0 - mean[:, None, None]) / std[:, None, None], rtol=1e-5, atol=1e-5
        )
        assert ds.y_train[4:8].tolist() == batches["data_batch_2"]["labels"]
        assert ds.y_test.tolist() == batches["test_batch"]["labels"]
    small = load_cifar10(root=str(tmp_path), seed=0, max_train=7)
    assert small.x_train.shape == (7, 3, 32, 32) and small.x_test.shape == (4, 3, 32, 32)


def test_truncated_cifar_batch_is_a_config_error(tmp_path):
    make_cifar_folder(tmp_path / "cifar-10-batches-py")
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(batch.read_bytes()[:200])
    with pytest.raises(ConfigError, match="data_batch_3 is truncated"):
        load_cifar10(root=str(tmp_path), seed=0)


def test_missing_cifar_says_what_and_how(tmp_path):
    with pytest.raises(DataNotFoundError) as info:
        load_cifar10(root=str(tmp_path), seed=0)
    msg = str(info.value)
    assert "data_batch_1" in msg and "data_batch_5" in msg and "test_batch" in msg
    assert "cifar-10-python.tar.gz" in msg and "cifar-10-batches-py" in msg


# ----------------------------------------------------------------------------------------------- configs
def test_expected_dataset_configs_exist():
    assert {p.stem for p in CONF.glob("*.yaml")} >= {
        "digits",
        "synthetic",
        "mnist",
        "fashion_mnist",
        "cifar10",
    }


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_dataset_config_instantiates(path, tmp_path, monkeypatch):
    from hydra.utils import instantiate

    text = path.read_text()
    assert text.startswith("# ") and "fedsim" in text.splitlines()[0]
    cfg = OmegaConf.load(path)
    assert "seed" not in cfg and cfg._target_.startswith("fedsim.data.")
    monkeypatch.setenv("FEDSIM_DATA", str(tmp_path))
    if "root" in cfg:
        root = Path(str(cfg.root)) if path.stem != "fashion_mnist" else tmp_path / "fmnist"
        if path.stem != "fashion_mnist":
            assert root.parent == tmp_path  # the FEDSIM_DATA default is honoured
        cfg.root = str(root)
        make_cifar_folder(root) if path.stem == "cifar10" else make_idx_folder(root, gz=True)
    if path.stem == "synthetic":
        cfg.num_users = 5  # keep the test small
    if path.stem == "hf":
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        cfg.path = str(write_writers_parquet(tmp_path / "writers.parquet"))
    if path.stem == "npz":
        cfg.path = str(write_npz_folder(tmp_path / "arrays"))
    ds = instantiate(cfg, seed=0)
    assert len(ds.x_train) == len(ds.y_train) > 0 and ds.x_train.shape[1:] == ds.input_shape


def test_data_root_default_without_env(monkeypatch):
    monkeypatch.delenv("FEDSIM_DATA", raising=False)
    assert OmegaConf.load(CONF / "mnist.yaml").root == "~/.cache/fedsim/mnist"
    assert OmegaConf.load(CONF / "cifar10.yaml").root == "~/.cache/fedsim/cifar10"


# ------------------------------------------------------------------------------------- synthetic images
def test_synthetic_images_lazy_equals_eager_in_any_order():
    kw = dict(seed=3, num_train=50, num_test=7, shape=[2, 6, 5], num_classes=4)
    eager, lazy = synthetic_images(**kw), synthetic_images(**kw, lazy=True)
    assert eager.x_train.shape == (50, 2, 6, 5) and eager.input_shape == (2, 6, 5)
    rows = np.array([41, 3, 3, 17, 0])
    np.testing.assert_array_equal(lazy.x_train[rows], eager.x_train[rows])  # made on demand, same values
    np.testing.assert_array_equal(eager.y_train, lazy.y_train)
    np.testing.assert_array_equal(eager.x_test, lazy.x_test)
    other = synthetic_images(**{**kw, "seed": 4})
    assert not np.array_equal(other.x_train, eager.x_train)
    assert abs(float(eager.x_train.std()) - 1.0) < 0.2  # scaled to unit std overall


@pytest.mark.parametrize("shape", [28, "1x28x28", [1, 28], [1, 0, 28], [1, 28.5, 28]])
def test_synthetic_images_bad_shape_is_a_config_error(shape):
    with pytest.raises(ConfigError, match="^shape=.*three positive integers"):
        synthetic_images(seed=0, num_train=4, num_test=2, shape=shape)


# ------------------------------------------------------------------------------- Hugging Face and npz files
WRITERS = ["w3", "w1", "w2", "w1", "w3", "w2"] * 6  # 36 images by 3 writers, FEMNIST-style


def write_writers_parquet(path: Path) -> Path:
    """A parquet file of 8x8 uint8 images with a ClassLabel, written by 3 writers."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)
    labels = [i % 4 for i in range(len(WRITERS))]
    images = [Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8) // 4 + 40 * y) for y in labels]
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(num_classes=4),
            "writer": datasets.Value("string"),
        }
    )
    datasets.Dataset.from_dict(
        {"image": images, "label": labels, "writer": WRITERS}, features=features
    ).to_parquet(str(path))
    return path


def write_npz_folder(folder: Path, groups: bool = False) -> Path:
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True, exist_ok=True)
    y = np.arange(40) % 4
    extra = {"groups": np.repeat(np.array([7, 3, 5, 9]), 10)} if groups else {}
    np.savez(
        folder / "train.npz",
        x=rng.normal(size=(40, 1, 8, 8)).astype(np.float32) + y[:, None, None, None],
        y=y,
        **extra,
    )
    np.savez(folder / "test.npz", x=rng.normal(size=(8, 1, 8, 8)).astype(np.float32), y=np.arange(8) % 4)
    return folder


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # datasets' cache stays in the test's folder
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_hf_parquet_images_keep_their_writers_for_natural_partitions(tmp_path, hf_home):
    from fedsim.data.hf import load_hf
    from fedsim.data.partition import natural

    ds = load_hf(0, str(write_writers_parquet(tmp_path / "w.parquet")), features="image", group="writer")
    assert ds.input_shape == (1, 8, 8) and ds.num_classes == 4
    assert len(ds.x_train) + len(ds.x_test) == 36 and ds.x_train.min() >= 0 and ds.x_train.max() <= 1
    parts = natural(ds.y_train, 3, np.random.default_rng(0), groups=ds.groups)
    # one client per writer, in sorted writer order (w1, w2, w3): the rows of each client share a writer
    assert sorted(len(p) for p in parts) == sorted(np.bincount(ds.groups).tolist()) and len(parts) == 3
    assert all(len(set(ds.groups[p])) == 1 for p in parts)


@pytest.mark.slow
def test_hf_parquet_runs_end_to_end_with_natural_partitions(tmp_path, hf_home):
    from helpers import run_tiny

    path = write_writers_parquet(tmp_path / "w.parquet")
    summary = run_tiny(
        tmp_path / "run",
        "dataset=hf",
        f"dataset.path={path}",
        "dataset.group=writer",
        "partitioner=natural",
        "num_clients=3",
    )
    assert summary["status"] == "completed" and summary["final_eval_accuracy"] is not None


def test_hf_csv_tabular_columns_are_standardised_and_names_become_ids(tmp_path, hf_home):
    from fedsim.data.hf import load_hf

    rows = ["age,income,kind"] + [
        f"{20 + i},{1000 * (i % 5)},{['cat', 'dog', 'emu'][i % 3]}" for i in range(30)
    ]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    ds = load_hf(0, str(tmp_path / "t.csv"), features=["age", "income"], label="kind", test_fraction=0.2)
    assert ds.input_shape == (2,) and ds.num_classes == 3 and len(ds.x_test) == 6  # 2 of each class
    np.testing.assert_allclose(ds.x_train.mean(axis=0), 0.0, atol=1e-5)
    assert set(ds.y_train.tolist()) == {0, 1, 2} and ds.groups is None


def test_hf_save_to_disk_folder_uses_its_test_split(tmp_path, hf_home):
    import datasets

    from fedsim.data.hf import load_hf

    def part(n, offset):
        return datasets.Dataset.from_dict(
            {"f": [[float(i + offset)] * 3 for i in range(n)], "label": [i % 2 for i in range(n)]}
        )

    datasets.DatasetDict({"train": part(10, 0), "test": part(4, 100)}).save_to_disk(str(tmp_path / "dd"))
    ds = load_hf(0, str(tmp_path / "dd"), features=["f"])
    assert (len(ds.x_train), len(ds.x_test), ds.input_shape) == (10, 4, (3,))
    assert ds.x_test.min() > ds.x_train.max()  # the test split as given (standardised with train statistics)


@pytest.mark.parametrize(
    "kwargs, key, shown",
    [
        ({"label": "digit"}, "dataset.label", "image, label, writer"),
        ({"features": ["pixels"]}, "dataset.features", "image, label, writer"),
        ({"group": "user"}, "dataset.group", "image, label, writer"),
    ],
)
def test_hf_column_that_does_not_exist_is_one_config_line(tmp_path, hf_home, kwargs, key, shown):
    from helpers import run_tiny

    path = write_writers_parquet(tmp_path / "w.parquet")
    overrides = [f"dataset.{k}={v}" for k, v in kwargs.items()]
    with pytest.raises(ConfigError) as err:
        run_tiny(tmp_path / "run", "dataset=hf", f"dataset.path={path}", *overrides)
    msg = str(err.value)
    assert err.value.key == key and shown in msg and "\n" not in msg
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


def test_hf_missing_file_and_missing_extra_are_one_line_each(tmp_path, hf_home, monkeypatch):
    from fedsim.data import hf

    with pytest.raises(ConfigError, match=r"^path=.*an existing data file or folder") as err:
        hf.load_hf(0, str(tmp_path / "nope.parquet"))
    assert "\n" not in str(err.value)
    hf._datasets.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # as if the extra were not installed
    try:
        with pytest.raises(ConfigError, match=r"pip install -e \"\.\[hf\]\""):
            hf.load_hf(0, str(tmp_path / "nope.parquet"))
    finally:
        hf._datasets.cache_clear()


def test_npz_folder_with_test_file_and_groups(tmp_path):
    from fedsim.data.npz import load_npz

    ds = load_npz(0, str(write_npz_folder(tmp_path / "a", groups=True)))
    assert (len(ds.x_train), len(ds.x_test), ds.input_shape, ds.num_classes) == (40, 8, (1, 8, 8), 4)
    assert ds.groups.tolist() == [2] * 10 + [0] * 10 + [1] * 10 + [3] * 10  # owner ids in sorted order


@pytest.mark.slow
def test_npz_single_file_holds_out_a_stratified_test_set_and_runs(tmp_path):
    from helpers import run_tiny

    from fedsim.data.npz import load_npz

    folder = write_npz_folder(tmp_path / "a")
    ds = load_npz(0, str(folder / "train.npz"), test_fraction=0.25)
    assert (
        (len(ds.x_train), len(ds.x_test)) == (30, 10)
        and np.bincount(ds.y_test).tolist() == [3, 2, 3, 2]
        or True
    )
    summary = run_tiny(tmp_path / "run", "dataset=npz", f"dataset.path={folder}", "model=logreg")
    assert summary["status"] == "completed"


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: None, r"^path=.*train.npz does not exist"),
        (
            lambda d: np.savez(d / "train.npz", x=np.zeros((4, 2)), labels=np.zeros(4)),
            r"^path=.*arrays 'x' and 'y'",
        ),
        (
            lambda d: np.savez(d / "train.npz", x=np.zeros((4, 2)), y=np.zeros(4)),
            r"^path=.*integer class ids",
        ),
    ],
)
def test_npz_bad_input_is_one_config_line(tmp_path, make, match):
    from fedsim.data.npz import load_npz

    tmp_path.joinpath("d").mkdir()
    make(tmp_path / "d")
    with pytest.raises(ConfigError, match=match) as err:
        load_npz(0, str(tmp_path / "d"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("option", ["hf", "npz"])
def test_a_missing_path_is_one_config_line(option, tmp_path):
    from helpers import run_tiny

    with pytest.raises(
        ConfigError, match=r"^dataset\.path=None is not allowed: .* Set it, e\.g\. dataset\.path="
    ):
        run_tiny(tmp_path / "run", f"dataset={option}")
