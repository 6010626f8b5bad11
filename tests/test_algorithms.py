"""Client algorithms (fedsim.algorithms): the contract, per-client state, and SCAFFOLD against a hand oracle."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import compose_cfg, read_metrics, run_tiny, without_wall_time
from torch.nn import functional as F

from fedsim import build
from fedsim.algorithms import state as client_state
from fedsim.algorithms.base import LocalSGD
from fedsim.algorithms.state import DirectoryState
from fedsim.errors import ConfigError

N, K, LR, LR_G = 3, 2, 0.1, 0.5
SCAFFOLD = [
    "strategy=scaffold",
    f"strategy.server_lr={LR_G}",
    "model=logreg",
    f"num_clients={N}",
    f"clients_per_round={N}",
    "client.batch_size=0",  # full batch: the oracle needs no minibatch order
    f"client.local_steps={K}",
    f"client.lr={LR}",
    "checkpoint_every=0",
]


def _scaffold_oracle(rounds: int) -> dict[str, torch.Tensor]:
    """SCAFFOLD option II by hand: full-batch local GD with the control-variate correction."""
    spec = json.loads(build.client_spec(compose_cfg(*SCAFFOLD), "cpu"))
    ds, (train, _) = build.build_dataset(spec), build.build_partitions(spec)
    model = build.build_initial_model(spec)
    x = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
    c = {k: torch.zeros_like(v) for k, v in x.items()}
    c_i = [{k: torch.zeros_like(v) for k, v in x.items()} for _ in range(N)]
    for _ in range(rounds):
        ys, dcs = [], []
        for pid in range(N):
            xb = torch.as_tensor(ds.x_train[train[pid]]).double().flatten(1)
            yb = torch.as_tensor(ds.y_train[train[pid]])
            w = {k: v.clone().requires_grad_() for k, v in x.items()}
            for _ in range(K):
                loss = F.cross_entropy(F.linear(xb, w["1.weight"], w["1.bias"]), yb)
                grads = torch.autograd.grad(loss, list(w.values()))
                with torch.no_grad():
                    for (k, p), g in zip(w.items(), grads):
                        p -= LR * (g + c[k] - c_i[pid][k])
            new_ci = {k: c_i[pid][k] - c[k] + (x[k] - w[k].detach()) / (K * LR) for k in x}
            dcs.append({k: new_ci[k] - c_i[pid][k] for k in x})
            c_i[pid] = new_ci
            ys.append({k: v.detach() for k, v in w.items()})
        x = {k: x[k] + LR_G * torch.stack([y[k] - x[k] for y in ys]).mean(0) for k in x}
        c = {k: c[k] + sum(dc[k] for dc in dcs) / N for k in x}
    return x


def test_scaffold_matches_the_hand_oracle(tmp_path):
    run_tiny(tmp_path, *SCAFFOLD, "num_rounds=2")
    model = torch.load(tmp_path / "model.pt")
    oracle = _scaffold_oracle(2)
    for k in oracle:
        torch.testing.assert_close(model[k].double(), oracle[k], rtol=1e-4, atol=1e-5)
    # the control variates change round 2: without them it would be another model
    plain = run_tiny(tmp_path / "fedavg", *[o for o in SCAFFOLD if "strategy" not in o], "num_rounds=2")
    assert plain["status"] == "completed"
    other = torch.load(tmp_path / "fedavg" / "model.pt")
    assert not torch.allclose(other["1.weight"].double(), oracle["1.weight"], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["scaffold", "ditto"])
def test_resume_is_bit_identical_with_the_client_state(tmp_path, strategy):
    over = [f"strategy={strategy}", *SCAFFOLD[2:-1], "client.batch_size=8", "client.local_steps=3"]
    over += ["checkpoint_every=2", "federated_eval=true"]
    run_tiny(tmp_path / "full", *over, "num_rounds=4")
    run_tiny(tmp_path / "part", *over, "num_rounds=2")
    run_tiny(tmp_path / "resumed", *over, "num_rounds=4", f"resume={tmp_path / 'part'}")
    assert without_wall_time(read_metrics(tmp_path / "full")) == without_wall_time(
        read_metrics(tmp_path / "resumed")
    )
    a, b = torch.load(tmp_path / "full" / "model.pt"), torch.load(tmp_path / "resumed" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "part" / "checkpoint_state" / "round-2").is_dir()


def test_directory_state_reads_the_newest_version_before_the_task(tmp_path):
    DirectoryState(tmp_path, 7, 1).save({"a": np.ones(2)})
    DirectoryState(tmp_path, 7, 3).save({"a": np.full(2, 3.0)})
    assert DirectoryState(tmp_path, 7, 1).load() == {}  # round 1 re-run after an interrupt: its own start
    assert DirectoryState(tmp_path, 7, 3).load()["a"].tolist() == [1.0, 1.0]
    assert DirectoryState(tmp_path, 7, 4).load()["a"].tolist() == [3.0, 3.0]
    assert DirectoryState(tmp_path, 8, 4).load() == {}  # another client
    for v in (4, 5, 6):
        DirectoryState(tmp_path, 7, v).save({"a": np.full(2, float(v))})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["7-4.npz", "7-5.npz", "7-6.npz"]  # bounded on disk


def test_client_state_checkpoint_and_resume_drop_an_abandoned_future(tmp_path):
    run = tmp_path / "run"
    for v in (1, 2, 3):
        DirectoryState(run / client_state.STATE_DIR, 0, v).save({"a": np.full(1, float(v))})
    client_state.checkpoint(run, 2)
    new = tmp_path / "new"
    client_state.resume(run, 2, new)
    assert DirectoryState(new / client_state.STATE_DIR, 0, 3).load()["a"].tolist() == [2.0]
    assert DirectoryState(new / client_state.STATE_DIR, 0, 9).load()["a"].tolist() == [
        2.0
    ]  # version 3 is gone


@pytest.mark.slow
def test_scaffold_clients_fall_back_from_the_vectorized_engine(tmp_path):
    a = run_tiny(tmp_path / "seq", *SCAFFOLD, "num_rounds=2")
    b = run_tiny(tmp_path / "vec", *SCAFFOLD, "num_rounds=2", "engine=vectorized")
    assert a["final_eval_accuracy"] == b["final_eval_accuracy"]


def test_a_strategy_gets_its_client_half_and_bad_pairs_are_one_line(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^client._target_='fedsim.features.scaffold.client.Scaffold' .*needs strategy"
    ):
        run_tiny(tmp_path / "a", "+client._target_=fedsim.features.scaffold.client.Scaffold")
    with pytest.raises(
        ConfigError, match=r"^client._target_='nope.Algo' is not allowed: expected a client algorithm"
    ):
        run_tiny(tmp_path / "b", "+client._target_=nope.Algo")
    with pytest.raises(ConfigError, match=r"^client.bogus=1 is not allowed: expected an optimiser setting"):
        run_tiny(tmp_path / "c", "+client.bogus=1")
    with pytest.raises(
        ConfigError, match=r"^strategy=.*synchronous strategy with a stateful client algorithm"
    ):
        run_tiny(tmp_path / "d", "strategy=fedbuff", "+client._target_=test_algorithms.KeepsState")
    assert not (tmp_path / "a" / "metrics.jsonl").exists()


class KeepsState(LocalSGD):
    """A user's stateful algorithm with no strategy of its own (counts its tasks)."""

    stateful, batched = True, False

    def after_training(self, run):
        super().after_training(run)
        run.state = {"tasks": np.asarray(run.state.get("tasks", 0)) + 1}


@pytest.mark.slow
def test_a_users_stateful_algorithm_keeps_its_state_per_client(tmp_path):
    run_tiny(tmp_path, "+client._target_=test_algorithms.KeepsState", "num_rounds=3")
    counts = {}
    for f in (tmp_path / "client_state").iterdir():
        pid, version = (int(x) for x in f.stem.split("-"))
        with np.load(f) as z:
            counts[(pid, version)] = int(z["tasks"])
    for pid in {p for p, _ in counts}:
        versions = sorted(v for p, v in counts if p == pid)
        assert [counts[(pid, v)] for v in versions] == list(range(1, len(versions) + 1))


def test_local_sgd_is_the_default_client_algorithm():
    spec = json.loads(build.client_spec(compose_cfg(), "cpu"))
    algo = build.client_algorithm(spec)
    assert (
        type(algo) is LocalSGD
        and algo.batched
        and not algo.stateful
        and algo.local == build.local_training(spec)
    )


# ---------------------------------------------------------------------------------------------------- FedNova
def test_fednova_normalises_by_local_steps_by_hand():
    from strategy_helpers import make_reply, numpy_of

    from fedsim.strategies.fednova import FedNova

    x = {"w": np.array([1.0, 2.0])}
    y1, y2 = {"w": np.array([0.0, 2.0])}, {"w": np.array([1.0, 0.0])}  # 4 steps, 1 step
    s = FedNova(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    s.current = x
    replies = [
        make_reply(y1, num_examples=1, num_steps=4),
        make_reply(y2, num_examples=3, partition_id=1, num_steps=1),
    ]
    out, _ = s.aggregate_train(1, replies)
    p = np.array([0.25, 0.75])
    tau_eff = 0.25 * 4 + 0.75 * 1
    expect = x["w"] - tau_eff * (p[0] * (x["w"] - y1["w"]) / 4 + p[1] * (x["w"] - y2["w"]) / 1)
    np.testing.assert_allclose(numpy_of(out)["w"], expect)
    fedavg = 0.25 * y1["w"] + 0.75 * y2["w"]
    assert not np.allclose(expect, fedavg)  # FedAvg lets the 4-step client pull harder
    s.current = x  # equal steps: FedNova is FedAvg
    same, _ = s.aggregate_train(2, [make_reply(y1, 1, num_steps=2), make_reply(y2, 3, 1, num_steps=2)])
    np.testing.assert_allclose(numpy_of(same)["w"], fedavg)


# ---------------------------------------------------------------------------------------------------- FedDyn
ALPHA = 0.1
FEDDYN = ["strategy=feddyn", f"strategy.alpha={ALPHA}", *SCAFFOLD[2:]]


def _feddyn_oracle(rounds: int) -> dict[str, torch.Tensor]:
    spec = json.loads(build.client_spec(compose_cfg(*FEDDYN), "cpu"))
    ds, (train, _) = build.build_dataset(spec), build.build_partitions(spec)
    x = {k: v.detach().double().clone() for k, v in build.build_initial_model(spec).state_dict().items()}
    h = {k: torch.zeros_like(v) for k, v in x.items()}
    g = [{k: torch.zeros_like(v) for k, v in x.items()} for _ in range(N)]
    for _ in range(rounds):
        ws = []
        for pid in range(N):
            xb = torch.as_tensor(ds.x_train[train[pid]]).double().flatten(1)
            yb = torch.as_tensor(ds.y_train[train[pid]])
            w = {k: v.clone().requires_grad_() for k, v in x.items()}
            for _ in range(K):
                loss = F.cross_entropy(F.linear(xb, w["1.weight"], w["1.bias"]), yb)
                grads = torch.autograd.grad(loss, list(w.values()))
                with torch.no_grad():
                    for (k, p), gr in zip(w.items(), grads):
                        p -= LR * (gr - g[pid][k] + ALPHA * (p - x[k]))
            g[pid] = {k: g[pid][k] - ALPHA * (w[k].detach() - x[k]) for k in x}
            ws.append({k: v.detach() for k, v in w.items()})
        h = {k: h[k] - ALPHA / N * sum(w[k] - x[k] for w in ws) for k in x}
        x = {k: torch.stack([w[k] for w in ws]).mean(0) - h[k] / ALPHA for k in x}
    return x


@pytest.mark.slow
def test_feddyn_matches_the_hand_oracle(tmp_path):
    run_tiny(tmp_path, *FEDDYN, "num_rounds=2")
    model = torch.load(tmp_path / "model.pt")
    oracle = _feddyn_oracle(2)
    for k in oracle:
        torch.testing.assert_close(model[k].double(), oracle[k], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- Ditto, FedPer
LAM = 0.5
DITTO = ["strategy=ditto", f"strategy.lam={LAM}", *SCAFFOLD[2:]]


def _client_data(over):
    spec = json.loads(build.client_spec(compose_cfg(*over), "cpu"))
    ds, (train, _) = build.build_dataset(spec), build.build_partitions(spec)
    x0 = {k: v.detach().double().clone() for k, v in build.build_initial_model(spec).state_dict().items()}
    data = [
        (torch.as_tensor(ds.x_train[train[p]]).double().flatten(1), torch.as_tensor(ds.y_train[train[p]]))
        for p in range(N)
    ]
    return x0, data


def _gd(w0, xb, yb, steps, extra=lambda k, p: 0.0):
    w = {k: v.clone().requires_grad_() for k, v in w0.items()}
    for _ in range(steps):
        loss = F.cross_entropy(F.linear(xb, w["1.weight"], w["1.bias"]), yb)
        grads = torch.autograd.grad(loss, list(w.values()))
        with torch.no_grad():
            for (k, p), g in zip(w.items(), grads):
                p -= LR * (g + extra(k, p))
    return {k: v.detach() for k, v in w.items()}


@pytest.mark.slow
def test_ditto_personal_models_match_the_hand_oracle(tmp_path):
    run_tiny(tmp_path, *DITTO, "num_rounds=1")
    x0, data = _client_data(DITTO)
    for pid, (xb, yb) in enumerate(data):
        # round 1: v starts at the received global model and is pulled toward it with weight lambda
        v = _gd(x0, xb, yb, K, extra=lambda k, p: LAM * (p - x0[k]))
        with np.load(tmp_path / "client_state" / f"{pid}-1.npz") as f:
            for k in v:
                np.testing.assert_allclose(f["v/" + k], v[k].numpy(), rtol=1e-4, atol=1e-5)
    # the global model is FedAvg of plain local GD (example-weighted)
    ys = [_gd(x0, xb, yb, K) for xb, yb in data]
    n = np.array([len(yb) for _, yb in data], float)
    model = torch.load(tmp_path / "model.pt")
    for k in x0:
        expect = sum(w * y[k] for w, y in zip(n / n.sum(), ys))
        torch.testing.assert_close(model[k].double(), expect, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_fedper_keeps_the_head_on_the_clients(tmp_path):
    over = ["strategy=fedper", "strategy.personal_layers=[1.bias]", *SCAFFOLD[2:]]
    run_tiny(tmp_path, *over, "num_rounds=2")
    x0, data = _client_data(over)
    model = torch.load(tmp_path / "model.pt")
    torch.testing.assert_close(model["1.bias"].double(), x0["1.bias"])  # the server never moves the head
    assert not torch.allclose(model["1.weight"].double(), x0["1.weight"])  # the base is trained and averaged
    heads = []
    for pid in range(N):
        with np.load(tmp_path / "client_state" / f"{pid}-2.npz") as f:
            assert sorted(f.files) == ["head/1.bias"]
            heads.append(f["head/1.bias"])
    assert not np.allclose(heads[0], heads[1])  # each client its own head


@pytest.mark.slow
def test_personal_evaluation_reports_mean_and_tenth_percentile(tmp_path):
    run_tiny(tmp_path, "strategy=ditto", "federated_eval=true", "num_rounds=2")
    rec = read_metrics(tmp_path)[-1]
    assert 0 <= rec["personal_eval_accuracy_p10"] <= rec["personal_eval_accuracy"] <= 1


def test_personal_layers_that_are_not_in_the_model_are_one_line(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^strategy.personal_layers=\['head'\] is not allowed: .*'head' matches none"
    ):
        run_tiny(tmp_path, "strategy=fedper", "strategy.personal_layers=[head]")
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_per_client_state_on_the_ray_engine_matches_the_run_folders_store(tmp_path):
    """On Ray each client's state lives in Flower's ``Context.state`` (as on a SuperNode), not in the run folder;
    SCAFFOLD with clients that skip rounds and come back gives the inprocess engine's results."""
    over = ["strategy=scaffold", "num_clients=6", "clients_per_round=3", "num_rounds=4", "seed=3"]
    over += ["placement.num_cpus_per_client=1", "checkpoint_every=0"]
    run_tiny(tmp_path / "inproc", "engine=inprocess", *over)
    summary = run_tiny(tmp_path / "ray", "engine=ray", *over)
    assert summary["engine"] == "ray" and summary["rounds_done"] == 4
    assert (tmp_path / "inproc" / "client_state").is_dir() and not (
        tmp_path / "ray" / "client_state"
    ).exists()
    a, b = (
        without_wall_time(read_metrics(tmp_path / "inproc")),
        without_wall_time(read_metrics(tmp_path / "ray")),
    )
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["round"], k)
    ma, mb = torch.load(tmp_path / "inproc" / "model.pt"), torch.load(tmp_path / "ray" / "model.pt")
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=1e-5, atol=1e-6)
