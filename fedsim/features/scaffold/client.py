"""SCAFFOLD's client half (Karimireddy et al., ICML 2020, https://arxiv.org/abs/1910.06378), option II.

Each local step corrects the gradient with the control variates: ``y <- y - lr (g(y) + c - c_i)``, where ``c``
is the server's control variate (sent with the model as the ArrayRecord ``scaffold-c``) and ``c_i`` the
client's own (its persistent state). After ``K`` steps, option II::

    c_i+ = c_i - c + (x - y) / (K lr)          # x: the model received, y: the model after local training
    send  y  and  dc_i = c_i+ - c_i            # as the model and the ArrayRecord ``scaffold-dc``

The strategy half is ``fedsim.features.scaffold.server.Scaffold``. The update rule is the paper's for plain local SGD;
with momentum or Adam the correction is still added to every gradient, but option II's ``(x - y) / (K lr)`` is no
longer the average corrected gradient.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsim.algorithms.base import ClientAlgorithm, LocalRun

SERVER_C = "scaffold-c"  # ArrayRecord in the train message: the server control variate c
DELTA_C = "scaffold-dc"  # ArrayRecord in the reply: c_i+ - c_i
_STATE = "c_i/"  # prefix of the client's persistent arrays


class Scaffold(ClientAlgorithm):
    """SCAFFOLD client: control-variate-corrected local SGD, option II update of ``c_i``."""

    stateful = True
    strategy = "fedsim.features.scaffold.server.Scaffold"
    sends = (("its control-variate delta dc_i", "raw"),)  # unclipped (fedsim.strategies.composition)
    keeps = "its control variate c_i"

    def before_training(self, run: LocalRun) -> None:
        super().before_training(run)
        if SERVER_C not in run.incoming:
            raise ValueError(
                f"SCAFFOLD client: the train message holds no '{SERVER_C}' (run strategy=scaffold)"
            )
        c = run.incoming[SERVER_C]
        run.scratch["c"], run.scratch["c_i"], run.scratch["corr"] = {}, {}, {}
        for name, p in run.params:
            c_k = np.asarray(c[name], np.float64)
            ci_k = np.asarray(run.state.get(_STATE + name, np.zeros_like(c_k)), np.float64)
            run.scratch["c"][name], run.scratch["c_i"][name] = c_k, ci_k
            run.scratch["corr"][name] = torch.as_tensor(c_k - ci_k, dtype=p.dtype, device=p.device)

    def on_gradients(self, run: LocalRun) -> None:
        super().on_gradients(run)
        with torch.no_grad():
            for name, p in run.params:
                p.grad.add_(run.scratch["corr"][name])

    def after_training(self, run: LocalRun) -> None:
        super().after_training(run)
        if run.done == 0:
            run.outgoing[DELTA_C] = {name: np.zeros_like(c) for name, c in run.scratch["c"].items()}
            return
        scale = 1.0 / (run.done * self.local.lr)
        delta, state = {}, {}
        for name, p in run.params:
            x = run.start[name].detach().cpu().double().numpy()
            y = p.detach().cpu().double().numpy()
            c, c_i = run.scratch["c"][name], run.scratch["c_i"][name]
            c_new = c_i - c + (x - y) * scale
            delta[name] = (c_new - c_i).astype(np.float32)
            state[_STATE + name] = c_new
        run.outgoing[DELTA_C] = delta
        run.state = state
