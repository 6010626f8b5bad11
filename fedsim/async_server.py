"""The asynchronous server loop (FedAsync, FedBuff), on Flower's ``Grid.push_messages`` / ``pull_messages``.

``concurrency`` clients are kept busy. When a task ends, its update's staleness is the number of server model
versions published since the client received its model; updates staler than ``max_staleness`` are dropped and
counted, the others go to the strategy's ``on_update``, which may publish a new version. The freed client is
replaced at once by a client drawn (seeded) from the idle ones, which receives the current model.

Two clocks, one loop:

* **Simulation** (every local engine): a discrete-event simulation on the virtual clock. Each task's simulated
  duration is known when it is sent (``fedsim.clock.Heterogeneity``: speed, work, network delay, stragglers),
  so the loop always handles the in-flight task with the earliest simulated finish time, whatever order the
  engine computes them in. Tasks whose client drops out, or that would run past ``heterogeneity.deadline``, are
  never sent: the server notices them at the deadline (or, for a dropout without one, when the task would
  have ended). A seeded run therefore gives the same metrics on ``inprocess``, ``ray`` and ``vectorized``.
* **Deployment** (the SuperLink's grid, or ``strategy.wall_clock=true``): real arrival order; ``sim_time`` is
  wall-clock seconds; a task without a reply after ``round_timeout`` seconds is abandoned and counted.

A checkpoint holds the in-flight tasks with the models they started from, so a resumed run re-sends them and
continues exactly where it stopped.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedsim import checkpoint, keys, schema
from fedsim.clock import Heterogeneity
from fedsim.errors import RunError
from fedsim.grid_utils import diverged_message, nonfinite_arrays, screen_replies
from fedsim.seeds import Purpose
from fedsim.seeds import rng as seeded_rng
from fedsim.server import Workload, connect_sizes, evaluate_finite, failure_fields, record_initial
from fedsim.state import LoopConfig, RunState

log = logging.getLogger("fedsim")

POLL = 0.005  # seconds between polls of the grid for a reply
MAX_IDLE_TASKS = 1000  # tasks in a row without a new model version before the loop gives up


@dataclass
class Task:
    """One unit of client work in flight."""

    pid: int
    task: int  # dispatch counter: seeds the client's training and the clock's per-task draws
    version: int  # server model version the client started from
    start: float  # simulated (or wall) time it was sent
    finish: float  # simulated time its reply arrives (or the server gives up on it)
    fate: str  # "train", "dropout" or "late"
    msg_id: str | None = None


@dataclass
class Pending:
    """Statistics of the updates since the last published version."""

    staleness: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    dropped_stale: int = 0
    dropped_out: int = 0
    dropped_late: int = 0
    failures: list = field(default_factory=list)


def choose_client(seed: int, task: int, num_clients: int, busy: set[int]) -> int:
    """The client that gets task ``task``: a seeded uniform draw among the clients not busy.

    Rejection sampling over the whole population, so the cost does not grow with it (at least one client
    is idle whenever the loop asks).
    """
    rng = seeded_rng(seed, Purpose.ASYNC_TASK, task)
    while (pid := int(rng.integers(num_clients))) in busy:
        pass
    return pid


def _to_state_dicts(parts: dict) -> dict:
    return {**parts, "models": {v: rec.to_torch_state_dict() for v, rec in parts["models"].items()}}


class _Snapshot:
    """Stands in ``RunState.async_loop`` for the loop's state; pickled (by a checkpoint) as ``AsyncLoop.snapshot()``.

    Converting the start models of tasks in flight costs a copy, so it is done only when a checkpoint is written.
    """

    def __init__(self, run: AsyncLoop) -> None:
        self.run = run

    def to_plain(self) -> dict:
        """What a checkpoint keeps: ``AsyncLoop.snapshot()`` now."""
        return self.run.snapshot()

    def __reduce__(self):
        return (dict, (self.to_plain(),))


class _Frozen:
    """The loop's state at one moment (``AsyncLoop.parts()``), pickled as ``snapshot()`` would have been then."""

    def __init__(self, parts: dict) -> None:
        self.parts = parts

    def to_plain(self) -> dict:
        """What a checkpoint keeps: ``snapshot()`` as it was when the parts were taken."""
        return _to_state_dicts(self.parts)

    def __reduce__(self):
        return (dict, (self.to_plain(),))


def train_message(
    arrays: ArrayRecord, spec: str, version: int, task: int, node_id: int, extra: dict | None = None
) -> Message:
    """A train instruction carrying the current model, its version, the task index and the strategy's ``extra``."""
    config = ConfigRecord(
        {
            keys.RUN_SPEC: spec,
            keys.MODEL_VERSION: version,
            keys.SERVER_ROUND: version,
            keys.TASK_ID: task,
            **(extra or {}),
        }
    )
    return Message(RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config}), node_id, MessageType.TRAIN)


class AsyncLoop:
    """State and steps of one asynchronous run (see the module docstring)."""

    def __init__(
        self,
        grid: Grid,
        loop: LoopConfig,
        strategy,
        state: RunState,
        spec: str,
        clock: Heterogeneity,
        wall_clock: bool,
    ) -> None:
        self.grid, self.loop, self.strategy, self.state, self.spec = grid, loop, strategy, state, spec
        self.clock, self.wall_clock = clock, wall_clock
        self.concurrency = int(strategy.concurrency)
        self.max_staleness = strategy.max_staleness
        self.node_of, sizes = connect_sizes(grid, loop, spec)
        self.work = Workload(spec, sizes)
        self.inflight: list[tuple[float, int, Task]] = []  # heap by (finish, task)
        self.models: dict[int, ArrayRecord] = {}  # start model of every version a task in flight holds
        self.next_task = 0
        self.pending = Pending()
        self.totals: Counter = Counter()
        self.t0 = time.monotonic() - (state.sim_time if wall_clock else 0.0)
        self.idle_tasks = 0
        self._early: list[Message] = []
        self._replies: dict[str, Message] = {}  # simulation: replies computed ahead of their turn

    # ------------------------------------------------------------------ dispatch
    def now(self) -> float:
        """Current time: the virtual clock, or wall seconds since the run began (deployment)."""
        return time.monotonic() - self.t0 if self.wall_clock else self.state.sim_time

    def busy(self) -> set[int]:
        return {t.pid for _, _, t in self.inflight}

    def fill(self) -> None:
        """Send work to idle clients until ``concurrency`` tasks are in flight."""
        busy = self.busy()
        while len(self.inflight) < self.concurrency:
            pid = choose_client(self.loop.seed, self.next_task, self.loop.num_clients, busy)
            self.dispatch(pid, self.next_task, self.state.round, self.state.arrays, self.now())
            busy.add(pid)
            self.next_task += 1

    def _train_config(self) -> dict:
        """What the strategy adds to every train message's config (e.g. ``proximal-mu``)."""
        return getattr(self.strategy, "train_config", dict)()

    def dispatch(self, pid: int, task: int, version: int, arrays: ArrayRecord, start: float) -> None:
        """Decide the task's fate on the clock, send it unless the client will not answer, track it."""
        examples = self.work.examples(pid)
        duration = self.clock.duration(pid, examples, task=task)
        fate = "train"
        if not self.wall_clock:
            deadline = self.clock.deadline
            if self.clock.drops(pid, task):
                fate, duration = "dropout", (deadline if deadline is not None else duration)
            elif self.clock.late(pid, examples, task=task):
                fate, duration = "late", deadline
        t = Task(pid, task, version, start, start + duration, fate)
        if fate == "train":
            self.models.setdefault(version, arrays)
            msg = train_message(arrays, self.spec, version, task, self.node_of[pid], self._train_config())
            ids = list(self.grid.push_messages([msg]))
            if not ids:
                raise RunError(f"the grid refused a train message for partition {pid}")
            t.msg_id = ids[0]
        heapq.heappush(self.inflight, (t.finish, t.task, t))

    # ------------------------------------------------------------------ events
    def next_event(self) -> tuple[Task, Message | None]:
        """The next finished task and its reply (None: no reply, i.e. dropout, late or timed out)."""
        if not self.wall_clock:
            _, _, t = heapq.heappop(self.inflight)
            self.state.sim_time = max(self.state.sim_time, t.finish)
            return t, (self.wait_for(t) if t.fate == "train" else None)
        return self.next_arrival()

    def wait_for(self, t: Task) -> Message | None:
        """The reply to ``t``, polling the grid up to ``round_timeout`` seconds (None on timeout).

        Every task in flight is asked for at once: their content is fixed when they are sent, so computing
        them ahead changes nothing, and local engines can run them together (worker pool, one vmap batch).
        """
        end = time.monotonic() + self.loop.round_timeout
        while t.msg_id not in self._replies:
            wanted = [
                x.msg_id
                for _, _, x in self.inflight
                if x.msg_id is not None and x.msg_id not in self._replies
            ]
            for rep in self.grid.pull_messages([t.msg_id, *(m for m in wanted if m != t.msg_id)]):
                self._replies[rep.metadata.reply_to_message_id] = rep
            if t.msg_id in self._replies:
                break
            if time.monotonic() > end:
                return None
            time.sleep(POLL)
        return self._replies.pop(t.msg_id)

    def next_arrival(self) -> tuple[Task, Message | None]:
        """Deployment: the first reply to arrive, or the first task past its timeout."""
        by_id = {t.msg_id: t for _, _, t in self.inflight}
        while True:
            now = self.now()
            if self._early:  # replies pulled together earlier, handled one at a time in arrival order
                rep = self._early.pop(0)
                return self._take(by_id[rep.metadata.reply_to_message_id], now), rep
            self._early = [
                r for r in self.grid.pull_messages(list(by_id)) if r.metadata.reply_to_message_id in by_id
            ]
            if self._early:
                continue
            expired = [t for t in by_id.values() if now - t.start > self.loop.round_timeout]
            if expired:
                t = min(expired, key=lambda x: x.start)
                return self._take(t, now), None
            time.sleep(POLL)

    def _take(self, t: Task, now: float) -> Task:
        self.inflight = [e for e in self.inflight if e[2] is not t]
        heapq.heapify(self.inflight)
        t.finish = now
        self.state.sim_time = now
        return t

    # ------------------------------------------------------------------ processing
    def handle(self, t: Task, reply: Message | None) -> bool:
        """Account for one finished task; return True when it published a new server model version."""
        p = self.pending
        if reply is None:
            if t.fate == "dropout":
                p.dropped_out += 1
            elif t.fate == "late":
                p.dropped_late += 1
            else:
                p.failures.append(
                    ("timeout", f"no reply from partition {t.pid} in {self.loop.round_timeout:.0f} s")
                )
            return False
        start = self.models[t.version]
        # a stock Flower ClientApp reports no partition-id: its reply is this task's partition
        valid, failures = screen_replies([reply], self.state.arrays, {self.node_of[t.pid]: t.pid})
        if failures:
            p.failures.extend(failures)
            return False
        staleness = self.state.round - t.version
        if self.max_staleness is not None and staleness > self.max_staleness:
            p.dropped_stale += 1
            return False
        m = valid[0].content[keys.METRICS]
        p.staleness.append(staleness)
        p.losses.append(float(m.get(keys.TRAIN_LOSS, float("nan"))))
        new = self.strategy.on_update(
            self.state.arrays,
            valid[0].content[keys.ARRAYS],
            start,
            staleness,
            int(m.get(keys.NUM_EXAMPLES, 0)),
        )
        if new is None:
            return False
        bad = nonfinite_arrays(new)
        if bad:
            raise RunError(diverged_message(self.state.round + 1, bad, "version"))
        self.state.arrays = new
        self.state.round += 1
        self.models.setdefault(self.state.round, new)
        return True

    def forget_unused_models(self) -> None:
        live = {t.version for _, _, t in self.inflight if t.fate == "train"}
        for v in [v for v in self.models if v not in live and v != self.state.round]:
            del self.models[v]

    def record(self, wall_start: float) -> dict:
        """The metrics.jsonl line of the version just published; resets the pending statistics."""
        p = self.pending
        rec: dict = {
            schema.ROUND: self.state.round,
            schema.SIM_TIME: self.state.sim_time,
            schema.NUM_CLIENTS: len(p.staleness),
            schema.TRAIN_LOSS: float(np.mean(p.losses)) if p.losses else None,
            schema.STALENESS_MEAN: float(np.mean(p.staleness)),
            schema.STALENESS_MAX: int(max(p.staleness)),
            schema.DROPPED_STALE: p.dropped_stale,
            **failure_fields(p.failures, f"version {self.state.round}", "task"),
        }
        if p.dropped_out:
            rec[schema.DROPPED_OUT] = p.dropped_out
        if p.dropped_late:
            rec[schema.DROPPED_LATE] = p.dropped_late
        self.totals.update(
            {
                "updates": len(p.staleness),
                schema.DROPPED_STALE: p.dropped_stale,
                schema.FAILURES: len(p.failures),
                schema.DROPPED_OUT: p.dropped_out,
                schema.DROPPED_LATE: p.dropped_late,
            }
        )
        rec[schema.UPDATES_TOTAL] = self.totals["updates"]
        rec[schema.ROUND_TIME] = time.perf_counter() - wall_start
        self.pending = Pending()
        return rec

    # ------------------------------------------------------------------ checkpoints
    def parts(self) -> dict:
        """``snapshot()`` with the start models still as (never changed in place) records: cheap to take."""
        return {
            "next_task": self.next_task,
            "inflight": [asdict(t) for _, _, t in sorted(self.inflight, key=lambda e: (e[0], e[1]))],
            "models": {
                v: rec
                for v, rec in self.models.items()
                if any(t.version == v and t.fate == "train" for _, _, t in self.inflight)
            },
            "totals": dict(self.totals),
        }

    def snapshot(self) -> dict:
        """What a checkpoint needs to continue: tasks in flight with their start models, counters."""
        return _to_state_dicts(self.parts())

    def restore(self, snap: dict) -> None:
        """Continue from ``snapshot()``: re-send every task that was in flight, from its own start model."""
        self.next_task = int(snap["next_task"])
        self.totals = Counter(snap.get("totals", {}))
        models = {int(v): ArrayRecord(sd) for v, sd in snap["models"].items()}
        for d in snap["inflight"]:
            t = Task(**{**d, "msg_id": None})
            if t.fate == "train":
                arrays = models[t.version]
                self.models.setdefault(t.version, arrays)
                msg = train_message(
                    arrays, self.spec, t.version, t.task, self.node_of[t.pid], self._train_config()
                )
                t.msg_id = list(self.grid.push_messages([msg]))[0]
            heapq.heappush(self.inflight, (t.finish, t.task, t))


def run_async(
    grid: Grid,
    loop: LoopConfig,
    strategy,
    state: RunState,
    spec: str,
    evaluate_fn: Callable[[ArrayRecord], tuple[float, float]],
    clock: Heterogeneity,
    on_round: Callable[[dict, RunState], None],
    wall_clock: bool | None = None,
) -> RunState:
    """Run the asynchronous loop until ``loop.num_rounds`` server model versions exist.

    ``wall_clock``: real arrival order (deployment); default: the strategy's ``wall_clock`` attribute.
    """
    if wall_clock is None:
        wall_clock = strategy.wall_clock
    run = AsyncLoop(grid, loop, strategy, state, spec, clock, wall_clock)
    if state.round == 0 and state.async_loop is None:
        record_initial(state, evaluate_fn, on_round, loop.metric)
    if state.async_loop is not None:
        run.restore(state.async_loop)
    wall_start = time.perf_counter()
    if state.round < loop.num_rounds:
        run.fill()
    state.rollback = checkpoint.mark(state, strategy, _Frozen(run.parts()))  # an interrupt returns here
    try:
        while state.round < loop.num_rounds and not state.stop_reason:
            run.fill()
            t, reply = run.next_event()
            if not run.handle(t, reply):
                run.idle_tasks += 1
                if run.idle_tasks >= MAX_IDLE_TASKS:
                    p = run.pending
                    kinds = dict(Counter(k for k, _ in p.failures))
                    raise RunError(
                        f"{MAX_IDLE_TASKS} tasks in a row gave no usable update ({p.dropped_out} dropped out, "
                        f"{p.dropped_late} past the deadline, {p.dropped_stale} staler than max_staleness, "
                        f"failures {kinds}); check heterogeneity, faults, max_staleness and the clients"
                    )
                continue
            run.idle_tasks = 0
            run.forget_unused_models()
            record = run.record(wall_start)
            if state.round % loop.eval_every == 0 or state.round == loop.num_rounds:
                loss_acc = evaluate_finite(evaluate_fn, state, state.round, "version")
                record[schema.EVAL_LOSS], record[schema.eval_field(loop.metric)] = loss_acc
            state.async_loop = _Snapshot(run)
            on_round(record, state)
            if state.round < loop.num_rounds and not state.stop_reason:
                run.fill()  # the next tasks are part of the continuation an interrupt returns to
            state.rollback = checkpoint.mark(state, strategy, _Frozen(run.parts()))
            wall_start = time.perf_counter()
    finally:
        state.async_loop = run.snapshot()
    return state
