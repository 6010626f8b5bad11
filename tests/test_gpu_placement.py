"""GPU placement, memory and numerics, emulated on the CPU (patched device counts, fake Ray GPUs, injected OOM).

The tests marked ``cuda`` run the same checks on a real GPU whenever one is present; they are not skipped on a
GPU machine.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import compose_cfg, read_metrics, run_tiny, without_wall_time

from fedsim import build
from fedsim.engines import vectorized
from fedsim.errors import ConfigError
from fedsim.groups import Placement

CUDA = torch.cuda.is_available()


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine that seems to have two CUDA devices (only device names are resolved; nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_devices_are_resolved_in_the_process_that_trains(two_gpus, monkeypatch):
    monkeypatch.delenv(build.WORKER_INDEX_ENV, raising=False)
    assert build.resolve_device("auto") == "cuda" and build.resolve_device("cuda") == "cuda"
    assert build.resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ConfigError, match=r"^placement.device='cuda:2' .* it has 2 CUDA device"):
        build.resolve_device("cuda:2")
    # pool workers 0..3 spread over the two GPUs
    seen = []
    for k in range(4):
        monkeypatch.setenv(build.WORKER_INDEX_ENV, str(k))
        seen.append(build.resolve_device("cuda"))
    assert seen == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert build.resolve_device("cpu") == "cpu"
    # clients trained in the server's own process (inprocess, vectorized) spread by partition id
    monkeypatch.delenv(build.WORKER_INDEX_ENV)
    assert [build.resolve_device("cuda", partition_id=p) for p in range(4)] == ["cuda:0", "cuda:1"] * 2
    assert build.resolve_device("cuda") == "cuda"  # the server's own evaluation


def test_auto_without_a_gpu_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert build.resolve_device("auto") == "cpu"
    with pytest.raises(ConfigError, match="no CUDA device"):
        build.resolve_device("cuda")


def test_pool_workers_are_told_their_index(monkeypatch):
    from fedsim.engines import pool

    started = []

    class FakePopen:
        def __init__(self, args, env, **kwargs):
            started.append(env[build.WORKER_INDEX_ENV])
            self.pid = 0

    monkeypatch.setattr(pool.subprocess, "Popen", FakePopen)
    for k in range(3):
        pool._start_worker("fedsim.client_app:app", k)
    assert started == ["0", "1", "2"]


def test_ray_placement_is_checked_against_ray_not_the_servers_gpus():
    from fedsim.engines.ray import check_placement

    with pytest.raises(
        ConfigError, match=r"^placement.device='cuda:1' is not allowed: expected cuda or auto"
    ):
        check_placement(Placement(device="cuda:1", num_gpus_per_client=1.0))
    with pytest.raises(ConfigError, match=r"^placement.num_gpus_per_client=0.0 is not allowed"):
        check_placement(Placement(device="cuda", num_gpus_per_client=0.0))
    check_placement(
        Placement(device="cuda", num_gpus_per_client=0.25)
    )  # a share: fine, even without a GPU here


def test_ray_auto_without_a_gpu_share_says_it_trains_on_the_cpu(caplog):
    from fedsim.engines.ray import check_placement

    with caplog.at_level(logging.WARNING, logger="fedsim"):
        check_placement(Placement(device="auto", num_gpus_per_client=0.0))
    assert "train on the CPU" in caplog.text


def test_flower_environment_keeps_zero_gpu_actors_off_the_gpu():
    from fedsim.config import FLOWER_ENV

    assert FLOWER_ENV["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "1"


@pytest.mark.slow
def test_fake_ray_gpus_zero_share_actors_see_no_gpu(tmp_path):
    """Ray with two fake GPUs: an actor without a share sees none, one with a share sees only its own."""
    code = textwrap.dedent(
        """
        import os, json
        from fedsim.config import flower_env
        flower_env()
        import ray
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="ERROR")

        @ray.remote
        def visible():
            return os.environ.get("CUDA_VISIBLE_DEVICES")

        out = {"zero": ray.get(visible.options(num_gpus=0).remote()),
               "one": ray.get(visible.options(num_gpus=1).remote())}
        ray.shutdown()
        print(json.dumps(out))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["zero"] == ""  # hidden: a zero-share client never lands on a GPU uncounted by Ray
    assert out["one"] in ("0", "1")


# ---------------------------------------------------------------------------------------------------- memory
@pytest.mark.slow
def test_out_of_memory_shrinks_the_batch_once_and_results_do_not_change(tmp_path, monkeypatch, caplog):
    """An injected out-of-memory error above 2 clients per batch: batches of 1, logged once, same results."""
    over = ["num_rounds=3", "num_clients=6", "clients_per_round=4"]
    run_tiny(tmp_path / "seq", "engine=inprocess", *over)
    sizes = []
    original = vectorized._train_bucket

    def limited(members, *args):
        sizes.append(len(members))
        if len(members) > 2:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return original(members, *args)

    monkeypatch.setattr(vectorized, "_train_bucket", limited)
    with caplog.at_level(logging.WARNING, logger="fedsim"):
        run_tiny(tmp_path / "vec", "engine=vectorized", *over)
    assert caplog.text.count("out of memory with") >= 1 and "running" not in caplog.text
    assert max(sizes) > 2 and sizes.count(max(sizes)) <= caplog.text.count("out of memory with")
    assert all(s <= 2 for s in sizes[sizes.index(max(sizes)) + 1 :])  # never retried big after the error
    a, b = (
        without_wall_time(read_metrics(tmp_path / "seq")),
        without_wall_time(read_metrics(tmp_path / "vec")),
    )
    for ra, rb in zip(a, b, strict=True):
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["round"], k)


@pytest.mark.slow
def test_a_single_client_that_does_not_fit_runs_through_the_client_app(tmp_path, monkeypatch, caplog):
    def never(members, *args):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(vectorized, "_train_bucket", never)
    with caplog.at_level(logging.WARNING, logger="fedsim"):
        summary = run_tiny(tmp_path, "engine=vectorized")
    assert summary["status"] == "completed" and "running" in caplog.text and "sequentially" in caplog.text


def test_memory_estimate_includes_activations_and_optimizer_state():
    from torch import nn

    from fedsim.training import LocalTraining

    model = nn.Sequential(nn.Flatten(), nn.Linear(100, 400), nn.ReLU(), nn.Linear(400, 10))
    x = torch.zeros(5, 100)
    client = vectorized._Client(msg=None, task=None, start={}, batches=[torch.arange(32)])
    sgd = vectorized.estimate_bytes(model, x, [client], LocalTraining(optimizer="sgd"), 0.0)
    mom = vectorized.estimate_bytes(model, x, [client], LocalTraining(optimizer="momentum"), 0.5)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert mom - sgd == 2 * params  # momentum buffer and FedProx anchor
    act = vectorized.activation_bytes(model, x[0])
    assert act >= (100 + 400 + 10) * 4  # input, ReLU output (the second layer reads it), logits
    assert sgd == 2 * params + 2 * 32 * act


@pytest.mark.slow
def test_memory_estimate_is_close_to_the_real_peak_on_cpu():
    """The estimate against the peak resident memory of one batched step measured in a fresh process."""
    code = textwrap.dedent(
        """
        import json, resource, torch
        from types import SimpleNamespace as NS
        from torch import nn
        from fedsim.engines import vectorized
        from fedsim.training import LocalTraining
        from fedsim.build import ClientTask
        torch.manual_seed(0)
        k, n, width, d, h = 24, 256, 256, 784, 1024
        model = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))
        local = LocalTraining(optimizer="momentum", lr=0.01, local_steps=2, batch_size=width)
        members = []
        for i in range(k):
            x, y = torch.randn(n, d), torch.randint(0, 10, (n,))
            task = ClientTask(i, model, x, y, x[:0], y[:0], local, 0, "cpu")
            start = {nm: p.detach().clone() for nm, p in model.named_parameters()}
            msg = NS(metadata=NS(message_id=str(i)))
            members.append(vectorized._Client(msg, task, start, [torch.arange(width)] * 2))
        est = k * vectorized.estimate_bytes(model, members[0].task.x_train, members, local, 0.0)
        def rss():  # resident bytes now (not the high-water mark, which earlier work may have set)
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * resource.getpagesize()

        samples = []
        grad = torch.autograd.grad

        def sampling_grad(*args, **kwargs):  # activations alive before, gradients alive after
            samples.append(rss())
            out = grad(*args, **kwargs)
            samples.append(rss())
            return out

        torch.autograd.grad = sampling_grad
        vectorized.train_reply = lambda *args, **kwargs: None  # the replies need real messages; not measured
        vectorized._dense_step = lambda *args: None  # the autograd path (the MLP's hand-written step holds less)
        base = rss()
        assert len(vectorized._train_bucket(members, local, "cpu", 0.0)) == k
        print(json.dumps({"estimate": est, "measured": max(samples) - base}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0.5 <= out["estimate"] / out["measured"] <= 2.0, out


# ---------------------------------------------------------------------------------------------------- numerics
def test_deterministic_placement_sets_torch_numerics():
    build.set_numerics(True)
    try:
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32 and torch.are_deterministic_algorithms_enabled()
    finally:
        build.set_numerics(False)
    assert not torch.backends.cudnn.deterministic and torch.backends.cudnn.allow_tf32
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_must_be_a_boolean():
    with pytest.raises(
        ConfigError, match=r"^placement.deterministic='yes' is not allowed: expected true or false"
    ):
        from fedsim.groups import typed

        typed("placement", Placement, {"deterministic": "yes"})


def test_agreement_tolerance_follows_the_precision():
    fp32 = build.agreement_tolerance("cpu", False, 10)
    assert fp32 == pytest.approx(1000 * torch.finfo(torch.float32).eps * 10)
    assert build.agreement_tolerance("cuda", True, 10) == fp32  # TF32 off
    assert build.agreement_tolerance("cuda", False, 10) > 10 * fp32  # TF32 convolutions


def _cnn_runs(tmp_path, device: str, deterministic: bool):
    over = [
        "dataset=synthetic_images",
        "model=cnn",
        "num_rounds=2",
        f"placement.device={device}",
        f"placement.server_device={device}",
        f"placement.deterministic={str(deterministic).lower()}",
        "client.local_steps=3",
    ]
    run_tiny(tmp_path / "seq", "engine=inprocess", *over)
    run_tiny(tmp_path / "vec", "engine=vectorized", "engine.vmap_conv_cpu=true", *over)
    tol = build.agreement_tolerance(device, deterministic, 3 * 2)
    a, b = torch.load(tmp_path / "seq" / "model.pt"), torch.load(tmp_path / "vec" / "model.pt")
    for k in a:
        torch.testing.assert_close(b[k].float().cpu(), a[k].float().cpu(), rtol=tol, atol=tol)


@pytest.mark.slow  # two CNN runs
def test_cnn_engines_agree_within_the_fp32_tolerance(tmp_path):
    _cnn_runs(tmp_path, "cpu", deterministic=False)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (runs whenever one is present)")
@pytest.mark.parametrize("deterministic", [True, False])
def test_cnn_engines_agree_on_the_gpu(tmp_path, deterministic):
    _cnn_runs(tmp_path, "cuda", deterministic)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (runs whenever one is present)")
def test_gpu_placement_trains_on_the_gpu(tmp_path):
    summary = run_tiny(tmp_path, "placement=gpu")
    assert summary["status"] == "completed"
    assert compose_cfg("placement=gpu").placement.device == "cuda"


@pytest.mark.slow
def test_client_data_leaves_the_device_when_the_run_ends(tmp_path):
    run_tiny(tmp_path, "engine=vectorized")
    assert build.client_task.cache_info().currsize == 0 and not build._MODELS


@pytest.mark.slow
def test_gpu_check_dry_run_exercises_every_path():
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--dry-run"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    out = proc.stdout
    for needle in (
        "agree-mlp",
        "agree-cnn-deterministic",
        "agree-cnn-fast",
        "agree-mlp-alie-median",
        "agree-mlp-client-dp",
        "pool workers",
        "injected OOM",
        "time-inprocess",
        "time-vectorized",
        "time-torch",
        "all checks passed",
    ):
        assert needle in out, needle
