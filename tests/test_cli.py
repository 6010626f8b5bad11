"""The ``fedsim`` command as a user runs it: bad input gives one line and exit 2; sweeps get a summary."""

import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import TINY, compose_cfg, fedsim_cli

from fedsim.config import FLOWER_ENV
from fedsim.errors import ConfigError
from fedsim.run import run_experiment

ENV = {**os.environ, **FLOWER_ENV}


def fedsim(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "fedsim", *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300
    )


BAD = [
    (["num_clients=0"], "num_clients=0"),
    (["num_rounds=-1"], "num_rounds=-1"),
    (["clients_per_round=30"], "clients_per_round=30"),
    (["client.batch_size=-4"], "client.batch_size=-4"),
    (["client.lr=0"], "client.lr=0"),
    (["client.optimizer=lbfgs"], "client.optimizer='lbfgs'"),
    (["client=sgd", "client.optimizer=nesterov", "client.momentum=0"], "client.momentum=0"),
    (["partitioner.alpha=0"], "partitioner.alpha=0"),
    (["partitioner.alpha=-1"], "partitioner.alpha=-1"),
    (["num_clients=5000"], "num_clients"),  # more clients than examples
    (["dataset=fashion_mnist", "dataset.root=/nonexistent/fmnist"], "dataset.root"),
    (["+strategy.foo=1"], "strategy.foo=1"),  # a key the strategy does not take: its parameters are listed
    (["+heterogeneity.sped=1"], "heterogeneity.sped=1"),
    (["strategy=fedbuff", "+strategy.alpha=0.5"], "strategy.alpha=0.5"),
    (["strategy=krum", "clients_per_round=2"], "clients_per_round=2 is not allowed"),  # not strategy.<key>
    (["strategy=krum", "strategy.num_malicious=1", "clients_per_round=4"], "strategy.num_malicious=1"),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, needle", BAD, ids=[b[1] for b in BAD])
def test_bad_values_raise_config_error_naming_the_key(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as err:
        run_experiment(compose_cfg("quiet=true", *overrides), tmp_path)
    assert needle in str(err.value)
    assert "expected" in str(err.value)
    assert not (tmp_path / "metrics.jsonl").exists()  # stopped before any training


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize(
    "override", ["placement=gpu", "placement.server_device=cuda:0", "placement.device=cuda:x"]
)
def test_a_cuda_device_this_machine_lacks_is_a_config_error(tmp_path, override):
    key = override.split("=")[0] if "." in override.split("=")[0] else "placement.device"
    with pytest.raises(ConfigError, match=f"^{key}="):
        run_experiment(compose_cfg("quiet=true", override), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_cli_bad_value_prints_one_line_and_exits_2(tmp_path):
    res = fedsim("partitioner.alpha=0", cwd=tmp_path)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("fedsim: config error")]
    assert len(errors) == 1 and "partitioner.alpha=0" in errors[0]


@pytest.mark.slow
def test_cli_unknown_option_is_refused(tmp_path):
    res = fedsim("strategy=nosuch", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "fedsim: config error: strategy='nosuch' is not allowed: expected one of " in res.stderr
    assert "fedavg" in res.stderr and "fedbuff" in res.stderr
    res = fedsim("-m", "partitioner=iid,dirichet", cwd=tmp_path)  # one bad option of a sweep: nothing runs
    assert res.returncode == 2 and "partitioner='dirichet' is not allowed" in res.stderr
    assert not (tmp_path / "multirun").exists()
    res = fedsim("num_clientz=3", cwd=tmp_path)
    assert (
        res.returncode == 2 and "unknown config key 'num_clientz' (did you mean 'num_clients'?)" in res.stderr
    )
    res = fedsim("client.lrr=0.1", cwd=tmp_path)
    assert res.returncode == 2 and "did you mean 'client.lr'?" in res.stderr


@pytest.mark.slow
def test_cli_multirun_writes_sweep_summary_and_survives_a_failing_job(tmp_path):
    res = fedsim(
        "-m",
        "num_clients=6",
        "num_rounds=2",
        "clients_per_round=2,3,7",
        "seed=0,1",
        "quiet=true",
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
    )
    assert res.returncode == 1  # some jobs failed: non-zero, but after every job ran
    assert "2 run(s) of the sweep failed" in res.stderr
    with open(tmp_path / "sweep" / "sweep_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    assert {r["overrides"] for r in rows} == {
        f"num_clients=6 num_rounds=2 clients_per_round={m} seed={s} quiet=True"
        for m in (2, 3, 7)
        for s in (0, 1)
    }
    for r in rows:
        if "clients_per_round=7" in r["overrides"]:
            assert r["status"] == "failed" and "clients_per_round=7" in r["error"]
        else:
            assert r["status"] == "completed" and float(r["final_eval_accuracy"]) > 0
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 0

    # the same sweep folder again, with two jobs: only they are summarised, and job 0 (completed before)
    # now fails without the earlier job's figures standing in for its own
    res = fedsim(
        "-m",
        "num_clients=6",
        "num_rounds=1",
        "clients_per_round=7,2",
        "quiet=true",
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
    )
    assert res.returncode == 1 and "sweep summary of 2 runs" in res.stdout
    with open(tmp_path / "sweep" / "sweep_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"], r["rounds_done"]) for r in rows] == [
        ("0", "failed", ""),
        ("1", "completed", "1"),
    ]
    assert rows[0]["final_eval_accuracy"] == "" and "clients_per_round=7" in rows[0]["error"]


@pytest.mark.slow
def test_cli_run_that_cannot_go_on_prints_one_line_and_keeps_its_outputs(tmp_path):
    res = fedsim(
        "strategy=fedasync",
        "heterogeneity=lognormal",
        "heterogeneity.dropout_prob=1.0",
        "num_rounds=2",
        "quiet=true",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr
    failed = [ln for ln in res.stderr.splitlines() if ln.startswith("fedsim: run failed:")]
    assert len(failed) == 1 and "dropped out" in failed[0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_python_api_gives_the_command_lines_one_line_for_a_bad_override():
    """fedsim.config.compose raises ConfigError (the README's promise), not Hydra's composition exceptions."""
    from fedsim.config import compose
    from fedsim.errors import ConfigError

    for override, key, says in [
        ("num_clientz=3", "num_clientz", "did you mean 'num_clients'?"),
        ("strategy=nosuch", "strategy", "expected one of ditto, "),
    ]:
        with pytest.raises(ConfigError) as e:
            compose(override)
        assert e.value.key == key and says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_a_run_folder_name_too_long_for_the_file_system_is_one_line(tmp_path):
    res = fedsim_cli(*TINY, "hydra.run.dir=" + "x" * 300, cwd=tmp_path)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("fedsim: config error")]
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(errors) == 1
    assert "hydra.run.dir=" in errors[0] and "a folder fedsim can create and write in" in errors[0]


def test_the_command_ends_without_the_interpreters_last_collection(tmp_path):
    """``fedsim`` freezes the garbage collector once it is done, on a normal end and on a sys.exit alike, so the
    interpreter's exit does not walk every object torch and Flower made."""
    code = """if True:
        import gc, sys
        from fedsim import cli
        for argv in (["--cfg", "job"], ["num_rounds=-1"]):
            gc.unfreeze()
            sys.argv = ["fedsim", *argv]
            try:
                cli.main()
                status = 0
            except SystemExit as e:
                status = e.code
            print("RESULT", status, gc.get_freeze_count() > 0)
    """
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300
    )
    results = [ln.split()[1:] for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert results == [["0", "True"], ["2", "True"]], out.stdout + out.stderr


def test_the_command_composes_its_config_once_for_both_checks(tmp_path, monkeypatch):
    """The unknown-key check keeps the config it composed; the run folder is settled from it, not a new one."""
    from fedsim import cli, run_folder
    from fedsim.recorder import unlock_run_folder

    composed, folder = {}, {}
    for module in (cli, run_folder):  # the command's and the run folder's module share the two
        monkeypatch.setattr(module, "RUN_FOLDER", folder)
        monkeypatch.setattr(module, "COMPOSED", composed)
    argv = ["num_rounds=2", f"hydra.run.dir={tmp_path / 'run'}"]
    assert cli.unknown_key(argv) is None and not cli.COMPOSED  # the Python API's check keeps nothing
    assert cli.unknown_key(argv, remember=True) is None and tuple(argv) in cli.COMPOSED
    monkeypatch.setattr(run_folder, "compose", lambda *a, **k: pytest.fail("composed a second time"))
    try:
        assert cli.prepare_folders(argv) == []  # an explicit folder: nothing to add
        assert cli.RUN_FOLDER["path"] == tmp_path / "run"
        assert cli.plain_run(argv) is not None and not cli.COMPOSED  # the run takes it
    finally:
        unlock_run_folder(tmp_path / "run")
    assert cli.unknown_key(["num_roundz=2"], remember=True).startswith("unknown config key 'num_roundz'")
    assert not cli.COMPOSED


ONE_COMPOSITION = """
import json, sys
from pathlib import Path
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
import fedsim.cli as cli

load, calls = ConfigLoaderImpl.load_configuration, []
def counted(self, *args, **kwargs):
    calls.append(kwargs.get("run_mode"))
    return load(self, *args, **kwargs)
ConfigLoaderImpl.load_configuration = counted

jobs = []
def task(cfg):  # the job as the run gets it; the run itself is left out (no torch in this test)
    hc = HydraConfig.get()
    folder = Path(hc.runtime.output_dir)
    files = {p.name: p.read_text() for p in sorted((folder / ".hydra").glob("*.yaml"))}
    text = json.dumps([OmegaConf.to_container(cfg), OmegaConf.to_container(hc), files], sort_keys=True, default=str)
    names = sorted(p.name for p in folder.iterdir())
    text = text.replace(str(folder), "DIR").replace(str(folder.relative_to(Path(hc.runtime.cwd))), "DIR")
    jobs.append([len(calls), str(folder), names, text])
cli._task = task
plain_run = cli.plain_run
for argv in json.loads(sys.argv[1]):
    for fast in (True, False):
        cli.plain_run = plain_run if fast else (lambda argv: cli.COMPOSED.clear())  # False: @hydra.main's way
        calls.clear()
        sys.argv = ["fedsim", *argv]
        try:
            cli.main()
        except SystemExit as e:
            assert not e.code, e.code
print("JOBS", json.dumps(jobs))
"""


@pytest.mark.parametrize("argv", [[], ["strategy=fedprox", "num_rounds=3", "hydra.job.chdir=true"]])
def test_the_default_command_composes_its_config_once(tmp_path, argv):
    """The command composes the config once (the unknown-key check's composition serves the folder and the run):
    ``ConfigLoaderImpl.load_configuration`` is called once, where ``@hydra.main`` makes two more; the job gets
    the same config, Hydra config and ``.hydra/`` files as ``@hydra.main``'s own composition gives it."""
    out = subprocess.run(
        [sys.executable, "-c", ONE_COMPOSITION, json.dumps([argv])],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (fast, slow) = json.loads(out.stdout.split("JOBS", 1)[1])
    assert fast[0] == 1 and slow[0] == 3  # the counter sees @hydra.main's own compositions
    assert fast[2] == slow[2] == [".fedsim.lock", ".hydra", "cli.log"]  # the log file named as Hydra names it
    assert (
        fast[1] != slow[1] and "DIR" in fast[3]
    )  # two folders (a timestamp, or its -1 suffix), else the same
    assert fast[3] == slow[3]
    assert "hydra.mode=RUN" in fast[3]  # as @hydra.main adds it to the overrides in hydra.yaml


def test_help_names_the_command_and_its_three_uses(tmp_path):
    out = fedsim("--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("fedsim: federated learning simulation"), first
    for use in ("fedsim key=value", "fedsim -m ", "fedsim --cfg job"):
        assert use in out.stdout, use
    assert "strategy: " in out.stdout  # Hydra's list of groups and options follows


def test_a_config_error_comes_before_torch_and_flower_are_imported(tmp_path):
    """The run's own knobs are checked first: ``fedsim num_rounds=-1`` says so without importing torch or flwr
    (half of a full run's start-up time)."""
    cmd = [sys.executable, "-X", "importtime", "-m", "fedsim", "num_rounds=-1", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "num_rounds=-1 is not allowed" in done.stderr
    imported = {
        ln.rsplit("|", 1)[-1].strip() for ln in done.stderr.splitlines() if ln.startswith("import time:")
    }
    assert "fedsim.cli" in imported and "fedsim.validate" in imported
    assert not {"torch", "flwr"} & imported, sorted({"torch", "flwr"} & imported)


# ---- hints that know config groups --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, group, option",
    [
        ("strategy.proximal_mu=0.1", "strategy", "fedprox"),  # fedprox is fedavg plus this key
        ("model.channels=[8]", "model", "cnn"),
        ("strategy.fraction_evaluat=1", "strategy", None),  # the closest key, when no option has it
    ],
)
def test_a_key_of_another_option_of_a_group_suggests_that_option(override, group, option):
    from fedsim.override_check import unknown_key

    msg = unknown_key([override])
    assert msg is not None and "\n" not in msg
    if option is None:
        assert f"with {group}=" not in msg and "did you mean" in msg
    else:
        assert f"it belongs to {group}={option}" in msg and f"try: fedsim {group}={option} {override}" in msg


@pytest.mark.parametrize("plus", ["+foo=1", "++foo=1", "+checkpointing.every=3"])
def test_a_plus_key_nothing_reads_is_refused_in_one_line(plus):
    from fedsim.override_check import unknown_key
    from fedsim.run_config import DeployConfigError, experiment_from

    msg = unknown_key(["num_rounds=1", plus])
    assert (
        msg is not None
        and msg.startswith(f"{plus} is not allowed: it adds a key nothing reads")
        and "\n" not in msg
    )
    with pytest.raises(DeployConfigError, match="nothing reads"):  # the deployed ServerApp's check too
        experiment_from({"overrides": plus})


@pytest.mark.parametrize(
    "argv",
    [
        ["+strategy.foo=1"],  # a parameter of a group's section: the builder names it if the target lacks it
        ["strategy=fedbuff", "+strategy.alpha=0.5"],
        ["+client._target_=fedsim.features.scaffold.client.Scaffold"],
        ["+heterogeneity.speeds=[1.0,0.5]"],
        ["+partitioner.self_balancing=true"],
        ["attack=alie", "++attack.knowledge=own"],
        ["attack=none", "++attack.knowledge=own"],  # bench/reproduce.py's sweep over attack=none,alie
        ["+target_mae=0.5"],  # target_<metric>
        ["++seed=3"],  # a key the config has: ++ only sets it
    ],
)
def test_the_declared_plus_keys_still_compose(argv):
    from fedsim.override_check import unknown_key

    assert unknown_key(argv) is None


@pytest.mark.slow
def test_cli_refuses_an_unknown_plus_key_and_hints_a_groups_option(tmp_path):
    res = fedsim("+foo=1", "num_rounds=1", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "fedsim: config error: +foo=1 is not allowed: it adds a key nothing reads" in res.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))
    res = fedsim("strategy.proximal_mu=0.1", cwd=tmp_path)
    assert res.returncode == 2 and "try: fedsim strategy=fedprox strategy.proximal_mu=0.1" in res.stderr
