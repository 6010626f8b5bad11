"""A user's own project folder, no fork: their data set, model and strategy in their own ``conf/``.

The folder is built in a temporary directory and fedsim runs in it as a user would run it (a subprocess with the
folder as its working directory and ``PYTHONPATH=.``): ``hydra.searchpath=[file://...]``, ``--config-dir``, a
primary config of their own, a sweep over their own model key, and the one-line error for an option that does
not exist. docs/extending.md describes the same folder.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from fedsim.cli import unknown_key
from fedsim.config import FLOWER_ENV, compose

USER_FILES = {
    "mydata.py": '''
        """Gaussian blobs: one cluster per class."""
        import numpy as np

        from fedsim.data.base import Dataset


        def blobs(seed, n=400, dim=2, num_classes=3, spread=1.0, test_fraction=0.2):
            rng = np.random.default_rng(seed)
            centers = rng.normal(0.0, 4.0, size=(num_classes, dim))
            y = rng.integers(0, num_classes, size=n)
            x = (centers[y] + spread * rng.normal(size=(n, dim))).astype(np.float32)
            k = int(round((1 - test_fraction) * n))
            y = y.astype(np.int64)
            return Dataset("blobs", x[:k], y[:k], x[k:], y[k:], num_classes, (dim,))
    ''',
    "mymodel.py": """
        import math

        from torch import nn


        def widthnet(input_shape, num_classes, width=8):
            return nn.Sequential(
                nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(), nn.Linear(width, num_classes)
            )
    """,
    "mystrategy.py": '''
        from fedsim.strategies.fedavg import FedAvg


        class CountingAvg(FedAvg):
            """FedAvg that counts its rounds: a metric per round and a field in summary.json."""

            def __init__(self, tag="mine", **kwargs):
                super().__init__(**kwargs)
                self.tag, self.rounds = tag, 0

            def aggregate_train(self, server_round, replies):
                arrays, metrics = super().aggregate_train(server_round, replies)
                self.rounds += 1
                if metrics is not None:
                    metrics["counting_rounds"] = self.rounds
                return arrays, metrics

            def summary_fields(self):
                return {"counting_avg": {"tag": self.tag, "rounds": self.rounds}}
    ''',
    "conf/dataset/blobs.yaml": """
        _target_: mydata.blobs
        n: 400
        spread: 1.0
    """,
    "conf/model/widthnet.yaml": """
        _target_: mymodel.widthnet
        _partial_: true
        width: 8
    """,
    "conf/strategy/counting.yaml": """
        _target_: mystrategy.CountingAvg
        tag: mine
    """,
    "mytask.py": '''
        import torch

        from fedsim.tasks import Task


        class Huber(Task):
            """Robust regression: Huber loss; the metric is the mean absolute error (lower is better)."""

            name, metric, higher_is_better, targets = "huber", "mae", False, "values"

            def loss(self, out, y, reduction="mean"):
                return torch.nn.functional.huber_loss(out.squeeze(-1), y, reduction=reduction)

            def score(self, out, y):
                return float((out.squeeze(-1) - y).abs().sum())

            def finish(self, total, y):
                return total / y.shape[0]
    ''',
    "conf/task/huber.yaml": """
        _target_: mytask.Huber
    """,
    "conf/loss/smooth.yaml": """
        smoothing: 0.1
    """,
    "conf/myexp.yaml": """
        defaults:
          - config
          - override dataset: blobs
          - override model: widthnet
          - _self_
        num_clients: 4
        clients_per_round: 2
        num_rounds: 2
    """,
}

TINY = ["num_clients=4", "clients_per_round=2", "num_rounds=2", "quiet=true", "checkpoint_every=0"]


@pytest.fixture
def user_folder(tmp_path):
    folder = tmp_path / "project"
    for name, text in USER_FILES.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return folder


def fedsim(*args, cwd: Path):
    env = {**os.environ, **FLOWER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (".", os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "fedsim", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_precheck_learns_the_users_options_and_keys_from_the_search_path(user_folder, monkeypatch):
    monkeypatch.chdir(user_folder)
    searchpath = f"hydra.searchpath=[file://{user_folder}/conf]"
    assert unknown_key([searchpath, "dataset=blobs", "model=widthnet", "model.width=4"]) is None
    assert unknown_key(["--config-dir", "conf", "-m", "model=widthnet", "model.width=4,8"]) is None
    assert unknown_key(["-cd", "conf", "-cn", "myexp", "model.width=4"]) is None  # the user's primary config
    assert unknown_key(["-cd", "conf", "+loss=smooth", "loss.smoothing=0.2"]) is None  # a new group of theirs

    msg = unknown_key([searchpath, "dataset=blobz"])  # the options found, theirs and fedsim's
    assert msg.startswith("dataset='blobz' is not allowed: expected one of blobs, ") and "digits" in msg
    assert "\n" not in msg
    assert unknown_key(["-cd", "conf", "+loss=nope"]) == "loss='nope' is not allowed: expected one of smooth"
    assert "did you mean 'model.width'?" in unknown_key(["-cd", "conf", "-cn", "myexp", "model.widht=4"])
    # fedsim's own configs: as before (the user's option is not there without their search path)
    assert unknown_key(["dataset=blobs"]).startswith(
        "dataset='blobs' is not allowed: expected one of cifar10"
    )
    assert "did you mean 'num_clients'?" in unknown_key(["num_clientz=3"])


def test_precheck_and_compose_read_a_pkg_searchpath(user_folder, monkeypatch):
    package = user_folder / "blobs_project_conf"
    (package / "dataset").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "dataset" / "pblobs.yaml").write_text("_target_: mydata.blobs\nn: 100\n")
    monkeypatch.syspath_prepend(str(user_folder))
    try:
        assert unknown_key(["hydra.searchpath=[pkg://blobs_project_conf]", "dataset=pblobs"]) is None
        assert "pblobs" in unknown_key(["hydra.searchpath=[pkg://blobs_project_conf]", "dataset=nope"])
        cfg = compose("dataset=pblobs", searchpath=["pkg://blobs_project_conf", user_folder / "conf"])
        assert cfg.dataset.n == 100
        cfg = compose("dataset=blobs", "model=widthnet", "model.width=5", searchpath=[user_folder / "conf"])
        assert cfg.dataset._target_ == "mydata.blobs" and cfg.model.width == 5
    finally:
        sys.modules.pop("blobs_project_conf", None)


@pytest.mark.slow
def test_a_user_folder_runs_with_its_own_data_model_and_strategy(user_folder):
    res = fedsim(
        f"hydra.searchpath=[file://{user_folder}/conf]",
        "dataset=blobs",
        "model=widthnet",
        "strategy=counting",
        "hydra.run.dir=run",
        *TINY,
        cwd=user_folder,
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads((user_folder / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_done"] == 2
    assert summary["config"]["dataset"]["_target_"] == "mydata.blobs"
    assert summary["counting_avg"] == {"tag": "mine", "rounds": 2}  # the user's strategy ran
    lines = [json.loads(ln) for ln in (user_folder / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["counting_rounds"] for ln in lines if "counting_rounds" in ln] == [1, 2]

    res = fedsim(f"hydra.searchpath=[file://{user_folder}/conf]", "dataset=blobz", cwd=user_folder)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("fedsim: config error")]
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(errors) == 1
    assert "dataset='blobz' is not allowed: expected one of blobs, cifar10, diabetes, digits" in errors[0]


@pytest.mark.slow
def test_config_dir_sweep_over_the_users_own_model_key(user_folder):
    res = fedsim(
        "--config-dir",
        "conf",
        "-m",
        "dataset=blobs",
        "model=widthnet",
        "model.width=4,8",
        "hydra.sweep.dir=sweep",
        *TINY,
        cwd=user_folder,
    )
    assert res.returncode == 0, res.stderr
    for job, width in (("0", 4), ("1", 8)):
        folder = user_folder / "sweep" / job
        assert yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())["model"]["width"] == width
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["config"]["model"]["width"] == width
        weights = torch.load(folder / "model.pt", weights_only=True)
        assert tuple(weights["1.weight"].shape) == (width, 2)  # the model that trained had that width

    res = fedsim("-cd", "conf", "-cn", "myexp", "model.width=5", "--cfg", "job", cwd=user_folder)
    assert res.returncode == 0, res.stderr
    cfg = yaml.safe_load(res.stdout)
    assert cfg["model"] == {"_target_": "mymodel.widthnet", "_partial_": True, "width": 5}
    assert cfg["dataset"]["_target_"] == "mydata.blobs" and cfg["num_rounds"] == 2

    res = fedsim("-cd", "conf", "-m", "model=widthnet,nosuch", cwd=user_folder)
    assert res.returncode == 2 and not (user_folder / "multirun").exists()
    assert (
        "fedsim: config error: model='nosuch' is not allowed: expected one of cnn, logreg, mlp, widthnet"
        in (res.stderr)
    )


@pytest.mark.slow
def test_a_users_own_task_names_the_metric_and_its_direction(user_folder):
    """docs/extending.md's Huber task: its metric (MAE, lower is better) names the outputs and the target."""
    res = fedsim(
        f"hydra.searchpath=[file://{user_folder}/conf]",
        "task=huber",
        "dataset=diabetes",
        "+target_mae=0.9",
        "hydra.run.dir=run",
        *TINY,
        "num_rounds=4",
        cwd=user_folder,
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads((user_folder / "run" / "summary.json").read_text())
    lines = [json.loads(ln) for ln in (user_folder / "run" / "metrics.jsonl").read_text().splitlines()]
    maes = [ln["eval_mae"] for ln in lines]
    assert summary["best_eval_mae"] == min(maes) and summary["final_eval_mae"] == maes[-1]
    first = next((ln["round"] for ln in lines if ln["eval_mae"] <= 0.9), None)
    assert summary["target_mae"] == 0.9 and summary["target_round"] == first


# --------------------------------------------------------- the guide's strategy keeps its state (issue 26)
def _guide_block(first_line: str) -> str:
    """The code block of docs/extending.md that starts with ``first_line``, verbatim."""
    text = (Path(__file__).parent.parent / "docs" / "extending.md").read_text()
    blocks = re.findall(r"```(?:python|yaml)\n(.*?)```", text, flags=re.S)
    found = [b for b in blocks if b.startswith(first_line + "\n")]
    assert len(found) == 1, f"docs/extending.md has no single block starting {first_line!r}"
    return found[0]


@pytest.fixture
def guide_strategy(tmp_path, monkeypatch):
    """The guide's mystrategy.py and conf/strategy/counting.yaml, copied from the docs into a folder."""
    (tmp_path / "conf" / "strategy").mkdir(parents=True)
    (tmp_path / "mystrategy.py").write_text(_guide_block("# mystrategy.py"))
    (tmp_path / "conf" / "strategy" / "counting.yaml").write_text(
        _guide_block("# conf/strategy/counting.yaml")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mystrategy", None)
    yield tmp_path
    sys.modules.pop("mystrategy", None)


def test_the_guides_strategy_keeps_its_count_through_a_checkpoint(guide_strategy, tmp_path):
    """CountingAvg, as the guide writes it (no state_dict): its round count is in the checkpoint as plain data
    (no pickle) and a strategy built from the config gets it back."""
    from flwr.app import ArrayRecord
    from mystrategy import CountingAvg

    from fedsim import checkpoint
    from fedsim.state import RunState

    s = CountingAvg(tag="mine")
    s.rounds = 48
    state = RunState(arrays=ArrayRecord({"w": torch.zeros(2)}), round=48)
    checkpoint.save(tmp_path / "checkpoint.pt", state, s, [])
    names = torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "checkpoint.pt")
    assert all(n.startswith("numpy") for n in names), names
    fresh = CountingAvg(tag="mine")
    back = checkpoint.restore(
        checkpoint.load(tmp_path / "checkpoint.pt"), RunState(arrays=state.arrays), fresh
    )
    assert back is fresh and fresh.rounds == 48 and fresh.summary_fields()["counting_avg"]["rounds"] == 48


@pytest.mark.slow
def test_the_guides_strategy_counts_on_after_a_resume(guide_strategy, tmp_path):
    """The issue's case: resumed at round 3, round 4 reports 4 (it reported 1 when the count was lost)."""
    from fedsim.run import run_experiment

    over = ["strategy=counting", *TINY[:2], "quiet=true", "checkpoint_every=1"]
    search = [str(guide_strategy / "conf")]
    run_experiment(compose(*over, "num_rounds=3", searchpath=search), tmp_path / "a")
    summary = run_experiment(
        compose(*over, "num_rounds=5", f"resume={tmp_path / 'a'}", searchpath=search), tmp_path / "b"
    )
    lines = [json.loads(ln) for ln in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["counting_rounds"] for ln in lines if "counting_rounds" in ln] == [1, 2, 3, 4, 5]
    assert summary["counting_avg"] == {"tag": "mine", "rounds": 5}


# ------------------------------------------------------------- the user's own files and code fail in one line
BROKEN = {
    "conf/dataset/broken.yaml": "_target_: mydata.blobs\nn: [1, 2\nspread: 1.0\n",
    "conf/dataset/raising.yaml": "_target_: myraising.blobs\n",
    "myraising.py": "def blobs(seed, n=40):\n    raise ValueError('boom in my loader')\n",
    "conf/strategy/syntax.yaml": "_target_: mysyntax.Strat\n",
    "mysyntax.py": "import math\nx = (\n",
    "conf/strategy/imports.yaml": "_target_: myimports.Strat\n",
    "myimports.py": "import math\nimport not_a_package_anywhere_xyz\n",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, status, says",
    [
        ("dataset=broken", 2, r"conf/dataset/broken\.yaml, line 3: not valid YAML \(expected ',' or ']'"),
        ("dataset=raising", 1, r"myraising\.py:2: ValueError: boom in my loader"),
        ("strategy=syntax", 2, r"Importing it failed: .*mysyntax\.py:2: SyntaxError"),
        (
            "strategy=imports",
            2,
            r"myimports\.py:2: ModuleNotFoundError: No module named 'not_a_package_anywhere",
        ),
    ],
)
def test_the_users_broken_file_or_code_is_one_line_naming_file_and_line(user_folder, override, status, says):
    for name, text in BROKEN.items():
        (user_folder / name).write_text(text)
    res = fedsim(
        f"hydra.searchpath=[file://{user_folder}/conf]", override, "hydra.run.dir=run", *TINY, cwd=user_folder
    )
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("fedsim:")]
    assert res.returncode == status and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(lines) == 1 and re.search(says, lines[0]), res.stderr[-3000:]
    assert not (user_folder / "run").exists()  # no half-written run folder


def test_where_it_failed_names_the_users_line_through_wrappers(tmp_path, monkeypatch):
    from hydra.errors import InstantiationException

    from fedsim.errors import where_it_failed

    (tmp_path / "mycode.py").write_text("def f():\n    return 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mycode", None)
    import mycode

    try:
        try:
            mycode.f()
        except ZeroDivisionError as e:
            raise InstantiationException("Error in call to target 'mycode.f'") from e
    except InstantiationException as e:
        assert where_it_failed(e) == f"{tmp_path / 'mycode.py'}:2: ZeroDivisionError: division by zero"


def test_the_guides_capability_table_is_a_part_of_the_contract_written_in_strategies_base():
    """The capability list is written once, in ``fedsim.strategies.base`` (every Protocol it defines is in its
    table); docs/extending.md's table shows some of them, and each method it names is in that list."""
    import inspect
    from typing import Protocol

    from fedsim.strategies import base

    contract = base.__doc__
    protocols = [n for n, c in vars(base).items() if inspect.isclass(c) and Protocol in c.__mro__[1:]]
    assert protocols and all(f":class:`{n}`" in contract for n in protocols), protocols
    guide = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    table = guide[guide.index("| method | what fedsim does with it |") :].split("\n\n")[0]
    methods = re.findall(r"^\| `([a-z_]+)\(", table, flags=re.M)
    assert len(methods) >= 4 and all(f"``{m}(" in contract for m in methods), methods


# ------------------------------------------------------------- a feature with a server and a client half
FEATURE = '''
from fedsim.algorithms.halves import ClientHalf
from fedsim.strategies.wrapper import Wrapper


class Tagging(Wrapper):
    """Server half: record the tag each reply carries; everything else is the wrapped strategy's."""

    client_half = "tagging.TagHalf"

    def __init__(self, strategy, scale=1.0):
        super().__init__(strategy)
        self.scale, self.tags = float(scale), []

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.tags.append(sorted(float(m.content["metrics"]["tag"]) for m in replies))
        return self.strategy.aggregate_train(server_round, replies)

    def own_summary_fields(self):
        return {"tags": self.tags}


class TagHalf(ClientHalf):
    """Client half: every reply carries its partition id times 10 as a metric."""

    def active(self, ins):
        return True

    def on_reply(self, reply):
        reply.metrics["tag"] = 10.0 * reply.partition_id
'''


@pytest.mark.parametrize("engine", ["inprocess", "auto"])
def test_a_feature_with_a_server_and_a_client_half_is_new_files_only(tmp_path, monkeypatch, engine):
    """The two halves of a feature and its config group, in the user's folder: the builder folds the wrapper, the
    run spec names the client half, every engine applies it (the batched one through the ClientApp)."""
    from fedsim.run import run_experiment

    (tmp_path / "conf" / "tagging").mkdir(parents=True)
    (tmp_path / "tagging.py").write_text(FEATURE)
    (tmp_path / "conf" / "tagging" / "on.yaml").write_text("_target_: tagging.Tagging\nscale: 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("tagging", None)
    over = [*TINY[:2], "quiet=true", "num_rounds=2", f"engine={engine}", "+tagging=on"]
    summary = run_experiment(compose(*over, searchpath=[str(tmp_path / "conf")]), tmp_path / "run")
    sys.modules.pop("tagging", None)
    assert summary["status"] == "completed" and len(summary["tags"]) == 2
    for tags in summary["tags"]:  # one tag per reply: the client half ran on both clients of each round
        assert len(set(tags)) == 2 and all(t in (0.0, 10.0, 20.0, 30.0) for t in tags), tags


# ------------------------------------------------------------- a strategy with a client-side setting
LR_SCALE = '''
import torch

from fedsim.algorithms.base import LocalSGD
from fedsim.strategies.fedavg import FedAvg
from flwr.app import ConfigRecord

KEY = "lr-scale"


class ScaledAvg(FedAvg):
    """FedAvg that asks its clients to scale their step size (a client-side setting of its own)."""

    client_algorithm = "lrscale.ScaledSGD"

    def __init__(self, scale=0.25, **kwargs):
        super().__init__(**kwargs)
        self.scale = float(scale)

    def configure_train(self, server_round, arrays, config, grid):
        config = ConfigRecord({**dict(config.items()), KEY: self.scale})
        return super().configure_train(server_round, arrays, config, grid)


class ScaledSGD(LocalSGD):
    """Plain SGD with the gradients scaled by the strategy's lr-scale (the same as scaling the step size)."""

    def on_gradients(self, run):
        scale = float(run.instruction.unhandled[KEY])
        with torch.no_grad():
            for _, p in run.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
'''


def test_a_strategy_with_a_client_side_setting_is_new_files_only_and_agrees_on_every_engine(
    tmp_path, monkeypatch
):
    """The composition issue's lr-scale case, by the algorithm route: the strategy sends its key, its client
    algorithm reads it; ``inprocess`` and ``auto`` give the same model, unlike plain FedAvg."""
    from fedsim.run import run_experiment

    (tmp_path / "conf" / "strategy").mkdir(parents=True)
    (tmp_path / "lrscale.py").write_text(LR_SCALE)
    (tmp_path / "conf" / "strategy" / "scaled.yaml").write_text("_target_: lrscale.ScaledAvg\nscale: 0.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("lrscale", None)
    search = [str(tmp_path / "conf")]
    over = [*TINY[:2], "quiet=true", "num_rounds=2", "client.optimizer=sgd"]
    models = {}
    for name, extra in (
        ("in", ["engine=inprocess"]),
        ("auto", ["engine=auto"]),
        ("avg", ["strategy=fedavg"]),
    ):
        strategy = [] if name == "avg" else ["strategy=scaled"]
        run_experiment(compose(*over, *strategy, *extra, searchpath=search), tmp_path / name)
        models[name] = torch.load(tmp_path / name / "model.pt")
    sys.modules.pop("lrscale", None)
    assert all(torch.allclose(models["in"][k], models["auto"][k], atol=1e-6) for k in models["in"])
    assert any(not torch.allclose(models["in"][k], models["avg"][k], atol=1e-4) for k in models["in"])


# ------------------------------------------------------------- a client algorithm with state
COUNTING_ALGORITHM = '''
import numpy as np

from fedsim.algorithms.base import LocalSGD


class CountingSGD(LocalSGD):
    """Plain SGD that counts its own tasks in the client's persistent state and reports the count."""

    stateful = True

    def after_training(self, run):
        super().after_training(run)
        count = int(run.state.get("count", np.zeros(1))[0]) + 1
        run.state["count"] = np.array([count])
        run.metrics["task-count"] = float(count)
'''


RECORDER = '''
import json

from fedsim.callbacks import Callback


class Keep(Callback):
    """A user's callback: every record it is given, one JSON line each, in its own file."""

    def __init__(self, path):
        self.path = path

    def on_round(self, record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\\n")
'''


@pytest.mark.slow
def test_a_stateful_client_algorithm_and_a_callback_from_new_files_agree_on_both_engines(
    tmp_path, monkeypatch
):
    """Two of the five extensions the one-form issue names, both from new files in one run: a client algorithm
    whose state survives from one task of a client to the next (with every client in every round, round r's
    replies report r, in metrics.jsonl as snake_case) and a callback. ``inprocess`` and the default engine give
    the same models and metrics (``test_matrix``'s tolerance), and the callback was given exactly the records of
    its run's ``metrics.jsonl``."""
    from helpers import read_metrics
    from test_matrix import _assert_agree, _tolerance

    from fedsim.run import run_experiment

    (tmp_path / "counting.py").write_text(COUNTING_ALGORITHM)
    (tmp_path / "keep.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("counting", "keep"):
        sys.modules.pop(name, None)
    over = [
        "num_clients=3",
        "clients_per_round=3",
        "num_rounds=3",
        "quiet=true",
        "+client._target_=counting.CountingSGD",
    ]
    cfgs = {}
    for engine in ("inprocess", "auto"):
        kept = tmp_path / f"{engine}.jsonl"
        cfgs[engine] = compose(
            *over, f"engine={engine}", f"callbacks=[{{_target_: keep.Keep, path: '{kept}'}}]"
        )
        assert run_experiment(cfgs[engine], tmp_path / engine)["status"] == "completed"
        records = read_metrics(tmp_path / engine)
        assert [json.loads(ln) for ln in kept.read_text().splitlines()] == records
        assert [r.get("task_count") for r in records if r.get("round")] == [1.0, 2.0, 3.0], engine
    for name in ("counting", "keep"):
        sys.modules.pop(name, None)
    _assert_agree(
        tmp_path / "inprocess", tmp_path / "auto", _tolerance(cfgs["inprocess"], tmp_path / "inprocess")
    )


# ------------------------------------------------------------- a user's subclass of a shipped class
SUBCLASSES = '''
import numpy as np

from fedsim.features.attacks.server import SignFlip
from fedsim.features.clipping.server import FixedClipping
from fedsim.strategies.fedavg import FedAvg
from fedsim.strategies.krum import Krum

CALLS = []


class QuietFlip(SignFlip):
    """Flower's per-client form overridden: the attackers' replies are left out before the attack."""

    def aggregate_train(self, server_round, replies):
        CALLS.append(type(self).__name__)
        replies = [r for r in replies if int(r.content["metrics"]["partition-id"]) not in self.malicious]
        return super().aggregate_train(server_round, replies)


class LoudFlip(SignFlip):
    """The per-client hook overridden: attackers send -5 d."""

    def craft(self, server_round, honest, own, pids):
        CALLS.append(type(self).__name__)
        return -5.0 * own


class LaterClipping(FixedClipping):
    """Flower's per-client form overridden: the reply of the lowest partition id is left out."""

    def aggregate_train(self, server_round, replies):
        CALLS.append(type(self).__name__)
        return super().aggregate_train(server_round, list(replies)[1:])


class FirstOnly(FedAvg):
    """The per-client combine overridden: the first client's model."""

    def combine(self, models, weights):
        CALLS.append(type(self).__name__)
        return {k: np.asarray(v, np.float64) for k, v in models[0].items()}


class LaterKrum(Krum):
    """Flower's per-client form overridden: the reply of the lowest partition id is left out."""

    def aggregate_train(self, server_round, replies):
        CALLS.append(type(self).__name__)
        return super().aggregate_train(server_round, list(replies)[1:])
'''

CASES = {
    "QuietFlip": ["attack=sign_flip", "attack._target_=subclasses.QuietFlip", "attack.fraction=0.5"],
    "LoudFlip": ["attack=sign_flip", "attack._target_=subclasses.LoudFlip", "attack.fraction=0.5"],
    "LaterClipping": [
        "clipping=fixed",
        "clipping._target_=subclasses.LaterClipping",
        "clipping.clip_norm=0.05",
    ],
    "FirstOnly": ["strategy._target_=subclasses.FirstOnly"],
    "LaterKrum": ["strategy=krum", "strategy._target_=subclasses.LaterKrum", "clients_per_round=4"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_users_subclass_of_a_shipped_class_is_honoured_on_every_engine(tmp_path, monkeypatch, name):
    """Issue 38's case and its kin: a user's subclass of a shipped attack, wrapper or strategy that overrides a
    per-client hook (Flower's ``aggregate_train``, ``craft``, ``combine``) is called on ``inprocess`` and on the
    default engine every round, and the two runs agree (``test_matrix``'s tolerance), while the override
    visibly changes the default engine's model (against the shipped class's run)."""
    from test_matrix import _assert_agree, _tolerance

    from fedsim.run import run_experiment

    (tmp_path / "subclasses.py").write_text(SUBCLASSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("subclasses", None)
    import subclasses

    base_over = ["num_clients=6", "clients_per_round=3", "num_rounds=2", "quiet=true", *CASES[name]]
    cfgs = {}
    for engine in ("inprocess", "auto"):
        subclasses.CALLS.clear()
        cfgs[engine] = compose(*base_over, f"engine={engine}")
        assert run_experiment(cfgs[engine], tmp_path / engine)["status"] == "completed"
        assert subclasses.CALLS.count(name) >= 1, (engine, subclasses.CALLS)
    sys.modules.pop("subclasses", None)
    _assert_agree(
        tmp_path / "inprocess", tmp_path / "auto", _tolerance(cfgs["inprocess"], tmp_path / "inprocess")
    )
    shipped = [o for o in base_over if "_target_" not in o]
    run_experiment(compose(*shipped, "engine=auto"), tmp_path / "shipped")
    a, b = torch.load(tmp_path / "auto" / "model.pt"), torch.load(tmp_path / "shipped" / "model.pt")
    assert any(not torch.equal(a[k], b[k]) for k in a), "the override changed nothing"


# ------------------------------------------------------------- a client half that runs batched, from new files
SHRINKING = '''
import torch
from flwr.app import ConfigRecord

from fedsim.algorithms.halves import ClientHalf
from fedsim.strategies.wrapper import Wrapper

KEY = "shrink-update"


class Shrink(Wrapper):
    """Server half: ask every client to send its update scaled by ``factor``."""

    client_half = "shrinking.ShrinkHalf"

    def __init__(self, strategy, factor=0.5):
        super().__init__(strategy)
        self.factor = float(factor)

    def configure_train(self, server_round, arrays, config, grid):
        config = ConfigRecord({**dict(config.items()), KEY: self.factor})
        return self.strategy.configure_train(server_round, arrays, config, grid)


class ShrinkHalf(ClientHalf):
    """Client half, written per client only: the update ``model - start`` scaled, and a metric saying so."""

    needs_start = True
    keys = (KEY,)

    def active(self, ins):
        return KEY in ins.unhandled

    def on_reply(self, reply):
        factor = float(reply.ins.unhandled[KEY])
        for k, s in reply.start.items():
            if torch.is_floating_point(s):
                reply.model[k] = s + (reply.model[k] - s) * factor
        reply.metrics["shrunk"] = factor
'''


def test_a_new_client_half_runs_batched_on_the_default_engine_and_agrees_with_inprocess(
    tmp_path, monkeypatch, caplog
):
    """A feature's two halves from new files (no engine file edited): its half declares its train-config key,
    so the default engine trains its clients batched and runs the half on the rows (its per-client form, by
    default); the metrics and the model agree with ``engine=inprocess`` (``test_matrix``'s tolerance), and
    the half visibly acted (its metric, and a model other than without it)."""
    from test_matrix import _assert_agree, _tolerance

    from fedsim.run import run_experiment

    (tmp_path / "conf" / "shrinking").mkdir(parents=True)
    (tmp_path / "shrinking.py").write_text(SHRINKING)
    (tmp_path / "conf" / "shrinking" / "on.yaml").write_text("_target_: shrinking.Shrink\nfactor: 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("shrinking", None)
    over = ["num_clients=6", "clients_per_round=3", "num_rounds=2", "quiet=true", "client.optimizer=sgd"]
    search = [str(tmp_path / "conf")]
    cfgs = {}
    for engine in ("inprocess", "auto"):
        caplog.clear()
        cfgs[engine] = compose(*over, "+shrinking=on", f"engine={engine}", searchpath=search)
        with caplog.at_level("INFO", logger="fedsim"):
            assert run_experiment(cfgs[engine], tmp_path / engine)["status"] == "completed"
    assert not [r for r in caplog.records if "through the ClientApp" in r.getMessage()]  # batched: auto
    sys.modules.pop("shrinking", None)
    _assert_agree(
        tmp_path / "inprocess", tmp_path / "auto", _tolerance(cfgs["inprocess"], tmp_path / "inprocess")
    )
    rows = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("shrunk") for r in rows if r["round"] > 0] == [0.5, 0.5], rows[-1]
    run_experiment(compose(*over, "engine=auto"), tmp_path / "plain")
    a, b = torch.load(tmp_path / "auto" / "model.pt"), torch.load(tmp_path / "plain" / "model.pt")
    assert any(not torch.equal(a[k], b[k]) for k in a), "the half changed nothing"
