# accelerate_loop.py — an accelerate loop, one node of a swarm (lines marked `# drift` added):
#   drift coord recipes/trainers/accelerate.yaml, then on each machine:
#   python recipes/trainers/accelerate_loop.py TICKET OUT_FILE
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import drift  # drift

torch.manual_seed(0)  # every node builds the same initial model
x = torch.rand(4000, 2) * 2 - 1
y = (x.norm(dim=1) * 2.8).long().clamp(max=3)
x_val = torch.rand(500, 2) * 2 - 1
y_val = (x_val.norm(dim=1) * 2.8).long().clamp(max=3)
accelerator = Accelerator(cpu=True)
model = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = accelerator.prepare(model, optimizer)


def val_loss(model):
    return nn.functional.cross_entropy(model(x_val), y_val).item()


with drift.DiLoCo(model, optimizer, ticket=sys.argv[1], samples=len(x), evaluate=val_loss) as swarm:  # drift
    loader = DataLoader(TensorDataset(x, y), batch_sampler=swarm.batches())  # drift (was: batch_size=32, shuffle=True)
    for step, (xb, yb) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(xb), yb)
        accelerator.backward(loss)
        swarm.log(step=step, loss=loss.item(), progress=swarm.progress.fraction)  # drift
        optimizer.step()  # the node's share of a round ends here: θ is averaged, written back
        optimizer.zero_grad()
torch.save(accelerator.unwrap_model(model).state_dict(), sys.argv[2])
