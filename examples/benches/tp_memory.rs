//! `cargo xtask bench tp`: parameter bytes and activation bytes per rank of the GPT bench
//! size (vocab 4096, d 256, 8 heads, 4 layers, seq 128, d_ff 1024, batch 8, f32) under
//! tensor parallelism TP = 1, 2, 4, with and without sequence parallelism (loss_parallel on
//! whenever TP > 1), next to the expected fractions.
//!
//! What is counted:
//! - `param_bytes`: the sum of the sizes of this rank's parameter tensors (local shards).
//!   `expected_param_bytes`: the same from the plan's arithmetic (sharded parameters / tp,
//!   replicated ones whole).
//! - `act_bytes`: bytes that stay allocated after the forward pass, until backward — the
//!   activations the autodiff graph saved for backward — measured with a counting global
//!   allocator (live bytes after forward minus live bytes before, over all rank threads,
//!   divided by tp; ranks are symmetric). `peak_bytes`: the highest live bytes during forward
//!   and backward above the same baseline, per rank. One warm-up step first, so that
//!   communication buffers are allocated before measuring.
//! - `expected_act_fraction`: the fraction of the TP=1 activations that ideal Megatron-style
//!   sharding keeps per rank, counting per block what a pre-norm block must save (LN inputs,
//!   the q/k/v and fc1 inputs, q, k, v, attention probabilities, the o input, the GELU input,
//!   the fc2 input): without SP the LN and q/k/v/fc1 inputs stay whole, with SP everything is
//!   divided by tp. `act_fraction` is the measured act_bytes over TP=1's with the same `sp`
//!   and `ckpt`.
//! - `ckpt=balanced` rows run on `Device::flex().autodiff().gradient_checkpointing()`
//!   (Burn's Balanced strategy): the sequence all-gathers of column-wise layers are marked
//!   recomputable, so they are re-gathered in backward instead of kept, like Megatron's
//!   sequence parallelism (Burn may recompute other cheap operations too).

use bonfire_comm::ThreadWorld;
use bonfire_comm::testing::rank_alloc::{self, RankAllocator};
use bonfire_dtensor::DeviceMesh;
use bonfire_examples::default_device;
use bonfire_models::gpt::parallelize::gpt_tp_plan;
use bonfire_models::{Gpt, GptConfig};
use bonfire_tp::parallelize_module;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Int, Tensor, TensorData};
use std::time::Duration;

#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

const BATCH: usize = 8;

struct Bytes(usize);
impl ModuleVisitor for Bytes {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        self.0 += p.dims().iter().product::<usize>() * 4;
    }
}

fn expected_param_bytes(c: &GptConfig, tp: usize) -> usize {
    let (v, d, t, f) = (c.vocab_size, c.d_model, c.max_seq_len, c.d_ff);
    let block_sharded = 3 * (d * d + d) + d * d + (f * d + f) + d * f;
    let block_replicated = 4 * d + 2 * d; // ln1, ln2, the row-wise biases of o and fc2
    let sharded = v * d + c.n_layers * block_sharded + v * d;
    let replicated = t * d + c.n_layers * block_replicated + 2 * d;
    4 * (sharded / tp + replicated)
}

fn expected_act_fraction(c: &GptConfig, tp: usize, sp: bool) -> f64 {
    let (b, t, d, f, h) = (BATCH, c.max_seq_len, c.d_model, c.d_ff, c.n_heads);
    let (b, t, d, f, h) = (b as f64, t as f64, d as f64, f as f64, h as f64);
    let whole = 4.0 * b * t * d; // LN1 and LN2 inputs, the q/k/v input, the fc1 input
    let sharded = 3.0 * b * t * d + b * h * t * t + b * t * d + 2.0 * b * t * f;
    let tp = tp as f64;
    let kept = if sp {
        (whole + sharded) / tp
    } else {
        whole + sharded / tp
    };
    kept / (whole + sharded)
}

fn main() {
    let cfg = GptConfig::bench();
    let n = BATCH * cfg.max_seq_len;
    let ids: Vec<i64> = (0..n as i64)
        .map(|i| (i * 7919) % cfg.vocab_size as i64)
        .collect();
    let tg: Vec<i64> = (0..n as i64)
        .map(|i| (i * 104729 + 1) % cfg.vocab_size as i64)
        .collect();
    let mut base_act = std::collections::HashMap::new();
    for tp in [1usize, 2, 4] {
        for (sp, ckpt) in [(false, false), (true, false), (true, true)] {
            let device = if ckpt {
                default_device().gradient_checkpointing()
            } else {
                default_device()
            };
            // Built on the device itself: a strategy is part of every tensor.
            let model = Gpt::new(&cfg, &device);
            let results = ThreadWorld::new(tp)
                .timeout(Duration::from_secs(300))
                .launch(|pg| {
                    let mesh = DeviceMesh::one_d(&pg, "tp").unwrap();
                    let mut m = model.clone().fork(&device);
                    if tp > 1 || sp {
                        let plan = gpt_tp_plan(sp, tp > 1);
                        m = parallelize_module(m, &mesh, "tp", &plan).unwrap();
                    }
                    let mut bytes = Bytes(0);
                    m.visit(&mut bytes);
                    let batch = || {
                        (
                            Tensor::<2, Int>::from_data(
                                TensorData::new(ids.clone(), [BATCH, cfg.max_seq_len]),
                                &device,
                            ),
                            Tensor::<2, Int>::from_data(
                                TensorData::new(tg.clone(), [BATCH, cfg.max_seq_len]),
                                &device,
                            ),
                        )
                    };
                    // Warm-up.
                    let (x, y) = batch();
                    drop(m.loss(x, y).backward());
                    let (x, y) = batch();
                    pg.barrier().unwrap();
                    let before = rank_alloc::process_live();
                    pg.barrier().unwrap();
                    if pg.rank() == 0 {
                        rank_alloc::reset_process_peak();
                    }
                    pg.barrier().unwrap();
                    let loss = m.loss(x, y);
                    pg.barrier().unwrap();
                    let after = rank_alloc::process_live();
                    pg.barrier().unwrap();
                    drop(loss.backward());
                    pg.barrier().unwrap();
                    let peak = rank_alloc::process_peak();
                    (
                        bytes.0,
                        (after as f64 - before as f64) / tp as f64,
                        (peak as f64 - before as f64) / tp as f64,
                    )
                })
                .unwrap();
            let (param_bytes, act, peak) = results[0];
            let base = *base_act.entry((sp, ckpt)).or_insert(act);
            println!(
                "bench tp tp={tp} sp={sp} param_bytes={param_bytes} expected_param_bytes={} act_bytes={:.0} act_fraction={:.3} expected_act_fraction={:.3} peak_bytes={:.0} ckpt={}",
                expected_param_bytes(&cfg, tp),
                act,
                act / base,
                expected_act_fraction(&cfg, tp, sp),
                peak,
                if ckpt { "balanced" } else { "none" }
            );
        }
    }
}
