"""The synchronous server loop, shared by every engine.

Per round: sample the cohort (seeded, by partition id), let the strategy build the train messages for a
``SampledGrid`` view, send them, screen the replies (errors, NaN/Inf, wrong shapes are dropped and counted),
aggregate in partition order, evaluate the global model on the server's test split, record. A round with fewer
than ``min_replies`` valid replies is skipped (the model is kept), except under a strategy that releases a model
every round (DP with noise, ``base.releases_every_round``): it is configured even for an empty cohort and
aggregates whatever valid replies it got, none included, as the privacy analysis assumes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedsim import checkpoint, comm, keys, schema
from fedsim.build import build_splits, local_training
from fedsim.clock import Heterogeneity
from fedsim.errors import ConfigError, RunError, StopRun
from fedsim.features.selection.server import probe_losses
from fedsim.grid_utils import (
    SampledGrid,
    discover,
    diverged_message,
    nonfinite_arrays,
    screen_replies,
    wait_for_nodes,
)
from fedsim.messages import Cohort
from fedsim.screen import screen_cohort
from fedsim.seeds import Purpose
from fedsim.seeds import rng as seeded_rng
from fedsim.state import LoopConfig, RunState
from fedsim.strategies import base
from fedsim.training import examples_processed, steps_within

log = logging.getLogger("fedsim")


def sample_cohort(seed: int, rnd: int, num_clients: int, size: int) -> list[int]:
    """Partition ids of round ``rnd``'s cohort: a seeded draw without replacement, sorted."""
    rng = seeded_rng(seed, Purpose.COHORT, rnd)
    return sorted(int(p) for p in rng.choice(num_clients, size=size, replace=False))


def sample_evaluators(seed: int, rnd: int, cohort: list[int], fraction: float) -> list[int]:
    """The part of round ``rnd``'s cohort asked to evaluate: ``ceil(fraction * len(cohort))`` of them, seeded."""
    size = min(len(cohort), max(1, math.ceil(fraction * len(cohort) - 1e-9)))
    if size == len(cohort):
        return list(cohort)
    rng = seeded_rng(seed, Purpose.EVALUATORS, rnd)
    return sorted(int(p) for p in rng.choice(cohort, size=size, replace=False))


def connect_sizes(grid: Grid, loop: LoopConfig, spec: str) -> tuple[dict[int, int], dict[int, int]]:
    """Wait for ``loop.num_clients`` nodes; return ``({partition_id: node_id}, {partition_id: train size})``."""
    nodes = wait_for_nodes(grid, loop.num_clients, loop.node_timeout)
    partition_of = getattr(grid, "partition_of", None)
    if (
        partition_of is not None
    ):  # a local engine knows its nodes: ask one (to surface a broken client), not all
        first = discover(grid, nodes[:1], spec, loop.node_timeout)
        sizes = build_splits(json.loads(spec)).sizes()
        found = {partition_of(n): (n, int(sizes[partition_of(n)])) for n in nodes}
        if any(found.get(pid) != got for pid, got in first.items()):
            raise RunError(f"node {nodes[0]} reports partition {first} but the grid maps it differently")
    else:  # deployment: every node reports its partition; a refused claim leaves it to a node joining later
        found: dict[int, tuple[int, int]] = {}
        asked: set[int] = set()
        end = time.monotonic() + loop.node_timeout
        while True:
            new = [
                n for n in grid.get_node_ids() if n not in asked
            ]  # the grid's order: first registered first
            asked.update(new)
            if new:
                discover(grid, new, spec, max(1.0, end - time.monotonic()), found, loop.num_clients)
            if set(range(loop.num_clients)) <= set(found) or time.monotonic() > end:
                break
            time.sleep(0.5)
    missing = sorted(set(range(loop.num_clients)) - set(found))
    if missing:
        raise RunError(f"no node answered for partition ids {missing[:10]}")
    return {pid: nid for pid, (nid, _) in found.items()}, {pid: n for pid, (_, n) in found.items()}


class Workload:
    """What a task of each client costs, known before it is sent: examples processed in local training."""

    def __init__(self, spec: str, sizes: dict[int, int]) -> None:
        self.local = local_training(json.loads(spec))
        self.sizes = dict(sizes)

    def examples(self, pid: int, max_steps: int | None = None) -> int:
        """Examples client ``pid`` processes in one task (capped at ``max_steps`` steps)."""
        return examples_processed(self.sizes[pid], self.local, max_steps)

    def steps_within(self, pid: int, examples: int) -> int:
        """The most local steps of client ``pid`` that fit in ``examples`` examples."""
        return steps_within(self.sizes[pid], self.local, examples)


@dataclass(frozen=True)
class Plan:
    """One sampled client's fate in a synchronous round, decided on the virtual clock before sending."""

    pid: int
    fate: str  # "train", "partial" (stops at the deadline, sends what it did), "dropout", "late"
    duration: float  # simulated seconds until its reply (or until the server gives up on it)
    max_steps: int | None = None


def plan_round(clock: Heterogeneity, work: Workload, cohort: list[int], rnd: int) -> list[Plan]:
    """Decide, for each sampled client, whether it trains fully, partially, drops out or misses the deadline."""
    plans = []
    for pid in cohort:
        examples = work.examples(pid)
        duration = clock.duration(pid, examples, task=rnd)
        if clock.drops(pid, rnd):
            plans.append(Plan(pid, "dropout", duration))
        elif not clock.late(pid, examples, task=rnd):
            plans.append(Plan(pid, "train", duration))
        elif clock.partial_work and (
            steps := work.steps_within(pid, clock.partial_examples(pid, examples, rnd))
        ):
            plans.append(Plan(pid, "partial", clock.duration(pid, work.examples(pid, steps), rnd), steps))
        else:
            plans.append(Plan(pid, "late", duration))
    return plans


def record_initial(state: RunState, evaluate_fn, on_round, metric: str = "accuracy") -> None:
    """Evaluate and record the initial global model as round 0 (once: not again when resuming at round 0)."""
    if state.initial_recorded:
        return
    loss, score = evaluate_fn(state.arrays)
    state.initial_recorded = True
    on_round(
        {
            schema.ROUND: 0,
            schema.SIM_TIME: 0.0,
            schema.NUM_CLIENTS: 0,
            schema.EVAL_LOSS: loss,
            schema.eval_field(metric): score,
        },
        state,
    )


def evaluate_finite(evaluate_fn, state: RunState, rnd: int, unit: str = "round") -> tuple[float, float]:
    """Evaluate the global model; ``RunError`` when its loss is NaN or Inf (the training diverged)."""
    loss, acc = evaluate_fn(state.arrays)
    if not math.isfinite(loss):
        raise RunError(diverged_message(rnd, [], unit, loss=loss))
    return loss, acc


def _pid(rep: Message) -> int:
    return int(rep.content[keys.METRICS][keys.PARTITION_ID])


@dataclass(frozen=True)
class _Loop:
    """What every round of :func:`run_sync` reads (the clients found, the strategy, the clock...)."""

    grid: Grid
    loop: LoopConfig
    strategy: object
    spec: str
    evaluate_fn: Callable[[ArrayRecord], tuple[float, float]]
    clock: Heterogeneity
    node_of: dict[int, int]
    sizes: dict[int, int]
    work: Workload
    every_round: bool  # DP: no round is skipped, an empty one is noised


def run_sync(
    grid: Grid,
    loop: LoopConfig,
    strategy,
    state: RunState,
    spec: str,
    evaluate_fn: Callable[[ArrayRecord], tuple[float, float]],
    clock: Heterogeneity,
    on_round: Callable[[dict, RunState], None],
) -> RunState:
    """Run synchronous rounds until ``loop.num_rounds``; call ``on_round(record, state)`` after each."""
    node_of, sizes = connect_sizes(grid, loop, spec)
    every_round = base.releases_every_round(strategy)
    ctx = _Loop(
        grid, loop, strategy, spec, evaluate_fn, clock, node_of, sizes, Workload(spec, sizes), every_round
    )
    if every_round and loop.min_replies > 1:
        log.warning(
            "min_replies=%d does not apply with DP noise: every round releases the noised sum of its valid "
            "replies, however few (none: the model plus the noise)",
            loop.min_replies,
        )
    if state.round == 0:
        record_initial(state, evaluate_fn, on_round, loop.metric)
    while state.round < loop.num_rounds and not state.stop_reason:
        state.rollback = checkpoint.mark(state, strategy)  # an interrupt in this round returns here
        record = _sync_round(ctx, state, state.round + 1)
        if record is None:  # the strategy stopped the run (StopRun)
            break
        on_round(record, state)
    return state


def _sync_round(ctx: _Loop, state: RunState, rnd: int) -> dict | None:
    """One synchronous round: its record (``state`` updated), or None when the strategy stops the run."""
    t0 = time.perf_counter()
    probed = {"down": 0, "up": 0}  # bytes of the loss probes a selection rule asks for this round
    plans = {p.pid: p for p in plan_round(ctx.clock, ctx.work, _choose(ctx, state, rnd, probed), rnd)}
    sent = [p for p in plans if plans[p].fate in ("train", "partial")]
    messages = _configure(ctx, state, rnd, plans, sent)
    if messages is None:
        return None
    bytes_up, valid, failures = _train_replies(
        ctx.grid, ctx.strategy, messages, state, ctx.node_of, ctx.loop.round_timeout
    )
    record: dict = {
        schema.ROUND: rnd,
        schema.NUM_CLIENTS: len(valid),
        **failure_fields(failures, f"round {rnd}", "client"),
    }
    record.update(base.round_fields(ctx.strategy, valid.partition_ids))  # e.g. attack=: the attackers
    record[schema.BYTES_DOWN] = comm.message_bytes(messages) + probed["down"]  # serialised, each way
    record[schema.BYTES_UP] = bytes_up + probed["up"]
    waited = _fate_fields(plans, record)
    state.sim_time += ctx.clock.round_time([plans[p].duration for p in sent], waited=waited)
    if not _aggregate_round(ctx, state, rnd, valid, record):
        return None
    if ctx.loop.federated_eval and not record.get(schema.SKIPPED) and sent:
        ids = sample_evaluators(ctx.loop.seed, rnd, sent, ctx.loop.fraction_evaluate)
        evaluators = SampledGrid(ctx.grid, [ctx.node_of[p] for p in ids])
        record.update(
            _federated_eval(
                ctx.grid,
                ctx.strategy,
                rnd,
                state.arrays,
                ctx.spec,
                evaluators,
                ctx.loop.round_timeout,
                ctx.loop.metric,
            )
        )
    state.round = rnd
    record[schema.SIM_TIME] = state.sim_time
    if rnd % ctx.loop.eval_every == 0 or rnd == ctx.loop.num_rounds:
        loss_score = evaluate_finite(ctx.evaluate_fn, state, rnd)
        record[schema.EVAL_LOSS], record[schema.eval_field(ctx.loop.metric)] = loss_score
    record[schema.ROUND_TIME] = time.perf_counter() - t0
    return record


def _choose(ctx: _Loop, state: RunState, rnd: int, probed: dict) -> list[int]:
    """Round ``rnd``'s cohort: the strategy's choice (a selection rule, its probes' bytes added to ``probed``),
    else the seeded sample."""
    loop = ctx.loop
    cohort = base.choose_cohort(
        ctx.strategy,
        rnd,
        loop.num_clients,
        loop.clients_per_round,
        lambda pids: probe_losses(
            ctx.grid, ctx.node_of, pids, state.arrays, ctx.spec, rnd, loop.round_timeout, probed
        ),
        ctx.sizes,
    )
    return (
        sample_cohort(loop.seed, rnd, loop.num_clients, loop.clients_per_round) if cohort is None else cohort
    )


def _configure(ctx: _Loop, state: RunState, rnd: int, plans: dict[int, Plan], sent: list[int]) -> list | None:
    """The strategy's train messages to the clients ``sent`` (none for an empty round, unless DP releases it),
    each told its step limit; None (``state.stop_reason`` set) when the strategy stops the run."""
    view = SampledGrid(ctx.grid, [ctx.node_of[p] for p in sent])
    config = ConfigRecord({keys.RUN_SPEC: ctx.spec})
    try:
        messages = []
        if sent or ctx.every_round:
            messages = list(ctx.strategy.configure_train(rnd, state.arrays, config, view))
    except StopRun as stop:
        log.warning("stopping before round %d: %s", rnd, stop)
        state.stop_reason = str(stop)
        return None
    _limit_partial(messages, plans, {nid: pid for pid, nid in ctx.node_of.items()})
    return messages


def _fate_fields(plans: dict[int, Plan], record: dict) -> bool:
    """Count the clients that dropped out, came late or did part of their work into ``record``; whether the
    server waited for one it did not get."""
    fates = Counter(p.fate for p in plans.values())
    for fate, field_name in (
        ("dropout", schema.DROPPED_OUT),
        ("late", schema.DROPPED_LATE),
        ("partial", schema.PARTIAL_WORK),
    ):
        if fates[fate]:
            record[field_name] = fates[fate]
    return bool(fates["dropout"] or fates["late"])


def _aggregate_round(ctx: _Loop, state: RunState, rnd: int, valid: Cohort, record: dict) -> bool:
    """Aggregate the round's valid replies into ``state.arrays`` (or mark the round skipped in ``record``);
    False (``state.stop_reason`` set) when the strategy stops the run."""
    if len(valid) < ctx.loop.min_replies and not ctx.every_round:
        log.warning(
            "round %d skipped: %d valid replies < min_replies=%d", rnd, len(valid), ctx.loop.min_replies
        )
        record[schema.SKIPPED] = True
        return True
    try:
        arrays, metrics = base.aggregate(ctx.strategy, rnd, valid)
    except StopRun as stop:
        log.warning("stopping at round %d: %s", rnd, stop)
        state.stop_reason = str(stop)
        return False
    except ConfigError as e:  # e.g. Krum with too few valid replies this round: skip, keep going
        log.warning("round %d skipped: %s", rnd, e)
        arrays, metrics = None, None
        record[schema.SKIPPED] = True
    if arrays is not None:
        bad = nonfinite_arrays(arrays)
        if bad:  # the loop stops before adopting it: the outputs keep the last finite model
            raise RunError(diverged_message(rnd, bad))
        state.arrays = arrays
    record.update(_metric_fields(metrics))
    return True


def _train_replies(
    grid: Grid, strategy, messages: list[Message], state: RunState, node_of: dict[int, int], timeout: float
) -> tuple[int, Cohort, list[tuple[str, str]]]:
    """Send a round's train messages: ``(bytes up, the cohort of valid replies in partition order, failures)``.

    The grid boundary, where the replies become the round's one cohort (``fedsim.messages.Cohort``): a grid that
    trains a cohort batched (``send_and_receive_cohort``, the vectorized engine) gives it as it is, screened and
    sized without per-client Messages; the Messages of per-client engines and deployed nodes are decoded
    (``compression=``), screened and stacked into one.
    """
    if not messages:
        return 0, Cohort.from_replies([]), []
    partitions = {n: p for p, n in node_of.items()}
    # sent in partition order, the order the cohort is aggregated in: replies that come back in message order
    # need no reordering (a copy of every model)
    messages = sorted(messages, key=lambda m: partitions.get(m.metadata.dst_node_id, -1))
    if hasattr(grid, "send_and_receive_cohort"):
        replies, cohort = grid.send_and_receive_cohort(messages, timeout=timeout)
        if cohort is not None:
            screened = screen_cohort(cohort, state.arrays, partitions)
            if screened is not None:
                valid, failures = screened
                order = sorted(range(len(valid)), key=valid.partition_ids.__getitem__)
                return comm.cohort_bytes(cohort), valid.take(order), failures
            replies = cohort.replies()  # the per-message screen names what is wrong
    else:
        replies = list(grid.send_and_receive(messages, timeout=timeout))
    bytes_up = comm.message_bytes(replies)  # as sent: compressed updates before decoding
    replies = base.decode_replies(strategy, replies, state.arrays)
    valid, failures = screen_replies(replies, state.arrays, partitions)
    failures += [("timeout", "no reply in time")] * (len(messages) - len(replies))
    valid.sort(key=_pid)
    return bytes_up, Cohort.from_replies(valid), failures


def failure_fields(failures: list[tuple[str, str]], where: str, unit: str) -> dict:
    """``failures`` and ``failure_kinds`` for metrics.jsonl; logs one line per kind (``where: n unit(s) failed``)."""
    lost = next((d for _, d in failures if "ClientStateError" in d), None)
    if lost is not None:  # the run folder failed, not a client: the run cannot go on as it computes
        raise RunError(f"{where}: {lost[max(0, lost.find('client state')) :].rstrip(chr(39) + '>')}")
    fields: dict = {schema.FAILURES: len(failures)}
    if failures:
        kinds = Counter(k for k, _ in failures)
        fields[schema.FAILURE_KINDS] = dict(kinds)
        for kind, detail in dict(failures).items():  # the last detail of each kind
            log.warning("%s: %d %s(s) failed (%s): %s", where, kinds[kind], unit, kind, detail)
    return fields


def _limit_partial(messages: list[Message], plans: dict[int, Plan], pid_of: dict[int, int]) -> None:
    """Tell each client that must stop at the deadline how many local steps it has.

    Flower's strategies give every message of a round the same RecordDict, so such a client gets its own
    RecordDict (same arrays object, its own ConfigRecord) instead of an edit that all clients would see.
    """
    for msg in messages:
        plan = plans.get(pid_of.get(msg.metadata.dst_node_id, -1))
        if plan is not None and plan.max_steps is not None:
            old = msg.content
            cfg = ConfigRecord({**dict(old[keys.CONFIG].items()), keys.MAX_STEPS: plan.max_steps})
            msg.content = RecordDict({**{k: v for k, v in old.items() if k != keys.CONFIG}, keys.CONFIG: cfg})


def _metric_fields(metrics: MetricRecord | None) -> dict:
    """Aggregated train metrics as metrics.jsonl fields ('-' -> '_'), minus bookkeeping keys."""
    if metrics is None:
        return {}
    skip = {keys.PARTITION_ID, keys.NUM_EXAMPLES, keys.NUM_STEPS, keys.EXAMPLES_PROCESSED}
    return {
        schema.metric_field(k): (float(v) if isinstance(v, (int, float)) else v)
        for k, v in metrics.items()
        if k not in skip
    }


def _has_eval_examples(rep: Message) -> bool:
    """An evaluation reply with a MetricRecord holding a positive ``num-examples`` (others add nothing)."""
    if rep.has_error() or not rep.has_content():
        return False
    m = rep.content.get(keys.METRICS)
    n = m.get(keys.NUM_EXAMPLES) if isinstance(m, MetricRecord) else None
    return isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) and n > 0


def _federated_eval(grid, strategy, rnd, arrays, spec, view, timeout, metric: str = "accuracy") -> dict:
    config = ConfigRecord({keys.RUN_SPEC: spec})
    msgs = list(strategy.configure_evaluate(rnd, arrays, config, view))
    # a client without validation examples has nothing to add (and a cohort of them would divide by zero)
    replies = [r for r in grid.send_and_receive(msgs, timeout=timeout) if _has_eval_examples(r)]
    # a fixed order, so that the float sums do not depend on the order of arrival
    replies.sort(key=lambda r: r.metadata.src_node_id)
    agg = strategy.aggregate_evaluate(rnd, replies) if replies else None
    if agg is None:
        return {}
    out = {
        schema.FED_EVAL_PREFIX + schema.metric_field(k): float(v)
        for k, v in agg.items()
        if k != keys.NUM_EXAMPLES
    }
    # each client evaluated the model it would use (a personalised one where it has one): spread over clients
    scores = [r.content[keys.METRICS].get(keys.eval_metric(metric)) for r in replies]
    if any(s is None for s in scores):  # a stock Flower ClientApp names its metrics its own way
        return out
    scores = [float(s) for s in scores]
    personal = schema.eval_field(metric, "personal_")
    out[personal] = float(np.mean(scores))
    out[personal + "_p10"] = float(np.percentile(scores, 10))
    return out
