"""Personalised FL on the client-algorithm contract: Ditto's personal models and FedPer's personal layers.

* **Ditto** (Li, Hu, Beirami, Smith, ICML 2021, https://arxiv.org/abs/2012.04221): the client trains the global
  model as usual (that is its reply) and, in the same task, its personal model ``v`` (persistent state, started
  from the first global model it sees) for as many steps on ``F_k(v) + lambda/2 ||v - w||^2`` around the received
  global model ``w``. It evaluates with ``v``.
* **FedPer** (Arivazhagan, Aggarwal, Singh, Choudhary 2019, https://arxiv.org/abs/1912.00818): the layers named
  by ``personal_layers`` (parameter-name prefixes) stay on the client: it trains with its own copy of them and
  sends the received global values back for them, so the server averages only the shared base.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsim.algorithms.base import ClientAlgorithm, LocalRun
from fedsim.local import SGD, LocalTraining, batch_size_for, proximal_gradient_

DITTO_LAMBDA = "ditto-lambda"  # train-config key: Ditto's lambda
FEDPER_LAYERS = (
    "fedper-layers"  # train-config key: comma-separated parameter-name prefixes kept on the client
)
_V = "v/"
_HEAD = "head/"


def personal_names(names: list[str], prefixes: list[str]) -> list[str]:
    """The parameter names that start with one of ``prefixes`` (a prefix is a name or a module path)."""
    return [n for n in names if any(n == p or n.startswith(p.rstrip(".") + ".") for p in prefixes)]


class Ditto(ClientAlgorithm):
    """Ditto client: global local SGD (the reply) plus a personal model kept on the client."""

    stateful = True
    strategy = "fedsim.features.personal.server.Ditto"
    keeps = "its personal model"

    def after_training(self, run: LocalRun) -> None:
        super().after_training(run)
        lam = float(run.instruction.unhandled.get(DITTO_LAMBDA, 0.0))
        params = run.params
        trained = [p.detach().clone() for _, p in params]  # the global update: the reply
        with torch.no_grad():
            for name, p in params:
                v = run.state.get(_V + name)
                p.copy_(run.start[name] if v is None else torch.as_tensor(v, dtype=p.dtype, device=p.device))
        opt = SGD([p for _, p in params], LocalTraining(lr=self.local.lr))  # plain SGD at the client's lr
        n, bs, done = run.x.shape[0], batch_size_for(run.x.shape[0], self.local), 0
        while done < run.done:
            order = torch.randperm(n, generator=run.generator).to(run.x.device)
            for s in range(0, n, bs):
                if done == run.done:
                    break
                idx = order[s : s + bs]
                loss = run.task.loss(run.model(run.x[idx]), run.y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                with torch.no_grad():
                    for name, p in params:
                        proximal_gradient_(p.grad, p, run.start[name], lam)  # Ditto's lambda/2 ||v - w||^2
                opt.step()
                done += 1
        run.state = {_V + name: p.detach().cpu().numpy().copy() for name, p in params}
        with torch.no_grad():
            for (_, p), t in zip(params, trained):
                p.copy_(t)

    def personalize(self, model, state) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if _V + name in state:
                    p.copy_(torch.as_tensor(state[_V + name], dtype=p.dtype, device=p.device))


class FedPer(ClientAlgorithm):
    """FedPer client: the personal layers stay here; the shared base is trained and sent as usual."""

    stateful = True
    strategy = "fedsim.features.personal.server.FedPer"
    keeps = "its personal layers"

    def _names(self, run: LocalRun) -> list[str]:
        prefixes = [p for p in str(run.instruction.unhandled.get(FEDPER_LAYERS, "")).split(",") if p]
        return personal_names([n for n, _ in run.params], prefixes)

    def before_training(self, run: LocalRun) -> None:
        super().before_training(run)
        run.scratch["personal"] = self._names(run)
        self.personalize(run.model, run.state)

    def after_training(self, run: LocalRun) -> None:
        super().after_training(run)
        personal = run.scratch["personal"]
        params = dict(run.params)
        run.state = {_HEAD + n: params[n].detach().cpu().numpy().copy() for n in personal}
        with torch.no_grad():  # the server averages the base only: it gets its own values back for the head
            for n in personal:
                params[n].copy_(run.start[n])

    def personalize(self, model, state) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if _HEAD + name in state:
                    p.copy_(torch.as_tensor(np.asarray(state[_HEAD + name]), dtype=p.dtype, device=p.device))
