"""A tiny nanoGPT-style training script: a character-level GPT on text made in code.

Runs as nanoGPT's train.py does: alone (``python tiny_gpt.py``), under torchrun
(``torchrun --nproc-per-node 2 tiny_gpt.py --steps=40``), or from a notebook cell with
``%run tiny_gpt.py --steps=40`` (in a ``%%taas --gpus 2`` cell: as under torchrun).  Any
setting below can be changed with ``--name=value``.  Under torch.distributed the model is
wrapped in DistributedDataParallel, so each rank trains on its own batches and the gradients
are averaged: every rank ends with the same weights.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# -- settings (override with --name=value, as nanoGPT's configurator.py does) --------------------
steps = 40
batch_size = 16
block_size = 32
n_layer = 2
n_head = 4
n_embd = 32
learning_rate = 3e-3
seed = 1337
for arg in sys.argv[1:]:
    name, _, value = arg.removeprefix("--").partition("=")
    if name not in globals() or name.startswith("_") or not value:
        raise SystemExit(f"tiny_gpt.py: unknown setting {arg!r}")
    globals()[name] = type(globals()[name])(value)

# -- distributed, as under torchrun --------------------------------------------------------------
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu"
else:
    rank, world_size, device = 0, 1, "cuda" if torch.cuda.is_available() else "cpu"
master_process = rank == 0

# -- data: sentences made in code, no download ----------------------------------------------------
text = " ".join(f"{a} plus {b} is {a + b}." for a in range(20) for b in range(20))
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
itos = dict(enumerate(chars))
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
vocab_size = len(chars)
batches = torch.Generator().manual_seed(seed + rank)  # each rank its own batches


def get_batch():
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=batches)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


# -- the model: nanoGPT's shape, small ------------------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        t = x.size(1)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        logits = self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos(pos))))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, prompt, n):
        idx = torch.tensor([[stoi[c] for c in prompt]], device=next(self.parameters()).device)
        for _ in range(n):
            logits, _ = self(idx[:, -block_size:])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return "".join(itos[int(i)] for i in idx[0])


torch.manual_seed(seed)  # the same initial weights on every rank (DDP checks)
model = GPT().to(device)
raw_model = model
if ddp:
    model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)

# -- training ------------------------------------------------------------------------------------
losses = []
for iter_num in range(steps):
    x, y = get_batch()
    _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # DDP averages the gradients over the ranks here
    optimizer.step()
    losses.append(loss.item())
    if master_process and iter_num % 10 == 0:
        print(f"iter {iter_num}")

if master_process:
    print(f"trained {steps} steps on {world_size} rank(s); loss fell: {losses[-1] < losses[0]}")
if ddp:  # the ranks trained together: they hold the same weights
    flat = torch.cat([p.detach().flatten() for p in raw_model.parameters()])
    mean = flat.clone()
    dist.all_reduce(mean)
    same = torch.tensor(float(torch.allclose(mean / world_size, flat, atol=1e-6)), device=flat.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if master_process:
        print(f"every rank holds the same weights: {bool(same)}")
