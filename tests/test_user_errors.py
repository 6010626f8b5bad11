"""A user's own code and data that fedsim cannot use: one line naming the user's file, key or value.

Each case once failed deep in fedsim, omegaconf or torch (a line naming their file, or a state_dict error cut
before its key), or was accepted silently (an int64 model cast back to float, a 256-class model from uint8 labels
holding 255, complex features with their imaginary part dropped).
"""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from omegaconf import OmegaConf
from strategy_helpers import flower_kwargs

from fedsim import build, build_server
from fedsim.data.base import Dataset
from fedsim.errors import ConfigError, RunError

USER = {
    "mydata.py": """
        import numpy as np
        from fedsim.data.base import Dataset

        def blobs(seed, n=400, mode="ok"):
            rng = np.random.default_rng(seed)
            y = rng.integers(0, 3, size=n)
            x = rng.normal(size=(n, 2)).astype(np.float32)
            if mode == "none":
                return None
            if mode == "complex":
                x = x.astype(np.complex64) + 1j
            if mode == "empty":
                x, y = x[:0], y[:0]
            return Dataset("blobs", x[:320], y[:320], x[320:], y[320:], 3, (2,))
    """,
    "mystrat.py": """
        import numpy as np
        from fedsim.strategies.fedavg import FedAvg

        class Bad(FedAvg):
            def __init__(self, mode="int", **kw):
                super().__init__(**kw)
                self.mode = mode

            def combine(self, models, weights):
                out = super().combine(models, weights)
                if self.mode == "int":
                    return {k: v.astype(np.int64) for k, v in out.items()}
                k = sorted(out)[0]
                out[k] = out[k][:1]
                return out
    """,
    "myalg.py": """
        from fedsim.algorithms.base import ClientAlgorithm

        class Chatty(ClientAlgorithm):
            def after_training(self, run):
                run.metrics["note"] = "hello"
    """,
}


@pytest.fixture
def user(tmp_path, monkeypatch):
    for name, text in USER.items():
        (tmp_path / name).write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in USER:
        sys.modules.pop(name[:-3], None)
    return tmp_path


def test_an_option_without_a_target_is_one_line_naming_its_section():
    with pytest.raises(ConfigError, match=r"^dataset\._target_=None is not allowed.*no _target_ line"):
        build._instantiate("dataset", OmegaConf.create({"mode": "ok"}), seed=0)


@pytest.mark.parametrize("mode, says", [("none", "It returned NoneType"), ("complex", "complex64")])
def test_a_loader_returning_none_or_complex_features_is_refused(user, mode, says):
    build._dataset.cache_clear()
    with pytest.raises(ConfigError, match=says) as err:
        build.build_dataset({"dataset": {"_target_": "mydata.blobs", "mode": mode}, "seed": 0})
    assert err.value.key.startswith("dataset") and "\n" not in str(err.value)


def test_a_data_set_without_examples_is_refused():
    x, y = np.zeros((0, 2), np.float32), np.zeros(0, np.int64)
    with pytest.raises(ConfigError, match="x_train holds 0"):
        Dataset("mine", x, y, x, y, 3, (2,))


def _npz(path, x, y):
    np.savez(path, x=x, y=y)
    return str(path)


def test_npz_files_with_no_examples_complex_features_or_a_255_label_marker_are_refused(tmp_path):
    from fedsim.data.npz import load_npz

    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 2)).astype(np.float32)
    y = rng.integers(0, 3, size=400).astype(np.uint8)
    with pytest.raises(ConfigError, match="holds 0 examples"):
        load_npz(0, _npz(tmp_path / "empty.npz", x[:0], y[:0]))
    with pytest.raises(ConfigError, match="features in x.*complex64"):
        load_npz(0, _npz(tmp_path / "complex.npz", x.astype(np.complex64) + 1j, y))
    y[:5] = 255  # uint8's "no label": once a 256-class model
    with pytest.raises(ConfigError, match=r"^dataset\.num_classes|^num_classes.*label 255"):
        load_npz(0, _npz(tmp_path / "u8.npz", x, y))
    assert load_npz(0, str(tmp_path / "u8.npz"), num_classes=256).num_classes == 256  # said explicitly
    assert load_npz(0, _npz(tmp_path / "ok.npz", x, y % 3)).num_classes == 3


@pytest.mark.parametrize(
    "mode, says", [("int", r"'0\.weight' as int64"), ("shape", r"'0\.bias' of shape \(1,\)")]
)
def test_a_user_combine_returning_a_non_float_or_misshapen_model_is_refused_naming_its_file(user, mode, says):
    import mystrat

    strategy = mystrat.Bad(mode=mode, **flower_kwargs())
    build_server.check_user_combine(strategy)
    models = [{"0.weight": np.ones((4, 2), np.float32), "0.bias": np.zeros(4, np.float32)}] * 2
    with pytest.raises(RunError, match=says) as err:
        strategy.combine(models, [1.0, 1.0])
    assert str(err.value).startswith(f"{user / 'mystrat.py'}:") and "Bad.combine" in str(err.value)


def test_a_user_client_algorithm_with_a_string_metric_is_refused_naming_its_file_and_key(user):
    import myalg

    from fedsim.training import LocalTraining

    algorithm = build.check_user_metrics(myalg.Chatty(LocalTraining()))

    class Run:
        metrics: dict = {}

    with pytest.raises(ConfigError, match=r"myalg\.py: run\.metrics\['note'\] = 'hello' \(str\)"):
        algorithm.after_training(Run())


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, status, says",
    [
        ("dataset=notarget", 2, r"dataset\._target_=None .*option dataset=notarget has no _target_"),
        ("dataset=none", 2, r"dataset\._target_='mydata\.blobs' .*returning fedsim\.data\.base\.Dataset"),
        ("dataset=empty", 2, r"dataset='blobs' .*x_train holds 0"),
        ("dataset=complex", 2, r"real-valued features .*complex64"),
        ("strategy=badint", 1, r"mystrat\.py:\d+: Bad\.combine returned '[\w.]+' as int64"),
        ("strategy=badshape", 1, r"mystrat\.py:\d+: Bad\.combine returned '[\w.]+' of shape"),
    ],
)
def test_the_command_says_it_in_one_line(user, override, status, says):
    from fedsim.config import FLOWER_ENV

    conf = user / "conf"
    for group, name, text in [
        ("dataset", "notarget", "mode: ok\n"),
        ("dataset", "none", "_target_: mydata.blobs\nmode: none\n"),
        ("dataset", "empty", "_target_: mydata.blobs\nmode: empty\n"),
        ("dataset", "complex", "_target_: mydata.blobs\nmode: complex\n"),
        ("strategy", "badint", "_target_: mystrat.Bad\nmode: int\n"),
        ("strategy", "badshape", "_target_: mystrat.Bad\nmode: shape\n"),
    ]:
        (conf / group).mkdir(parents=True, exist_ok=True)
        (conf / group / f"{name}.yaml").write_text(text)
    env = {**os.environ, **FLOWER_ENV, "PYTHONPATH": "."}
    tiny = ["num_clients=4", "clients_per_round=2", "num_rounds=2", "quiet=true", "checkpoint_every=0"]
    cmd = [sys.executable, "-m", "fedsim", f"hydra.searchpath=[file://{conf}]", override, "hydra.run.dir=run"]
    res = subprocess.run([*cmd, *tiny], cwd=user, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("fedsim:")]
    assert res.returncode == status and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(lines) == 1 and re.search(says, lines[0]), res.stderr[-3000:]
