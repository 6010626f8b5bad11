"""DP rounds without a valid reply (issue 30): an empty Poisson cohort, or a round whose every reply failed, still
releases what the analysed mechanism releases, the global model plus that round's Gaussian noise, and is charged
exactly once; without noise such a round keeps the model.

The oracles draw the noise by hand from the documented derivation (numpy's generator seeded with
``[noise_seed, SECRET_TAG, purpose, round]``, std ``z C / m``) and compute epsilon with dp-accounting directly.
"""

from __future__ import annotations

from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting import NeighboringRelation
from dp_accounting.rdp import RdpAccountant
from flwr.app import ConfigRecord, Error, Message, RecordDict
from strategy_helpers import (
    FakeGrid,
    configure,
    flower_kwargs,
    make_replies,
    numpy_of,
    record,
    server_identity,
)

from fedsim import keys, schema
from fedsim.errors import RunError
from fedsim.features.clipping.server import AdaptiveClipping, FixedClipping
from fedsim.features.clipping.wrapper import COHORT, COUNT_NOISE, SECRET_TAG, UPDATE_NOISE
from fedsim.strategies.fedavg import FedAvg
from fedsim.strategies.fedavgm import FedAvgM

try:  # the tiny-run helpers: tests/helpers.py, formerly tests/conftest.py
    from helpers import read_metrics, run_tiny
except ImportError:
    from conftest import read_metrics, run_tiny

G = {"w": np.full((3, 4), 0.5, np.float32), "b": np.zeros(4, np.float32), "n": np.array(7, np.int64)}
N, M, Z, C = 6, 3, 1.0, 0.5  # q = 0.5: an empty cohort 1 round in 64
LONG = 0x9E3779B97F4A7C15F39CC0605CEDC834  # a 128-bit base for the noise seeds set here


def _empty_round_one(noise_seed: int) -> bool:
    """Round 1's Poisson cohort is empty: each client joins when its uniform draw is below q (by hand)."""
    u = np.random.default_rng([noise_seed, SECRET_TAG, COHORT, 1]).random(N)
    return not np.any(u < M / N)


NS = next(LONG + k for k in range(2000) if _empty_round_one(LONG + k))


def _wrapper(cls=FixedClipping, inner=None, z=Z, **kw):
    inner = inner or FedAvg(**flower_kwargs())
    clip = {"clip_norm": C} if cls is FixedClipping else {"initial_clip_norm": C}
    seed = {"noise_seed": NS, "debug_noise_seed": True} if z else {}
    return cls(inner, N, M, **clip, noise_multiplier=z, **seed, **kw)


def _hand_release(std: float, rnd: int = 1) -> dict[str, np.ndarray]:
    """G plus N(0, std^2) on every floating-point array, drawn in the model's order, cast back to float32."""
    rng = np.random.default_rng([NS, SECRET_TAG, UPDATE_NOISE, rnd])
    out = {k: a.copy() for k, a in G.items()}
    for k, a in G.items():
        if a.dtype.kind == "f":
            out[k] = (a.astype(np.float64) + rng.normal(0.0, std, a.shape)).astype(a.dtype)
    return out


def _direct_epsilon(rounds: int) -> float:
    event = dp_accounting.PoissonSampledDpEvent(M / N, dp_accounting.GaussianDpEvent(Z))
    acc = RdpAccountant(neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
    return acc.compose(dp_accounting.SelfComposedDpEvent(event, rounds)).get_epsilon(1e-5)


def _configure_empty(s, rnd: int) -> list:
    with server_identity():
        return list(s.configure_train(rnd, record(G), ConfigRecord({}), FakeGrid([])))


def _failed_reply() -> Message:
    """An error reply (the client raised), as Flower's grid hands it back."""
    with server_identity():
        ins = Message(RecordDict({keys.CONFIG: ConfigRecord({})}), dst_node_id=100, message_type="train")
    ins.metadata.__dict__["_message_id"] = "error-instruction"
    return Message(Error(2, "<class 'ValueError'>:<'client broke'>"), reply_to=ins)


@pytest.mark.parametrize("inner", ["fedavg", "fedavgm"])
def test_an_empty_poisson_round_releases_the_model_plus_the_hand_drawn_noise(inner):
    strategy = (
        FedAvg(**flower_kwargs()) if inner == "fedavg" else FedAvgM(**flower_kwargs(), server_momentum=0.9)
    )
    s = _wrapper(inner=strategy)
    assert s.sample_cohort(1, N, M) == []
    assert _configure_empty(s, 1) == []  # nothing is sent
    out, metrics = s.aggregate_train(1, [])
    # a server optimiser's first step from x on the pseudo-gradient -xi lands on x + xi as well
    want = _hand_release(Z * C / M)
    got = numpy_of(out)
    for k in G:
        assert got[k].dtype == G[k].dtype
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-7)
    assert not np.array_equal(got["w"], G["w"]) and got["n"] == 7
    assert metrics[keys.AGG_NOISE_STD] == pytest.approx(Z * C / M)
    assert metrics[keys.AGG_EPSILON] == pytest.approx(_direct_epsilon(1), abs=1e-9)
    assert keys.TRAIN_LOSS not in metrics and keys.AGG_CLIPPED_FRACTION not in metrics
    assert s.rounds_accounted == 1


def test_adaptive_clipping_noises_an_empty_count_in_the_same_shape():
    s = _wrapper(AdaptiveClipping)
    assert s.sample_cohort(1, N, M) == [] and _configure_empty(s, 1) == []
    out, metrics = s.aggregate_train(1, [])
    sigma_b = max(M / 20, Z)
    z_delta = (Z**-2 - (2 * sigma_b) ** -2) ** -0.5
    got = numpy_of(out)
    np.testing.assert_allclose(got["w"], _hand_release(z_delta * C / M)["w"], rtol=0, atol=1e-7)
    # (sum over no reply of (b_k - 1/2) + noise) / m + 1/2, the count query of every other round
    count_noise = np.random.default_rng([NS, SECRET_TAG, COUNT_NOISE, 1]).normal(0.0, sigma_b)
    frac = count_noise / M + 0.5
    assert metrics[keys.AGG_NOISY_UNCLIPPED_FRACTION] == pytest.approx(frac)
    assert s.clip_norm == pytest.approx(C * np.exp(-0.2 * (frac - 0.5)))


@pytest.mark.parametrize("z", [Z, 0.0])
def test_a_round_whose_every_reply_failed_is_noised_with_dp_and_kept_without(z):
    s = _wrapper(z=z)
    cohort = s.sample_cohort(1, N, M)
    configure(s, 1, G, num_nodes=max(1, len(cohort)))
    out, metrics = s.aggregate_train(1, [_failed_reply()])
    assert s.error_replies == 1
    if z == 0:  # nothing private: the loop keeps the model (skipped round)
        assert (out, metrics) == (None, None)
        return
    np.testing.assert_allclose(numpy_of(out)["w"], _hand_release(Z * C / M)["w"], rtol=0, atol=1e-7)
    assert metrics[keys.AGG_NOISE_STD] == pytest.approx(Z * C / M)


def test_every_round_is_charged_exactly_once_however_it_ends():
    """Round 1 empty, 2 with replies, 3 every reply failed, 4 with replies: epsilon after 4 is dp-accounting's
    for 4 steps."""
    s = _wrapper()
    models = [
        {k: (a + 0.01 * (i + 1)).astype(a.dtype) if a.dtype.kind == "f" else a for k, a in G.items()}
        for i in range(3)
    ]
    for rnd in range(1, 5):
        cohort = s.sample_cohort(rnd, N, M)
        if rnd == 1:
            assert cohort == [] and _configure_empty(s, rnd) == []
            replies = []
        else:
            configure(s, rnd, G, num_nodes=max(1, len(cohort)))
            replies = [_failed_reply()] if rnd == 3 else make_replies(models)
        out, metrics = s.aggregate_train(rnd, replies)
        assert out is not None and s.rounds_accounted == rnd
        assert metrics[keys.AGG_EPSILON] == pytest.approx(_direct_epsilon(rnd), abs=1e-9)
    assert s.summary_fields()["final_epsilon"] == pytest.approx(_direct_epsilon(4), abs=1e-9)


@pytest.mark.slow
def test_a_run_whose_every_reply_fails_is_noised_with_dp_and_keeps_its_model_without(tmp_path):
    faults = [
        "faults=mixed",
        "faults.error=1.0",
        "faults.timeout=0",
        "faults.nan=0",
        "faults.shape=0",
        "faults.dtype=0",
    ]
    fixed = [
        "clipping=fixed",
        "clipping.clip_norm=0.5",
        "clipping.sampling=fixed",
        "clipping.noise_seed=" + str(NS),
        "clipping.debug_noise_seed=true",
    ]
    for z in (1.0, 0.0):
        out = tmp_path / f"z{z}"
        over = [*faults, *fixed, f"clipping.noise_multiplier={z}"]
        if z == 0:
            over.remove("clipping.noise_seed=" + str(NS))
        with pytest.raises(RunError, match="no round aggregated an update"):  # no client contributed
            run_tiny(out, *over)
        recs = read_metrics(out)
        assert [r["failures"] for r in recs[1:]] == [M, M] and all(r["num_clients"] == 0 for r in recs[1:])
        losses = [r["eval_loss"] for r in recs]
        if z:  # every round released the model plus its noise, charged once
            assert not any(r.get("skipped") for r in recs[1:])
            assert (
                len(set(losses)) == 3
                and [r["noise_std"] for r in recs[1:]] == [pytest.approx(z * 0.5 / M)] * 2
            )
            assert recs[-1]["epsilon"] > recs[1]["epsilon"] > 0
        else:  # skipped: the model is kept
            assert all(r.get("skipped") for r in recs[1:]) and len(set(losses)) == 1


def test_the_privacy_page_names_every_field_a_dp_run_writes_outside_the_guarantee():
    readme = (Path(__file__).resolve().parents[1] / "docs" / "privacy.md").read_text()
    section = readme[readme.index("- **Not covered**") : readme.index("Covered, as post-processing")]
    missing = [f for f in schema.DP_NOT_COVERED if f"`{f}`" not in section]
    assert not missing, missing
    covered = readme[readme.index("Covered, as post-processing") :][:400]
    assert all(f"`{f}`" in covered for f in schema.DP_COVERED if f != "round")
