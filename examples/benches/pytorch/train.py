"""PyTorch's side of `cargo xtask bench train`: the same bench models, batch, optimizer and
thread count as Bonfire's bench, timed the same way (the slowest rank of each timed step after
warm-up; their median, and the fastest of them), so the two rows of one run compare directly.

- `--model gpt`: the bench GPT written in plain PyTorch exactly as Bonfire's (`crates/models/
  src/gpt`): token + learned position embeddings, pre-LayerNorm blocks with biased q/k/v/o
  projections and causal SDPA, a GELU (erf) MLP with biases, a final LayerNorm, an untied head
  without bias; vocab 4096, d 256, 8 heads, 4 layers, d_ff 1024, seq 128.
- `--model llama`: transformers' `LlamaForCausalLM` with the bench config (vocab 4096, hidden
  256, 8 heads, 4 kv heads, 4 layers, intermediate 688, seq 128, untied head), SDPA attention.
- `--ranks N > 1`: N processes, one per rank, under `torch.distributed` (gloo) DDP, each with
  `--threads` intra-op threads and `--batch` sequences (Bonfire's ddp layout: the same global
  batch).

- `--device cuda` (one rank): the same on a GPU, each step's clock stopped after
  `torch.cuda.synchronize()`; `--tf32` lets its f32 products run on TF32 tensor cores, as
  Burn's CUDA backend does (PyTorch's default keeps them f32). What the GPU kit's `bench` check
  is compared with (docs/gpu.md).

Prints `bench pytorch model=… layout=single|ddp ranks=N step_ms=… tokens_per_s=… best_step_ms=…
best_tokens_per_s=… optimizer=… threads=… torch=…` (and `device=cuda tf32=0|1` on a GPU). Needs `torch` (and `transformers` for the Llama); the xtask finds a Python
that has them (`BONFIRE_PYTHON`, else `python3`) and says so when none does.
"""

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads, d_ff):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True
        )
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab=4096, d=256, heads=8, layers=4, d_ff=1024, seq=128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, d_ff) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids, targets):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=4096, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
            num_hidden_layers=4, intermediate_size=688, max_position_embeddings=128,
            tie_word_embeddings=False, attn_implementation="sdpa",
        )
        self.inner = LlamaForCausalLM(cfg)

    def forward(self, ids, targets):
        logits = self.inner(input_ids=ids).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01)
    # PyTorch's fastest stock AdamW: the fused kernel (one pass over every parameter, CPU and
    # CUDA), not the default per-tensor loop — the anchor is the best a user gets.
    return torch.optim.AdamW(
        params, lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, fused=True
    )


def run(rank, args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Gpt() if args.model == "gpt" else Llama()
    cuda = args.device == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        model = model.cuda()
    if args.ranks > 1:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=args.ranks)
        model = nn.parallel.DistributedDataParallel(model)
    opt = optimizer(args.optimizer, model.parameters())
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(0, 4096, (args.batch, 129), generator=gen)
        if cuda:
            ids = ids.cuda()
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    # The slowest rank of each timed step, as Bonfire's bench takes it; then their median and
    # the fastest of them.
    slowest = torch.tensor(times[args.warmup:], dtype=torch.float64)
    if args.ranks > 1:
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    step, best = statistics.median(slowest.tolist()), min(slowest.tolist())
    if rank == 0:
        tokens = args.batch * args.ranks * 128
        layout = "single" if args.ranks == 1 else "ddp"
        print(
            f"bench pytorch model={args.model} layout={layout} ranks={args.ranks} "
            f"step_ms={step * 1e3:.1f} tokens_per_s={tokens / step:.0f} "
            f"best_step_ms={best * 1e3:.1f} best_tokens_per_s={tokens / best:.0f} "
            f"optimizer={args.optimizer} fused={int(args.optimizer == 'adamw')} threads={args.threads} torch={torch.__version__}"
            + (f" device=cuda tf32={int(args.tf32)}" if cuda else ""),
            flush=True,
        )
    if args.ranks > 1:
        torch.distributed.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tf32", action="store_true")
    args = p.parse_args()
    if args.device == "cuda" and args.ranks > 1:
        p.error("--device cuda runs one rank")
    if args.ranks == 1:
        run(0, args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.multiprocessing.spawn(run, args=(args,), nprocs=args.ranks)


if __name__ == "__main__":
    main()
