"""PyTorch's side of `cargo xtask bench gemm` (issue 49, point 1): the same products as
`examples/benches/gemm.rs` — the bench GPT's and Llama's linear layers at 1,024 rows, forward
`x Wᵀ`, input gradient `dY W`, weight gradient `dYᵀ x`, f32 and bf16 — through `torch.matmul`
(MKL / oneDNN) on one thread, timed the same way (median of at least 5 repetitions and 0.2 s
after 0.1 s of warm-up, and the fastest of them). Prints
`bench gemm side=pytorch shape=… m= n= k= dtype= gflops= best_gflops= ms=`.
"""

import time

import torch

LAYERS = [
    ("gpt.qkvo", 256, 256),
    ("gpt.fc1", 256, 1024),
    ("gpt.fc2", 1024, 256),
    ("llama.kv", 256, 128),
    ("llama.gate_up", 256, 688),
    ("llama.down", 688, 256),
    ("head", 256, 4096),
]
ROWS = 1024


def timed(f):
    warm = time.perf_counter()
    f()
    f()
    while time.perf_counter() - warm < 0.1:
        f()
    times, start = [], time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < 0.2:
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2], times[0]


def main():
    torch.set_num_threads(1)
    torch.manual_seed(1)
    print(f"bench gemm side=pytorch torch={torch.__version__} threads={torch.get_num_threads()}")
    for dtype, name in [(torch.float32, "f32"), (torch.bfloat16, "bf16")]:
        for layer, d_in, d_out in LAYERS:
            x = torch.randn(ROWS, d_in).to(dtype)
            w = torch.randn(d_out, d_in).to(dtype)
            dy = torch.randn(ROWS, d_out).to(dtype)
            cases = [
                ("fwd", x, w.t(), (ROWS, d_out, d_in)),
                ("dx", dy, w, (ROWS, d_in, d_out)),
                ("dw", dy.t(), x, (d_out, d_in, ROWS)),
            ]
            for part, a, b, (m, n, k) in cases:
                seconds, best = timed(lambda: torch.matmul(a, b))
                gflops = 2 * m * n * k / 1e9
                print(
                    f"bench gemm side=pytorch shape={layer}.{part} m={m} n={n} k={k} "
                    f"dtype={name} gflops={gflops / seconds:.1f} best_gflops={gflops / best:.1f} "
                    f"ms={seconds * 1e3:.3f}"
                )


if __name__ == "__main__":
    main()
