//! Every strategy on Burn's wgpu backend (on a machine without a GPU, Mesa's software
//! Vulkan), a device whose memory is not the host's: one rank, DDP, ZeRO-1/2/3 (with and
//! without offload), tensor and pipeline parallelism train to the same losses, step-0
//! gradients and parameters as the same layout on Flex, with SGD and with AdamW (the device
//! checks the GPU kit runs on CUDA, `examples/gpu_check/checks.rs`); and the transfer ledger
//! of one training step shows each bucket staged down and up exactly once (under tensor
//! parallelism, each activation all-reduce and the logits' all-gather once), and no parameter
//! or optimizer round trip, and its sync counter one host read a loss value. Run with
//! `--features wgpu` (`cargo xtask test` does).

#![cfg(feature = "wgpu")]

mod common;

use bonfire_dtensor::plane::Transfers;
use bonfire_dtensor::plane::ledger::{Direction, Reason};
#[path = "../examples/gpu_check/checks.rs"]
#[allow(dead_code)]
mod device_checks;
#[path = "../examples/gpu_check/profile.rs"]
mod profile;
#[path = "../benches/common/throughput.rs"]
#[allow(dead_code)]
mod throughput;
use bonfire_examples::harness;
use device_checks::ROWS;
#[path = "../benches/common/ledger.rs"]
#[allow(dead_code)]
mod ledger;
use bonfire_layout::ParallelDims;
use bonfire_layout::ZeroStage;
use bonfire_models::data::Batches;
use bonfire_models::{Gpt, GptConfig};
use bonfire_module::params;
use bonfire_train::OptimizerKind;
use burn::tensor::Device;
use std::sync::OnceLock;

fn wgpu() -> Device {
    harness::device("wgpu").unwrap()
}

/// Two layers, d 16, vocab 32, seq 8: small enough for a software GPU.
fn cfg() -> GptConfig {
    GptConfig::tiny()
}

struct Fixture {
    flex: Gpt,
    wgpu: Gpt,
    batches: Batches,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let (flex, batches) = device_checks::gpt_fixture();
        let wgpu = params::fork(flex.clone(), &wgpu());
        Fixture {
            flex,
            wgpu,
            batches,
        }
    })
}

/// The layouts of several ranks the GPU kit checks too: DDP, ZeRO 1–3, offload, TP, PP.
fn layouts() -> Vec<ParallelDims> {
    device_checks::layouts()
        .into_iter()
        .filter(|dims| dims.world_size() > 1)
        .collect()
}

#[test]
fn every_strategy_on_wgpu_matches_flex() {
    let f = fixture();
    let layouts = device_checks::layouts();
    for line in device_checks::parity(&f.flex, &f.batches, &wgpu(), &layouts) {
        println!("{line}");
    }
}

/// Every rank's transfers during its second training step under `dims` on wgpu, and the
/// model's number of parameter elements.
/// The CUDA checks' comparison (`parity_tf32`: normwise per tensor, AdamW's parameters by
/// their updates) run where f32 products are f32 (lavapipe): every bound holds with room, the
/// initial values it measures the updates from are found under the outcome's names, and the
/// layouts are compared against one wgpu rank as on CUDA.
#[test]
fn the_tf32_comparison_passes_where_products_are_f32() {
    let f = fixture();
    let all = device_checks::layouts();
    let layouts = [all[0].clone(), all[4].clone()]; // one rank, ZeRO-3 over 2
    let lines = device_checks::parity_tf32(&f.flex, &f.batches, &wgpu(), &layouts);
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert!(lines.iter().any(|l| l.contains("updates")), "{lines:?}");
    for line in lines {
        eprintln!("{line}");
    }
}

fn second_step(dims: &ParallelDims) -> (Vec<Transfers>, usize) {
    let f = fixture();
    let batch = |s: usize, device: &Device| f.batches.rows(s, 0, ROWS, device);
    let ranks = ledger::second_step(&f.wgpu, dims, OptimizerKind::AdamW, 0.01, batch)
        .unwrap_or_else(|e| panic!("{dims}: {e}"));
    let numel = params::inventory(&f.wgpu).iter().map(|p| p.numel()).sum();
    (ranks, numel)
}

/// Bytes staged (down, up) for the collectives of one step of a data-parallel layout on two
/// ranks, with `b` the bytes of every gradient (one bucket: the tiny model fits one).
/// ZeRO-3's gathers depend on the layer split; it is bounded below by ZeRO-2's.
fn data_parallel_staging(zero: ZeroStage, b: u64) -> Option<(u64, u64)> {
    match zero {
        // All-reduce of the bucket: down once, up once.
        ZeroStage::Zero0 => Some((b, b)),
        // All-reduce of the gradients, then all-gather of the updated parameters (own half
        // down, every half up).
        ZeroStage::Zero1 => Some((b + b / 2, b + b)),
        // Reduce-scatter of the gradients (all down, own half up), all-gather as above.
        ZeroStage::Zero2 => Some((b + b / 2, b / 2 + b)),
        ZeroStage::Zero3 => None,
    }
}

/// Bytes staged (down, up) by one step of the GPT on `tp` ranks alone (no sequence or loss
/// parallelism; the plan of `bonfire_models::gpt::parallelize`): no gradient bucket (dp=1; the
/// replicated parameters see the same inputs on every rank), only activations. An all-reduce
/// of a `[ROWS, seq, d]` activation stages it down and up whole; there are 2 + 6 per layer:
/// the vocab-parallel embedding's partial rows (forward), per block the row-wise `attn.o` and
/// `mlp.fc2` outputs (forward) and the input gradients of the column-wise `attn.q`, `k`, `v`
/// and `mlp.fc1` (backward: Megatron's f, one per column-wise layer), and the head's input
/// gradient (backward). The head's logits `[ROWS, seq, vocab]` are all-gathered forward (own
/// share down, all of them up; backward keeps the own share, no communication).
fn tensor_parallel_staging(tp: usize) -> (u64, u64) {
    let c = cfg();
    let activation = (ROWS * c.max_seq_len * c.d_model * 4) as u64;
    let all_reduces = (2 + 6 * c.n_layers) as u64;
    let logits = (ROWS * c.max_seq_len * c.vocab_size * 4) as u64;
    (
        all_reduces * activation + logits / tp as u64,
        all_reduces * activation + logits,
    )
}

#[test]
fn one_staged_copy_down_and_up_per_bucket() {
    use Direction::{DeviceToHost as Down, HostToDevice as Up};
    for dims in layouts() {
        let (ranks, numel) = second_step(&dims);
        let b = 4 * numel as u64;
        for (rank, t) in ranks.iter().enumerate() {
            println!(
                "ledger {dims} rank {rank}: {t} ({numel} parameters) {:?}",
                t.moved
            );
            let of = |d, r| t.of(d, r);
            for d in [Down, Up] {
                for r in [Reason::Export, Reason::Checkpoint] {
                    assert_eq!(of(d, r), 0, "{dims} rank {rank}: no parameter round trip");
                }
            }
            // Only the rank holding the loss reads it (four bytes a micro-batch) for the report.
            let (last, m) = (rank + 1 == ranks.len(), dims.microbatches() as u64);
            let report = if dims.pp() == 1 {
                4
            } else {
                4 * m * last as u64
            };
            assert_eq!(
                of(Down, Reason::Report),
                report,
                "{dims} rank {rank}: the loss"
            );
            // The sync counter: one host read a loss value, none of a parameter or a state.
            let reads = |r| t.reads_of(r);
            assert_eq!(
                reads(Reason::Report),
                report / 4,
                "{dims} rank {rank}: syncs"
            );
            assert_eq!(
                reads(Reason::Export) + reads(Reason::Checkpoint),
                0,
                "{dims}"
            );
            if dims.pp() > 1 {
                // The stage boundary: activations down and up forward, their gradients
                // backward, [ROWS, seq, d] f32 each; a data-parallel group of one moves nothing.
                let boundary = (ROWS * cfg().max_seq_len * cfg().d_model * 4) as u64;
                let staged = (of(Down, Reason::Activation), of(Up, Reason::Activation));
                assert_eq!(
                    staged,
                    (boundary, boundary),
                    "{dims} rank {rank}: activations"
                );
                let collective = (of(Down, Reason::Collective), of(Up, Reason::Collective));
                assert_eq!(
                    collective,
                    (0, 0),
                    "{dims} rank {rank}: dp=1 reduces nothing"
                );
                continue;
            }
            let what = format!("{dims} rank {rank}: collective staging");
            let staged = (of(Down, Reason::Collective), of(Up, Reason::Collective));
            if dims.tp() > 1 {
                assert_eq!(dims.dp(), 1, "{what}: the layouts' tp runs alone");
                assert_eq!(staged, tensor_parallel_staging(dims.tp()), "{what}");
            } else {
                match data_parallel_staging(dims.zero, b) {
                    Some(expected) => assert_eq!(staged, expected, "{what}"),
                    None => assert!(staged.0 >= b + b / 2 && staged.1 >= b + b / 2, "{what}"),
                }
            }
            let offloaded = if dims.offload { (b / 2, b / 2) } else { (0, 0) };
            assert_eq!(
                (of(Down, Reason::Offload), of(Up, Reason::Offload)),
                offloaded,
                "{dims} rank {rank}: offload sends the gradient shard down and the update up"
            );
        }
    }
}

/// ZeRO-Offload with the model on wgpu: the optimizer state and its master values live on
/// Flex (a different device: its memory is the host's), the parameters and gradients on wgpu.
#[test]
fn offload_keeps_the_state_on_flex_and_the_model_on_wgpu() {
    use bonfire_comm::ThreadWorld;
    use bonfire_module::DataParallel;
    use bonfire_zero::{Zero, ZeroConfig};
    let f = fixture();
    ThreadWorld::new(2)
        .launch(|pg| {
            for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
                let config = ZeroConfig::new(stage).with_offload(true);
                let model = params::fork(f.wgpu.clone(), &wgpu());
                let optim = OptimizerKind::AdamW.build();
                let mut z = Zero::new(model, optim, pg.clone(), config.clone()).unwrap();
                for s in 0..2 {
                    let (x, y) = f.batches.rows(s, pg.rank() * 2, 2, z.device());
                    let loss = z.forward(|m: &Gpt| m.loss(x, y));
                    z.backward(loss).unwrap();
                    let g = z.held_gradients().expect("gradients after backward");
                    assert!(
                        bonfire_kernels::runs_kernels(&g.device()),
                        "{stage:?}: grads on wgpu"
                    );
                    z.step(0.01).unwrap();
                }
                let optim = z.optimizer();
                assert!(
                    !bonfire_kernels::runs_kernels(optim.state_device()),
                    "{stage:?}"
                );
                assert_eq!(
                    optim.state_device(),
                    &Device::flex(),
                    "{stage:?}: state on Flex"
                );
                assert_eq!(optim.device_bytes(), 0, "{stage:?}: no state on wgpu");
                let own = z.own_range().len();
                assert_eq!(
                    optim.offload_bytes(),
                    12 * own,
                    "{stage:?}: moments and master"
                );
                let shard = z.own_tensor().unwrap();
                assert!(
                    bonfire_kernels::runs_kernels(&shard.device()),
                    "{stage:?}: params on wgpu"
                );
            }
        })
        .unwrap();
}

/// The kit's 1 B bench model is Llama-3.2-1B's shape with its tied head (1,235,814,400
/// parameters, the planner's preset), and its MFU counts the same training FLOPs a token as
/// the untied model's (the tied table multiplies as the head; the untied one's input table
/// is a lookup).
#[test]
fn the_1b_bench_is_llama_3_2_1b_tied() {
    let tied = device_checks::llama_1b();
    assert!(tied.variant.tie_word_embeddings);
    assert_eq!(tied.num_params(), 1_235_814_400);
    let preset = bonfire_plan::ModelSpec::preset("llama3.2-1b").unwrap();
    assert_eq!(tied.num_params(), preset.num_params());
    let mut untied = tied;
    untied.variant.tie_word_embeddings = false;
    let t = tied.max_position_embeddings;
    let flops = |c| device_checks::flops_per_token(c, c.num_params(), t);
    assert_eq!(flops(&tied), flops(&untied));
}

/// The loss and each parameter's gradient (host f32, inventory order) of `model` on `device`.
fn loss_and_grads(
    model: &bonfire_models::llama::Llama,
    device: &Device,
    (ids, targets): (&[i64], &[i64]),
) -> (f32, Vec<(String, Vec<f32>)>) {
    use burn::tensor::{Int, Tensor, TensorData};
    let model = params::fork(model.clone(), device);
    let rows = |v: &[i64]| {
        let data = TensorData::new(v.to_vec(), [2, v.len() / 2]);
        Tensor::<2, Int>::from_data(data, device)
    };
    let loss = model.loss(rows(ids), rows(targets));
    let value = params::to_host(loss.clone().cast(burn::tensor::DType::F32))[0];
    let mut grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
    let infos = params::inventory(&model);
    let flat = params::take_flat_grads(&model, &infos, &mut grads);
    let grads = infos.iter().zip(flat).map(|(info, g)| {
        let g = g.unwrap_or_else(|| panic!("{}: no gradient", info.path));
        (
            info.path.clone(),
            params::to_host(g.cast(burn::tensor::DType::F32)),
        )
    });
    (value, grads.collect())
}

/// In f16 on wgpu the Llama takes the fused CubeCL kernels — RMSNorm, RoPE, SwiGLU, the flash
/// attention ([`bonfire_kernels::fuses`]: f16 on a CubeCL device, never on Flex, whose fused
/// paths are f32 only) — and its loss and every step-0 gradient match the same f16 model on
/// Flex (Burn's ops, rounding to f16 after each) normwise per tensor within 2e-2 (f16's unit
/// roundoff is 4.9e-4; the kernels round once where Burn's ops round at each op: measured
/// 3.3e-3 at most on `LlamaConfig::tiny()` with this seed, the loss 4.3e-6 apart; 4.2e-3 to
/// 5.7e-3 on a vocabulary of 64). A norm kernel that reduced each unit's part alone (broken to
/// see it fail) put the embedding's gradient 210 times its scale apart.
#[test]
fn a_16_bit_llama_takes_the_fused_kernels_on_wgpu() {
    use burn::tensor::DType;
    let flex = harness::device("flex").unwrap();
    assert!(bonfire_kernels::fuses(&wgpu(), DType::F16));
    assert!(!bonfire_kernels::fuses(&flex, DType::F16));
    assert!(bonfire_kernels::fuses(&flex, DType::F32));
    let cfg = bonfire_models::llama::LlamaConfig::tiny();
    let model = params::seeded(7, &flex, |d| bonfire_models::llama::Llama::new(&cfg, d));
    let model = bonfire_module::precision::cast_module(model, DType::F16);
    let vocab = cfg.vocab_size as i64;
    let ids: Vec<i64> = (0..16).map(|i| (i * 7 + 3) % vocab).collect();
    let targets: Vec<i64> = (0..16).map(|i| (i * 5 + 1) % vocab).collect();
    let (got_loss, got) = loss_and_grads(&model, &wgpu(), (&ids, &targets));
    let (want_loss, want) = loss_and_grads(&model, &flex, (&ids, &targets));
    let bound = 2e-2f32;
    let worst_loss = (got_loss - want_loss).abs() / want_loss.abs();
    assert!(worst_loss <= bound, "loss {got_loss} vs {want_loss}");
    assert_eq!(got.len(), want.len());
    assert!(!want.is_empty());
    let mut worst: f32 = 0.0;
    for ((path, g), (_, w)) in got.iter().zip(&want) {
        let scale = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.0, "{path}: a zero gradient on Flex");
        let diff = g
            .iter()
            .zip(w)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= bound * scale, "{path}: {diff} apart, scale {scale}");
        worst = worst.max(diff / scale);
    }
    eprintln!("f16 Llama wgpu vs flex: loss {worst_loss:.1e}, gradients {worst:.1e} normwise");
}

/// The kit's `profile` on a tiny Llama on wgpu in f16: every piece of the step measured (a
/// piece that timed nothing would read 0), the shares of the split line adding up to 1.
#[test]
fn the_profile_check_splits_a_step() {
    let device = wgpu().autodiff();
    let cfg = bonfire_models::llama::LlamaConfig::tiny();
    let f16 = bonfire_layout::MixedPrecision::f16();
    let layout = ParallelDims::parse_mesh("dp=1")
        .unwrap()
        .with_precision(f16);
    let (speed, _) = device_checks::train_llama(&device, &cfg, layout, (2, 2), None).unwrap();
    let run = (burn::tensor::DType::F16, device_checks::bench_adamw());
    let split = profile::profile(&device, &cfg, run, (2, 2), speed.step_ms).unwrap();
    for (name, ms) in [
        ("matmul", split.matmul),
        ("attention", split.attention),
        ("elementwise", split.elementwise),
        ("optimizer", split.optimizer),
    ] {
        assert!(ms.is_finite() && ms > 0.0, "{name}: {ms} ms in {split:?}");
    }
    assert_eq!(split.communication, 0.0);
    let line = split.line("tiny");
    let shares: f64 = line
        .split_whitespace()
        .filter_map(|kv| kv.split_once("_share="))
        .map(|(_, v)| v.parse::<f64>().unwrap())
        .sum();
    assert!((shares - 1.0).abs() < 1e-2, "{line}");
    eprintln!("{line}");
}

/// The kit's `offload` check on a tiny Llama on wgpu: ZeRO-Offload over one rank (f16 on the
/// device, f32 masters and AdamW state on the host) runs its steps, its losses finite; the
/// 8 B shape is Llama-3.1-8B's (the planner's preset).
#[test]
fn the_offload_check_trains_on_one_rank() {
    let cfg = bonfire_models::llama::LlamaConfig::tiny();
    // lavapipe multiplies no bf16: f16 stands in for the kit's bf16.
    let f16 = bonfire_layout::MixedPrecision::f16();
    let run = device_checks::offload_llama(&wgpu().autodiff(), &cfg, f16, (2, 3));
    let (speed, params) = run.unwrap();
    assert_eq!(params, cfg.num_params());
    let (first, last) = speed.losses;
    // Random batches each step at the kit's lr 1e-4: the losses need not fall (offload's
    // arithmetic is the parity suites'); they must be finite.
    assert!(first.is_finite() && last.is_finite(), "{first} -> {last}");
    assert!(speed.tokens_per_s > 0.0);
    let big = device_checks::llama_8b();
    assert_eq!(big.num_params(), 8_030_261_248);
    let preset = bonfire_plan::ModelSpec::preset("llama3.1-8b").unwrap();
    assert_eq!(big.num_params(), preset.num_params());
}
