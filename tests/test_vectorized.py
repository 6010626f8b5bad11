"""The vectorized engine trains a cohort as one batched model and matches the sequential ClientApp."""

import json
import logging

import pytest
import torch
from helpers import compose_cfg, read_metrics, run_tiny, without_wall_time
from torch import nn

from fedsim import build
from fedsim.engines import vectorized
from fedsim.training import LocalTraining, num_local_steps

# Dirichlet(0.5) over 6 clients gives uneven sizes; batch 16 leaves partial last batches.
CASES = {
    "sgd": [],
    "momentum-nesterov-wd": ["client=momentum", "client.optimizer=nesterov", "client.weight_decay=0.01"],
    "fedprox-momentum": ["strategy=fedprox", "strategy.proximal_mu=0.5", "client=momentum"],
    "fullbatch-steps": ["client=fedsgd", "client.local_steps=3"],
    "fewer-steps-than-data": ["client.local_steps=2", "client=momentum"],  # x holds only the rows taken
    "client-side-dp": [
        "clipping=fixed",
        "clipping.side=client",
        "clipping.clip_norm=0.05",
        "clipping.noise_multiplier=0.5",
        "clipping.noise_seed=4242",
        "clipping.sampling=fixed",
        "clipping.debug_noise_seed=true",
        "clipping.debug_metrics=true",
    ],
}


@pytest.fixture
def batched_clients(monkeypatch):
    """Count the clients trained by the batched path (not the ClientApp fallback)."""
    seen = []
    original = vectorized._train_bucket

    def counting(members, *args):
        seen.extend(c.task.partition_id for c in members)
        return original(members, *args)

    monkeypatch.setattr(vectorized, "_train_bucket", counting)
    return seen


def _close(a_dir, b_dir, rel=1e-5, atol=1e-5):
    a, b = without_wall_time(read_metrics(a_dir)), without_wall_time(read_metrics(b_dir))
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=rel, abs=atol), (ra["round"], k)
    ma, mb = torch.load(a_dir / "model.pt"), torch.load(b_dir / "model.pt")
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=rel, atol=atol)


def test_setting_has_uneven_clients_and_partial_batches():
    spec = json.loads(build.client_spec(compose_cfg("num_clients=6"), "cpu"))
    sizes = [len(t) for t in build.build_partitions(spec)[0]]
    assert len(set(sizes)) > 1
    assert any(s % 16 for s in sizes)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_sequential_inprocess(tmp_path, case, batched_clients):
    over = ["num_rounds=3", *CASES[case]]
    run_tiny(tmp_path / "seq", "engine=inprocess", *over)
    assert not batched_clients
    summary = run_tiny(tmp_path / "vec", "engine=vectorized", *over)
    assert summary["engine"] == "vectorized"
    assert len(batched_clients) == 9  # 3 rounds x 3 clients, all batched
    _close(tmp_path / "seq", tmp_path / "vec")


@pytest.mark.slow
def test_unsupported_optimizer_falls_back_to_the_client_app(tmp_path, batched_clients):
    run_tiny(tmp_path / "seq", "client=adam", "engine=inprocess")
    run_tiny(tmp_path / "vec", "client=adam", "engine=vectorized")
    assert not batched_clients
    assert without_wall_time(read_metrics(tmp_path / "seq")) == without_wall_time(
        read_metrics(tmp_path / "vec")
    )


def test_schedule_takes_exactly_the_sequential_steps():
    for n, cfg in (
        (37, LocalTraining(batch_size=16, local_epochs=2)),
        (5, LocalTraining(batch_size=16)),
        (37, LocalTraining(batch_size=0, local_steps=3)),
        (37, LocalTraining(batch_size=8, local_steps=7)),
    ):
        gen = torch.Generator().manual_seed(0)
        steps = vectorized.schedule(n, cfg, gen)
        assert len(steps) == num_local_steps(n, cfg)
        ref = torch.Generator().manual_seed(0)
        first = torch.randperm(n, generator=ref)
        bs = n if cfg.batch_size <= 0 else min(cfg.batch_size, n)
        assert torch.equal(steps[0], first[:bs])
        assert all(len(s) <= bs for s in steps)


def test_models_it_cannot_batch_are_named():
    assert vectorized.unsupported(nn.Sequential(nn.Linear(2, 2)), "cpu", False) is None
    assert "buffers" in vectorized.unsupported(
        nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), "cpu", False
    )
    assert "dropout" in vectorized.unsupported(nn.Sequential(nn.Linear(2, 2), nn.Dropout()), "cpu", False)
    conv = nn.Sequential(nn.Sequential(nn.Conv2d(1, 2, 3)))  # nested: not for fedsim.engines.grouped
    assert "convolutions" in vectorized.unsupported(conv, "cpu", False)
    assert vectorized.unsupported(conv, "cpu", True) is None
    assert vectorized.unsupported(conv, "cuda", False) is None
    assert vectorized.unsupported(nn.Sequential(nn.Conv2d(1, 2, 3)), "cpu", False) is None  # grouped


@pytest.mark.slow
@pytest.mark.parametrize("taught_the_parser", [False, True])
def test_a_train_key_it_does_not_handle_falls_back_to_the_client_app(
    tmp_path, monkeypatch, batched_clients, caplog, taught_the_parser
):
    """A strategy that sends its own client-side key: the batched path must not drop it silently, also when the
    key was added to the parser as the README's recipe says (the engine runs only the keys its step or a client
    half claims)."""
    from flwr.app import ConfigRecord

    import fedsim.messages
    from fedsim.strategies.fedavg import FedAvg

    seen_keys = []
    original = FedAvg.configure_train

    def with_key(self, server_round, arrays, config: ConfigRecord, grid):
        config["my-client-knob"] = 0.5
        return original(self, server_round, arrays, config, grid)

    import fedsim.client_app as ca

    parse = ca.parse_train

    def recording(config):
        ins = parse(config)
        seen_keys.append(dict(ins.unhandled))
        return ins

    monkeypatch.setattr(FedAvg, "configure_train", with_key)
    monkeypatch.setattr(ca, "parse_train", recording)
    if taught_the_parser:
        known = fedsim.messages.KNOWN_TRAIN_KEYS | {"my-client-knob"}
        monkeypatch.setattr(fedsim.messages, "KNOWN_TRAIN_KEYS", known)
    with caplog.at_level(logging.INFO, logger="fedsim"):
        run_tiny(tmp_path, "engine=vectorized")
    assert not batched_clients  # every train message went through the ClientApp
    expected = {} if taught_the_parser else {"my-client-knob": 0.5}
    assert seen_keys and all(k == expected for k in seen_keys)
    said = [r.getMessage() for r in caplog.records if "claims" in r.getMessage()]
    assert said == [
        "vectorized engine: running train messages through the ClientApp: train config keys no batched step "
        "or client half claims: my-client-knob"
    ]


# ------------------------------------------------------------------ grouped convolutions, engine=auto
def _grouped_case(model: nn.Sequential, x: torch.Tensor, k: int = 3):
    """Per-client logits and gradients vs ``grouped_forward`` on ``k`` clients with different weights."""
    from fedsim.engines.grouped import grouped_forward

    gen = torch.Generator().manual_seed(0)
    names = [n for n, _ in model.named_parameters()]
    stacked = {
        n: (p.detach() + 0.1 * torch.randn((k, *p.shape), generator=gen)).requires_grad_()
        for n, p in model.named_parameters()
    }  # (k, *shape)
    xs = x.expand(k, *x.shape).clone() + torch.randn((k, *x.shape), generator=gen)  # (k, batch, *input)
    out = grouped_forward(model)(stacked, xs)  # (k, batch, classes)
    grads = torch.autograd.grad(out.square().sum(), [stacked[n] for n in names])
    for i in range(k):
        own = {n: stacked[n][i].detach().clone().requires_grad_() for n in names}
        ref = torch.func.functional_call(model, own, (xs[i],))  # (batch, classes)
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)
        ref_grads = torch.autograd.grad(ref.square().sum(), [own[n] for n in names])
        for n, g, r in zip(names, grads, ref_grads):
            torch.testing.assert_close(g[i], r, rtol=1e-4, atol=1e-5, msg=f"client {i}, {n}")


def test_grouped_forward_is_each_clients_own_forward_and_gradient():
    from fedsim.models import cnn

    _grouped_case(cnn((1, 12, 12), 5, channels=(4, 6), hidden=8), torch.randn(4, 1, 12, 12))
    _grouped_case(cnn((8, 8), 10, channels=(3,), hidden=7), torch.randn(5, 64))  # digits: Unflatten first
    odd = nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=2, dilation=2, groups=2, bias=False),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Conv2d(4, 3, 1),
        nn.Flatten(),
        nn.Linear(3 * 2 * 2, 3, bias=False),
    )
    _grouped_case(odd, torch.randn(2, 2, 9, 9))


def test_grouped_supports_only_plain_sequential_conv_nets():
    from fedsim.engines.grouped import supports

    assert supports(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2, 2)))
    assert not supports(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)))  # no conv: vmap does it
    assert not supports(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect")))
    assert not supports(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(0)))
    assert not supports(nn.Sequential(nn.Sequential(nn.Conv2d(1, 2, 3))))


@pytest.mark.slow
def test_auto_is_the_default_and_batches_a_cnn_on_the_cpu(tmp_path, batched_clients):
    assert compose_cfg().engine.name == "auto"
    over = ["num_rounds=2", "model=cnn", "model.channels=[4]", "model.hidden=8"]
    run_tiny(tmp_path / "seq", "engine=inprocess", *over)
    assert not batched_clients
    summary = run_tiny(tmp_path / "auto", *over)
    assert summary["engine"] == "auto"
    assert len(batched_clients) == 6  # 2 rounds x 3 clients, the conv net batched on the CPU
    _close(tmp_path / "seq", tmp_path / "auto")


@pytest.mark.slow
def test_auto_runs_what_it_cannot_batch_through_the_client_app_unchanged(tmp_path, batched_clients):
    run_tiny(tmp_path / "seq", "engine=inprocess", "client=adam")
    run_tiny(tmp_path / "auto", "client=adam")
    assert not batched_clients
    assert without_wall_time(read_metrics(tmp_path / "seq")) == without_wall_time(
        read_metrics(tmp_path / "auto")
    )


def _dense_case(model: nn.Module, xs: torch.Tensor, task) -> None:
    """DenseStep's per-client losses and gradients equal each client's own autograd ones (float64)."""
    from fedsim.engines.dense import DenseStep

    model = model.double()
    k, b = 3, xs.shape[0]
    names = [n for n, _ in model.named_parameters()]
    params = {n: torch.stack([p.detach() + 0.1 * i for i in range(k)]) for n, p in model.named_parameters()}
    x = torch.stack([xs.double() * (1 + i) for i in range(k)])
    y = torch.randint(0, 3, (k, b)) if task.targets == "classes" else torch.randn(k, b, dtype=torch.float64)
    w = torch.zeros(k, b, dtype=torch.float64)
    for i, used in enumerate((b, b - 1, 1)):  # partial batches: padded slots weigh 0
        w[i, :used] = 1.0 / used
    losses, grads = DenseStep(model, task)(params, x, y, w)
    for i in range(k):
        used = int((w[i] > 0).sum())
        own = {n: params[n][i].clone().requires_grad_() for n in names}
        out = torch.func.functional_call(model, own, (x[i, :used],))
        loss = task.loss(out, y[i, :used])
        ref = torch.autograd.grad(loss, [own[n] for n in names])
        torch.testing.assert_close(losses[i], loss.detach(), rtol=1e-12, atol=1e-12)
        for n, r in zip(names, ref):
            torch.testing.assert_close(grads[n][i], r, rtol=1e-10, atol=1e-12, msg=f"client {i}, {n}")


def test_dense_step_is_each_clients_own_loss_and_gradient():
    from fedsim.models import mlp
    from fedsim.tasks import CLASSIFICATION, Regression

    _dense_case(mlp((4, 2), 3, hidden=(5, 6)), torch.randn(5, 4, 2), CLASSIFICATION)
    _dense_case(nn.Sequential(nn.Linear(4, 3, bias=False)), torch.randn(4, 4), CLASSIFICATION)
    _dense_case(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 1)), torch.randn(4, 4), Regression())


def test_dense_supports_only_plain_mlps():
    from fedsim.engines.dense import supports

    assert supports(nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    assert not supports(nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))
    assert not supports(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2, 2)))
    assert not supports(nn.Sequential(nn.Flatten(0), nn.Linear(4, 2)))
    assert not supports(nn.Sequential(nn.ReLU()))


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_static_buffer_step_of_the_cuda_graph_equals_the_eager_steps(model):
    """The step a CUDA graph captures (static buffers, momentum buffers from zero) gives the eager path's
    parameters and losses exactly (run here without capture; the capture itself is checked on a GPU)."""
    from fedsim.engines.vectorized import _Client, schedule, train_stacked

    over = ["model=cnn", "model.channels=[3]", "model.hidden=8"] if model == "cnn" else []
    spec = build.client_spec(compose_cfg("num_clients=6", "partitioner=iid", *over), "cpu")
    local = LocalTraining(
        optimizer="nesterov", lr=0.05, momentum=0.9, weight_decay=0.01, batch_size=8, local_steps=5
    )
    tasks = [build.client_task(spec, pid) for pid in range(4)]
    start = {n: p.detach().clone() for n, p in tasks[0].model.named_parameters()}
    members = [
        _Client(None, t, start, schedule(int(t.x_train.shape[0]), local, torch.Generator().manual_seed(i)))
        for i, t in enumerate(tasks)
    ]
    eager, eager_loss = train_stacked(members, local, "cpu", 0.3, graph=False)
    static, static_loss = train_stacked(members, local, "cpu", 0.3, graph=True)
    assert static_loss == eager_loss
    for n in eager:
        assert torch.equal(static[n], eager[n]), n
    assert not torch.equal(eager[n], start[n].expand_as(eager[n]))


# ------------------------------------------------------------------------ the engine's per-client caches
def _uncached() -> None:
    """Forget everything the engine caches per client, per step lengths and per model."""
    vectorized._layout.cache_clear()
    vectorized._steps.cache_clear()
    vectorized._MODEL_INFO.clear()


def _stacked_round(grid, spec, arrays, rnd, nodes, limits):
    """One round's train messages (``limits``: node -> its step limit, as the loop writes partial work) run on
    ``grid``; the stacked replies, which must cover the whole cohort."""
    from flwr.app import ConfigRecord, MessageType, RecordDict

    from fedsim import keys

    def content(limit):
        cfg = {keys.RUN_SPEC: spec, keys.SERVER_ROUND: rnd}
        if limit is not None:
            cfg[keys.MAX_STEPS] = limit
        return RecordDict({keys.ARRAYS: arrays, keys.CONFIG: ConfigRecord(cfg)})

    shared = content(None)
    msgs = [
        grid.create_message(content(limits[n]) if n in limits else shared, MessageType.TRAIN, n, "")
        for n in nodes
    ]
    replies, stacked = grid.send_and_receive_cohort(msgs)
    assert replies == [] and len(stacked) == len(nodes)
    return stacked


def test_cached_client_plans_give_what_a_fresh_engine_gives_round_after_round():
    """The plans a grid keeps across rounds (task lookup, checks, step lengths, passes, group), against a new grid
    with every cache cleared, each round: the same stacked replies bit for bit, while the cohort, the clients'
    step limits (partial work) and the round (the clients' seeds) change; a task built anew (the client tasks
    released) gets a new plan."""
    from flwr.app import ArrayRecord

    from fedsim import keys

    spec = build.client_spec(compose_cfg("num_clients=6"), "cpu")
    arrays = ArrayRecord(
        build.build_initial_model(json.loads(spec)).state_dict()
    )  # the same start every round
    rounds = [
        (1, [1, 2, 3], {}),
        (2, [1, 2, 3], {}),
        (3, [2, 4, 5], {2: 3}),
        (4, [2, 4, 5, 6], {2: 5, 4: 1}),
        (5, [1, 2, 3], {}),
    ]
    rows: dict[int, list[dict]] = {}
    with vectorized.VectorizedGrid(6, threads=1) as kept:
        for rnd, nodes, limits in rounds:
            if rnd == 5:  # a sweep's next job: new tasks (new data and model objects), so new plans
                build.release_client_tasks()
            got = _stacked_round(kept, spec, arrays, rnd, nodes, limits)
            _uncached()
            with vectorized.VectorizedGrid(6, threads=1) as fresh:
                want = _stacked_round(fresh, spec, arrays, rnd, nodes, limits)
            assert got.metrics == want.metrics, rnd
            assert got.arrays.keys() == want.arrays.keys()
            assert all(torch.equal(got.arrays[n], want.arrays[n]) for n in want.arrays), rnd
            for i, (node, m) in enumerate(zip(got.node_ids, got.metrics)):
                if node in limits:
                    assert m[keys.NUM_STEPS] == limits[node]
                rows.setdefault(node, []).append({n: t[i] for n, t in got.arrays.items()})
        # one plan per client and step limit, reused across rounds (round 5's after the release)
        assert len(kept._plans) == len({(n, limits.get(n)) for _, nodes, limits in rounds for n in nodes})
        for (_, pid, limit, _), plan in kept._plans.items():  # round 5's clients: plans of their new tasks
            if pid + 1 in rounds[-1][1] and limit is None:
                assert plan.task() is build.client_task(spec, pid)
    # the same client from the same start model in rounds 1, 2 and 5: its own seed each round, another model
    for a, b in ((0, 1), (1, 2), (0, 2)):
        assert not torch.equal(rows[1][a]["1.weight"], rows[1][b]["1.weight"])


@pytest.mark.slow
def test_a_run_with_the_engine_caches_equals_one_without(tmp_path, monkeypatch):
    """engine=auto over rounds whose cohorts and deadlines (partial work) change: metrics.jsonl (wall clock
    aside) and model.pt bit for bit with the per-client plans kept and with every plan and cache rebuilt for each
    client and round; the kept run builds fewer plans than it trains clients."""
    over = [
        "num_rounds=5",
        "strategy=fedprox",
        "heterogeneity=lognormal",
        "heterogeneity.deadline=0.4",
        "heterogeneity.partial_work=true",
    ]
    calls, grids = [], []
    original = vectorized.VectorizedGrid._plan

    def counting(self, ins, pid):
        calls.append(pid)
        grids.append(self)
        return original(self, ins, pid)

    monkeypatch.setattr(vectorized.VectorizedGrid, "_plan", counting)
    run_tiny(tmp_path / "kept", *over)
    records = read_metrics(tmp_path / "kept")
    assert any(r.get("partial_work") for r in records)  # step limits change between rounds
    assert len(grids[-1]._plans) < len(calls)  # plans reused across rounds

    def rebuilt(self, ins, pid):
        self._plans.clear()
        _uncached()
        return original(self, ins, pid)

    monkeypatch.setattr(vectorized.VectorizedGrid, "_plan", rebuilt)
    run_tiny(tmp_path / "rebuilt", *over)
    assert without_wall_time(records) == without_wall_time(read_metrics(tmp_path / "rebuilt"))
    ma, mb = torch.load(tmp_path / "kept" / "model.pt"), torch.load(tmp_path / "rebuilt" / "model.pt")
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def test_client_side_clipping_of_the_batched_rows_is_the_client_apps():
    """Train messages asking for client-side clipping (``clip-norm``): the vectorized engine clips the stacked rows
    and reports each client's norm and clipped flag as the ClientApp does (the pool grid runs the ClientApp per
    message), with a bound between the clients' norms so that some rows clip and some do not."""
    from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict

    from fedsim import keys
    from fedsim.engines.pool import PoolGrid

    spec = build.client_spec(compose_cfg("num_clients=6"), "cpu")
    arrays = ArrayRecord(build.build_initial_model(json.loads(spec)).state_dict())

    def round_of(grid, bound):
        cfg = {keys.RUN_SPEC: spec, keys.SERVER_ROUND: 1}
        if bound is not None:
            cfg[keys.CLIP_NORM] = bound
        content = RecordDict({keys.ARRAYS: arrays, keys.CONFIG: ConfigRecord(cfg)})
        return [grid.create_message(content, MessageType.TRAIN, n, "") for n in range(1, 7)]

    with PoolGrid(6) as pool:
        unclipped = list(pool.send_and_receive(round_of(pool, 1e9)))
        norms = sorted(r.content[keys.METRICS][keys.UPDATE_NORM] for r in unclipped)
        bound = (norms[2] + norms[3]) / 2  # three clients above, three below
        want = list(pool.send_and_receive(round_of(pool, bound)))
    with vectorized.VectorizedGrid(6, threads=1) as grid:
        replies, stacked = grid.send_and_receive_cohort(round_of(grid, bound))
        assert replies == [] and len(stacked) == 6  # every client trained (and clipped) batched
        got = stacked.replies()
    flags = []
    for g, w in zip(got, want, strict=True):
        gm, wm = dict(g.content[keys.METRICS].items()), dict(w.content[keys.METRICS].items())
        assert gm.keys() == wm.keys()
        assert gm[keys.UPDATE_NORM] == pytest.approx(wm[keys.UPDATE_NORM], rel=1e-6)
        assert gm[keys.CLIPPED] == wm[keys.CLIPPED]
        flags.append(wm[keys.CLIPPED])
        ga, wa = g.content[keys.ARRAYS], w.content[keys.ARRAYS]
        for n in wa:
            torch.testing.assert_close(ga[n].numpy(), wa[n].numpy(), rtol=1e-5, atol=1e-6)
        if wm[keys.CLIPPED]:  # the reply's update has norm C
            start = {n: arrays[n].numpy().astype("float64") for n in arrays}
            d2 = sum(float(((ga[n].numpy().astype("float64") - start[n]) ** 2).sum()) for n in ga)
            assert d2**0.5 == pytest.approx(bound, rel=1e-5)
    assert sorted(flags) == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
