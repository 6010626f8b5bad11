"""``GridView`` forwards every public method of Flower's ``Grid``: a method it leaves to ``Grid``'s own default
answers for the view, not for the grid underneath (``Grid.get_nodes`` rebuilt the nodes from their ids alone,
without names or public keys, so a deployment's node binding refused every node)."""

from __future__ import annotations

import inspect

from flwr.serverapp import Grid

from fedsim.grid_utils import GridView, SampledGrid
from fedsim.server_app import FlowerTrainKeys, ReplyLog


class _Keyed(Grid):
    """A grid whose nodes have names and public keys, as a SuperLink's do."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def set_run(self, run_id):  # pragma: no cover - not used
        self.calls.append("set_run")

    @property
    def run(self):
        return "the run"

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # pragma: no cover
        raise AssertionError("views build their own messages")

    def get_node_ids(self):
        return [7, 9]

    def get_nodes(self):
        from types import SimpleNamespace

        return [
            SimpleNamespace(node_id=7, name="a", public_key=b"k7"),
            SimpleNamespace(node_id=9, name="b", public_key=b"k9"),
        ]

    def push_messages(self, messages):
        self.calls.append("push")
        return []

    def pull_messages(self, message_ids):
        self.calls.append("pull")
        return []

    def send_and_receive(self, messages, *, timeout=None):
        self.calls.append("send_and_receive")
        return []


def _public_methods(cls) -> set[str]:
    return {
        n
        for n, v in inspect.getmembers(cls)
        if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }


def test_grid_view_overrides_every_public_method_of_flowers_grid():
    missing = sorted(n for n in _public_methods(Grid) if n not in vars(GridView))
    assert not missing, f"GridView leaves these to Grid's defaults: {missing}"


def test_every_view_keeps_the_nodes_names_and_public_keys(tmp_path):
    base = _Keyed()
    views = [GridView(base), SampledGrid(base, [7]), FlowerTrainKeys(base)]
    views.append(ReplyLog(FlowerTrainKeys(base), tmp_path / "replies.jsonl"))
    for view in views:
        nodes = list(view.get_nodes())
        assert [(n.node_id, n.name, n.public_key) for n in nodes] == [(7, "a", b"k7"), (9, "b", b"k9")], view
