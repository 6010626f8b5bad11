"""The ``vectorized`` engine: a cohort's train messages trained at once, as one batched model.

``VectorizedGrid.send_and_receive`` takes the batch of train messages of a round and, instead of running
the ClientApp once per client, stacks the clients' parameters (``(clients, *shape)`` per tensor) and runs
``torch.func.vmap(torch.func.functional_call(model, ...))`` over them, one optimiser step for the whole
cohort at a time. Each client still takes exactly its own steps on its own batches in the same order as the
sequential ClientApp (the same seeded ``torch.randperm`` per pass, the same partial last batch):

1. schedule: per client, the index list of every step, from the generator the ClientApp would seed (what
   does not change between rounds, the client's task, checks, step lengths and group, is kept in its plan,
   ``_Plan``: a round seeds the generators and draws the batch orders);
2. bucket: clients grouped by batch size (powers of two), so padding wastes at most half a batch; inside a
   bucket, clients are sorted by step count and step ``t`` trains only the prefix still active, so no client
   takes an extra step (momentum buffers and weight decay included);
3. step: gather the padded batches ``(k, B, ...)``, per-client mean loss through a 0/1-over-b weight mask,
   one backward for the cohort (clients are independent, so the gradient of the summed loss with respect to
   the stacked parameters is each client's own gradient), then FedProx's term and the SGD update of
   ``fedsim.local`` (weight decay, momentum, Nesterov), the functions a client's own training applies; after the last step,
   the client halves the messages ask for, on the rows (``ClientHalf.on_rows``: client-side clipping, a user's
   half; each half also gives every client's labels, e.g. label flipping);
4. reply: each client's full weights and the ClientApp's metrics keys, kept stacked on the device
   (``fedsim.messages.Cohort``): ``send_and_receive_cohort`` hands them to the server loop as the round's
   cohort, which every aggregator and wrapper takes as it is; every other caller
   gets one Flower reply Message per client, an ArrayRecord of its weights and a MetricRecord.

Supported: SGD, momentum, Nesterov, weight decay, ``local_epochs``/``local_steps``, any ``batch_size``
(0 = full batch), ``proximal-mu``. Run through the ordinary ClientApp (sequentially in this process)
instead, with one log line per reason: non-train messages (query, evaluate), Adam and averaged SGD,
train-config keys that neither the batched step nor a client half of the run claims (``ClientHalf.keys``), a
client half that says it does not run on this client's row (``ClientHalf.batched``: injected faults, the
halves that keep client state such as compression's), models with buffers (BatchNorm), dropout, frozen or tied
parameters, and, by default, convolutional models on the CPU that are not a plain ``nn.Sequential`` of
conv/pool/linear layers: there vmap turns ``conv2d`` into a grouped convolution that measured 1.2-3.5x slower
than per-client convolutions (``engine.vmap_conv_cpu=true`` forces it). Sequential conv nets on the CPU are
batched by ``fedsim.engines.grouped`` (grouped convolutions in one layout, a few clients per chunk), faster
than per client. If batched training raises, its clients are rerun sequentially.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import time
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Message, MessageType
from torch import nn
from torch.func import functional_call, vmap

from fedsim import keys
from fedsim.algorithms.halves import ClientHalf, RowHalves, Rows, chain, row_halves, run_on_rows
from fedsim.build import ClientTask, client_task
from fedsim.engines import dense, grouped
from fedsim.engines.memory import (  # noqa: F401
    _MODEL_INFO,
    _model_info,
    _names,
    activation_bytes,
    client_bytes,
    estimate_bytes,
    free_bytes,
    unsupported,
)
from fedsim.engines.pool import PoolGrid
from fedsim.engines.schedule import (  # noqa: F401  (tests read them here)
    Schedule,
    _draw,
    _info,
    _layout,
    _order,
    _parts,
    _Steps,
    _steps,
    cohort_batches,
    schedule,
)
from fedsim.engines.steps import _capacity, _sgd_step, _stack_starts, _StepGraph
from fedsim.messages import (
    DRAW_INDEX_KEYS,
    Cohort,
    TrainInstruction,
    global_state,
    parse_train,
    train_metrics,
)
from fedsim.seeds import torch_generators
from fedsim.tasks import CLASSIFICATION
from fedsim.training import LocalTraining

log = logging.getLogger("fedsim")

VECTOR_OPTIMIZERS = ("sgd", "momentum", "nesterov")
PLANS = 4096  # clients' plans kept (as many as fedsim.build.client_task keeps tasks); then they start again
# The train-config keys the batched step itself runs: the run spec, the step limit, the draw index and the base
# client algorithm's proximal term. The run's client halves claim theirs (``ClientHalf.keys``); a message with a
# key nobody claims runs through the ClientApp (one INFO line the first time), so no client-side setting is
# dropped silently.
STEP_KEYS = frozenset({keys.RUN_SPEC, keys.PROXIMAL_MU, keys.MAX_STEPS, *DRAW_INDEX_KEYS})


def _declares_batched(algorithm: object) -> bool:
    """True when the algorithm's own class declares ``batched = True``: a subclass of a batched algorithm (one
    that overrides a hook, say) does not inherit it, so the engine never skips hooks it does not run."""
    return vars(type(algorithm)).get("batched") is True


@functools.lru_cache(maxsize=64)
def _claimed(spec: str) -> frozenset[str] | None:
    """The train-config keys the batched path runs under ``spec``: the step's and its client halves' (None when
    the spec names a half that cannot be built: the ClientApp replies with the error)."""
    try:
        return STEP_KEYS.union(*(h.keys for h in chain(spec)))
    except (ValueError, TypeError, AttributeError):
        return None


@dataclass
class _Client:
    """One train message prepared for batched training."""

    msg: Message
    task: ClientTask
    start: dict[str, torch.Tensor]  # initial weights, by parameter name
    batches: Sequence[torch.Tensor] = field(default_factory=list)  # example indices of every step, in order
    proximal_mu: float = 0.0
    ins: TrainInstruction | None = None
    plan: _Plan | None = None  # what is the same every round (the engine's cache)
    halves: RowHalves = RowHalves()  # the client halves its instruction asks for (fedsim.algorithms.halves)
    y: torch.Tensor | None = None  # the labels it trains on (its halves' ``labels``; None: its task's)


@dataclass(eq=False)
class _Plan:
    """What the engine needs of one client that is the same every round, for one instruction (run spec, step
    limit, FedProx mu): kept while ``fedsim.build.client_task`` returns the same task object for the client (a
    new task, e.g. after ``release_client_tasks``, makes a new plan). Each round only seeds the client's
    generator and draws its batch order (``_draw``)."""

    task: weakref.ref  # the task it was made for (not kept alive by the plan)
    algorithm: str | None = None  # why it runs through the ClientApp: its client algorithm
    reason: str | None = None  # ... or its faults, optimiser or model
    n: int = 0  # training examples
    info: _Steps | None = None  # its steps (``_layout``)
    passes: int = 0  # passes over its data the steps take
    group: tuple = ()  # (model id, local training, device, mu): clients trained together (one object per group)


class VectorizedGrid(PoolGrid):
    """A local Grid that trains each batch of train messages as one vmapped model (see the module docstring).

    Parameters
    ----------
    num_nodes : int
        Population size.
    threads : int, optional
        Torch threads while training a cohort (None: all cores).
    max_cohort : int
        At most this many clients per batched step (0: no limit); bounds activation memory.
    vmap_conv_cpu : bool
        Also batch convolutional models that ``fedsim.engines.grouped`` does not handle on the CPU, with vmap
        (slower there; see the module docstring).
    workers : int
        Worker processes for the messages that run through the ClientApp (1: in this process).
    """

    def __init__(
        self,
        num_nodes: int,
        threads: int | None = None,
        max_cohort: int = 0,
        vmap_conv_cpu: bool = False,
        node_config: dict | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(num_nodes, workers=workers, node_config=node_config)
        self._threads = int(threads or os.cpu_count() or 1)
        self._max_cohort = int(max_cohort)
        self._vmap_conv_cpu = bool(vmap_conv_cpu)
        self._reported: set[str] = set()
        self._model_checks: dict[tuple, str | None] = {}  # (model id, device) -> why it cannot be batched
        self._fits: dict[str, int] = {}  # device -> the most clients per batch that did not run out of memory
        self._plans: dict[tuple, _Plan] = {}  # (spec, partition, max steps, mu) -> the client's plan
        self._groups: dict[tuple, tuple] = {}  # one object per group key (grouped by identity every round)
        self._bytes: dict[tuple, tuple] = {}  # (model id, ...) -> (model, bytes a client, chunked on the CPU)

    def send_and_receive_cohort(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> tuple[list[Message], Cohort | None]:
        """``send_and_receive``, keeping the replies of a cohort trained batched as stacked tensors.

        ``([], stacked)`` when every message was trained batched (rows in message order), else
        ``(replies, None)`` exactly as ``send_and_receive`` returns them.
        """
        messages = list(messages)
        ids = list(self.push_messages(messages))
        batch = [self._pending.pop(mid) for mid in ids]
        done, parts = self._run_stacked(batch, None if timeout is None else time.monotonic() + timeout)
        if parts and not done and len(ids) == len(messages) and sum(map(len, parts)) == len(ids):
            # the rows in the order the messages were pushed (one copy from the parts, sorted by step count)
            row = {id(msg): i for i, msg in enumerate(m for p in parts for m in p.messages)}
            stacked = Cohort.concat(parts, [row[id(msg)] for msg in batch])
            if stacked is not None:
                return [], stacked
        for part in parts:
            done.update(_by_id(part))
        return [done[mid] for mid in ids if mid in done], None

    def _run_batch(self, batch: list[Message], deadline: float | None) -> dict[str, Message]:
        done, parts = self._run_stacked(batch, deadline)
        for part in parts:
            done.update(_by_id(part))
        return done

    def _run_stacked(
        self, batch: list[Message], deadline: float | None
    ) -> tuple[dict[str, Message], list[Cohort]]:
        """Run ``batch``: the replies of the messages run through the ClientApp (by message id), and the
        stacked replies of those trained batched."""
        # strategies send one RecordDict (config, ArrayRecord) to the whole cohort: read and convert it once
        shared: dict[int, tuple] = {}
        prepared = [(msg, self._prepare(msg, shared)) for msg in batch]
        todo = [c for _, c in prepared if c is not None]
        rows = [c.ins.generator_row(c.task.seed, c.task.partition_id) for c in todo]
        for c, gen in zip(todo, torch_generators(rows)):  # the cohort's seeds computed together
            c.batches = _draw(c.plan.n, c.plan.info, c.plan.passes, gen)  # this round's batch order
        clients = [c for c in todo if c.plan.passes]
        rest = [msg for msg, c in prepared if c is None or not c.plan.passes]
        done = super()._run_batch(rest, deadline) if rest else {}
        groups: dict[int, tuple[tuple, list[_Client]]] = {}
        for c in clients:
            groups.setdefault(id(c.plan.group), (c.plan.group, []))[1].append(c)
        items = list(groups.values())
        devices = {key[2] for key, _ in items}
        if len(devices) > 1 and all(torch.device(d).type == "cuda" for d in devices):
            # the cohort's clients sit on several GPUs (partition id mod GPUs): one thread per GPU
            with ThreadPoolExecutor(len(devices)) as pool:
                results = list(pool.map(self._attempt, items))
        else:
            results = [self._attempt(item) for item in items]
        parts: list[Cohort] = []
        for (_, group), stacked, why in results:
            if stacked is not None:
                parts.extend(stacked)
                continue
            # outside the except block, so that the failed batch's tensors are freed before the ClientApp runs
            log.warning("vectorized training failed (%s); running %d clients sequentially", why, len(group))
            done.update(super()._run_batch([c.msg for c in group], deadline))
        return done, parts

    def _attempt(self, item: tuple) -> tuple:
        """Batched training of one group: ``(item, stacked replies, None)``, or ``(item, None, why)`` when it
        failed."""
        (_, local, device, mu), group = item
        try:
            return item, self._train(group, local, device, mu), None
        except Exception as exc:  # noqa: BLE001  (the ClientApp path gives each client its own reply)
            return item, None, f"{type(exc).__name__}: {exc}"

    def _skip(self, reason: str) -> None:
        if reason not in self._reported:
            self._reported.add(reason)
            log.info("vectorized engine: running train messages through the ClientApp: %s", reason)

    def _prepare(self, msg: Message, shared: dict) -> _Client | None:
        """The batched-training view of a train message, or None to run it through the ClientApp.

        ``shared`` holds what the batch's messages share, read once: per RecordDict object, its instruction;
        per ArrayRecord object, its start model. What depends on the client alone comes from its plan.
        """
        meta = msg.metadata
        if meta.message_type != MessageType.TRAIN or not msg.has_content():
            return None
        content = msg.content
        entry = shared.get(id(content))  # (both objects are kept in ``shared``: their ids stay unique)
        if entry is None:
            entry = shared[id(content)] = (content, *self._instruction(content))
        _, arrays, ins, extra, halves = entry
        if ins is None:
            return None
        task, plan = self._plan(ins, self.partition_of(meta.dst_node_id))
        if plan is None:
            return None
        reason = plan.algorithm or ("extra arrays in the train message" if extra else plan.reason)
        reason = reason or (halves.refused and f"client half {halves.refused}")
        for half in halves.ask:  # a half that says per client whether it runs on the client's row
            if reason is None and not half.batched(ins, task):
                reason = f"client half {type(half).__name__}"
        if reason is not None:
            self._skip(reason)
            return None
        entry = shared.get(id(arrays))
        if entry is None:  # parsed once per record (shared with the server's evaluation)
            start = global_state(arrays)
            entry = shared[id(arrays)] = (arrays, start, {n: tuple(t.shape) for n, t in start.items()}, {})
        _, start, shapes, fits = entry
        model = task.model
        fit = fits.get(id(model))
        if fit is None:
            fit = fits[id(model)] = shapes == _model_info(model)[2]
        if not fit:
            return None  # the ClientApp's strict load reports the mismatch
        y = task.y_train
        for half in halves.relabel:
            y = half.labels(ins, task.partition_id, y, task.num_classes)
        return _Client(msg, task, start, proximal_mu=ins.proximal_mu, ins=ins, plan=plan, halves=halves, y=y)

    def _plan(self, ins: TrainInstruction, pid: int) -> tuple[ClientTask | None, _Plan | None]:
        """Client ``pid``'s task and plan under ``ins`` (None when its task cannot be built: the ClientApp
        replies)."""
        try:
            task = client_task(ins.spec, pid)  # cached per process: the same object every round
        except Exception:  # noqa: BLE001  (the ClientApp turns it into this client's error reply)
            return None, None
        key = (ins.spec, pid, ins.max_steps, ins.proximal_mu)
        plan = self._plans.get(key)
        if plan is not None and plan.task() is task:
            return task, plan
        plan = _Plan(weakref.ref(task))
        if task.algorithm is not None and not _declares_batched(task.algorithm):
            plan.algorithm = f"client algorithm {type(task.algorithm).__name__}"
        elif task.local.optimizer not in VECTOR_OPTIMIZERS:
            plan.reason = f"optimizer {task.local.optimizer} (batched: {', '.join(VECTOR_OPTIMIZERS)})"
        else:
            mkey = (id(task.model), task.device)
            if mkey not in self._model_checks:
                self._model_checks[mkey] = unsupported(
                    task.model, torch.device(task.device).type, self._vmap_conv_cpu
                )
            plan.reason = self._model_checks[mkey]
        plan.n = int(task.x_train.shape[0])
        plan.info, plan.passes = _layout(plan.n, task.local, ins.max_steps)
        if (
            len(self._plans) >= PLANS or len(self._groups) >= PLANS
        ):  # beyond the task cache's size: start again
            self._plans.clear()
            self._groups.clear()
        group = (id(task.model), task.local, task.device, ins.proximal_mu)
        plan.group = self._groups.setdefault(group, group)
        self._plans[key] = plan
        return task, plan

    def _instruction(self, content) -> tuple:
        """A train message's start model, instruction (None when no client of it can be trained batched),
        whether it holds arrays besides the model, and the client halves it asks for."""
        cfg = content.get(keys.CONFIG)
        arrays = content.get(keys.ARRAYS)
        if cfg is None or arrays is None or not isinstance(cfg.get(keys.RUN_SPEC), str):
            return None, None, False, ()
        claimed = _claimed(cfg[keys.RUN_SPEC])
        if claimed is None:
            return None, None, False, ()
        ins = parse_train(cfg)
        extra = set(cfg.keys()) - claimed
        if extra:  # unknown to fedsim, or a user's setting that no client half of the run claims
            self._skip(f"train config keys no batched step or client half claims: {', '.join(sorted(extra))}")
            return None, None, False, ()
        halves = row_halves(cfg[keys.RUN_SPEC], ins)
        return arrays, ins, any(name != keys.ARRAYS for name in content.array_records), halves

    def _train(self, clients: list[_Client], local: LocalTraining, device: str, mu: float) -> list[Cohort]:
        """Train ``clients`` (same model, optimiser and mu) batched; their replies, stacked, a part per batch."""
        buckets: dict[int, list[_Client]] = {}
        for c in clients:
            buckets.setdefault(_info(c.batches).bucket, []).append(c)
        threads = torch.get_num_threads()
        torch.set_num_threads(self._threads)
        try:
            done = []
            for members in buckets.values():
                members.sort(key=lambda c: -len(c.batches))  # the active clients of any step are a prefix
                start = 0
                while start < len(members):
                    size = self._chunk(members[start:], local, device, mu)
                    chunk = members[start : start + size]
                    stacked = _try_bucket(chunk, local, device, mu)
                    if stacked is None:  # out of memory: the next try is a smaller chunk
                        self._shrink(device, len(chunk))
                        continue
                    if len(chunk) < len(clients) and torch.device(device).type == "cuda":
                        stacked = stacked.to("cpu")  # the next batches need the GPU's memory
                    done.append(stacked)
                    start += len(chunk)
            return done
        finally:
            torch.set_num_threads(threads)

    def _chunk(self, members: list[_Client], local: LocalTraining, device: str, mu: float) -> int:
        """Clients in the next batch: at most ``max_cohort``, what the memory estimate says fits, and what fit."""
        size = len(members)
        if self._max_cohort:
            size = min(size, self._max_cohort)
        model, x = members[0].task.model, members[0].task.x_train
        width = max((_info(c.batches).lens[0] for c in members if c.batches), default=1)
        key = (id(model), tuple(x.shape[1:]), x.dtype, local, width, mu, device)
        known = self._bytes.get(key)
        if known is None or known[0]() is not model:  # the same for every cohort of this model and width
            if len(self._bytes) >= 256:
                self._bytes.clear()
            chunked = torch.device(device).type == "cpu" and grouped.supports(model)
            per_client = estimate_bytes(model, x, members, local, mu)
            known = self._bytes[key] = (weakref.ref(model), per_client, chunked)
        _, per_client, chunked = known
        if chunked:
            size = min(size, grouped.CPU_CHUNK)  # a few clients at a time: their activations stay in cache
        if device in self._fits:
            size = min(size, self._fits[device])
        fit = max(1, int(0.8 * free_bytes(device) // max(per_client, 1)))
        if fit < size:
            self._skip_once(
                f"memory: about {per_client / 2**20:.1f} MiB per client, {fit} clients per batch on {device}"
            )
            size = fit
        return size

    def _shrink(self, device: str, tried: int) -> None:
        """After an out-of-memory error with ``tried`` clients: half as many from now on (then: sequential)."""
        if tried <= 1:
            raise torch.OutOfMemoryError(f"one client's batched training does not fit on {device}")
        self._fits[device] = tried // 2
        log.warning(
            "vectorized engine: out of memory with %d clients per batch on %s; %d from now on",
            tried,
            device,
            tried // 2,
        )

    def _skip_once(self, message: str) -> None:
        if message not in self._reported:
            self._reported.add(message)
            log.info("vectorized engine: %s", message)


def _try_bucket(members: list[_Client], local: LocalTraining, device: str, mu: float) -> Cohort | None:
    """``_train_bucket``, or None when it runs out of memory (with the memory it held released)."""
    try:
        return _train_bucket(members, local, device, mu)
    except torch.OutOfMemoryError:
        pass  # leave the except block first: its traceback holds the failed batch's tensors
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return None


_DENSE: dict[tuple, dense.DenseStep | None] = {}  # (model id, task) -> the model's hand-written batched step


def _dense_step(model: nn.Module, task) -> dense.DenseStep | None:
    """The hand-written batched step of an MLP (``fedsim.engines.dense``), or None for other models."""
    key = (id(model), task)
    if key not in _DENSE:
        _DENSE[key] = dense.DenseStep(model, task) if dense.supports(model) else None
    return _DENSE[key]


def _train_bucket(members: list[_Client], local: LocalTraining, device: str, mu: float) -> Cohort:
    """Batched local training of clients sorted by step count (descending); their replies, stacked (rows in
    ``members`` order, models on ``device``)."""
    names = _names(members[0].task.model)
    params, losses = train_stacked(members, local, device, mu)
    params = {n: params[n].detach() for n in names}
    extra = _apply_halves(members, names, params)
    metrics = [
        train_metrics(
            num_examples=int(c.task.x_train.shape[0]),
            loss=losses[i] / len(c.batches),
            partition_id=c.task.partition_id,
            steps=len(c.batches),
            examples_processed=_info(c.batches).total,
            extra=extra[i],
        )
        for i, c in enumerate(members)
    ]
    return Cohort([c.msg for c in members], params, metrics)


def _apply_halves(members: list[_Client], names: list[str], params: dict[str, torch.Tensor]) -> list[dict]:
    """Each client half the members ask for, in the chain's order, on the trained rows (``ClientHalf.on_rows``,
    ``params`` edited in place); each row's extra reply metrics."""
    halves: list[ClientHalf] = []
    for group in {id(c.halves): c.halves.active for c in members}.values():
        halves.extend(h for h in group if h not in halves)
    if not halves:
        return [{} for _ in members]
    device = next(iter(params.values())).device
    rows = Rows(
        params,
        lambda: _stack_starts(members, names, device),
        [c.ins for c in members],
        [c.task.partition_id for c in members],
        [c.task.seed for c in members],
        [c.task.faults for c in members],
    )
    for half in halves:
        run_on_rows(half, rows)
    return rows.metrics


def _by_id(stacked: Cohort) -> dict[str, Message]:
    """The Flower replies of stacked replies, keyed by the id of the message each answers."""
    return {msg.metadata.message_id: rep for msg, rep in zip(stacked.messages, stacked.replies())}


# Capture a cohort's SGD step as a CUDA graph where shapes repeat (see train_stacked). Measured on an H200
# (bench/gpu_check.py, CIFAR-size CNN, 100 clients of 450 examples, 145 steps): 1.46 s -> 0.86 s a round,
# the same models as per-client training (3e-8). A capture that fails falls back to the eager batched steps.
CUDA_GRAPHS = True
# The MLPs' hand-written step (fedsim.engines.dense) under a graph: equal to its eager form on the CPU (test), not
# yet run on a GPU (bench/gpu_check.py agree-mlp-graph checks it); off until it has been.
CUDA_GRAPHS_DENSE = False
_GRAPHS: dict[tuple, _StepGraph | None] = {}  # None: capture failed for that key, eager from then on


def _step_graph(key: tuple, sgd, params, anchor, x, y, capture: bool) -> _StepGraph | None:
    """The static-buffer step of ``key`` (captured as a CUDA graph when ``capture``), made once; None when its
    capture failed (the eager steps from then on)."""
    if key not in _GRAPHS:
        if len(_GRAPHS) >= 16:
            _GRAPHS.clear()
        k_all, width = key[2], key[3]
        try:
            _GRAPHS[key] = _StepGraph(sgd, params, anchor, k_all, width, x, y, capture=capture)
        except (RuntimeError, NotImplementedError) as exc:
            log.warning("vectorized engine: CUDA graph capture failed (%s); eager batched steps", exc)
            _GRAPHS[key] = None
    return _GRAPHS[key]


def train_stacked(
    members: list[_Client], local: LocalTraining, device: str, mu: float, graph: bool | None = None
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The batched steps of clients sorted by step count (descending): their final parameters stacked
    ``(clients, *shape)`` on ``device``, by name, and each client's summed loss over its steps.

    Only ``task`` (model, loss, data), ``start`` and ``batches`` of the members are read. ``graph`` (default:
    :data:`CUDA_GRAPHS` on a CUDA device): when every client takes the same number of steps (every step has
    the same shapes), one step is captured as a CUDA graph on static buffers and replayed for every step (on
    the CPU, ``graph=True`` runs the same static-buffer step without capture: the tests' check of its math).
    """
    model = members[0].task.model
    learnt = members[0].task.task or CLASSIFICATION  # the run's loss (fedsim.tasks)
    names = _names(model)
    k_all, steps = len(members), len(members[0].batches)
    width = max(_info(c.batches).width for c in members)
    ends = np.cumsum(np.bincount([len(c.batches) for c in members], minlength=steps + 1))
    active = (k_all - ends[:steps]).tolist()  # clients still training at each step (a prefix: sorted)
    x, y, gather, weight = cohort_batches(members, steps, width, device)
    params = _stack_starts(members, names, device)  # (clients, *shape)
    anchor = {n: p.clone() for n, p in params.items()} if mu > 0 else None
    step = _dense_step(model, learnt)
    forward = None
    if step is None:
        forward = (
            grouped.grouped_forward(model)
            if torch.device(device).type == "cpu" and grouped.supports(model)
            else vmap(lambda p, xb: functional_call(model, p, (xb,)))
        )
    model.train()
    cuda = torch.device(device).type == "cuda"
    if graph is None:
        graph = CUDA_GRAPHS and cuda and (step is None or CUDA_GRAPHS_DENSE)
    sgd = functools.partial(_sgd_step, step, forward, learnt, names, local, mu)
    if graph and active[-1] == k_all:  # every client takes every step: the shapes repeat
        key = (
            id(model),
            learnt,
            k_all,
            width,
            _capacity(x.shape[0]),
            x.shape[1:],
            x.dtype,
            local,
            mu,
            device,
        )
        found = _step_graph(key, sgd, params, anchor, x, y, cuda)
        if found is not None:
            return found.run(params, anchor, x, y, gather, weight)
    bufs = {n: torch.zeros_like(p) for n, p in params.items()} if local.optimizer != "sgd" else {}
    loss_sum = torch.zeros(k_all, dtype=torch.float64, device=device)
    rows = x.shape[1:]
    labels = y.index_select(0, gather.reshape(-1)).view(gather.shape)  # every step's labels, gathered once
    for t in range(steps):
        k = active[t]
        idx, w, yb = gather[t, :k], weight[t, :k], labels[t, :k]  # (k, width)
        xb = x.index_select(0, idx.reshape(-1)).view(k, width, *rows)  # x[idx], without advanced indexing
        sgd(params, bufs, anchor, loss_sum, xb, yb, w)
    return params, loss_sum.cpu().tolist()
