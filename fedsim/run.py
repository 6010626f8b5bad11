"""One experiment from a composed config, in four phases: build, open the run folder, loop, finish.

``run_experiment`` reads top to bottom:

1. :func:`fedsim.experiment.build_experiment` turns the config into objects and checks every value;
   :class:`fedsim.engines.EngineRunner` checks what the chosen engine can check without running.
   Nothing has been written yet, so a bad config leaves no run folder behind.
2. :class:`Run` opens the run folder: partition statistics, the resumed checkpoint if any, the recorder, and
   the round hooks (target accuracy, periodic checkpoints).
3. :meth:`Run.execute` runs the synchronous or asynchronous loop on the engine. An interrupt (Ctrl-C) rolls
   back to the end of the last completed round and writes a checkpoint, so a resume repeats nothing.
4. :meth:`Run.finish` writes model.pt, curves.png and summary.json, whatever happened before.
"""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord
from flwr.serverapp import Grid
from omegaconf import DictConfig

from fedsim import __version__, checkpoint, schema
from fedsim.engines import EngineRunner
from fedsim.experiment import Experiment, build_experiment
from fedsim.recorder import Recorder, atomic_torch_save
from fedsim.server import run_sync
from fedsim.state import RunState, TargetReached
from fedsim.strategies import base

log = logging.getLogger("fedsim")


def run_experiment(
    cfg: DictConfig, out_dir: str | Path, choices: dict | None = None, grid: Grid | None = None
) -> dict:
    """Run the experiment ``cfg``, write its outputs to ``out_dir`` and return its summary.

    ``grid`` is given by a deployed ServerApp (the SuperLink's Grid); otherwise ``cfg.engine`` picks the engine.
    """
    exp = build_experiment(cfg, deployed=grid is not None)
    engine = EngineRunner(exp.engine, exp.placement, exp.loop.num_clients, grid)
    run = Run(exp, Path(out_dir), choices or {})
    status = "failed"
    try:
        status = run.execute(engine)
    finally:
        summary = run.finish(status, engine.name)
    return summary


class TargetWatch:
    """Round hook: note the first round whose evaluation reaches ``target_accuracy``; optionally stop there."""

    def __init__(self, target: float | None, stop: bool) -> None:
        self.target, self.stop = target, stop

    def __call__(self, record: dict, state: RunState, wall_time: float) -> None:
        acc = record.get(schema.EVAL_ACCURACY)
        if self.target is None or acc is None or acc < self.target or state.target_reached is not None:
            return
        sim = record.get(schema.SIM_TIME)
        state.target_reached = TargetReached(self.target, record[schema.ROUND], sim, wall_time)
        log.warning(
            "target accuracy %.4g reached at round %d (simulated time %.1f s)",
            self.target,
            record[schema.ROUND],
            sim or 0.0,
        )
        if self.stop:
            state.stop_reason = f"target accuracy {self.target} reached"


class Run:
    """One experiment's run folder and the state of its loop (see the module docstring)."""

    def __init__(self, exp: Experiment, out_dir: Path, choices: dict) -> None:
        self.exp, self.out_dir, self.choices = exp, out_dir, choices
        self.strategy = exp.strategy
        self.state = RunState(arrays=ArrayRecord(exp.initial_model.state_dict()))
        cfg = exp.cfg
        records: list[dict] = []
        out_dir.mkdir(parents=True, exist_ok=True)
        write_partition_stats(out_dir, exp.train_partitions, exp.dataset.y_train, exp.dataset.num_classes)
        self.watch = TargetWatch(cfg.get("target_accuracy"), bool(cfg.get("stop_at_target")))
        if cfg.get("resume"):
            records = self._resume(str(cfg.resume))
        self.recorder = Recorder(
            out_dir, exp.loop.num_rounds, quiet=bool(cfg.get("quiet", False)), records=records
        )
        self.every = int(cfg.get("checkpoint_every") or 0)
        self.ckpt_path = out_dir / "checkpoint.pt"

    def _resume(self, path: str) -> list[dict]:
        ckpt = checkpoint.load(path)
        checkpoint.check_config(ckpt, self.exp.resolved, path)
        self.strategy = checkpoint.restore(ckpt, self.state, self.strategy)
        if self.state.target_reached is not None and self.state.target_reached.target != self.watch.target:
            self.state.target_reached = None  # reached for another target
        log.warning("resuming from %s at round %d", path, self.state.round)
        return ckpt["records"]

    # ------------------------------------------------------------------ the loop
    def on_round(self, record: dict, state: RunState) -> None:
        """After every round (or server model version): record, watch the target, checkpoint periodically."""
        self.recorder.log(record)
        self.watch(record, state, self.recorder.records[-1][schema.WALL_TIME])
        last = self.exp.loop.num_rounds
        if self.every and state.round > 0 and (state.round % self.every == 0 or state.round == last):
            self.save_checkpoint()

    def save_checkpoint(self, records: list[dict] | None = None) -> None:
        """checkpoint.pt of the current state (and the records up to it)."""
        records = self.recorder.records if records is None else records
        checkpoint.save(self.ckpt_path, self.state, self.strategy, records, self.exp.resolved)

    def server_main(self, grid: Grid, deployed: bool) -> None:
        """The synchronous or asynchronous loop on ``grid``."""
        e = self.exp
        if base.is_async(self.strategy):
            from fedsim.async_server import run_async

            wall = True if deployed else None  # deployment: real arrival order and wall-clock time
            args = (
                grid,
                e.loop,
                self.strategy,
                self.state,
                e.spec_json,
                e.evaluate_fn,
                e.clock,
                self.on_round,
            )
            run_async(*args, wall_clock=wall)
        else:
            run_sync(
                grid, e.loop, self.strategy, self.state, e.spec_json, e.evaluate_fn, e.clock, self.on_round
            )

    def execute(self, engine: EngineRunner) -> str:
        """Run the loop on ``engine``; return the status (``completed``, ``stopped`` or ``interrupted``)."""
        try:
            engine.run(lambda grid: self.server_main(grid, engine.deployed))
            if self.state.stop_reason:
                self._close_early_stop()
                return "stopped"
            return "completed"
        except KeyboardInterrupt:
            if self.state.rollback is not None:  # the end of the last completed round: resume repeats nothing
                self.strategy = checkpoint.restore(self.state.rollback, self.state, self.strategy)
            log.warning(
                "interrupted: writing a checkpoint and the outputs of the %d rounds done", self.state.round
            )
            self.save_checkpoint([r for r in self.recorder.records if r[schema.ROUND] <= self.state.round])
            return "interrupted"

    def _close_early_stop(self) -> None:
        """A stop before num_rounds: the final model is evaluated (eval_every or not) and checkpointed."""
        records = self.recorder.records
        if not records or records[-1][schema.ROUND] != self.state.round:
            return
        if records[-1].get(schema.EVAL_ACCURACY) is None:
            loss, acc = self.exp.evaluate_fn(self.state.arrays)
            self.recorder.amend({schema.EVAL_LOSS: loss, schema.EVAL_ACCURACY: acc})
        if self.every:
            self.save_checkpoint()

    # ------------------------------------------------------------------ outputs
    def finish(self, status: str, engine: str) -> dict:
        """model.pt, curves.png and summary.json for a run that ended with ``status``; return the summary."""
        rec = self.recorder
        rec.close()
        if rec.records:
            atomic_torch_save(self.state.arrays.to_torch_state_dict(), self.out_dir / "model.pt")
            rec.plot(title=" ".join(f"{k}={v}" for k, v in self.choices.items()))
        reached = self.state.target_reached
        summary = rec.summary(
            {
                "status": status,
                "stop_reason": self.state.stop_reason,
                "engine": engine,
                "choices": self.choices,
                "target_accuracy": self.watch.target,
                "target_round": reached.round if reached else None,
                "target_sim_time": reached.sim_time if reached else None,
                "target_wall_time": reached.wall_time if reached else None,
                **base.summary_fields(self.strategy),
                "config": self.exp.resolved,
                "versions": versions(),
            }
        )
        rec.write_summary(summary)
        return summary


def versions() -> dict:
    """Versions of fedsim and its main dependencies, for summary.json."""
    import flwr

    return {
        "fedsim": __version__,
        "flwr": flwr.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def write_partition_stats(
    out_dir: Path, train: list[np.ndarray], labels: np.ndarray, num_classes: int
) -> None:
    """partitions.json and partitions.png: size and label histogram per client."""
    from fedsim.data.stats import partition_stats, plot_partitions

    stats = partition_stats(train, labels, num_classes)
    (out_dir / "partitions.json").write_text(json.dumps(stats) + "\n")
    plot_partitions(stats, out_dir / "partitions.png")
