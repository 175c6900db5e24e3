"""PyTorch's side of the GPU kit's `gemm` and `bench-1b` checks (docs/gpu.md), run by
`gpu_check` on the same GPU in the same kit run when `python3` there imports torch (and, for
`bench-1b`, transformers). Prints `key=value` lines that `gpu_check` reads:

    python3 gpu_bench.py gemm --shapes 4096x2048x2048,4096x2048x8192 --reps 20
    python3 gpu_bench.py bench-1b --batch 2 --steps 5 --mode eager|compile
    python3 gpu_bench.py attention --shapes 2x32x8x2048x64

`attention`: causal SDPA (grouped-query, bf16; PyTorch's flash kernel) forward, and forward +
backward, ms a call over 10 calls after 2 warm-ups. `gemm`: torch.matmul (cuBLAS/cuBLASLt) on bf16 random normal operands, the chain
`x <- (x @ B) @ C` of `reps` links after 3 warm-ups timed with CUDA events (as `gpu_check`
times CubeCL's), TFLOP/s over both products. `bench-1b`: transformers' LlamaForCausalLM with
Llama-3.2-1B's shape and its tied head (as Bonfire's bench), f32 parameters, bf16 autocast,
SDPA attention, fused AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-6, weight decay 0.1): the fastest
stock options a user gets. Step time is the median of the timed steps, each ended by a
synchronisation; peak bytes are the caching allocator's.
"""

import argparse
import statistics
import time

import torch


def gemm(shapes, reps):
    for shape in shapes:
        m, k, n = (int(x) for x in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * k**-0.5
        c = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * n**-0.5
        link = lambda x: torch.matmul(torch.matmul(x, b), c)
        for _ in range(3):
            x = link(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            x = link(x)
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        tflops = 4.0 * m * k * n * reps / seconds / 1e12
        print(f"gemm m={m} k={k} n={n} backend=cublas tflops={tflops:.1f}", flush=True)


def events_ms(run, reps=10, warm=2):
    for _ in range(warm):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def attention(shapes):
    import torch.nn.functional as F

    for shape in shapes:
        b, h, h_kv, t, dh = (int(x) for x in shape.split("x"))
        draw = lambda heads: torch.randn(b, heads, t, dh, device="cuda", dtype=torch.bfloat16)
        q, k, v = draw(h), draw(h_kv), draw(h_kv)
        attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        forward = events_ms(lambda: attend(q, k, v))
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        both = events_ms(lambda: attend(qg, kg, vg).sum().backward())
        print(
            f"attention shape={shape} sdpa_fwd_ms={forward:.3f} sdpa_fwd_bwd_ms={both:.3f}",
            flush=True,
        )


def llama_1b():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).cuda()


def bench_1b(batch, steps, mode):
    model = llama_1b()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, fused=True
    )
    forward = torch.compile(model) if mode == "compile" else model
    gen = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.randint(0, 128256, (steps + 2, batch, 2048), device="cuda", generator=gen)

    def step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times = []
    torch.cuda.reset_peak_memory_stats()
    for s in range(steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(ids[s])
        loss.item()
        torch.cuda.synchronize()
        if s >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    step_ms = statistics.median(times)
    print(
        f"pytorch mode={mode} batch={batch} params={params} step_ms={step_ms:.1f} "
        f"tokens_per_s={batch * 2048 / (step_ms / 1e3):.0f} "
        f"peak_allocated_bytes={torch.cuda.max_memory_allocated()} "
        f"peak_reserved_bytes={torch.cuda.max_memory_reserved()} loss={loss.item():.3f}",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["gemm", "bench-1b", "attention"])
    parser.add_argument("--shapes", default="4096x2048x2048")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mode", choices=["eager", "compile"], default="eager")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.what == "gemm":
        gemm(args.shapes.split(","), args.reps)
    elif args.what == "attention":
        attention(args.shapes.split(","))
    else:
        bench_1b(args.batch, args.steps, args.mode)


if __name__ == "__main__":
    main()
