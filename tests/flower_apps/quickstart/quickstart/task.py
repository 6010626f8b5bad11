"""quickstart: A Flower / PyTorch app.

Written as Flower's quickstart-pytorch writes its task (its own ``Net``, ``load_data``, ``train`` with Adam over
``epochs`` at ``lr``, ``test`` returning loss and accuracy), on local data: scikit-learn's 8x8 digits, split
``partition_id::num_partitions``, which is what fedsim's ``dataset=digits`` holds.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """Model (a small CNN for 8x8 digits)"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = x.view(-1, 8 * 4 * 4)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def load_data(partition_id: int, num_partitions: int):
    """Load partition of the 8x8 digits (local, offline)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target)
    x, y = images[partition_id::num_partitions], labels[partition_id::num_partitions]
    # Divide data on each node: 80% train, 20% test
    n = int(0.8 * len(y))
    trainloader = DataLoader(TensorDataset(x[:n], y[:n]), batch_size=32, shuffle=True)
    testloader = DataLoader(TensorDataset(x[n:], y[n:]), batch_size=32)
    return trainloader, testloader


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            images = images.to(device)
            labels = labels.to(device)
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
        for images, labels in testloader:
            images = images.to(device)
            labels = labels.to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
