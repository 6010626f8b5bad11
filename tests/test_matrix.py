"""Every combination runs and agrees across engines, or is refused: the matrix of docs/composition.md.

Each shipped strategy with each feature (clipping, DP, every attack, compressor and cohort selection;
``bench/matrix.py`` lists them from ``conf/``): a cell the code builds runs two rounds on ``engine=inprocess``
and on ``engine=auto``, whose final models and ``metrics.jsonl`` records agree within
``fedsim.build.agreement_tolerance``; a refused cell stops before anything is written, in one line that names
the strategy and the feature. One cell per strategy and per feature (a diagonal of the grid) runs in the quick
suite, the rest are ``slow``; a few cells also run on ``engine=ray``.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg, read_metrics, without_wall_time

from fedsim import build
from fedsim.errors import ConfigError
from fedsim.strategies import composition

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_matrix", ROOT / "bench" / "matrix.py")
matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matrix)

STRATEGIES = matrix.strategies()
FEATURES = list(matrix.features())
# the quick suite's cells: every strategy and every feature once
_N = max(len(STRATEGIES), len(FEATURES))
SAMPLE = {(STRATEGIES[i % len(STRATEGIES)], FEATURES[i % len(FEATURES)]) for i in range(_N)}


def _cells():
    for s in STRATEGIES:
        for f in FEATURES:
            marks = [] if (s, f) in SAMPLE else [pytest.mark.slow]
            yield pytest.param(s, f, marks=marks, id=f"{s}-{f.replace(', ', '+')}")


def _composed(strategy: str, feature: str, engine: str):
    """The cell's config on ``engine`` (a fresh copy): composed by Hydra with ``engine=auto`` (the default), then
    ``engine=...`` put in as Hydra would (``matrix.put_in``). One Hydra composition a cell instead of one per
    engine; test_an_engine_put_in_is_what_hydra_composes checks the two are the same."""
    cfg = copy.deepcopy(_hydra_composed(strategy, feature))
    matrix.put_in(cfg, f"engine={engine}")
    return cfg


@functools.lru_cache(maxsize=1)  # the cell's two runs, one after the other
def _hydra_composed(strategy: str, feature: str):
    return compose_cfg(*matrix.overrides(strategy, feature))


def _run(out: Path, strategy: str, feature: str, engine: str):
    """The cell's run on ``engine`` (its config as the command line composes it): its config and summary."""
    from fedsim.run import run_experiment

    cfg = _composed(strategy, feature, engine)
    return cfg, run_experiment(cfg, out)


@pytest.mark.parametrize("engine", ["inprocess", "ray", "vectorized", "auto"])
@pytest.mark.parametrize("strategy, feature", [("scaffold", "none"), ("fedprox", "DP, clipping=fixed")])
def test_an_engine_put_in_is_what_hydra_composes(strategy, feature, engine):
    from omegaconf import OmegaConf

    want = compose_cfg(*matrix.overrides(strategy, feature), f"engine={engine}")
    got = _composed(strategy, feature, engine)
    assert OmegaConf.to_container(got) == OmegaConf.to_container(want)
    assert OmegaConf.to_yaml(got) == OmegaConf.to_yaml(want)  # the keys in the same order too


def _tolerance(cfg, run_dir: Path) -> float:
    """``agreement_tolerance`` for the most local steps a client of the run takes, times the rounds."""
    import json

    local = cfg.client
    if local.local_steps:
        steps = int(local.local_steps)
    else:  # epochs over the largest share (its validation split taken off makes it fewer)
        largest = max(json.loads((run_dir / "partitions.json").read_text())["sizes"])
        steps = int(local.local_epochs) * math.ceil(largest / (local.batch_size or largest))
    return build.agreement_tolerance("cpu", False, steps * int(cfg.num_rounds))


def _assert_agree(ref: Path, other: Path, tol: float) -> None:
    a, b = torch.load(ref / "model.pt"), torch.load(other / "model.pt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=tol, atol=tol, msg=lambda m, k=k: f"{k}: {m}")
    ra, rb = without_wall_time(read_metrics(ref)), without_wall_time(read_metrics(other))
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys(), (x["round"], sorted(x.keys() ^ y.keys()))
        for k in x:
            assert y[k] == pytest.approx(x[k], rel=tol, abs=tol), (x["round"], k, x[k], y[k])


def test_the_docs_table_is_the_generated_one():
    """docs/composition.md holds what ``python bench/matrix.py --write`` writes today."""
    text = (ROOT / "docs" / "composition.md").read_text()
    assert matrix.docs_table(text) == matrix.table(), "run python bench/matrix.py --write"


def test_the_matrix_lists_every_shipped_strategy_and_feature():
    assert set(STRATEGIES) == set(composition.shipped_strategies())
    kinds = {"", "clipping", "DP", "attack", "compression", "selection"}
    assert {matrix.component(f) for f in FEATURES} == kinds
    for group in ("attack", "compression"):  # every option but none
        shipped = {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")} - {"none"}
        assert {f.split("=")[1] for f in FEATURES if f.startswith(group + "=")} == shipped


@pytest.mark.parametrize("strategy, feature", list(_cells()))
def test_each_cell_agrees_on_both_engines_or_is_refused_before_training(tmp_path, strategy, feature):
    expected = matrix.verdict(strategy, feature)  # the table's verdict (bench/matrix.py)
    if expected is None:
        cfg, ref = _run(tmp_path / "inprocess", strategy, feature, "inprocess")
        _, got = _run(tmp_path / "auto", strategy, feature, "auto")
        assert ref["status"] == got["status"] == "completed", (ref.get("error"), got.get("error"))
        _assert_agree(tmp_path / "inprocess", tmp_path / "auto", _tolerance(cfg, tmp_path / "inprocess"))
        return
    for engine in ("inprocess", "auto"):
        out = tmp_path / engine
        with pytest.raises(ConfigError) as refused:
            _run(out, strategy, feature, engine)
        line = str(refused.value)
        assert line == expected  # the table's line is the command line's
        assert not out.exists()  # refused before the run folder was made: nothing trained or written
    assert "\n" not in line and line.strip() == line
    # one line naming both components, from what they declare (fedsim.strategies.composition)
    assert f"strategy={strategy}" in line, line
    assert matrix.component(feature) in line, line
    assert isinstance(refused.value, composition.CompositionError), type(refused.value)


RAY_CELLS = [("scaffold", "none"), ("fedavg", "compression=topk"), ("fedprox", "DP, clipping=fixed")]


@pytest.mark.slow  # starts Ray once per cell
def test_a_sample_of_cells_agrees_on_ray(tmp_path):
    """Stateful clients (SCAFFOLD's control variates, top-k's error feedback) and DP's sampler and noise on Ray's
    actors give the inprocess result. (Flower's simulation starts and stops Ray with every run.)"""
    import ray

    for strategy, feature in RAY_CELLS:
        assert matrix.verdict(strategy, feature) is None
        ref, other = tmp_path / f"{strategy}-inprocess", tmp_path / f"{strategy}-ray"
        cfg, _ = _run(ref, strategy, feature, "inprocess")
        _, summary = _run(other, strategy, feature, "ray")
        assert summary["engine"] == "ray" and summary["status"] == "completed"
        _assert_agree(ref, other, _tolerance(cfg, ref))
    assert not ray.is_initialized()
