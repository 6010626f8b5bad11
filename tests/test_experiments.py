"""Every ``conf/experiment/*.yaml`` composes, keeps its settings and runs two tiny rounds.

The reproduction configs (docs/reproductions.md) are long runs; here they get a few clients, two rounds and,
for the Fashion-MNIST ones, tiny stand-in IDX files, so the whole file stays within seconds. Besides the
generic check (every leaf the experiment sets that is not overridden is in summary.json's config), a few
tests pin what each reproduction depends on: the straggler model of fedprox_synthetic, epsilon accounting in
dp_fedavg, pathological shards and the target knobs of the FedAvg ones.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import compose_cfg, read_metrics, run_tiny
from omegaconf import OmegaConf

EXPERIMENTS = Path(__file__).resolve().parents[1] / "conf" / "experiment"
NAMES = sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))
FILE_DATASETS = ("fashion_mnist", "mnist")  # read from a folder: the tests write small stand-ins


def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def _fake_idx(root: Path, n_train: int = 200, n_test: int = 50) -> Path:
    """Four small IDX files in MNIST layout: random pixels, labels cycling over 0..9."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(root / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(root / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    return root


def _dataset_of(name: str) -> str:
    return str(compose_cfg(f"experiment={name}").dataset._target_).rsplit(".", 1)[-1]


def _data_overrides(name: str, tmp_path: Path) -> list[str]:
    if any(_dataset_of(name).endswith(d) for d in FILE_DATASETS):
        return [f"dataset.root={_fake_idx(tmp_path / 'idx')}"]
    return []


def _leaves(node, prefix: str = ""):
    """(dotted key, value) of every leaf of a plain dict/list tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


# Small enough for two rounds in a second or two, whatever the experiment's full setting.
SMALL = {
    "fedprox_synthetic": ["client.local_epochs=2"],
    "dp_fedavg": [
        "clipping.noise_multiplier=1.0",
        "clipping.noise_seed=1",
        "clipping.debug_noise_seed=true",
    ],  # cohorts 4, 2
}


def _tiny(name: str, tmp_path: Path, *extra: str, small: bool = True) -> dict:
    small_overrides = SMALL.get(name, []) if small else []
    overrides = [f"experiment={name}", *_data_overrides(name, tmp_path), *small_overrides, *extra]
    return run_tiny(tmp_path / "run", *overrides)


def test_experiments_found():
    assert {"fedavg_mnist", "fedavg_digits", "fedprox_synthetic", "dp_fedavg"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_experiment_file_header(name):
    lines = (EXPERIMENTS / f"{name}.yaml").read_text().splitlines()
    assert lines[0].strip() == "# @package _global_"
    comments = [ln for ln in lines if ln.startswith("#")]
    assert any(f"experiment={name}" in ln and "fedsim" in ln for ln in comments), "no command in the header"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_experiment_runs_with_its_settings(name, tmp_path):
    summary = _tiny(name, tmp_path)
    assert summary["status"] in ("completed", "stopped")
    assert summary["rounds_done"] >= 1 and summary["final_eval_accuracy"] is not None
    # every value the experiment sets (outside the defaults list) is in effect unless the test overrode it
    own = OmegaConf.to_container(OmegaConf.load(EXPERIMENTS / f"{name}.yaml"), resolve=False)
    own.pop("defaults", None)
    overridden = {
        o.split("=", 1)[0]
        for o in [
            "num_clients",
            "clients_per_round",
            "num_rounds",
            "quiet",
            *_data_overrides(name, tmp_path),
            *SMALL.get(name, []),
        ]
    }
    checked = 0
    for key, value in _leaves(own):
        if key in overridden or key.startswith("hydra.") or (isinstance(value, str) and "${" in value):
            continue  # (hydra.*: the sweep a bundle runs under -m, not part of a run's config)
        assert _get(summary["config"], key) == value, key
        checked += 1
    assert checked > 0


def test_fedavg_mnist_is_the_paper_setting():
    cfg = compose_cfg("experiment=fedavg_mnist")
    assert cfg.dataset._target_.endswith("load_fashion_mnist")
    assert (cfg.num_clients, cfg.clients_per_round) == (100, 10)  # C = 0.1
    assert list(cfg.model.hidden) == [200, 200]  # the paper's 2NN
    assert cfg.stop_at_target and cfg.target_accuracy == pytest.approx(0.80)
    fedsgd = compose_cfg("experiment=fedavg_mnist", "client=fedsgd")  # the experiment must not pin B or E
    assert (fedsgd.client.batch_size, fedsgd.client.local_steps) == (0, 1)


def test_alie_paper_is_the_paper_setting():
    """n = 50 all in every round, 12 attackers (24 %), the paper's z from its formula (~0.58), one local step."""
    from fedsim.features.attacks.server import alie_z, malicious_clients

    cfg = compose_cfg("experiment=alie_paper")
    n = cfg.num_clients
    assert n == cfg.clients_per_round == 50
    attackers = malicious_clients(cfg.seed, n, cfg.attack.fraction)
    assert len(attackers) == 12 and cfg.attack.z is None
    assert alie_z(n, len(attackers)) == pytest.approx(0.583, abs=1e-3)  # s = 26 - 12 = 14, Phi^-1(36/50)
    assert (cfg.client.local_steps, list(cfg.model.hidden)) == (1, [100])
    assert cfg.partitioner._target_.endswith(".iid")
    # the authors' optimiser: lr 0.1 on the gradient, momentum 0.9 at the server, under every defence
    from fedsim import build_server
    from fedsim.strategies import base

    assert cfg.client.lr == pytest.approx(0.1)
    for over in ("strategy=fedavgm", "strategy=fedmedian", "strategy=fedtrimmedavg", "strategy=krum"):
        inner = base.unwrap(
            build_server.build_strategy(compose_cfg("experiment=alie_paper", over), 50)
        )  # the attack's
        assert (inner.server_momentum, inner.server_learning_rate) == (0.9, 1.0), over


def test_scaffold_similarity_is_the_paper_setting():
    cfg = compose_cfg("experiment=scaffold_similarity")
    assert cfg.clients_per_round / cfg.num_clients == pytest.approx(0.2)  # 20 % of the clients per round
    per_client = 60000 // cfg.num_clients
    assert cfg.client.batch_size == pytest.approx(0.2 * per_client)  # batches of 0.2 of a client's data
    assert cfg.client.local_steps == 5  # one epoch = 5 steps
    assert cfg.model._target_.endswith("logreg") and cfg.partitioner._target_.endswith(".similarity")


def test_fedavg_shards_give_two_classes_and_record_target(tmp_path):
    # 5 clients, 10 shards of the 200 stand-in images (20 per class): every shard holds one class
    from fedsim.run import run_experiment

    root = _fake_idx(tmp_path / "idx")
    cfg = compose_cfg(
        "experiment=fedavg_mnist",
        f"dataset.root={root}",
        "num_clients=5",
        "clients_per_round=2",
        "partitioner=shards",
        "client=fedsgd",
        "target_accuracy=0.01",
        "quiet=true",
    )
    summary = run_experiment(cfg, tmp_path / "run")
    parts = json.loads((tmp_path / "run" / "partitions.json").read_text())
    assert [sum(1 for c in counts if c) for counts in parts["label_counts"]] == [2] * 5
    assert summary["status"] == "stopped" and summary["target_round"] == 0  # reached by the initial model


def _fates(tmp_path: Path, *extra: str, small: bool = True) -> list[dict]:
    _tiny("fedprox_synthetic", tmp_path, *extra, small=small)
    return read_metrics(tmp_path / "run")[1:]


@pytest.mark.slow
def test_fedprox_stragglers_cannot_finish(tmp_path):
    # every task straggles: FedAvg (partial_work=false) drops them all, FedProx keeps their partial work
    # (at the experiment's E = 20 a straggler gets through 800 examples, fewer than any client's 20 epochs)
    from fedsim.errors import RunError

    with pytest.raises(RunError, match="past the deadline"):  # a run that aggregated nothing has failed
        _fates(tmp_path / "a", "heterogeneity.straggler_prob=1.0", small=False)
    dropped = read_metrics(tmp_path / "a" / "run")[1:]
    assert dropped and all(r.get("dropped_late") == 3 and r.get("skipped") for r in dropped)
    kept = _fates(
        tmp_path / "b",
        "heterogeneity.straggler_prob=1.0",
        "heterogeneity.partial_work=true",
        "strategy=fedprox",
        "strategy.proximal_mu=1.0",
        small=False,
    )
    assert all(r.get("partial_work") == 3 and r["num_clients"] == 3 for r in kept)
    # without stragglers every client finishes its full E epochs before the deadline
    full = _fates(tmp_path / "c")
    assert all(r["num_clients"] == 3 and "dropped_late" not in r and "partial_work" not in r for r in full)


def test_fedprox_synthetic_paper_setting():
    cfg = compose_cfg("experiment=fedprox_synthetic")
    assert (cfg.dataset.alpha, cfg.dataset.beta, cfg.num_clients, cfg.clients_per_round) == (1.0, 1.0, 30, 10)
    assert (cfg.client.local_epochs, cfg.client.batch_size, cfg.client.lr) == (20, 10, 0.01)
    assert cfg.model._target_.endswith("logreg")


@pytest.mark.slow
def test_dp_fedavg_reports_epsilon(tmp_path):
    summary = _tiny("dp_fedavg", tmp_path)
    records = read_metrics(tmp_path / "run")[1:]
    eps = [r["epsilon"] for r in records]
    assert all(e > 0 for e in eps) and eps == sorted(eps)  # grows with every round
    cfg = summary["config"]
    z, c, m = cfg["clipping"]["noise_multiplier"], cfg["clipping"]["clip_norm"], cfg["clients_per_round"]
    assert records[-1]["noise_std"] == pytest.approx(z * c / m)
