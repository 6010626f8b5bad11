"""DP end to end (issue 13): the sampler that runs is the one accounted for, the noise is secret from clients,
metrics.jsonl holds only private releases about clients, and a DP run resumes with its own noise.

epsilon is recomputed here with dp-accounting directly (the DpEvent is built in this file, not taken from
``fedsim.features.clipping.accounting``) and compared with what a tiny run wrote into metrics.jsonl and
summary.json.
"""

from __future__ import annotations

import json
import logging

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import NeighboringRelation
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from flwr.app import ArrayRecord
from strategy_helpers import flower_kwargs

from fedsim import keys, schema
from fedsim.features.clipping.server import AdaptiveClipping, FixedClipping
from fedsim.features.clipping.wrapper import SECRET_TAG, UPDATE_NOISE
from fedsim.strategies.fedavg import FedAvg

try:  # the tiny-run helpers: tests/helpers.py, formerly tests/conftest.py
    from helpers import read_metrics, run_tiny, without_wall_time
except ImportError:
    from conftest import read_metrics, run_tiny, without_wall_time

DP = ["clipping=fixed", "clipping.noise_multiplier=1.0"]
DEBUG_SEED = "clipping.debug_noise_seed=true"  # an operator's noise_seed is accepted in the debug mode only


def direct_epsilon(
    sampling: str, accountant: str, n: int, m: int, z: float, delta: float, rounds: int
) -> float:
    """epsilon of ``rounds`` DP-FedAvg rounds, straight from dp-accounting.

    Poisson sampling at q = m/n, add/remove one client: the sum of clipped updates moves by C, noise std z C.
    Fixed-size sampling without replacement, replace one client: the sum moves by up to 2C, so the Gaussian's
    noise-to-sensitivity ratio is z / 2.
    """
    if sampling == "poisson":
        event = dp_accounting.PoissonSampledDpEvent(m / n, dp_accounting.GaussianDpEvent(z))
        relation = NeighboringRelation.ADD_OR_REMOVE_ONE
    else:
        event = dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(z / 2))
        relation = NeighboringRelation.REPLACE_ONE
    acc = RdpAccountant(neighboring_relation=relation) if accountant == "rdp" else PLDAccountant(relation)
    return acc.compose(dp_accounting.SelfComposedDpEvent(event, rounds)).get_epsilon(delta)


LONG = 0x9E3779B97F4A7C15F39CC0605CEDC834  # a 128-bit base for the noise seeds these tests set (>= 64 bits)


def cohort_sizes(noise_seed: int, n: int, m: int, rounds: int) -> list[int]:
    """The Poisson cohort sizes a DP run with this noise seed will draw (the wrapper is deterministic in it)."""
    s = FixedClipping(
        FedAvg(**flower_kwargs()), n, m, noise_multiplier=1.0, noise_seed=noise_seed, debug_noise_seed=True
    )
    return [len(s.sample_cohort(r, n, m)) for r in range(1, rounds + 1)]


def seed_where(pred, n: int, m: int, rounds: int) -> int:
    """The first long noise seed ``LONG + k`` whose cohorts satisfy ``pred(sizes)``."""
    return next(LONG + k for k in range(1000) if pred(cohort_sizes(LONG + k, n, m, rounds)))


# ---------------------------------------------------------------- 1. sampling and accounting agree
@pytest.mark.slow
@pytest.mark.parametrize("sampling, accountant", [("poisson", "rdp"), ("poisson", "pld"), ("fixed", "rdp")])
def test_epsilon_per_round_equals_dp_accounting_for_the_sampler_that_ran(tmp_path, sampling, accountant):
    n, m, rounds = 20, 5, 3
    ns = seed_where(lambda s: min(s) >= 1, n, m, rounds)
    summary = run_tiny(
        tmp_path,
        *DP,
        f"num_clients={n}",
        f"clients_per_round={m}",
        f"num_rounds={rounds}",
        f"clipping.sampling={sampling}",
        f"clipping.accountant={accountant}",
        f"clipping.noise_seed={ns}",
        DEBUG_SEED,
    )
    records = read_metrics(tmp_path)[1:]
    assert [r["round"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["epsilon"] == pytest.approx(
            direct_epsilon(sampling, accountant, n, m, 1.0, 1e-5, r["round"]), abs=5e-4
        )
    sizes = [r["num_clients"] for r in records]
    if sampling == "fixed":
        assert sizes == [m] * rounds
    else:
        assert sizes == cohort_sizes(ns, n, m, rounds)
    assert summary["final_epsilon"] == summary["epsilon"] == records[-1]["epsilon"]
    assert (summary["delta"], summary["accountant"], summary["sampling"]) == (1e-5, accountant, sampling)
    assert summary["adjacency"] == {"poisson": "add_or_remove_one", "fixed": "replace_one"}[sampling]
    assert summary["noise_multiplier"] == 1.0 and summary["noise_seed_source"] == "operator"
    assert str(ns) not in (tmp_path / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_poisson_cohorts_vary_and_every_round_is_released_with_noise_and_charged_once(tmp_path):
    """q = 0.5 over 6 clients. A round with fewer than min_replies = 3 sampled clients, or none, is not skipped:
    it releases the noised sum of what it got (none: the model plus the noise), as the analysed mechanism
    does, and the accountant charges it once."""
    n, m, rounds = 6, 3, 6
    ns = seed_where(lambda s: s[0] >= 3 and 0 in s[1:] and any(0 < x < 3 for x in s), n, m, rounds)
    summary = run_tiny(
        tmp_path,
        *DP,
        f"num_clients={n}",
        f"clients_per_round={m}",
        f"num_rounds={rounds}",
        "min_replies=3",
        f"clipping.noise_seed={ns}",
        DEBUG_SEED,
    )
    records = read_metrics(tmp_path)
    sizes = cohort_sizes(ns, n, m, rounds)
    assert [r["num_clients"] for r in records[1:]] == sizes  # the cohort size varies, 0 included
    for r in records[1:]:
        assert not r.get("skipped") and r["noise_std"] == pytest.approx(1.0 * 1.0 / m)
        assert r["epsilon"] == pytest.approx(direct_epsilon("poisson", "rdp", n, m, 1.0, 1e-5, r["round"]))
    for rnd in (i + 1 for i, size in enumerate(sizes) if size == 0):  # the noise alone moved the model
        assert records[rnd]["eval_loss"] != records[rnd - 1]["eval_loss"]
        assert "train_loss" not in records[rnd]
    assert summary["final_epsilon"] == pytest.approx(
        direct_epsilon("poisson", "rdp", n, m, 1.0, 1e-5, rounds)
    )
    assert summary["rounds_accounted"] == rounds and summary["status"] == "completed"
    # every field written is either a private release or on docs/privacy.md's "not covered" list
    written = set().union(*[set(r) for r in records])
    assert written <= set(schema.DP_COVERED) | set(schema.DP_NOT_COVERED), written


@pytest.mark.slow
def test_the_budget_stop_still_works_with_poisson_sampling(tmp_path):
    budget = (
        direct_epsilon("poisson", "rdp", 6, 3, 1.0, 1e-5, 3)
        + direct_epsilon("poisson", "rdp", 6, 3, 1.0, 1e-5, 4)
    ) / 2
    ns = seed_where(lambda s: min(s) >= 1, 6, 3, 4)
    summary = run_tiny(
        tmp_path,
        *DP,
        "num_rounds=10",
        f"clipping.max_epsilon={budget}",
        f"clipping.noise_seed={ns}",
        DEBUG_SEED,
    )
    assert summary["status"] == "stopped" and "max_epsilon" in summary["stop_reason"]
    assert summary["rounds_done"] == 3 and summary["final_epsilon"] <= budget


# ---------------------------------------------------------------- 2. noise nobody else can predict
class _Tap:
    """Records every message fedsim's local grid sends to a client."""

    def __init__(self, monkeypatch):
        from fedsim.engines.pool import PoolGrid

        self.sent = []
        original = PoolGrid.push_messages

        def push(grid, messages):
            messages = list(messages)
            self.sent.extend(messages)
            return original(grid, messages)

        monkeypatch.setattr(PoolGrid, "push_messages", push)

    def texts(self) -> list[str]:
        """Every non-array record value and the metadata of every message, as text."""
        out = []
        for msg in self.sent:
            out.append(repr(msg.metadata))
            for name, rec in msg.content.items():
                if not isinstance(rec, ArrayRecord):
                    out.extend(f"{name}.{k}={v!r}" for k, v in rec.items())
        return out

    def train_models(self, rnd: int) -> list[dict[str, np.ndarray]]:
        found = []
        for msg in self.sent:
            if (
                msg.metadata.message_type == "train"
                and msg.content[keys.CONFIG].get(keys.SERVER_ROUND) == rnd
            ):
                found.append({k: a.numpy() for k, a in msg.content[keys.ARRAYS].items()})
        return found


@pytest.mark.slow
@pytest.mark.parametrize("noise_seed", [LONG + 918273645, None])
def test_no_message_to_a_client_carries_the_noise_seed(tmp_path, monkeypatch, noise_seed):
    tap = _Tap(monkeypatch)
    extra = [] if noise_seed is None else [f"clipping.noise_seed={noise_seed}", DEBUG_SEED]
    summary = run_tiny(  # 4 rounds: a drawn seed's Poisson cohorts (q = 0.5 of 6) are all empty 1 in 64^4
        tmp_path, "clipping=adaptive", "clipping.noise_multiplier=1.0", "clipping.side=client",
        "federated_eval=true", "num_rounds=4", "checkpoint_every=4", *extra,
    )  # fmt: skip
    from fedsim.checkpoint import load

    secret = str(load(tmp_path / "checkpoint.pt")["strategy_state"]["noise_seed"])
    assert noise_seed is None or secret == str(noise_seed)
    assert "noise_seed" not in summary and summary["noise_seed_source"] == (
        "entropy" if noise_seed is None else "operator"
    )
    texts = tap.texts()
    assert any(keys.RUN_SPEC in t for t in texts) and any(keys.CLIP_NORM in t for t in texts)
    assert not [t for t in texts if secret in t or "noise_seed" in t]
    specs = [
        json.loads(msg.content[keys.CONFIG][keys.RUN_SPEC])
        for msg in tap.sent
        if keys.CONFIG in msg.content and keys.RUN_SPEC in msg.content[keys.CONFIG]
    ]
    assert specs and all("clipping" not in spec for spec in specs)  # the clipping section stays on the server


@pytest.mark.slow
def test_the_run_seed_no_longer_regenerates_the_noise(tmp_path, monkeypatch):
    """One round with noise far above the clipped updates: the model moves by the noise, which the old
    derivation from the run seed (sent to every client) does not reproduce and the server's noise seed does."""
    tap = _Tap(monkeypatch)
    z, c, m, seed, noise_seed = 1e4, 1e-3, 6, 0, LONG + 4242
    run_tiny(
        tmp_path,
        "clipping=fixed",
        f"clipping.noise_multiplier={z}",
        f"clipping.clip_norm={c}",
        f"clipping.noise_seed={noise_seed}",
        DEBUG_SEED,
        f"seed={seed}",
        "num_clients=6",
        f"clients_per_round={m}",  # q = 1: everyone trains, the round is never empty
        "num_rounds=1",
    )
    (x, *_) = tap.train_models(1)
    out = {k: v.numpy() for k, v in torch.load(tmp_path / "model.pt").items()}
    floats = [k for k in x if x[k].dtype.kind == "f"]
    moved = np.concatenate([(out[k].astype(np.float64) - x[k]).ravel() for k in floats])
    sigma = z * c / m

    def noise(rng):
        return np.concatenate([rng.normal(0.0, sigma, np.shape(x[k])).ravel() for k in floats])

    old = noise(np.random.default_rng([seed, 5, 1, 0]))  # how fedsim drew it before issue 13
    new = noise(np.random.default_rng([noise_seed, SECRET_TAG, UPDATE_NOISE, 1]))
    assert np.abs(moved - new).max() < 1e-2 * sigma  # the server's own seed explains the model exactly
    assert abs(np.corrcoef(moved, old)[0, 1]) < 0.1  # the client-known seed explains nothing
    assert np.abs(moved - old).max() > sigma


# ---------------------------------------------------------------- 3. only private releases about clients
@pytest.mark.slow
def test_dp_metrics_jsonl_has_no_exact_client_statistics(tmp_path):
    # a noise seed whose Poisson cohorts are not empty (an entropy-drawn one leaves both rounds empty 1 in 4096)
    ns = f"clipping.noise_seed={seed_where(lambda s: min(s) >= 1, 6, 3, 2)}"
    run_tiny(
        tmp_path / "private",
        "clipping=adaptive",
        "clipping.noise_multiplier=1.0",
        "clipping.side=client",
        ns,
        DEBUG_SEED,
    )
    fields = set().union(*[set(r) for r in read_metrics(tmp_path / "private")])
    assert {"epsilon", "noisy_unclipped_fraction", "clip_norm", "noise_std"} <= fields
    assert not fields & {"clipped_fraction", "clipped", "update_norm"}
    run_tiny(
        tmp_path / "debug",
        "clipping=adaptive",
        "clipping.noise_multiplier=1.0",
        "clipping.side=client",
        "clipping.debug_metrics=true",
        ns,
        DEBUG_SEED,
    )
    fields = set().union(*[set(r) for r in read_metrics(tmp_path / "debug")])
    assert {"clipped_fraction", "clipped", "update_norm"} <= fields


@pytest.mark.slow
def test_a_run_whose_every_poisson_cohort_is_empty_says_so(tmp_path):
    from fedsim.errors import RunError

    ns = seed_where(lambda s: max(s) == 0, 6, 3, 1)  # q = 0.5 of 6: an empty cohort 1 in 64
    # not skipped (the round released the model plus its noise), but no client's update was aggregated
    with pytest.raises(
        RunError, match=r"all 1 round\(s\) released DP noise alone or were skipped \(empty cohort: 1\)"
    ):
        run_tiny(tmp_path, *DP, "num_rounds=1", f"clipping.noise_seed={ns}", DEBUG_SEED)


# ---------------------------------------------------------------- resume
@pytest.mark.slow
def test_a_resumed_dp_run_keeps_its_drawn_noise_seed(tmp_path):
    """noise_seed null: the seed drawn from OS entropy is checkpointed, so the resumed run is the run that a
    fresh one with that seed set explicitly would have been, bit for bit."""
    over = ["clipping=adaptive", "clipping.noise_multiplier=0.5", "checkpoint_every=2"]
    # 4 rounds first: a drawn seed's Poisson cohorts (q = 0.5 of 6) are all empty 1 in 64^4 (the run fails)
    part = run_tiny(tmp_path / "part", *over, "num_rounds=4")
    assert "noise_seed" not in part and part["noise_seed_source"] == "entropy"
    from fedsim.checkpoint import load

    drawn = load(tmp_path / "part" / "checkpoint.pt")["strategy_state"]["noise_seed"]
    resumed = run_tiny(tmp_path / "resumed", *over, "num_rounds=6", f"resume={tmp_path / 'part'}")
    assert load(tmp_path / "resumed" / "checkpoint.pt")["strategy_state"]["noise_seed"] == drawn
    assert resumed["rounds_accounted"] == 6 and "noise_seed" not in resumed
    run_tiny(tmp_path / "full", *over, "num_rounds=6", f"clipping.noise_seed={drawn}", DEBUG_SEED)
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(
        read_metrics(tmp_path / "full")
    )
    a, b = torch.load(tmp_path / "resumed" / "model.pt"), torch.load(tmp_path / "full" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_an_operator_seed_stays_in_the_checkpoint_and_a_resume_without_it_is_the_same_run(tmp_path):
    """summary.json holds no noise seed (its config says ``<secret>``'s absence); resuming without restating
    the seed takes it from the checkpoint, and the run is the uninterrupted one, bit for bit."""
    seed = "340282366920938463463374607431768211297"
    over = ["clipping=fixed", "clipping.noise_multiplier=0.5", "checkpoint_every=2", DEBUG_SEED]
    part = run_tiny(tmp_path / "part", *over, "num_rounds=4", f"clipping.noise_seed={seed}")
    assert seed not in json.dumps(part) and part["noise_seed_source"] == "operator"
    assert "noise_seed" not in part["config"]["clipping"]
    assert seed not in (tmp_path / "part" / "summary.json").read_text()
    run_tiny(tmp_path / "resumed", *over, "num_rounds=6", f"resume={tmp_path / 'part'}")
    run_tiny(tmp_path / "full", *over, "num_rounds=6", f"clipping.noise_seed={seed}")
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(
        read_metrics(tmp_path / "full")
    )
    a, b = torch.load(tmp_path / "resumed" / "model.pt"), torch.load(tmp_path / "full" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _sweep(tmp_path, *overrides: str):
    import os
    import subprocess
    import sys

    from fedsim.config import FLOWER_ENV

    cmd = [sys.executable, "-m", "fedsim", "-m", "num_clients=6", "clients_per_round=3", "num_rounds=1"]
    cmd += ["clipping=fixed", "clipping.noise_multiplier=1", DEBUG_SEED, *overrides, "progress=lines"]
    cmd += [f"hydra.sweep.dir={tmp_path}"]
    done = subprocess.run(cmd, env={**os.environ, **FLOWER_ENV}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


@pytest.mark.slow
def test_the_sweep_and_run_folders_hold_the_noise_seed_only_in_the_checkpoint(tmp_path):
    """Two seeds in one multirun: Hydra's own files (.hydra/config.yaml, hydra.yaml, overrides.yaml, the sweep's
    multirun.yaml), summary.json, the sweep summary and every console line show ``<secret>`` for both; with job
    folders named by their overrides, no folder name holds one either."""
    seeds = ["340282366920938463463374607431768211297", "170141183460469231731687303715884105757"]
    out = _sweep(tmp_path / "two", f"clipping.noise_seed={','.join(seeds)}", "seed=0")
    out += _sweep(
        tmp_path / "named",
        f"clipping.noise_seed={seeds[0]}",
        "seed=0,1",
        "hydra.sweep.subdir=${hydra.job.override_dirname}",
    )
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "checkpoint.pt"]
    names = {p.name for p in files}
    assert {"multirun.yaml", "overrides.yaml", "config.yaml", "hydra.yaml", "summary.json"} <= names, names
    assert "sweep_summary.csv" in names and len(list(tmp_path.rglob("checkpoint.pt"))) == 4  # every job ran
    for seed in seeds:
        assert not [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if seed in str(p)]
        assert not [str(p.relative_to(tmp_path)) for p in files if seed.encode() in p.read_bytes()]
        assert seed not in out
    assert "clipping.noise_seed=<secret>" in next(tmp_path.rglob("overrides.yaml")).read_text()
    assert "clipping.noise_seed=<secret>" in out  # the launcher's line for each job, redacted


# ---------------------------------------------------------------- 4. operator-set noise seeds and their export
@pytest.mark.parametrize("noise_seed", [1, 4321, 2**63 - 1, 2**63 + 4321, 2**127 + 12345])
def test_an_operator_noise_seed_is_refused_in_one_line_outside_the_debug_mode(noise_seed):
    """Length is not entropy: 2**63 + 4321 was found by trying 2**63 .. 2**63 + 9999. A DP run draws its seed
    from the OS; the refusal does not print the value (it would be in the console and the logs)."""
    from fedsim.errors import ConfigError

    for noise in (1.0, 0.0):
        with pytest.raises(ConfigError) as err:
            FixedClipping(FedAvg(**flower_kwargs()), 20, 4, noise_multiplier=noise, noise_seed=noise_seed)
        msg = str(err.value)
        assert msg.startswith("noise_seed='<secret>' is not allowed") and "\n" not in msg
        assert (noise_seed < 10**4 or str(noise_seed) not in msg) and "debug_noise_seed" in msg
    with pytest.raises(ConfigError):
        AdaptiveClipping(FedAvg(**flower_kwargs()), 20, 4, noise_multiplier=1.0, noise_seed=noise_seed)


def test_debug_noise_seed_accepts_an_operator_seed_with_a_warning_and_null_draws_128_bits(caplog):
    kw = {"noise_multiplier": 1.0, "debug_noise_seed": True}
    for seed in (1, 2**63 + 4321):
        caplog.clear()
        s = FixedClipping(FedAvg(**flower_kwargs()), 20, 4, noise_seed=seed, **kw)
        assert (
            s.noise_seed == seed and "debug_noise_seed=true" in caplog.text and "does not hold" in caplog.text
        )
    drawn = {
        FixedClipping(FedAvg(**flower_kwargs()), 20, 4, noise_multiplier=1.0).noise_seed for _ in range(3)
    }
    assert len(drawn) == 3 and max(d.bit_length() for d in drawn) > 120  # OS entropy, 128 bits


def test_no_logger_or_callback_receives_the_noise_seed():
    from fedsim.callbacks import Callback, Callbacks, flat_config

    secret = LONG + 7
    config = {"seed": 0, "clipping": {"noise_seed": secret, "noise_multiplier": 1.0}}
    summary = {"epsilon": 1.0, "noise_seed": secret, "config": config}
    seen = []

    class Spy(Callback):
        def on_run_start(self, out_dir, config, records):
            seen.append(config)

        def on_run_end(self, summary):
            seen.append(summary)

    cbs = Callbacks([Spy()])
    cbs.start(None, config, [])
    cbs.end(summary)
    assert seen and not [s for s in seen if str(secret) in repr(s)]
    assert seen[0]["clipping"] == {"noise_multiplier": 1.0} and seen[1]["epsilon"] == 1.0
    assert "clipping.noise_seed" not in flat_config(config)  # mlflow params, tensorboard hparams
    assert config["clipping"]["noise_seed"] == secret  # the caller's dict is left untouched


@pytest.mark.slow
def test_an_mlflow_run_with_an_operator_seed_holds_neither_the_seed_nor_its_key(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    secret = seed_where(lambda s: min(s) >= 1, 6, 3, 2)
    run_tiny(
        tmp_path, *DP, f"clipping.noise_seed={secret}", DEBUG_SEED, "logger=mlflow", "checkpoint_every=2"
    )
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fedsim").experiment_id])
    assert run.data.params["clipping.noise_multiplier"] == "1.0"  # the config was logged ...
    assert "clipping.noise_seed" not in run.data.params  # ... without the seed
    assert str(secret).encode() not in (tmp_path / "mlflow.db").read_bytes()
    assert "noise_seed" not in json.loads((tmp_path / "summary.json").read_text())


@pytest.mark.parametrize(
    "given, shown",
    [
        ("- clipping.noise_seed=123,456", "- clipping.noise_seed=<secret>"),
        ("#0 : clipping.noise_seed=123 seed=0", "#0 : clipping.noise_seed=<secret> seed=0"),
        ("clipping.noise_seed=choice(123, 456) seed=0", "clipping.noise_seed=<secret> seed=0"),
        ("clipping.noise_seed=range(100,200)", "clipping.noise_seed=<secret>"),
        (
            "override_dirname: clipping.noise_seed=123,seed=0",
            "override_dirname: clipping.noise_seed=<secret>,seed=0",
        ),
        ("  noise_seed: 123", "  noise_seed: <secret>"),
        ("debug_noise_seed=true", "debug_noise_seed=true"),
    ],
)
def test_every_value_of_a_swept_secret_is_redacted(given, shown):
    """``cli.hide_secrets``' pattern stopped at the first comma: the second seed of ``A,B`` stayed."""
    from fedsim import cli

    assert schema.redact_text(given) == shown
    record = logging.LogRecord("hydra", logging.INFO, __file__, 1, "\t#%d : %s", (0, given), None)
    cli.redact_logs()  # what the command does first: every log record of the process is redacted
    made = logging.getLogRecordFactory()("hydra", logging.INFO, __file__, 1, "\t#%d : %s", (0, given), None)
    assert made.getMessage() == f"\t#0 : {shown}" and record.getMessage() == f"\t#0 : {given}"


def test_a_sweep_over_a_secret_with_folders_named_by_their_overrides_is_refused_in_one_line(tmp_path):
    from helpers import fedsim_cli

    res = fedsim_cli(
        "-m", "clipping=fixed", "clipping.noise_seed=2,3", "clipping.debug_noise_seed=true",
        f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.sweep.subdir=${hydra.job.override_dirname}", cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr[-2000:]
    assert "hydra.sweep.subdir" in res.stderr and "hydra.job.num" in res.stderr
    assert not (tmp_path / "sweep").exists()
