"""The ray engine (Flower's simulation engine) runs the same apps and gives the same result as inprocess."""

import pytest
import torch
from conftest import read_metrics, run_tiny, without_wall_time


@pytest.mark.slow
def test_ray_engine_matches_inprocess(tmp_path):
    over = ["seed=2", "num_rounds=3", "placement.num_cpus_per_client=1"]
    run_tiny(tmp_path / "inproc", *over)
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
    over = ["strategy=fedbuff", "strategy.buffer_size=2", "heterogeneity=lognormal", "num_rounds=4",
            "placement.num_cpus_per_client=1"]
    run_tiny(tmp_path / "inproc", *over)
    run_tiny(tmp_path / "ray", "engine=ray", *over)
    a, b = read_metrics(tmp_path / "inproc"), read_metrics(tmp_path / "ray")
    assert [r["staleness_max"] for r in a[1:]] == [r["staleness_max"] for r in b[1:]]
    for ra, rb in zip(without_wall_time(a), without_wall_time(b), strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-7), (ra["round"], k)
