"""Every strategy under clipping and under DP either runs or is refused in one line, from what each component
declares it releases (``fedsim.strategies.composition``); docs/privacy.md's table is the generated one.

The expected verdicts are written out by hand here (``DP_REFUSED``), independently of the declarations, so a
declaration that changes a verdict fails a test.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fedsim.errors import ConfigError
from fedsim.features.clipping import privacy_table
from fedsim.features.clipping.wrapper import ClippingWrapper
from fedsim.strategies import composition

try:
    from helpers import TINY, compose_cfg, run_tiny
except ImportError:
    from conftest import TINY, compose_cfg, run_tiny

ROOT = Path(__file__).resolve().parents[1]
LONG_SEED = "clipping.noise_seed=340282366920938463463374607431768211297"  # 128 bits
DP = ["clipping=fixed", "clipping.noise_multiplier=1.0", LONG_SEED, "clipping.debug_noise_seed=true"]
CLIP = ["clipping=fixed", "clipping.noise_multiplier=0"]

# What DP must refuse, and the word its reason must contain: written out by hand, not read from the code.
DP_REFUSED = {
    "scaffold": "control variate c is released without noise",
    "fednova": "without strategy.dp_tau_eff",  # privatised when it is set (tests below)
    "feddyn": "scales with the number of replies",
    "fedmedian": "robust rule",
    "fedtrimmedavg": "robust rule",
    "krum": "robust rule",
    "fedasync": "synchronous aggregation",
    "fedbuff": "synchronous aggregation",
}
ASYNC = {"fedasync", "fedbuff"}
STRATEGIES = sorted(p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml"))


def build(*overrides: str):
    """Build the experiment (everything checked before any training); the refusal, if any."""
    from fedsim.experiment import build_experiment

    try:
        build_experiment(compose_cfg(*TINY, *overrides))
    except ConfigError as e:
        return e
    return None


def test_every_shipped_strategy_has_a_hand_written_verdict():
    assert set(STRATEGIES) == set(composition.shipped_strategies())
    assert set(DP_REFUSED) <= set(STRATEGIES)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", ["clipping", "dp"])
def test_each_strategy_under_clipping_and_dp_builds_or_is_refused_in_one_line(strategy, mode):
    extra = ["strategy.concurrency=2"] if strategy in ASYNC else []
    refusal = build(f"strategy={strategy}", *extra, *(DP if mode == "dp" else CLIP))
    cls = composition.shipped_strategies()[strategy]
    derived = composition.dp_refusal(cls, ClippingWrapper.privatises, dp=mode == "dp")
    refused = strategy in ASYNC or (mode == "dp" and strategy in DP_REFUSED)
    assert (derived is not None) == refused  # the declarations give the hand-written verdict
    if not refused:
        assert refusal is None, refusal
        return
    text = str(refusal)
    assert isinstance(refusal, composition.CompositionError) and "\n" not in text
    assert re.match(rf"{'DP' if mode == 'dp' else 'clipping'} does not cover strategy={strategy}[: ]", text)
    assert (
        derived in text
        and DP_REFUSED[strategy] in text
        and re.search(r"\(expected (clipping|strategy)", text)
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s not in DP_REFUSED])
def test_each_strategy_dp_covers_runs_two_rounds_and_reports_epsilon(tmp_path, strategy):
    summary = run_tiny(tmp_path, f"strategy={strategy}", *DP, "clients_per_round=5")  # q = 5/6: never empty
    assert summary["status"] == "completed" and summary["epsilon"] > 0


@pytest.mark.slow
def test_the_cli_refuses_dp_scaffold_in_one_line(tmp_path):
    try:
        from helpers import fedsim_cli
    except ImportError:
        from conftest import fedsim_cli

    out = fedsim_cli("strategy=scaffold", "clipping=fixed", "clipping.noise_multiplier=1", cwd=tmp_path)
    assert out.returncode == 2
    line = out.stderr.strip()
    assert line.count("\n") == 0, out.stderr
    assert line.startswith(
        "fedsim: config error: DP does not cover strategy=scaffold: its control variate c is released without "
        "noise"
    )


def test_dp_scaffold_through_flower_classes_is_refused_too():
    """The check works on objects, not config names: a user's own SCAFFOLD subclass is refused as well."""
    from strategy_helpers import flower_kwargs

    from fedsim.features.clipping.server import FixedClipping
    from fedsim.features.scaffold.client import Scaffold as ScaffoldClient
    from fedsim.features.scaffold.server import Scaffold

    class MyScaffold(Scaffold):
        pass

    wrapped = FixedClipping(MyScaffold(num_clients=10, **flower_kwargs()), 10, 3, noise_multiplier=1.0)
    with pytest.raises(
        composition.CompositionError, match="DP does not cover strategy=myscaffold: its control"
    ):
        composition.check(wrapped, ScaffoldClient, "sgd")
    clip_only = FixedClipping(MyScaffold(num_clients=10, **flower_kwargs()), 10, 3, noise_multiplier=0.0)
    composition.check(clip_only, ScaffoldClient, "sgd")  # clipping alone claims nothing: it runs


def test_a_client_algorithm_that_sends_raw_values_is_refused_under_dp_with_fedavg():
    from strategy_helpers import flower_kwargs

    from fedsim.algorithms.base import LocalSGD
    from fedsim.features.clipping.server import FixedClipping
    from fedsim.strategies.fedavg import FedAvg

    class Leaky(LocalSGD):
        sends = (("its raw gradient norms", "raw"),)

    wrapped = FixedClipping(FedAvg(**flower_kwargs()), 10, 3, noise_multiplier=1.0)
    composition.check(wrapped, LocalSGD, "sgd")
    with pytest.raises(
        composition.CompositionError, match=r"client._target_=.*Leaky: its raw gradient norms"
    ):
        composition.check(wrapped, Leaky, "sgd")


def test_dp_fednova_with_a_public_tau_eff_builds():
    assert build("strategy=fednova", "strategy.dp_tau_eff=4", *DP) is None
    assert build("strategy=fednova", "strategy.dp_tau_eff=0", *DP).key == "strategy.dp_tau_eff"


@pytest.mark.parametrize("optimizer", ["momentum", "nesterov", "adam", "asgd"])
def test_fednova_refuses_local_optimisers_its_normaliser_does_not_model(optimizer):
    refusal = build("strategy=fednova", f"client.optimizer={optimizer}")
    assert isinstance(refusal, composition.CompositionError)
    assert str(refusal).startswith(f"strategy=fednova does not cover client.optimizer={optimizer}: ")
    assert "(expected client.optimizer=sgd)" in str(refusal) and "\n" not in str(refusal)
    assert build("strategy=fedavg", f"client.optimizer={optimizer}") is None  # FedAvg assumes nothing


def test_the_privacy_pages_table_is_the_generated_one():
    readme = (ROOT / "docs" / "privacy.md").read_text()
    assert privacy_table.readme_table(readme) == privacy_table.privacy_table()
    table = privacy_table.privacy_table()
    for strategy in STRATEGIES:  # one row per shipped strategy, with the hand-written verdict
        row = next(r for r in table.splitlines() if r.startswith(f"| `strategy={strategy}` |"))
        dp_cell = row.rstrip(" |").rsplit("|", 1)[1].strip()
        if strategy == "fednova":  # privatised with a public tau_eff, refused without one
            assert dp_cell.startswith("privatised") and "refused without" in dp_cell, row
            continue
        assert dp_cell.startswith("refused") == (strategy in DP_REFUSED), row
    assert re.search(r"client._target_=fedsim.features.scaffold.client.Scaffold` .*\| refused", table)


def test_two_wrappers_that_both_draw_the_cohort_are_refused_from_their_declarations():
    refusal = build("selection=power_of_choice", "clipping=fixed")
    assert isinstance(refusal, composition.CompositionError) and refusal.key == "selection"
    assert str(refusal).startswith(
        "selection=power_of_choice does not compose with clipping=fixed: both draw"
    )
    assert build("selection=power_of_choice") is None and build("clipping=fixed") is None


# ---------------------------------------------------------------- FedNova under DP: normalised updates clipped
def _fednova_release(replies, taus, tau_pub=4.0, z=1.0, c=0.5, m=3, noise_seed=2**100 + 5, server_lr=0.5):
    from strategy_helpers import flower_kwargs, make_reply, run_round

    from fedsim.features.clipping.server import FixedClipping
    from fedsim.strategies.fednova import FedNova

    x = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    nova = FedNova(server_lr=server_lr, dp_tau_eff=tau_pub, **flower_kwargs())
    s = FixedClipping(
        nova,
        10,
        m,
        clip_norm=c,
        noise_multiplier=z,
        noise_seed=noise_seed,
        sampling="fixed",
        debug_noise_seed=True,
    )
    msgs = [make_reply(y, 7 * (i + 1), i, num_steps=t) for i, (y, t) in enumerate(zip(replies, taus))]
    out, metrics = run_round(s, 1, x, msgs)
    return x, out, metrics


def test_dp_fednova_releases_the_public_tau_eff_times_the_noised_mean_of_clipped_normalised_updates():
    """Hand oracle: x + lr * tau_pub * (sum_k clip((y_k - x) / tau_k, C) / m + xi), xi drawn from the noise seed
    as the wrapper draws it; uniform weights whatever num-examples and tau_k say."""
    from fedsim.features.clipping.wrapper import SECRET_TAG, UPDATE_NOISE

    rng = np.random.default_rng(1)
    ys = [{"w": rng.normal(size=(2, 3)) * s, "b": rng.normal(size=3) * s} for s in (0.01, 3.0, 20.0)]
    taus = [1, 4, 10]
    x, out, metrics = _fednova_release(ys, taus)
    c, m, z, lr, tau_pub = 0.5, 3, 1.0, 0.5, 4.0

    def clip(d):
        norm = np.sqrt(sum(float(np.sum(v**2)) for v in d.values()))
        return {k: v * min(1.0, c / norm) for k, v in d.items()}

    total = {k: sum(clip({q: y[q] / t for q in y})[k] for y, t in zip(ys, taus)) for k in x}
    noise_rng = np.random.default_rng([2**100 + 5, SECRET_TAG, UPDATE_NOISE, 1])
    xi = {k: noise_rng.normal(0.0, z * c / m, np.shape(x[k])) for k in x}
    for k in x:
        want = lr * tau_pub * (total[k] / m + xi[k])
        np.testing.assert_allclose(out[k], want.astype(np.float32), rtol=1e-5, atol=1e-6)
    assert metrics["noise-std"] == pytest.approx(z * c / m)


def test_dp_fednova_one_client_moves_the_release_by_at_most_lr_tau_pub_c_over_m():
    """The sensitivity the noise is calibrated to: dropping any one client (however few steps it took and however
    large its update) moves the release by at most lr * tau_pub * C / m (same round, same noise)."""
    rng = np.random.default_rng(2)
    ys = [{"w": rng.normal(size=(2, 3)) * 50, "b": rng.normal(size=3) * 50} for _ in range(3)]
    taus = [1, 1, 30]  # the audit's case: few-step clients weighted up by tau_eff / tau_i
    _, full, _ = _fednova_release(ys, taus)
    for k in range(3):
        _, without, _ = _fednova_release(ys[:k] + ys[k + 1 :], taus[:k] + taus[k + 1 :])
        moved = np.sqrt(sum(float(np.sum((full[q].astype(np.float64) - without[q]) ** 2)) for q in full))
        assert moved <= 0.5 * 4.0 * 0.5 / 3 * (1 + 1e-5)


@pytest.mark.slow
def test_dp_fednova_epsilon_equals_dp_accounting_at_the_noise_multiplier(tmp_path):
    """Clipping the normalised update keeps one client's influence at C/m, so the effective noise multiplier is
    z itself: epsilon per round equals dp-accounting's Poisson-sampled Gaussian at z, called directly."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant
    from helpers import read_metrics

    n, m, z = 6, 5, 1.5
    run_tiny(
        tmp_path, "strategy=fednova", "strategy.dp_tau_eff=4", "client.local_steps=4", "clipping=fixed",
        f"clipping.noise_multiplier={z}", LONG_SEED, "clipping.debug_noise_seed=true", f"num_clients={n}",
        f"clients_per_round={m}", "num_rounds=2",
    )  # fmt: skip
    for r in read_metrics(tmp_path)[1:]:
        if "epsilon" not in r:
            continue  # an empty Poisson cohort: charged, reported with the next round
        event = dp_accounting.PoissonSampledDpEvent(m / n, dp_accounting.GaussianDpEvent(z))
        want = RdpAccountant().compose(dp_accounting.SelfComposedDpEvent(event, r["round"])).get_epsilon(1e-5)
        assert r["epsilon"] == pytest.approx(want, abs=5e-4)
