"""fedsim: federated-learning simulation on Flower, PyTorch and Hydra."""

__version__ = "0.1.0"
