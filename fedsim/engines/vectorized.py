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
   the stacked parameters is each client's own gradient), then the SGD update of ``torch.optim.SGD``
   written out (weight decay, momentum, Nesterov) plus FedProx's ``mu * (w - w_start)``; after the last step,
   client-side clipping (``clip-norm``) of the rows that ask for it (:func:`clip_rows`);
4. reply: each client's full weights and the ClientApp's metrics keys, kept stacked on the device
   (``fedsim.messages.Cohort``): ``send_and_receive_cohort`` hands them to the server loop as the round's
   cohort, which every aggregator and wrapper takes as it is; every other caller
   gets one Flower reply Message per client, an ArrayRecord of its weights and a MetricRecord.

Supported: SGD, momentum, Nesterov, weight decay, ``local_epochs``/``local_steps``, any ``batch_size``
(0 = full batch), ``proximal-mu``. Run through the ordinary ClientApp (sequentially in this process)
instead, with one log line per reason: non-train messages (query, evaluate), Adam and averaged SGD,
train-config keys it does not handle (``fedsim.messages``), injected faults, models with buffers (BatchNorm), dropout, frozen or tied
parameters, and, by default, convolutional models on the CPU that are not a plain ``nn.Sequential`` of
conv/pool/linear layers: there vmap turns ``conv2d`` into a grouped convolution that measured 1.2-3.5x slower
than per-client convolutions (``engine.vmap_conv_cpu=true`` forces it). Sequential conv nets on the CPU are
batched by ``fedsim.engines.grouped`` (grouped convolutions in one layout, a few clients per chunk), faster
than per client. If batched training raises, its clients are rerun sequentially.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import time
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MessageType
from torch import nn
from torch.func import functional_call, vmap

from fedsim import keys
from fedsim.build import ClientTask, client_task
from fedsim.engines import dense, grouped
from fedsim.engines.pool import PoolGrid
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
from fedsim.training import LocalTraining, batch_size_for, num_local_steps

log = logging.getLogger("fedsim")

VECTOR_OPTIMIZERS = ("sgd", "momentum", "nesterov")
PLANS = 4096  # clients' plans kept (as many as fedsim.build.client_task keeps tasks); then they start again
# The train-config keys this engine implements. A message with any other key runs through the ClientApp (one
# INFO line the first time): a key fedsim does not know, and one a user taught the parser
# (``fedsim.messages.parse_train``) but not this engine, so no client-side setting is dropped silently.
IMPLEMENTS = frozenset({keys.RUN_SPEC, keys.PROXIMAL_MU, keys.MAX_STEPS, keys.CLIP_NORM, *DRAW_INDEX_KEYS})
# Client halves (fedsim.algorithms.halves) a run spec may name that this engine honours: they act only on a
# train-config key it does not implement (such a message runs through the ClientApp), or on evaluations. A run
# whose spec names any other half trains through the ClientApp.
HALVES = frozenset(f"fedsim.algorithms.halves.{name}" for name in ("Compress", "LabelFlip", "ProbeTrain"))


def _declares_batched(algorithm: object) -> bool:
    """True when the algorithm's own class declares ``batched = True``: a subclass of a batched algorithm (one
    that overrides a hook, say) does not inherit it, so the engine never skips hooks it does not run."""
    return vars(type(algorithm)).get("batched") is True


@functools.lru_cache(maxsize=64)
def _unknown_halves(spec: str) -> tuple[str, ...]:
    """The client halves ``spec`` names that this engine does not implement."""
    try:
        named = json.loads(spec).get("halves") or ()
    except (ValueError, AttributeError):
        return ()
    return tuple(h for h in named if h not in HALVES)


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


class _Steps:
    """What follows from a client's step lengths alone, computed once per lengths (:func:`_steps`): the
    lengths, their sum, the widest step, the batch-size bucket, each step's offset into the step order, and the
    step, slot and loss weight of every example (the rows of the cohort's gather index, ``cohort_batches``)."""

    __slots__ = ("lens", "total", "width", "bucket", "offsets", "step", "slot", "weight")

    def __init__(self, lens: tuple[int, ...]) -> None:
        counts = np.array(lens, dtype=np.int64)
        first = np.cumsum(counts) - counts
        self.lens, self.total = lens, int(counts.sum())
        self.width = max(lens, default=0)
        self.bucket = self.width.bit_length()
        self.offsets = tuple(int(v) for v in first)
        self.step = np.repeat(np.arange(len(lens), dtype=np.int64), counts)
        self.slot = np.arange(self.total, dtype=np.int64) - np.repeat(first, counts)
        self.weight = np.repeat(1.0 / counts.astype(np.float64), counts)  # a client's mean over its batch


@functools.lru_cache(maxsize=4096)
def _steps(lens: tuple[int, ...]) -> _Steps:
    return _Steps(lens)


class Schedule(Sequence):
    """The example indices of each local step (a sequence of index tensors), held as the permutations of the
    passes over the data (``parts``, the last one cut where the steps end: one after the other, every step's
    indices in order, ``order``) and the steps' lengths (``info``, shared by the clients whose steps have the same
    lengths)."""

    __slots__ = ("parts", "info", "steps", "_order")

    def __init__(self, parts: Sequence[torch.Tensor], info: _Steps) -> None:
        self.parts, self.info, self.steps, self._order = parts, info, len(info.lens), None

    @property
    def order(self) -> torch.Tensor:
        if self._order is None:
            parts = self.parts
            self._order = parts[0] if len(parts) == 1 else torch.cat(list(parts)) if parts else _EMPTY
        return self._order

    @property
    def lens(self) -> tuple[int, ...]:
        return self.info.lens

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self.info.lens))[i]
        start = self.info.offsets[i]
        return self.order[start : start + self.info.lens[i]]


@functools.lru_cache(maxsize=4096)
def _step_lens(n: int, bs: int, steps: int) -> tuple[int, ...]:
    """The batch length of each of ``steps`` steps over ``n`` examples in batches of ``bs`` (a pass ends with
    its partial batch)."""
    one_pass = (bs,) * (n // bs) + ((n % bs,) if n % bs else ())
    return (one_pass * -(-steps // len(one_pass)))[:steps]


def _info(batches) -> _Steps:
    """The step lengths of a client's batches and what follows from them."""
    return batches.info if isinstance(batches, Schedule) else _steps(tuple(len(b) for b in batches))


def _lens(batches) -> tuple[int, ...]:
    """The length of each step's batch."""
    return _info(batches).lens


def _parts(batches) -> Sequence[torch.Tensor]:
    """Tensors that, one after the other, hold every step's example indices in order."""
    return batches.parts if isinstance(batches, Schedule) else batches


_EMPTY = torch.zeros(0, dtype=torch.long)


def _order(batches) -> torch.Tensor:
    """Every step's example indices, one after the other, as one tensor."""
    if isinstance(batches, Schedule):
        return batches.order
    return torch.cat(list(batches)) if len(batches) else _EMPTY


@functools.lru_cache(maxsize=4096)
def _layout(n: int, cfg: LocalTraining, max_steps: int | None) -> tuple[_Steps, int]:
    """The steps of a client with ``n`` examples and the passes over its data they take."""
    bs = batch_size_for(n, cfg)
    steps = num_local_steps(n, cfg, max_steps)
    info = _steps(_step_lens(n, bs, steps) if n > 0 and bs > 0 and steps > 0 else ())
    return info, -(-info.total // n) if info.total else 0


def _draw(n: int, info: _Steps, passes: int, gen: torch.Generator) -> Schedule:
    """The schedule of steps ``info``: one seeded ``randperm`` per pass over the ``n`` examples, as
    ``fedsim.training.train_local`` draws them."""
    parts = [torch.randperm(n, generator=gen) for _ in range(passes)]
    cut = passes * n - info.total  # the last pass ends early
    if cut:
        parts[-1] = parts[-1][: n - cut]
    return Schedule(parts, info)


def schedule(n: int, cfg: LocalTraining, gen: torch.Generator, max_steps: int | None = None) -> Schedule:
    """Example indices of each local step, drawn as ``fedsim.training.train_local`` draws them: one
    ``randperm`` per pass over the data, split into batches, as many passes as the steps need."""
    return _draw(n, *_layout(n, cfg, max_steps), gen)


def unsupported(model: nn.Module, device: str, vmap_conv_cpu: bool) -> str | None:
    """Why ``model`` cannot be trained batched (None when it can)."""
    if next(model.buffers(), None) is not None:
        return "the model has buffers (e.g. BatchNorm)"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        return "the model uses dropout"
    params = list(model.named_parameters())
    if not all(p.requires_grad for _, p in params) or len(params) != len(model.state_dict()):
        return "the model has frozen or tied parameters"
    if (
        device == "cpu"
        and not vmap_conv_cpu
        and not grouped.supports(model)
        and any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    ):
        return (
            "convolutions in a model that is not a plain Sequential of conv/pool/linear layers are faster per "
            "client on the CPU (engine.vmap_conv_cpu=true forces vmap)"
        )
    return None


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
        stacked = Cohort.concat(parts) if parts and not done and len(ids) == len(messages) else None
        if stacked is not None and len(stacked) == len(ids):
            row = {id(msg): i for i, msg in enumerate(stacked.messages)}  # the messages pushed, as they were
            return [], stacked.take([row[id(msg)] for msg in batch])
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
        _, arrays, ins, extra = entry
        if ins is None:
            return None
        task, plan = self._plan(ins, self.partition_of(meta.dst_node_id))
        if plan is None:
            return None
        reason = plan.algorithm or ("extra arrays in the train message" if extra else plan.reason)
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
        return _Client(msg, task, start, proximal_mu=ins.proximal_mu, ins=ins, plan=plan)

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
        elif task.faults is not None:
            plan.reason = "injected faults"
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

    def _instruction(self, content) -> tuple[ArrayRecord | None, TrainInstruction | None, bool]:
        """A train message's start model, instruction (None when no client of it can be trained batched), and
        whether it holds arrays besides the model."""
        cfg = content.get(keys.CONFIG)
        arrays = content.get(keys.ARRAYS)
        if cfg is None or arrays is None or not isinstance(cfg.get(keys.RUN_SPEC), str):
            return None, None, False
        ins = parse_train(cfg)
        extra = set(cfg.keys()) - IMPLEMENTS
        if extra:  # unknown to fedsim, or known to the parser (a user's setting) but not implemented here
            self._skip(f"train config keys it does not implement: {', '.join(sorted(extra))}")
            return None, None, False
        halves = _unknown_halves(cfg[keys.RUN_SPEC])
        if halves:  # a feature's client half of its own: the ClientApp applies it
            self._skip(f"client halves it does not implement: {', '.join(halves)}")
            return None, None, False
        return arrays, ins, any(name != keys.ARRAYS for name in content.array_records)

    def _train(
        self, clients: list[_Client], local: LocalTraining, device: str, mu: float
    ) -> list[Cohort]:
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


def _try_bucket(
    members: list[_Client], local: LocalTraining, device: str, mu: float
) -> Cohort | None:
    """``_train_bucket``, or None when it runs out of memory (with the memory it held released)."""
    try:
        return _train_bucket(members, local, device, mu)
    except torch.OutOfMemoryError:
        pass  # leave the except block first: its traceback holds the failed batch's tensors
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return None


def free_bytes(device: str) -> int:
    """Memory free for a batch on ``device``: the GPU's free memory, or the machine's available RAM."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 2**62


def activation_bytes(model: nn.Module, example: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward pass of one example (probed once per model and input shape)."""
    key = (id(model), tuple(example.shape), example.dtype)
    if key not in _ACTIVATIONS:
        seen: dict[tuple, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = (
                t.numel() * t.element_size()
            )
            return t

        params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = functional_call(model, params, (example.detach().clone().unsqueeze(0),))
        param_storages = {p.untyped_storage().data_ptr() for p in params.values()}
        _ACTIVATIONS[key] = sum(b for (ptr, *_), b in seen.items() if ptr not in param_storages) + out.nbytes
    return _ACTIVATIONS[key]


_ACTIVATIONS: dict[tuple, int] = {}


def estimate_bytes(
    model: nn.Module, x: torch.Tensor, members: list[_Client], local: LocalTraining, mu: float
) -> int:
    """Peak bytes one more client adds to a batched step (:func:`client_bytes`, at the cohort's batch width)."""
    width = max((_info(c.batches).lens[0] for c in members if c.batches), default=1)
    return client_bytes(model, x[0] if x.shape[0] else None, local, width, mu)


def client_bytes(
    model: nn.Module, example: torch.Tensor | None, local: LocalTraining, width: int, mu: float
) -> int:
    """Peak bytes one client adds to a batched step: its weights, gradients, optimiser state and FedProx
    anchor, plus its activations (one example's, times the batch width, twice: forward and backward).
    The run's pre-flight memory check uses the same estimate (``fedsim.experiment.check_memory``)."""
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    copies = 2 + (local.optimizer in ("momentum", "nesterov")) + (mu > 0)  # weights, grads, momentum, anchor
    per_example = activation_bytes(model, example) if example is not None else 0
    return copies * param_bytes + 2 * width * per_example


# model id -> (the model, its parameters' names in order, their shapes by name)
_MODEL_INFO: dict[int, tuple[weakref.ref, list[str], dict[str, tuple[int, ...]]]] = {}


def _model_info(model: nn.Module) -> tuple[weakref.ref, list[str], dict[str, tuple[int, ...]]]:
    """``model``'s parameters' names and shapes, read once per model."""
    known = _MODEL_INFO.get(id(model))
    if known is None or known[0]() is not model:
        if len(_MODEL_INFO) >= 64:
            _MODEL_INFO.clear()
        params = list(model.named_parameters())
        known = (weakref.ref(model), [n for n, _ in params], {n: tuple(p.shape) for n, p in params})
        _MODEL_INFO[id(model)] = known
    return known


def _names(model: nn.Module) -> list[str]:
    """The names of ``model``'s parameters, in order (read once per model; not to be modified)."""
    return _model_info(model)[1]


_DENSE: dict[tuple, dense.DenseStep | None] = {}  # (model id, task) -> the model's hand-written batched step


def _dense_step(model: nn.Module, task) -> dense.DenseStep | None:
    """The hand-written batched step of an MLP (``fedsim.engines.dense``), or None for other models."""
    key = (id(model), task)
    if key not in _DENSE:
        _DENSE[key] = dense.DenseStep(model, task) if dense.supports(model) else None
    return _DENSE[key]


def cohort_batches(
    members: list[_Client], steps: int, width: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cohort's data in one tensor, and the gather index and loss weight of every (step, client, slot):
    ``x`` ``(examples, *input)``, ``y``, ``gather`` ``(steps, clients, width)`` into them, ``weight``.

    Each client's step, slot and weight of every example come from its step lengths (:class:`_Steps`, computed
    once per lengths); a round adds its batch order, and the index is written with one numpy scatter. When the
    steps take fewer examples than the clients hold (a few steps on large partitions, as in distributed SGD),
    ``x`` holds just the rows they take, in step order, instead of every client's whole partition."""
    k = len(members)
    infos = [_info(c.batches) for c in members]
    counts = np.fromiter((i.total for i in infos), np.int64, k)
    sizes = np.fromiter((c.task.x_train.shape[0] for c in members), np.int64, k)
    where = (np.concatenate([i.step for i in infos]) * k + np.repeat(np.arange(k), counts)) * width
    where += np.concatenate([i.slot for i in infos])
    gather = np.zeros(steps * k * width, dtype=np.int64)
    if counts.sum() < sizes.sum():  # the rows the steps take: example e of the cohort's steps is row e
        rows = [(c.task, _order(c.batches)) for c in members]
        x = torch.cat([t.x_train.index_select(0, r.to(t.x_train.device)) for t, r in rows])
        y = torch.cat([t.y_train.index_select(0, r.to(t.y_train.device)) for t, r in rows])
        gather[where] = np.arange(int(counts.sum()), dtype=np.int64)
    else:
        x = torch.cat([c.task.x_train for c in members])  # (examples, *input)
        y = torch.cat([c.task.y_train for c in members])
        order = torch.cat([t for c in members for t in _parts(c.batches)]).cpu().numpy()
        gather[where] = order + np.repeat(np.cumsum(sizes) - sizes, counts)  # into the cohort's data
    weight = np.zeros(steps * k * width, dtype=np.float64)
    weight[where] = np.concatenate([i.weight for i in infos])
    shape = (steps, k, width)
    gather_t = torch.from_numpy(gather).view(shape).to(device)
    return x, y, gather_t, torch.from_numpy(weight).view(shape).to(device=device, dtype=x.dtype)


def _stack_starts(members: list[_Client], names: list[str], device: str) -> dict[str, torch.Tensor]:
    """The clients' start parameters as ``(clients, *shape)`` tensors on ``device`` (one copy of a start
    model the whole cohort shares, expanded)."""
    k = len(members)
    first = members[0].start
    if all(c.start is first for c in members):
        out = {}
        for n in names:
            p = first[n].to(device)
            out[n] = p.unsqueeze(0).expand(k, *p.shape).clone()
        return out
    return {n: torch.stack([c.start[n] for c in members]).to(device) for n in names}


def _train_bucket(members: list[_Client], local: LocalTraining, device: str, mu: float) -> Cohort:
    """Batched local training of clients sorted by step count (descending); their replies, stacked (rows in
    ``members`` order, models on ``device``)."""
    names = _names(members[0].task.model)
    params, losses = train_stacked(members, local, device, mu)
    params = {n: params[n].detach() for n in names}
    clipping = clip_rows(members, names, params)
    metrics = [
        train_metrics(
            num_examples=int(c.task.x_train.shape[0]),
            loss=losses[i] / len(c.batches),
            partition_id=c.task.partition_id,
            steps=len(c.batches),
            examples_processed=_info(c.batches).total,
            extra=clipping[i],
        )
        for i, c in enumerate(members)
    ]
    return Cohort([c.msg for c in members], params, metrics)


def clip_rows(members: list[_Client], names: list[str], params: dict[str, torch.Tensor]) -> list[dict]:
    """Client-side clipping (``clip-norm``) of the stacked rows in place, as the ClientApp's
    ``fedsim.algorithms.halves.ClientClipping`` clips one reply: a row whose update ``y - start`` has an L2 norm
    (over every parameter, in float64) above its client's bound ``C`` becomes ``start + (y - start) * (C /
    norm)`` in the parameters' dtype; the others stay as trained. Returns each row's extra metrics: the norm
    before clipping and whether it clipped, for the rows that were asked to clip (``{}`` for the others).

    The norms are one reduction per parameter over the stack, so they agree with the ClientApp's per-tensor
    sums to float64 rounding."""
    bounds = [c.ins.clip_norm if c.ins is not None else None for c in members]
    if all(b is None for b in bounds):
        return [{} for _ in members]
    k = len(members)
    device = next(iter(params.values())).device
    starts = _stack_starts(members, names, device)
    deltas = {n: params[n] - starts[n] for n in names}
    squares = torch.zeros(k, dtype=torch.float64, device=device)
    for d in deltas.values():
        squares += d.double().square().reshape(k, -1).sum(1)
    norms = squares.sqrt().tolist()
    clipped = [b is not None and norm > b and norm != 0.0 for b, norm in zip(bounds, norms)]
    if any(clipped):
        rows = torch.tensor([i for i, c in enumerate(clipped) if c], device=device)
        scale = [bounds[i] / norms[i] for i in rows.tolist()]
        for n, d in deltas.items():
            factor = torch.tensor(scale, dtype=d.dtype, device=device).view(-1, *([1] * (d.dim() - 1)))
            params[n].index_copy_(0, rows, starts[n].index_select(0, rows) + d.index_select(0, rows) * factor)
    return [
        {} if b is None else {keys.UPDATE_NORM: norm, keys.CLIPPED: float(c)}
        for b, norm, c in zip(bounds, norms, clipped)
    ]


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
        if key not in _GRAPHS:
            if len(_GRAPHS) >= 16:
                _GRAPHS.clear()
            try:
                _GRAPHS[key] = _StepGraph(sgd, params, anchor, k_all, width, x, y, capture=cuda)
            except (RuntimeError, NotImplementedError) as exc:
                log.warning("vectorized engine: CUDA graph capture failed (%s); eager batched steps", exc)
                _GRAPHS[key] = None
        if _GRAPHS[key] is not None:
            return _GRAPHS[key].run(params, anchor, x, y, gather, weight)
    bufs = {n: torch.zeros_like(p) for n, p in params.items()} if local.optimizer != "sgd" else {}
    loss_sum = torch.zeros(k_all, dtype=torch.float64, device=device)
    rows = x.shape[1:]
    for t in range(steps):
        k = active[t]
        idx, w = (gather[t], weight[t]) if k == k_all else (gather[t, :k], weight[t, :k])  # (k, width)
        xb = x.index_select(0, idx.reshape(-1)).view(k, width, *rows)  # x[idx], without advanced indexing
        sgd(params, bufs, anchor, loss_sum, xb, y[idx], w)
    return params, loss_sum.cpu().tolist()


def _capacity(n: int) -> int:
    """Rows of a static data buffer for ``n`` examples (a power of two: uneven cohorts reuse one graph)."""
    return 1 << max(0, (n - 1).bit_length())


def _sgd_step(step, forward, learnt, names, local, mu, params, bufs, anchor, loss_sum, xb, yb, w) -> None:
    """One SGD step of the first ``k = len(w)`` clients in place: gradients (the dense step, or autograd
    through ``forward``), FedProx's term, weight decay, momentum / Nesterov (buffers start at zero, so the
    first step's buffer is the gradient, as in ``torch.optim.SGD``), the update; losses added to ``loss_sum``."""
    k, width = w.shape
    if step is not None:  # an MLP on cross-entropy: the hand-written batched step
        per_client, by_name = step({n: params[n][:k] for n in names}, xb, yb, w)
        grads = [by_name[n] for n in names]
    else:
        leaves = {n: params[n][:k].detach().requires_grad_() for n in names}
        out = forward(leaves, xb)  # (k, width, classes)
        losses = learnt.loss(out.flatten(0, 1), yb.flatten(), reduction="none").view(k, width)
        per_client = (losses * w).sum(1)  # (k,) each client's mean batch loss
        grads = torch.autograd.grad(per_client.sum(), [leaves[n] for n in names])
    with torch.no_grad():
        loss_sum[:k] += per_client.double()
        for n, g in zip(names, grads):
            p = params[n][:k]
            if anchor is not None:
                g = g + mu * (p - anchor[n][:k])
            if local.weight_decay != 0:
                g = g.add(p, alpha=local.weight_decay)
            if bufs:
                buf = bufs[n][:k].mul_(local.momentum).add_(g)  # 0 * m + g = g exactly on the first step
                g = g.add(buf, alpha=local.momentum) if local.optimizer == "nesterov" else buf
            p.add_(g, alpha=-local.lr)


class _StepGraph:
    """A cohort's SGD step on static buffers, captured once as a CUDA graph (``capture``) and replayed."""

    def __init__(self, sgd, params, anchor, k: int, width: int, x, y, capture: bool) -> None:
        self.params = {n: torch.zeros_like(p) for n, p in params.items()}
        momentum = sgd.args[4].optimizer != "sgd"
        self.bufs = {n: torch.zeros_like(p) for n, p in params.items()} if momentum else {}
        self.anchor = None if anchor is None else {n: torch.zeros_like(p) for n, p in anchor.items()}
        self.loss_sum = torch.zeros(k, dtype=torch.float64, device=x.device)
        cap = _capacity(x.shape[0])
        self.x = torch.zeros((cap, *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.y = torch.zeros(cap, dtype=y.dtype, device=y.device)
        self.idx = torch.zeros(k, width, dtype=torch.long, device=x.device)
        self.w = torch.zeros(k, width, dtype=x.dtype, device=x.device)

        def fn() -> None:
            sgd(
                self.params, self.bufs, self.anchor, self.loss_sum, self.x[self.idx], self.y[self.idx], self.w
            )

        self.fn, self.graph = fn, None
        if capture:
            side = torch.cuda.Stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up before capture (the state is reset before every use)
                    fn()
            torch.cuda.current_stream(x.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                fn()

    def run(self, params, anchor, x, y, gather, weight) -> tuple[dict[str, torch.Tensor], list[float]]:
        for n, p in self.params.items():
            p.copy_(params[n])
        for b in self.bufs.values():
            b.zero_()
        if self.anchor is not None:
            for n, a in self.anchor.items():
                a.copy_(anchor[n])
        self.loss_sum.zero_()
        self.x[: x.shape[0]].copy_(x)
        self.y[: y.shape[0]].copy_(y)
        for t in range(gather.shape[0]):
            self.idx.copy_(gather[t])
            self.w.copy_(weight[t])
            if self.graph is not None:
                self.graph.replay()
            else:
                self.fn()
        return {n: p.clone() for n, p in self.params.items()}, self.loss_sum.cpu().tolist()
