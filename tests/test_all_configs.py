"""Every YAML shipped in conf/ composes, builds and (where the machine allows) runs two tiny rounds."""

from pathlib import Path

import numpy as np
import pytest
from helpers import compose_cfg, run_tiny

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("_"))
OPTIONS = [(g, y.stem) for g in GROUPS for y in sorted((CONF / g).glob("*.yaml"))]

# Options that need more than this machine has, with what they need; they are composed but not run.
NEEDS = {
    ("placement", "gpu"): "a CUDA GPU",
    ("placement", "gpu_shared"): "a CUDA GPU",
    ("engine", "ray"): "Ray start-up (run in test_engines.py)",
}


def _write_idx(path: Path, arr: np.ndarray) -> None:
    import gzip

    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def _fake_files(group: str, option: str, tmp_path: Path) -> list[str]:
    """Small stand-in files for data sets that are read from a folder."""
    rng = np.random.default_rng(0)
    tmp_path.mkdir(parents=True, exist_ok=True)
    if option in ("mnist", "fashion_mnist"):
        for split, n in (("train", 120), ("t10k", 40)):
            _write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
            _write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
        return [f"dataset.root={tmp_path}"]
    if option == "cifar10":
        import pickle

        d = tmp_path / "cifar-10-batches-py"
        d.mkdir()
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            batch = {
                "data": rng.integers(0, 256, (20, 3072), dtype=np.uint8),
                "labels": list(np.arange(20) % 10),
            }
            (d / name).write_bytes(pickle.dumps(batch))
        return [f"dataset.root={tmp_path}"]
    if option == "npz":  # a user's own arrays
        x, y = rng.normal(size=(90, 5)).astype(np.float32), np.arange(90) % 3
        np.savez(tmp_path / "train.npz", x=x, y=y)
        return [f"dataset.path={tmp_path}"]
    if option == "hf":  # a local parquet file with numeric feature columns
        pd = pytest.importorskip("pandas")
        pytest.importorskip("datasets")
        path = tmp_path / "train.parquet"
        pd.DataFrame(
            {"a": rng.normal(size=90), "b": rng.normal(size=90), "label": np.arange(90) % 3}
        ).to_parquet(path)
        return [f"dataset.path={path}", "dataset.features=[a,b]"]
    return []


def test_every_shipped_yaml_names_a_target_that_exists():
    """The quick half: each YAML of conf/ loads and its ``_target_`` imports (the slow half composes, builds and
    runs every one)."""
    import yaml
    from hydra.utils import get_object

    for group, option in OPTIONS:
        node = yaml.safe_load((CONF / group / f"{option}.yaml").read_text()) or {}
        assert isinstance(node, dict), (group, option)
        target = node.get("_target_")
        if target is not None:
            assert callable(get_object(target)), (group, option, target)


@pytest.mark.slow
@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_config_option_composes_and_runs(group, option, tmp_path):
    extra = _fake_files(group, option, tmp_path / "data") if group == "dataset" else []
    overrides = [f"{group}={option}", *extra]
    if group == "partitioner" and option == "natural":
        overrides.append("dataset=synthetic")
    if group == "dataset" and option == "synthetic":
        overrides.append("num_clients=6")
    if group == "model" and option == "cnn":
        overrides.append("dataset=digits")
    if (group, option) == ("dataset", "diabetes"):  # real-valued targets: a regression data set
        overrides.append("task=regression")
    if (group, option) == ("task", "regression"):
        overrides.append("dataset=diabetes")
    cfg = compose_cfg(*overrides)
    if group == "experiment":  # a `@package _global_` bundle: it must change something
        assert cfg != compose_cfg(*extra)
        pytest.skip("composed; tests/test_experiments.py runs every experiment bundle on stand-in data")
    else:
        assert cfg[group] is not None
    if (group, option) in NEEDS:
        pytest.skip(f"composed; running it needs {NEEDS[(group, option)]}")
    if group == "partitioner" and option == "natural":
        overrides.append("num_clients=30")
    if group == "partitioner" and option == "flwr_datasets":
        pytest.importorskip("flwr_datasets")
    summary = run_tiny(tmp_path / "run", *overrides)
    assert summary["rounds_done"] >= 1
    metric = "r2" if "task=regression" in overrides else "accuracy"
    assert summary[f"final_eval_{metric}"] is not None
