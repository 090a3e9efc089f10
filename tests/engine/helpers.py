"""Small models and data shared by the engine tests."""

import torch
import torch.nn as nn


class TinyNet(nn.Module):
    """Two-layer MLP with dropout (exercises the RNG) and a loss head."""

    def __init__(self, dim=16, hidden=32, classes=4, dropout=0.1):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x, y):
        logits = self.fc2(self.drop(torch.relu(self.fc1(x))))
        return nn.functional.cross_entropy(logits.float(), y)


def make_data(n, dim=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, classes, generator=g)
    x = torch.randn(n, dim, generator=g)
    y = (x @ w).argmax(-1)
    return x, y


def base_config(**overrides):
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "steps_per_print": 1000,
    }
    cfg.update(overrides)
    return cfg
