"""ZeRO-2 training on every rank torchrun starts: CPU ranks over gloo, or one GPU per rank over NCCL.

    torchrun --nproc-per-node 2 examples/train.py                      # resumes from checkpoint.pt if it exists
    torchrun --nproc-per-node 2 examples/train.py --steps 40 --checkpoint out/run.pt
"""
import argparse
import contextlib
import os

import torch
import torch.distributed as dist

from shardopt.checkpoint import load_consolidated, save_consolidated
from shardopt.elastic import init_process_group
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--checkpoint", default="checkpoint.pt")
args = parser.parse_args()
cuda = torch.cuda.is_available()
device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
if cuda:
    torch.cuda.set_device(device)
init_process_group("nccl" if cuda else "gloo")  # torch's, made safe for torchrun restarts
rank = dist.get_rank()

torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).to(device)
optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)  # ZeRO-1: each rank keeps 1/N of Adam's state
ddp = ShardedDataParallel(model, optimizer)  # ZeRO-2: each gradient is reduced to the rank that owns it
start = load_consolidated(args.checkpoint, model, optimizer)["step"] if os.path.exists(args.checkpoint) else 0
teacher = torch.randn(32, 1, generator=torch.Generator().manual_seed(1)).to(device)

for step in range(start, args.steps):
    data = torch.Generator().manual_seed(1000 * step + rank)  # different data on every rank and step
    micro_batches = [torch.randn(64, 32, generator=data).to(device) for _ in range(4)]
    optimizer.zero_grad()
    total = 0.0
    for i, x in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():  # accumulate locally, reduce on the last one
            loss = torch.nn.functional.mse_loss(ddp(x), x @ teacher) / len(micro_batches)
            loss.backward()
        total += loss.item()
    norm = optimizer.clip_grad_norm(1.0)  # the global norm over every rank's shard of the gradients
    optimizer.step()  # steps this rank's shard, then re-gathers the updated parameters
    if rank == 0:
        print(f"step {step + 1} loss {total:.4f} grad_norm {norm:.3f}", flush=True)
save_consolidated(args.checkpoint, model, optimizer, extra={"step": args.steps})  # one file, any world size
dist.destroy_process_group()
