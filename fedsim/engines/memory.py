"""What a batch of the vectorized engine fits: which models it can batch, free memory, the bytes a client takes,
a model's parameter names and shapes."""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call

from fedsim.engines import grouped
from fedsim.engines.schedule import _info
from fedsim.training import LocalTraining

if TYPE_CHECKING:
    from fedsim.engines.vectorized import _Client


def free_bytes(device: str) -> int:
    """Memory free for a batch on ``device``: the GPU's free memory, or the machine's available RAM."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 2**62


def activation_bytes(model: nn.Module, example: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward pass of one example (probed once per model and input shape)."""
    key = (id(model), tuple(example.shape), example.dtype)
    if key not in _ACTIVATIONS:
        seen: dict[tuple, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = (
                t.numel() * t.element_size()
            )
            return t

        params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = functional_call(model, params, (example.detach().clone().unsqueeze(0),))
        param_storages = {p.untyped_storage().data_ptr() for p in params.values()}
        _ACTIVATIONS[key] = sum(b for (ptr, *_), b in seen.items() if ptr not in param_storages) + out.nbytes
    return _ACTIVATIONS[key]


_ACTIVATIONS: dict[tuple, int] = {}


def estimate_bytes(
    model: nn.Module, x: torch.Tensor, members: list[_Client], local: LocalTraining, mu: float
) -> int:
    """Peak bytes one more client adds to a batched step (:func:`client_bytes`, at the cohort's batch width)."""
    width = max((_info(c.batches).lens[0] for c in members if c.batches), default=1)
    return client_bytes(model, x[0] if x.shape[0] else None, local, width, mu)


def client_bytes(
    model: nn.Module, example: torch.Tensor | None, local: LocalTraining, width: int, mu: float
) -> int:
    """Peak bytes one client adds to a batched step: its weights, gradients, optimiser state and FedProx
    anchor, plus its activations (one example's, times the batch width, twice: forward and backward).
    The run's pre-flight memory check uses the same estimate (``fedsim.experiment.check_memory``)."""
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    copies = 2 + (local.optimizer in ("momentum", "nesterov")) + (mu > 0)  # weights, grads, momentum, anchor
    per_example = activation_bytes(model, example) if example is not None else 0
    return copies * param_bytes + 2 * width * per_example


# model id -> (the model, its parameters' names in order, their shapes by name)


_MODEL_INFO: dict[int, tuple[weakref.ref, list[str], dict[str, tuple[int, ...]]]] = {}


def _model_info(model: nn.Module) -> tuple[weakref.ref, list[str], dict[str, tuple[int, ...]]]:
    """``model``'s parameters' names and shapes, read once per model."""
    known = _MODEL_INFO.get(id(model))
    if known is None or known[0]() is not model:
        if len(_MODEL_INFO) >= 64:
            _MODEL_INFO.clear()
        params = list(model.named_parameters())
        known = (weakref.ref(model), [n for n, _ in params], {n: tuple(p.shape) for n, p in params})
        _MODEL_INFO[id(model)] = known
    return known


def _names(model: nn.Module) -> list[str]:
    """The names of ``model``'s parameters, in order (read once per model; not to be modified)."""
    return _model_info(model)[1]


def unsupported(model: nn.Module, device: str, vmap_conv_cpu: bool) -> str | None:
    """Why ``model`` cannot be trained batched (None when it can)."""
    if next(model.buffers(), None) is not None:
        return "the model has buffers (e.g. BatchNorm)"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        return "the model uses dropout"
    params = list(model.named_parameters())
    if not all(p.requires_grad for _, p in params) or len(params) != len(model.state_dict()):
        return "the model has frozen or tied parameters"
    if (
        device == "cpu"
        and not vmap_conv_cpu
        and not grouped.supports(model)
        and any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    ):
        return (
            "convolutions in a model that is not a plain Sequential of conv/pool/linear layers are faster per "
            "client on the CPU (engine.vmap_conv_cpu=true forces vmap)"
        )
    return None
