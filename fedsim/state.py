"""What the loops are told (``LoopConfig``), what a run carries between rounds (``RunState``) and checkpoints."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from flwr.app import ArrayRecord


@dataclass(frozen=True)
class LoopConfig:
    """Knobs of both loops (plain values; no OmegaConf)."""

    seed: int
    num_clients: int
    num_rounds: int
    clients_per_round: int
    min_replies: int = 1
    round_timeout: float = 600.0
    node_timeout: float = 300.0
    eval_every: int = 1
    federated_eval: bool = False
    fraction_evaluate: float = 1.0  # share of the round's cohort asked to evaluate (federated_eval only)
    metric: str = "accuracy"  # the task's metric: records get eval_<metric> (fedsim.tasks)


@dataclass(frozen=True)
class TargetReached:
    """The first round whose centralised evaluation reached ``target_accuracy``."""

    target: float
    round: int
    sim_time: float | None
    wall_time: float | None


@dataclass
class RunState:
    """The run's state between rounds (or server model versions), shared by both loops and the checkpoints.

    Attributes
    ----------
    arrays : ArrayRecord
        The global model.
    round : int
        Rounds done (sync) or server model versions published (async).
    sim_time : float
        Simulated seconds so far (wall seconds in deployment's asynchronous loop).
    initial_recorded : bool
        Round 0 (the initial model's evaluation) is in the records.
    stop_reason : str or None
        Why the run ends before ``num_rounds`` (a privacy budget, a target); None: it goes on.
    target_reached : TargetReached or None
        When ``target_accuracy`` was first reached.
    async_loop : Any
        The asynchronous loop's continuation (tasks in flight and the models they started from).
    rollback : dict or None
        A checkpoint held in memory (``checkpoint.mark``) after the last completed round: where an interrupt
        returns. Never written to disk.
    """

    arrays: ArrayRecord
    round: int = 0
    sim_time: float = 0.0
    initial_recorded: bool = False
    stop_reason: str | None = None
    target_reached: TargetReached | None = None
    async_loop: Any = None
    rollback: dict | None = None

    def carried(self) -> dict:
        """The fields a checkpoint keeps besides model, round and clock (``extra`` in the file)."""
        return {
            "initial_recorded": self.initial_recorded,
            "stop_reason": self.stop_reason,
            "target_reached": asdict(self.target_reached) if self.target_reached else None,
            "async": self.async_loop,
        }

    def carry(self, extra: dict) -> None:
        """Take the fields :meth:`carried` wrote (from a checkpoint, or a checkpoint of format 1)."""
        self.initial_recorded = bool(extra.get("initial_recorded", False))
        self.stop_reason = None  # why the checkpointed run stopped is not a reason to stop this one
        reached = extra.get("target_reached")
        self.target_reached = TargetReached(**reached) if reached else None
        self.async_loop = extra.get("async")
