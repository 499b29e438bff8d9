"""Muon for the hidden matrices, AdamW for the rest: two OSS under one ShardedDataParallel.

    torchrun --nproc-per-node 2 examples/muon_adamw.py --steps 30 --checkpoint muon_adamw.pt
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from shardopt.elastic import init_process_group
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS, ShardedGradScaler, split_hidden_matrices

VOCAB, DIM = 64, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)  # the output layer, not tied to the embedding

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--checkpoint", default="muon_adamw.pt")
args = parser.parse_args()
cuda = torch.cuda.is_available()
device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
if cuda:
    torch.cuda.set_device(device)
init_process_group("nccl" if cuda else "gloo")  # torch's, made safe for torchrun restarts
rank = dist.get_rank()

torch.manual_seed(0)  # the same initial weights on every rank
model = TinyLM().to(device)
# Muon: the blocks' Linear weights, each whole on one rank. AdamW: embedding, head, norms, biases.
matrices, others = split_hidden_matrices(model, non_hidden=model.head)
muon = OSS(matrices, optim=torch.optim.Muon, lr=0.02, momentum=0.95, weight_decay=0.01)
adamw = OSS(others, optim=torch.optim.AdamW, lr=3e-3, weight_decay=0.01)
ddp = ShardedDataParallel(model, [muon, adamw])  # one wrapper reduces every gradient to its owner
scaler = ShardedGradScaler(enabled=False)  # enabled=True when training in fp16
offsets = torch.arange(17)

for step in range(args.steps):
    data = torch.Generator().manual_seed(1000 * step + rank)  # different data on every rank and step
    batch = ((torch.randint(0, VOCAB, (16, 1), generator=data) + offsets) % VOCAB).to(device)  # counting sequences
    ddp.zero_grad(set_to_none=True)
    logits = ddp(batch[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    scaler.scale(loss).backward()
    scaler.unscale_(muon)
    scaler.unscale_(adamw)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm, both optimizers' gradients
    scaler.step(muon)
    scaler.step(adamw)
    scaler.update()
    if rank == 0:
        print(f"step {step + 1} loss {loss.item():.4f} grad norm {norm.item():.4f}")

# Each optimizer's state, consolidated on rank 0: plain torch.optim state dicts that load into
# torch.optim.Muon / AdamW, or into OSS at any world size (muon.load_state_dict(saved["muon"])).
muon.consolidate_state_dict(recipient_rank=0)
adamw.consolidate_state_dict(recipient_rank=0)
if rank == 0:
    torch.save({"model": model.state_dict(), "muon": muon.state_dict(), "adamw": adamw.state_dict()},
               args.checkpoint)
ddp.close()
dist.destroy_process_group()
