"""The round's cohort (``fedsim.messages.Cohort``): rows = clients, models stacked where they sit. A cohort trained
batched stays stacked tensors; per-client replies are stacked into one; every aggregator and wrapper is written
once against it, checked here against independent oracles (numpy's closed forms, Flower's own strategies)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from helpers import compose_cfg, read_metrics, run_tiny, without_wall_time

from fedsim import build, build_server, comm, keys, messages, seeds
from fedsim.aggregate import weighted_mean
from fedsim.engines.vectorized import VectorizedGrid
from fedsim.features.attacks import server as attacks
from fedsim.grid_utils import screen_replies
from fedsim.messages import Cohort, array_record, device_mean
from fedsim.records import average_metrics, to_record
from fedsim.screen import screen_cohort
from fedsim.seeds import torch_generator, torch_generators
from fedsim.strategies import base
from fedsim.strategies.fedavg import FedAvg

BATCHED_FORM = [
    "fedavg",
    "fedprox",
    "fedavgm",
    "fedadam",
    "fedyogi",
    "fedadagrad",
    "fedmedian",
    "fedtrimmedavg strategy.beta=0.25",
    "krum",
    "krum strategy.num_selected=2 strategy.server_momentum=0.9",
    "fedmedian strategy.server_momentum=0.9 attack=alie attack.fraction=0.5 attack.z=1.0",
    "fedavg attack=sign_flip attack.fraction=0.5",
    "fedtrimmedavg strategy.beta=0.25 attack=ipm attack.fraction=0.5",
    "krum attack=gaussian attack.fraction=0.5",
]
ROUNDED_FORM = [
    "fednova",
    "fedavg clipping=fixed",
    "fedavgm clipping=fixed clipping.clip_norm=0.05",
    "fedavg clipping=fixed clipping.noise_multiplier=1.0 clipping.noise_seed=12345 clipping.debug_noise_seed=true",
    "fedadam clipping=adaptive clipping.noise_multiplier=0.5 clipping.noise_seed=7 clipping.debug_noise_seed=true",
    "fednova strategy.dp_tau_eff=4 clipping=fixed clipping.clip_norm=0.05 clipping.noise_multiplier=1.0 "
    "clipping.noise_seed=9 clipping.debug_noise_seed=true clipping.sampling=fixed",
    "fedavg clipping=fixed clipping.side=client clipping.clip_norm=0.05",
    "fedavgm clipping=fixed clipping.side=client clipping.clip_norm=0.05 clipping.noise_multiplier=1.0 "
    "clipping.noise_seed=31 clipping.debug_noise_seed=true clipping.debug_metrics=true",
]
PER_CLIENT_ONLY = ["feddyn", "scaffold", "fedavg compression=topk"]


def _stacked(k: int, seed: int = 0, **bad) -> Cohort:
    """``k`` rows of a small model's parameters with fedsim's train metrics, answering real train messages."""
    gen = torch.Generator().manual_seed(seed)
    arrays = {
        "0.weight": torch.randn(k, 5, 3, generator=gen),
        "0.bias": torch.randn(k, 5, generator=gen),
        "scale": torch.randn(k, generator=gen),  # a 0-d parameter
    }
    grid = VectorizedGrid(8)
    content = RecordDict({keys.CONFIG: ConfigRecord({keys.RUN_SPEC: "{}"})})
    msgs = [grid.create_message(content, MessageType.TRAIN, i + 1, "") for i in range(k)]
    metrics = [
        {
            keys.NUM_EXAMPLES: int(n),
            keys.TRAIN_LOSS: float(loss),
            keys.PARTITION_ID: i,
            keys.NUM_STEPS: 3,
            keys.EXAMPLES_PROCESSED: 3 * int(n),
        }
        for i, (n, loss) in enumerate(
            zip(torch.randint(1, 500, (k,), generator=gen), torch.rand(k, generator=gen))
        )
    ]
    for row in bad.get("nan_rows", ()):
        arrays["0.bias"][row, 2] = float("nan")
    for row in bad.get("inf_loss_rows", ()):
        metrics[row][keys.TRAIN_LOSS] = float("inf")
    return Cohort(msgs, arrays, metrics)


@pytest.mark.parametrize(
    "block",
    [None, 300, 8, 1],
    ids=["every-row-at-once", "rows-in-blocks", "windows-of-a-row", "value-by-value"],
)
@pytest.mark.parametrize("k", [1, 2, 7, 23])
def test_the_stacked_mean_is_fedavgs_mean_bit_for_bit(k, block, monkeypatch):
    if (
        block is not None
    ):  # blocks of 14 rows of the 21 values; windows of 8 values of a row, across parameters
        monkeypatch.setattr(messages, "HOST_MEAN_BLOCK", block)
    stacked = _stacked(k, seed=k)
    weights = [float(m[keys.NUM_EXAMPLES]) for m in stacked.metrics]
    rows = [{n: t[i].numpy() for n, t in stacked.arrays.items()} for i in range(k)]
    want = weighted_mean(rows, weights)
    got = stacked.weighted_mean(weights)
    assert got.keys() == want.keys()
    for n in want:
        assert got[n].dtype == np.float64 and np.shape(got[n]) == np.shape(want[n]), n
        assert np.array_equal(got[n], want[n]), n


def test_concat_in_an_order_is_concat_then_take_and_names_a_bad_order():
    parts = [_stacked(3, seed=1), _stacked(1, seed=2), _stacked(4, seed=3)]
    rows = [5, 0, 7, 3, 1, 6, 2, 4]
    want, got = Cohort.concat(parts).take(rows), Cohort.concat(parts, rows)
    assert got.messages == want.messages and got.metrics == want.metrics
    assert all(torch.equal(got.arrays[n], want.arrays[n]) for n in want.arrays)
    assert Cohort.concat(parts[:1], [2, 0, 1]).metrics == parts[0].take([2, 0, 1]).metrics
    with pytest.raises(ValueError, match="each of the 8 rows once"):
        Cohort.concat(parts, [0, 0, 1, 2, 3, 4, 5, 6])


def test_the_mean_on_a_gpu_is_the_mean_to_float64_rounding():
    stacked = _stacked(150, seed=3)  # more rows than one matrix product takes
    w = np.random.default_rng(0).random(150)
    for n, t in stacked.arrays.items():
        want = weighted_mean([{n: t[i].numpy()} for i in range(150)], list(w))[n]
        got = device_mean(t, w / w.sum()).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_the_replies_it_stands_for_are_the_engines_and_sized_without_being_made():
    stacked = _stacked(5)
    replies = stacked.replies()
    assert [r.metadata.reply_to_message_id for r in replies] == [
        m.metadata.message_id for m in stacked.messages
    ]
    for i, rep in enumerate(replies):
        assert dict(rep.content[keys.METRICS].items()) == stacked.metrics[i]
        for n, t in stacked.arrays.items():
            assert rep.content[keys.ARRAYS][n].data == array_record({n: t[i]})[n].data
    assert comm.cohort_bytes(stacked) == comm.message_bytes(replies)


def test_a_cohorts_generators_seeded_together_are_torch_generators():
    rng = np.random.default_rng(0)
    rows = [tuple(int(v) for v in r) for r in rng.integers(0, 2**32, size=(300, 4))]
    rows += [tuple(int(v) for v in r) for r in rng.integers(0, 4, size=(50, 4))]
    rows += [(0, 3, 0, 0), (2**32 - 1, 3, 2**32 - 1, 7), (5, 3, 1, 2, 9)]  # the last: five entries
    assert len(rows[:-1]) >= seeds.TOGETHER
    for row in [rows[:-1], [rows[-1]] * 20, [(2**40, 3, 1, 2)] + rows[:20], [(0, 3, 1)] * 20, rows[:3]]:
        got = [g.initial_seed() for g in torch_generators(row)]
        assert got == [torch_generator(*r).initial_seed() for r in row]
    assert torch_generators([]) == []


def test_average_metrics_is_flowers_aggregation():
    rows = [
        {"num-examples": n, "train_loss": loss, "partition-id": i, "steps": 3, "hist": [loss, 2.0 * i]}
        for i, (n, loss) in enumerate([(10, 0.5), (7, 0.25), (31, 1.0 / 3.0)])
    ]
    want = aggregate_metricrecords(
        [RecordDict({"metrics": m}) for m in map(_metric_record, rows)], "num-examples"
    )
    got = average_metrics(rows, "num-examples")
    assert list(got.items()) == list(want.items())


def _metric_record(row):
    from flwr.app import MetricRecord

    return MetricRecord(row)


@pytest.mark.parametrize(
    "a",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(12, dtype=np.float64).reshape(3, 4).T,  # not C-contiguous
        np.asfortranarray(np.ones((2, 3), np.float32)),
        np.array(3.5),  # 0-d
        np.zeros((0, 4), np.int64),
        np.arange(5, dtype=np.int64),
    ],
)
def test_to_record_writes_the_bytes_flower_writes(a):
    from flwr.app import Array

    got, want = to_record({"a": a})["a"], Array(np.array(a, order="C", copy=None))
    assert (got.data, got.dtype, tuple(got.shape), got.stype) == (
        want.data,
        want.dtype,
        tuple(want.shape),
        want.stype,
    )
    assert np.array_equal(got.numpy(), a)


def _garble(metrics: list[dict], kind: str) -> None:
    """One kind of garbled train metrics, in rows 1 (and 3)."""
    m1, m3 = metrics[1], metrics[3]
    if kind == "huge-num-examples":
        m1[keys.NUM_EXAMPLES] = 1e300
    elif kind == "nan-num-examples":
        m1[keys.NUM_EXAMPLES] = float("nan")
    elif kind == "fractional-num-examples":
        m1[keys.NUM_EXAMPLES] = 2.5
    elif kind == "negative-num-examples":
        m1[keys.NUM_EXAMPLES] = -3
    elif kind == "no-num-examples":
        del m1[keys.NUM_EXAMPLES]
    elif kind == "fractional-partition-id":
        m1[keys.PARTITION_ID] = 1.5
    elif kind == "another-nodes-partition":
        m1[keys.PARTITION_ID] = 4
    elif kind == "duplicate-partition":
        m1[keys.PARTITION_ID] = m3[keys.PARTITION_ID] = 4
    elif kind == "extra-metric-key":
        m1["surprise"] = 1.0
    elif kind == "missing-metric-key":
        del m1[keys.TRAIN_LOSS], m3[keys.TRAIN_LOSS]
    elif kind == "every-num-examples-0":
        for m in metrics:
            m[keys.NUM_EXAMPLES] = 0
    elif kind == "nonfinite":
        m1[keys.TRAIN_LOSS] = float("inf")


GARBLED = [
    "huge-num-examples",
    "nan-num-examples",
    "fractional-num-examples",
    "negative-num-examples",
    "no-num-examples",
    "fractional-partition-id",
    "another-nodes-partition",
    "duplicate-partition",
    "extra-metric-key",
    "missing-metric-key",
    "every-num-examples-0",
    "nonfinite",
]


@pytest.mark.parametrize("partitions", [True, False], ids=["discovered", "no-discovery"])
@pytest.mark.parametrize("kind", GARBLED)
def test_one_screen_drops_the_same_garbled_replies_on_every_engines_path(kind, partitions):
    """The same garbled replies through the batched engine's path (the cohort screened as it is) and the
    per-client engines' path (its Messages through ``screen_replies``): the same rows kept, the same failures
    (kind and detail), in the same order."""
    cohort = _stacked(6, nan_rows=[5] if kind == "nonfinite" else [])
    _garble(cohort.metrics, kind)
    reference = array_record({n: t[0] for n, t in cohort.arrays.items()})
    nodes = {i + 1: i for i in range(6)} if partitions else None
    want_valid, want_failures = screen_replies(cohort.replies(), reference, nodes)
    valid, failures = screen_cohort(cohort, reference, nodes)
    assert failures == want_failures and failures, kind
    assert valid.partition_ids == [int(r.content[keys.METRICS][keys.PARTITION_ID]) for r in want_valid]
    for n, t in valid.arrays.items():
        rows = [r.content[keys.ARRAYS][n].numpy() for r in want_valid]
        assert np.array_equal(t.numpy(), np.stack(rows) if rows else t.numpy()[:0]), n


def test_a_stack_unlike_the_global_model_goes_to_the_message_screen():
    stacked = _stacked(3)
    other = array_record({n: t[0, ..., :1] if t.dim() > 1 else t[0] for n, t in stacked.arrays.items()})
    assert screen_cohort(stacked, other, None) is None  # shapes differ: the message screen names them


@pytest.mark.parametrize("kind", ["huge-num-examples", "nan-num-examples", "extra-metric-key"])
def test_a_garbled_reply_fails_alike_in_the_loop_on_both_engines(tmp_path, monkeypatch, kind):
    """A client's train metrics garbled where both engines write them (``train_metrics``): the run goes on
    with the same failures and failure kinds each round on ``inprocess`` and the default engine (a huge or
    NaN num-examples once zeroed the batched path's model or failed its run)."""
    import fedsim.engines.vectorized as vectorized

    original = messages.train_metrics

    def garbled(**kw):
        out = original(**kw)
        if kw["partition_id"] == 1:
            metrics = [out, out, out, out]
            _garble(metrics, kind)
            out = metrics[1]
        return out

    monkeypatch.setattr(messages, "train_metrics", garbled)
    monkeypatch.setattr(vectorized, "train_metrics", garbled)
    runs = {}
    for engine in ("inprocess", "auto"):
        summary = run_tiny(tmp_path / engine, f"engine={engine}", "num_clients=4", "clients_per_round=4")
        assert summary["status"] == "completed", engine
        runs[engine] = [
            (r.get("failures"), r.get("failure_kinds"), r.get("num_clients"))
            for r in read_metrics(tmp_path / engine)
        ]
    assert runs["inprocess"] == runs["auto"] and runs["auto"][-1] == (1, {"malformed": 1}, 3)
    assert read_metrics(tmp_path / "auto")[-1]["eval_accuracy"] > 0.2


@pytest.mark.parametrize("name", BATCHED_FORM + ROUNDED_FORM + PER_CLIENT_ONLY)
def test_which_strategies_take_the_cohort(name):
    cfg = compose_cfg("num_clients=6", *_overrides(name))
    strategy = build_server.build_strategy(cfg, 4)
    assert base.takes_cohort(strategy) == (name.split()[0] not in ("feddyn", "scaffold"))


def _overrides(name: str) -> list[str]:
    strategy, *rest = name.split()
    return [f"strategy={strategy}", *rest]


def test_a_subclass_that_overrides_flowers_aggregate_train_gets_messages():
    class Mine(FedAvg):
        def aggregate_train(self, server_round, replies):
            return super().aggregate_train(server_round, replies)

    class Halved(FedAvg):
        def server_step(self, mean):
            return {k: v / 2 for k, v in mean.items()}

    class Flip(attacks.SignFlip):
        def aggregate_train(self, server_round, replies):
            return super().aggregate_train(server_round, replies)

    assert not base.takes_cohort(Mine()) and base.takes_cohort(Halved()) and base.takes_cohort(FedAvg())
    flip = Flip(strategy=FedAvg(), fraction=0.5, num_clients=4, clients_per_round=4, seed=0)
    assert not base.takes_cohort(flip) and not base.takes_cohort(object())


def _flower(name: str):
    from flwr.serverapp import strategy as flower

    return {
        "fedavg": flower.FedAvg(),
        "fedmedian": flower.FedMedian(),
        "fedtrimmedavg": flower.FedTrimmedAvg(beta=0.25),
        "krum": flower.Krum(num_malicious_nodes=0),
    }[name]


@pytest.mark.parametrize("name", ["fedavg", "fedmedian", "fedtrimmedavg", "krum"])
def test_each_aggregator_on_the_cohort_is_flowers_strategy(name):
    """The one form of each aggregator against Flower's own strategy of the same name (the oracle) on the
    Messages the cohort stands for: the same model to float32 rounding, the same metrics."""
    cfg = compose_cfg(
        "num_clients=8", *_overrides(name), *(["strategy.beta=0.25"] if "trimmed" in name else [])
    )
    ours = build_server.build_strategy(cfg, 5)
    cohort = _stacked(5, seed=11)
    got, got_metrics = ours.aggregate_cohort(1, cohort)
    want, want_metrics = _flower(name).aggregate_train(1, [_plain(r) for r in cohort.replies()])
    for n in want:
        np.testing.assert_allclose(got[n].numpy(), want[n].numpy(), rtol=1e-6, atol=1e-7, err_msg=n)
    for k, v in dict(want_metrics.items()).items():
        assert dict(got_metrics.items())[k] == pytest.approx(v, rel=1e-9), k


def _plain(reply):
    """A copy of a reply with its own records (Flower's robust strategies pop the arrays they aggregate)."""
    from flwr.app import Message

    content = RecordDict(
        {
            k: (ArrayRecord(dict(r.items())) if isinstance(r, ArrayRecord) else r)
            for k, r in reply.content.items()
        }
    )
    return Message(content, metadata=reply.metadata)


def test_the_attack_and_clipping_on_the_cohort_are_their_closed_forms():
    """SignFlip then fixed clipping, on a cohort: the attackers' rows become ``x - d``, every update is clipped
    to ``C`` (numpy's closed form, ``aggregate.clip``) and FedAvg takes the weighted mean of ``x + clip(d)``."""
    from fedsim.aggregate import clip
    from fedsim.features.clipping.server import FixedClipping

    cohort = _stacked(5, seed=5)
    x = {n: t[0].numpy() * 0.5 for n, t in cohort.arrays.items()}
    clipping = FixedClipping(strategy=FedAvg(), clip_norm=0.5, num_clients=8, clients_per_round=5, seed=1)
    attack = attacks.SignFlip(strategy=clipping, fraction=0.5, num_clients=8, clients_per_round=5, seed=0)
    for w in (attack, clipping):
        w.current = {k: np.asarray(v) for k, v in x.items()}
    got, _ = attack.aggregate_cohort(1, cohort)
    rows, weights = [], []
    for i, pid in enumerate(cohort.partition_ids):
        d = {n: t[i].numpy().astype(np.float64) - x[n] for n, t in cohort.arrays.items()}
        if pid in attack.malicious:
            d = {n: (x[n] - d[n]).astype(np.float32).astype(np.float64) - x[n] for n in d}
        c, _, _ = clip(d, 0.5)
        rows.append({n: (x[n] + c[n]).astype(np.float32) for n in c})
        weights.append(cohort.metrics[i][keys.NUM_EXAMPLES])
    assert 0 < attack.malicious_among(cohort.partition_ids) < 5
    want = weighted_mean(rows, weights)
    for n in want:
        np.testing.assert_allclose(got[n].numpy(), want[n], rtol=1e-6, atol=1e-7, err_msg=n)


def test_a_cohort_not_all_batched_comes_back_as_the_messages_send_and_receive_gives():
    cfg = compose_cfg("num_clients=6")
    spec = build.client_spec(cfg, "cpu")
    arrays = ArrayRecord(build.build_initial_model(json.loads(spec)).state_dict())
    plain = RecordDict(
        {keys.ARRAYS: arrays, keys.CONFIG: ConfigRecord({keys.RUN_SPEC: spec, "server-round": 1})}
    )
    odd = RecordDict(
        {keys.ARRAYS: arrays, keys.CONFIG: ConfigRecord({keys.RUN_SPEC: spec, "server-round": 1, "mine": 1})}
    )  # a key the batched path does not handle: this client goes through the ClientApp
    with VectorizedGrid(6, threads=1) as a, VectorizedGrid(6, threads=1) as b:
        make = [(plain, 1), (odd, 2), (plain, 3)]
        replies, stacked = a.send_and_receive_cohort(
            [a.create_message(c, MessageType.TRAIN, n, "") for c, n in make]
        )
        want = list(b.send_and_receive([b.create_message(c, MessageType.TRAIN, n, "") for c, n in make]))
    assert stacked is None and [r.metadata.src_node_id for r in replies] == [1, 2, 3]
    for got, ref in zip(replies, want):
        assert dict(got.content[keys.METRICS].items()) == dict(ref.content[keys.METRICS].items())
        for n, arr in ref.content[keys.ARRAYS].items():
            assert got.content[keys.ARRAYS][n].data == arr.data


@pytest.mark.parametrize(
    "name",
    [
        "fedavg",
        "fedavgm",
        "fednova",
        "fedavg selection=power_of_choice",
        "fedmedian strategy.server_momentum=0.5 attack=alie attack.fraction=0.5 attack.z=1.0",
        "fedavg clipping=fixed clipping.side=client clipping.clip_norm=0.05 clipping.noise_multiplier=0.3 "
        "clipping.noise_seed=77 clipping.debug_noise_seed=true",
    ],
)
def test_the_loop_on_the_cohort_gives_the_run_of_flowers_adapter(tmp_path, monkeypatch, name):
    """engine=auto with the cohort handed to the strategy, and with every strategy made to take Messages
    (Flower's ``aggregate_train``, the adapter that stacks them again): the same metrics.jsonl (wall clock
    aside), bytes up included, and the same model.pt, bit for bit."""
    over = [*_overrides(name), "num_rounds=3"]
    run_tiny(tmp_path / "cohort", *over)
    monkeypatch.setattr(base, "takes_cohort", lambda strategy: False)
    run_tiny(tmp_path / "messages", *over)
    a, b = read_metrics(tmp_path / "cohort"), read_metrics(tmp_path / "messages")
    assert without_wall_time(a) == without_wall_time(b) and a[-1]["bytes_up"] > 0
    ma, mb = torch.load(tmp_path / "cohort" / "model.pt"), torch.load(tmp_path / "messages" / "model.pt")
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def test_host_mean_is_weighted_mean_bit_for_bit_and_its_reused_scratch_leaves_earlier_results_alone():
    from fedsim.aggregate import normalised_weights

    gen = torch.Generator().manual_seed(0)
    results = []
    for rows, width in ((7, 5), (3, 11), (7, 5)):  # the scratch grows, then is reused smaller
        stack = {
            "w": torch.randn(rows, width, 3, generator=gen),
            "b": torch.randn(rows, width, generator=gen),
        }
        sizes = torch.randint(1, 50, (rows,), generator=gen).tolist()
        got = messages.host_mean(stack, normalised_weights(sizes))
        oracle = weighted_mean([{n: t[i].numpy() for n, t in stack.items()} for i in range(rows)], sizes)
        assert all(np.array_equal(got[n], oracle[n]) for n in oracle)
        results.append((got, {n: a.copy() for n, a in got.items()}))
    for got, kept in results:  # no later call wrote into an earlier result
        assert all(np.array_equal(got[n], kept[n]) for n in kept)
