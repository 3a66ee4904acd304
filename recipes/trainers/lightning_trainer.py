# lightning_trainer.py — a Lightning script, one node of a swarm (lines marked `# drift` added):
#   drift coord recipes/trainers/lightning.yaml, then on each machine:
#   python recipes/trainers/lightning_trainer.py TICKET OUT_FILE
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from drift.lightning import DriftCallback  # drift

torch.manual_seed(0)  # every node builds the same initial model
x = torch.rand(4000, 2) * 2 - 1
y = (x.norm(dim=1) * 2.8).long().clamp(max=3)
x_val = torch.rand(500, 2) * 2 - 1
y_val = (x_val.norm(dim=1) * 2.8).long().clamp(max=3)


class Rings(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        xb, yb = batch
        return nn.functional.cross_entropy(self.net(xb), yb)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def val_loss(module):
    return nn.functional.cross_entropy(module.net(x_val), y_val).item()


module = Rings()
swarm = DriftCallback(ticket=sys.argv[1], evaluate=val_loss)  # drift
trainer = L.Trainer(logger=False, enable_checkpointing=False, callbacks=[swarm])  # drift (+ callbacks)
trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
torch.save(module.state_dict(), sys.argv[2])
