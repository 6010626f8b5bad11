"""One experiment from a composed config: build, run on the chosen engine, write the run folder."""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord
from omegaconf import DictConfig, OmegaConf

from fedsim import __version__, build, checkpoint
from fedsim.engines import LOCAL_ENGINES, local_grid
from fedsim.errors import ConfigError
from fedsim.recorder import Recorder, atomic_torch_save
from fedsim.server import LoopConfig, RunState, run_sync
from fedsim.strategies import base
from fedsim.training import evaluate
from fedsim.validate import clients_per_round, validate

log = logging.getLogger("fedsim")


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


def check_memory(model: torch.nn.Module, cohort: int, data_bytes: int, device: str) -> None:
    """Refuse a cohort whose rough memory estimate exceeds what the machine (or GPU) has free.

    Estimate: every sampled client's reply (one model copy each) plus a few global copies for aggregation and
    the data set; on a GPU, the same for the clients' models and optimiser state.
    """
    model_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    need = model_bytes * (cohort + 4) + data_bytes
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    where = "RAM"
    if device.startswith("cuda") and torch.cuda.is_available():
        avail, _ = torch.cuda.mem_get_info(torch.device(device))
        where = "GPU memory"
    if need > avail:
        raise ConfigError(
            "clients_per_round",
            cohort,
            f"a cohort that fits: about {need / 2**30:.1f} GiB needed, {avail / 2**30:.1f} GiB {where} free",
            "Sample fewer clients per round or use a smaller model.",
        )


def make_evaluator(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, device: str):
    """Centralised evaluation of global arrays on the server's test split."""
    model = model.to(device)
    xt, yt = torch.as_tensor(x, device=device), torch.as_tensor(y, device=device)

    def evaluate_fn(arrays: ArrayRecord) -> tuple[float, float]:
        model.load_state_dict(arrays.to_torch_state_dict())
        return evaluate(model, xt, yt)

    return evaluate_fn


def write_partition_stats(
    out_dir: Path, train: list[np.ndarray], labels: np.ndarray, num_classes: int
) -> None:
    """partitions.json and partitions.png: size and label histogram per client."""
    from fedsim.data.stats import partition_stats, plot_partitions

    stats = partition_stats(train, labels, num_classes)
    (out_dir / "partitions.json").write_text(json.dumps(stats) + "\n")
    plot_partitions(stats, out_dir / "partitions.png")


def run_experiment(cfg: DictConfig, out_dir: str | Path, choices: dict | None = None, grid=None) -> dict:
    """Run the experiment ``cfg`` and write its outputs to ``out_dir``; return the summary.

    ``grid`` is given by a deployed ServerApp (the SuperLink's Grid); otherwise ``cfg.engine`` picks the engine.
    """
    out_dir = Path(out_dir)
    validate(cfg)
    torch.set_num_threads(max(1, int(cfg.placement.threads_per_client)))
    spec_json = build.client_spec(cfg, device=str(cfg.placement.device))
    spec = json.loads(spec_json)
    build.fault_rates(spec)  # validates the faults group before any work
    ds = build.build_dataset(spec)
    train, _ = build.build_partitions(spec)
    m = clients_per_round(cfg)
    strategy = build.build_strategy(cfg, m)
    clock = build.build_heterogeneity(cfg, int(cfg.num_clients))
    model = build.build_initial_model(spec)
    # deployed clients resolve placement.device on their own machines; only the server's device is checked here
    client_device = "cpu" if grid is not None else build.resolve_device(str(cfg.placement.device))
    check_memory(model, m, ds.x_train.nbytes + ds.x_test.nbytes, client_device)
    server_device = build.resolve_device(str(cfg.placement.server_device), "placement.server_device")
    evaluate_fn = make_evaluator(build.build_initial_model(spec), ds.x_test, ds.y_test, server_device)
    loop = LoopConfig(
        seed=int(cfg.seed),
        num_clients=int(cfg.num_clients),
        num_rounds=int(cfg.num_rounds),
        clients_per_round=m,
        min_replies=int(cfg.min_replies),
        round_timeout=float(cfg.round_timeout),
        node_timeout=float(cfg.get("node_timeout", 300)),
        eval_every=int(cfg.eval_every),
        federated_eval=bool(cfg.federated_eval),
        fraction_evaluate=float(cfg.strategy.get("fraction_evaluate", 1.0)),
    )
    if grid is None and str(cfg.engine.name) == "ray":  # Ray's own checks, before any output is written
        from fedsim.engines import ray as ray_engine

        backend = ray_engine.backend_config(
            cfg.placement.num_cpus_per_client,
            cfg.placement.num_gpus_per_client,
            address=cfg.engine.get("address"),
            num_cpus=cfg.engine.get("num_cpus"),
            num_gpus=cfg.engine.get("num_gpus"),
        )
        ray_engine.preflight(backend)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_partition_stats(out_dir, train, ds.y_train, ds.num_classes)
    state = RunState(arrays=ArrayRecord(model.state_dict()))
    records: list[dict] = []
    resolved = OmegaConf.to_container(cfg, resolve=True)
    target = cfg.get("target_accuracy")
    stop_at_target = bool(cfg.get("stop_at_target"))
    if cfg.get("resume"):
        ckpt = checkpoint.load(cfg.resume)
        checkpoint.check_config(ckpt, resolved, str(cfg.resume))
        strategy = checkpoint.restore(ckpt, state, strategy)
        if (state.extra.get("target_reached") or {}).get("target") != target:
            state.extra.pop("target_reached", None)  # reached for another target (or none)
        records = ckpt["records"]
        log.warning("resuming from %s at round %d", cfg.resume, state.round)
    recorder = Recorder(out_dir, loop.num_rounds, quiet=bool(cfg.get("quiet", False)), records=records)
    every = int(cfg.get("checkpoint_every") or 0)
    ckpt_path = out_dir / "checkpoint.pt"

    def on_round(record: dict, st: RunState) -> None:
        recorder.log(record)
        acc = record.get("eval_accuracy")
        if target is not None and acc is not None and acc >= target and "target_reached" not in st.extra:
            st.extra["target_reached"] = {
                "target": target,
                "round": record["round"],
                "sim_time": record.get("sim_time"),
                "wall_time": recorder.records[-1]["wall_time"],
            }
            log.warning(
                "target accuracy %.4g reached at round %d (simulated time %.1f s)",
                target,
                record["round"],
                record.get("sim_time", 0.0),
            )
            if stop_at_target:
                st.extra["stop_reason"] = f"target accuracy {target} reached"
        if every and st.round > 0 and (st.round % every == 0 or st.round == loop.num_rounds):
            checkpoint.save(ckpt_path, st, strategy, recorder.records, resolved)

    deployed = grid is not None

    def server_main(grid) -> None:
        if base.is_async(strategy):
            from fedsim.async_server import run_async

            # deployment: real clients, real arrival order and wall-clock time
            wall = True if deployed else None
            run_async(grid, loop, strategy, state, spec_json, evaluate_fn, clock, on_round, wall_clock=wall)
        else:
            run_sync(grid, loop, strategy, state, spec_json, evaluate_fn, clock, on_round)

    engine = "deployment" if grid is not None else str(cfg.engine.name)
    status = "completed"
    try:
        if grid is not None:
            server_main(grid)
        elif engine in LOCAL_ENGINES:
            local = local_grid(engine, int(cfg.num_clients), OmegaConf.to_container(cfg.engine, resolve=True))
            try:
                server_main(local)
            finally:
                getattr(local, "close", lambda: None)()  # stop worker processes, also after errors
        elif engine == "ray":
            ray_engine.run(int(cfg.num_clients), server_main, backend)
        else:
            raise ConfigError("engine", engine, f"one of {', '.join((*LOCAL_ENGINES, 'ray'))}")
        if (
            state.extra.get("stop_reason")
            and recorder.records
            and recorder.records[-1]["round"] == state.round
        ):
            # a stop before num_rounds: the final model is evaluated (eval_every or not) and checkpointed
            if recorder.records[-1].get("eval_accuracy") is None:
                loss, acc = evaluate_fn(state.arrays)
                recorder.amend({"eval_loss": loss, "eval_accuracy": acc})
            if every:
                checkpoint.save(ckpt_path, state, strategy, recorder.records, resolved)
    except KeyboardInterrupt:
        status = "interrupted"
        if state.rollback is not None:  # back to the end of the last completed round: resume repeats nothing
            strategy = checkpoint.restore(state.rollback, state, strategy)
        log.warning("interrupted: writing a checkpoint and the outputs of the %d rounds done", state.round)
        checkpoint.save(
            ckpt_path, state, strategy, [r for r in recorder.records if r["round"] <= state.round], resolved
        )
    except BaseException:
        status = "failed"
        raise
    finally:
        recorder.close()
        if recorder.records:
            atomic_torch_save(state.arrays.to_torch_state_dict(), out_dir / "model.pt")
            recorder.plot(title=" ".join(f"{k}={v}" for k, v in (choices or {}).items()))
        if status == "completed" and state.extra.get("stop_reason"):
            status = "stopped"
        reached = state.extra.get("target_reached") or {}
        summary = recorder.summary(
            {
                "status": status,
                "stop_reason": state.extra.get("stop_reason"),
                "engine": engine,
                "choices": choices or {},
                "target_accuracy": target,
                "target_round": reached.get("round"),
                "target_sim_time": reached.get("sim_time"),
                "target_wall_time": reached.get("wall_time"),
                **base.summary_fields(strategy),
                "config": OmegaConf.to_container(cfg, resolve=True),
                "versions": versions(),
            }
        )
        recorder.write_summary(summary)
    return summary
