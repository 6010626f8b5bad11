"""pytorchapp: A Flower / PyTorch app."""
