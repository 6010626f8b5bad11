"""The ray engine (Flower's simulation engine) runs the same apps and gives the same result as inprocess."""

import pytest
import torch
from helpers import read_metrics, run_tiny, without_wall_time


@pytest.mark.slow
def test_ray_engine_matches_inprocess(tmp_path):
    over = ["seed=2", "num_rounds=3", "placement.num_cpus_per_client=1"]
    run_tiny(tmp_path / "inproc", "engine=inprocess", *over)
    summary = run_tiny(tmp_path / "ray", "engine=ray", *over)
    assert summary["engine"] == "ray" and summary["rounds_done"] == 3
    import ray

    assert not ray.is_initialized()  # Ray is shut down after the run, so sweeps do not leak it
    a, b = read_metrics(tmp_path / "inproc"), read_metrics(tmp_path / "ray")
    for ra, rb in zip(without_wall_time(a), without_wall_time(b), strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-7), (ra["round"], k)
    ma, mb = torch.load(tmp_path / "inproc" / "model.pt"), torch.load(tmp_path / "ray" / "model.pt")
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_async_loop_gives_identical_metrics_on_ray_and_inprocess(tmp_path):
    # the discrete-event loop handles tasks in simulated-time order, whatever order Ray computes them in
    over = [
        "strategy=fedbuff",
        "strategy.buffer_size=2",
        "heterogeneity=lognormal",
        "num_rounds=4",
        "placement.num_cpus_per_client=1",
    ]
    run_tiny(tmp_path / "inproc", "engine=inprocess", *over)
    run_tiny(tmp_path / "ray", "engine=ray", *over)
    a, b = read_metrics(tmp_path / "inproc"), read_metrics(tmp_path / "ray")
    assert [r["staleness_max"] for r in a[1:]] == [r["staleness_max"] for r in b[1:]]
    for ra, rb in zip(without_wall_time(a), without_wall_time(b), strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-7), (ra["round"], k)


def test_ray_placement_beyond_the_machine_is_a_config_error_before_ray_starts(tmp_path, monkeypatch):
    import os

    from fedsim.errors import ConfigError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no cluster file there
    with pytest.raises(ConfigError, match=r"^placement\.num_cpus_per_client=.*Ray gets 1 CPUs"):
        run_tiny(tmp_path / "a", "engine=ray", "+engine.num_cpus=1", "placement.num_cpus_per_client=2")
    with pytest.raises(ConfigError, match=r"^engine\.address='auto' .*running Ray cluster"):
        run_tiny(tmp_path / "b", "engine=ray", "engine.address=auto")
    assert os.cpu_count() >= 1 and not (tmp_path / "a" / "metrics.jsonl").exists()


def test_a_failing_ray_engine_is_one_run_error_and_ends_the_server_waits(monkeypatch):
    """Flower's engine fails (e.g. no actor fits): one RunError at once, and the ServerApp thread stops waiting."""
    import threading
    import time

    import flwr.simulation

    from fedsim.engines import ray as ray_engine
    from fedsim.errors import RunError
    from fedsim.grid_utils import wait_for_nodes

    waited = {}

    def failing_run_simulation(server_app, client_app, num_supernodes, backend_config):
        class NoNodes:
            def get_node_ids(self):
                return []

        def serve():  # what Flower's ServerApp thread does: wait for the nodes
            t0 = time.monotonic()
            try:
                server_app._main(NoNodes(), None)
            except RunError as e:
                waited["error"], waited["s"] = str(e), time.monotonic() - t0

        waited["thread"] = threading.Thread(target=serve)
        waited["thread"].start()
        time.sleep(0.3)
        try:
            raise ValueError("ActorPool is empty. Nothing to do")
        except ValueError as ex:
            raise RuntimeError("An error was encountered. Ending simulation.") from ex

    monkeypatch.setattr(flwr.simulation, "run_simulation", failing_run_simulation)
    backend = ray_engine.backend_config(1, 0, num_cpus=1)
    with pytest.raises(RunError, match="the Ray simulation failed: .*ActorPool is empty"):
        ray_engine.run(2, lambda grid: wait_for_nodes(grid, 2, timeout=300), backend)
    waited["thread"].join(timeout=10)
    assert waited["error"] == "the Ray simulation engine stopped" and waited["s"] < 5


# ------------------------------------------------------------- ArrayRecord conversions in local engines
def test_reply_arrays_are_the_bytes_flower_writes():
    import numpy as np
    from flwr.app import Array

    from fedsim.messages import to_array

    cases = [torch.randn(3, 4), torch.tensor(2.5), torch.zeros(0, 3), torch.arange(5), torch.ones(2).bool()]
    for t in cases:
        a, b = to_array(t), Array(t)
        assert (a.data, a.dtype, a.shape, a.stype) == (b.data, b.dtype, b.shape, b.stype)
    for t in (torch.randn(4, 3).t(), torch.randn(2, 3)[:, 1]):  # not C-contiguous: same values, C order
        np.testing.assert_array_equal(to_array(t).numpy(), t.numpy())


def test_the_global_model_is_parsed_once_per_record_object(monkeypatch):
    from flwr.app import Array, ArrayRecord

    from fedsim import messages
    from fedsim.messages import global_state

    record = ArrayRecord({"w": torch.ones(2, 2), "b": torch.zeros(2)})
    calls = []
    original = messages.array_values

    def counting(a, **kw):
        calls.append(1)
        return original(a, **kw)

    monkeypatch.setattr(messages, "array_values", counting)
    first = global_state(record)
    assert global_state(record) is first and len(calls) == 2  # one parse of each array
    assert first.keys() == record.to_torch_state_dict().keys()
    assert all(torch.equal(first[k], v) for k, v in record.to_torch_state_dict().items())  # Flower's values
    record["b"] = Array(torch.full((2,), 3.0))  # the same object, changed: parsed again
    assert torch.equal(global_state(record)["b"], torch.full((2,), 3.0)) and len(calls) == 4
    other = ArrayRecord({"w": torch.ones(2, 2), "b": torch.zeros(2)})
    assert global_state(other) is not first and len(calls) == 6
