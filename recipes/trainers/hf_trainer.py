# hf_trainer.py — a Hugging Face Trainer script, one node of a swarm (lines marked `# drift` added):
#   drift coord recipes/trainers/hf.yaml, then on each machine:
#   python recipes/trainers/hf_trainer.py TICKET OUT_DIR
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from drift.hf import DriftCallback  # drift

torch.manual_seed(0)  # every node builds the same initial model
model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=16, n_embd=32, n_layer=1, n_head=2))
starts = torch.randint(0, 16, (2200,))
seqs = (starts[:, None] + torch.arange(16)) % 16  # count up from a random token: easy to learn
train = [{"input_ids": s, "labels": s} for s in seqs[:2000]]
val = [{"input_ids": s, "labels": s} for s in seqs[2000:]]

args = TrainingArguments(
    output_dir=sys.argv[2],
    max_steps=1000,  # an upper bound: the swarm's run ends training
    per_device_train_batch_size=16,
    learning_rate=3e-3,
    lr_scheduler_type="constant",
    logging_steps=5,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
)
swarm = DriftCallback(ticket=sys.argv[1], eval_dataset=val)  # drift
trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[swarm])  # drift (+ callbacks)
trainer.train()
trainer.save_model()
