# The PyTorch app that `flwr new pytorchapp --framework PyTorch --username flwrlabs` generates (Flower 1.22.0:
# the installed Flower's `flwr new` fetches its templates from the Flower hub, which is not reachable offline;
# Apache-2.0), verbatim except its data loading, swapped for local data:
#   - removed: `from flwr_datasets import FederatedDataset`, `from flwr_datasets.partitioner import
#     IidPartitioner`, `from torchvision.transforms import Compose, Normalize, ToTensor`, `fds = None`,
#     `pytorch_transforms = ...` and `apply_transforms`
#   - replaced: the body of `load_data` (CIFAR-10 from the Hugging Face Hub -> seeded synthetic 3x32x32 images,
#     the data set fedsim's server evaluates on with the overrides in pyproject.toml); same signature, same
#     DataLoaders of {"img", "label"} batches, same 80/20 split and batch size
# client_app.py is verbatim.
"""pytorchapp: A Flower / PyTorch app."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def load_data(partition_id: int, num_partitions: int):
    """Load partition of local images (seeded synthetic images shaped like CIFAR-10)."""
    from fedsim.data.synthetic_images import synthetic_images

    ds = synthetic_images(seed=0, num_train=1200, num_test=300, shape=(3, 32, 32), noise=1.0)
    x, y = ds.x_train[partition_id::num_partitions], ds.y_train[partition_id::num_partitions]
    partition = [{"img": torch.as_tensor(a), "label": int(b)} for a, b in zip(x, y)]
    # Divide data on each node: 80% train, 20% test
    n = int(0.8 * len(partition))
    trainloader = DataLoader(partition[:n], batch_size=32, shuffle=True)
    testloader = DataLoader(partition[n:], batch_size=32)
    return trainloader, testloader


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / len(trainloader)
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
