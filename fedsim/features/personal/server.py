"""Server halves of personalised FL: Ditto and FedPer (the clients' halves are in ``fedsim.features.personal.client``).

Both average the global model like FedAvg; what differs is what they tell the clients. Their personal models or
layers never leave the clients; federated evaluation (``federated_eval=true``) has each client evaluate the model
it would use, and ``metrics.jsonl`` reports the mean and 10th percentile over the clients.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fedsim.checks import number
from fedsim.errors import ConfigError
from fedsim.features.personal.client import DITTO_LAMBDA, FEDPER_LAYERS, personal_names
from fedsim.strategies.fedavg import FedAvg


class Ditto(FedAvg):
    """Ditto: FedAvg for the global model; clients also train personal models with weight ``lam`` toward it.

    Parameters
    ----------
    lam : float
        lambda >= 0, the pull of each personal model toward the global one (0: purely local models).
    """

    client_algorithm = "fedsim.features.personal.client.Ditto"

    def __init__(self, lam: float = 0.1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lam = number("lam", lam, 0.0)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        config[DITTO_LAMBDA] = self.lam
        return super().configure_train(server_round, arrays, config, grid)


class FedPer(FedAvg):
    """FedPer: the layers named by ``personal_layers`` stay on the clients; the base is averaged.

    Parameters
    ----------
    personal_layers : list of str
        Parameter-name prefixes of the personal layers (e.g. ``["3"]`` for the last layer of the default MLP,
        whose parameters are ``3.weight`` and ``3.bias``).
    """

    client_algorithm = "fedsim.features.personal.client.FedPer"

    def __init__(self, personal_layers: Sequence[str] = ("3",), **kwargs) -> None:
        super().__init__(**kwargs)
        if isinstance(personal_layers, str) or not personal_layers:
            raise ConfigError(
                "personal_layers", personal_layers, "a non-empty list of parameter-name prefixes"
            )
        self.personal_layers = [str(p) for p in personal_layers]

    def check_model(self, names: list[str]) -> None:
        """Refuse prefixes that match no parameter of the model (one line, before any work)."""
        missing = [p for p in self.personal_layers if not personal_names(names, [p])]
        if missing:
            raise ConfigError(
                "personal_layers",
                self.personal_layers,
                f"prefixes of the model's parameters ({', '.join(names)}); {missing[0]!r} matches none",
            )
        if len(personal_names(names, self.personal_layers)) == len(names):
            raise ConfigError("personal_layers", self.personal_layers, "a part of the model, not all of it")

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        config[FEDPER_LAYERS] = ",".join(self.personal_layers)
        return super().configure_train(server_round, arrays, config, grid)
