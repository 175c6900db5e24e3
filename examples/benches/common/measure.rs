//! What a layout really holds, per rank, measured on the counting allocator
//! ([`measure_layout`]), for the planner's tests and the memory bench: the side of the
//! planner's predictions ([`bonfire_plan::predict_ranks`]) that is measured.

use bonfire_comm::testing::rank_alloc;
use bonfire_layout::ParallelDims;
use bonfire_models::data::TokenBatch;
use bonfire_parallel::{DataSource, ParallelModel};
use bonfire_train::{Launcher, OptimizerKind, TrainError, Trainer};
use burn::tensor::{Device, Tensor, TensorData};
use std::time::Instant;

/// One rank's measurement of a layout ([`measure_layout`]), bytes over the rank's baseline.
#[derive(Debug, Clone, Copy, Default)]
pub struct RankRun {
    /// Live after the last forward+backward, before its optimizer step: parameters,
    /// gradients, optimizer state.
    pub held: usize,
    /// The most bytes live during those steps' forward+backward (the planner's moment "at a
    /// backward's start", and, in a pipeline, its gradient sums).
    pub backward_peak: usize,
    /// The most bytes live during those steps' optimizer step (the planner's gradient sum
    /// without a pipeline).
    pub step_peak: usize,
    /// The most bytes one of those steps' forward+backward added over what was live right
    /// before it (activations and the transients of forward and backward, gradients made).
    pub activation_peak: usize,
    /// The fastest step after the first (forward+backward and optimizer step), ms.
    pub step_ms: f64,
    /// The CPU backend's per-thread matrix-product workspace, allocated before the baseline
    /// and so in neither figure above ([`warm_matmul_workspace`]).
    pub workspace: usize,
}

impl RankRun {
    /// The most bytes live during the steps after the first (the larger of the two moments).
    pub fn steady_peak(&self) -> usize {
        self.backward_peak.max(self.step_peak)
    }
}

/// Has this thread's matrix-product workspace allocated (one small product) and returns the
/// bytes that took on this thread's rank: the `gemm` crate behind Burn's CPU backend keeps a
/// packing buffer per thread, sized to the core's L2 cache (`gemm_common::gemm::L2_SLAB`:
/// 2 MiB on this machine), allocated by the thread's first product and kept for the
/// thread's life. It is the backend's, not the layout's — the same on every
/// rank whatever the model, mesh or schedule, like a GPU's cuBLAS workspace, which the
/// planner does not model either — so [`measure_layout`] allocates it before a rank's
/// baseline and reports it beside the rank's bytes instead of inside them.
pub fn warm_matmul_workspace() -> usize {
    let before = rank_alloc::current_rank().map_or(0, rank_alloc::live);
    let device = Device::flex().autodiff();
    let a = Tensor::<2>::from_data(TensorData::new(vec![0.5f32; 64 * 64], [64, 64]), &device);
    std::hint::black_box(a.clone().matmul(a).into_data());
    rank_alloc::current_rank()
        .map_or(0, rank_alloc::live)
        .saturating_sub(before)
}

/// Trains `model` (of a vocabulary of `vocab`) `steps` AdamW steps (at least 2) under `dims`
/// on rank threads, `rows` sequences of `seq` tokens a step
/// ([`bonfire_models::data::pattern_batch`]), and reads every
/// rank's bytes from the counting allocator — which must be the binary's global allocator
/// ([`rank_alloc::RankAllocator`]) — charged to allocator ranks `first..first + world` (fresh
/// ones per run: blocks a run leaves alive do not disturb the next). Each rank's baseline is
/// taken after its thread's matrix-product workspace exists ([`warm_matmul_workspace`]).
pub fn measure_layout<M: ParallelModel<Batch = TokenBatch> + Sync>(
    vocab: usize,
    dims: &ParallelDims,
    model: &M,
    (rows, seq, steps): (usize, usize, usize),
    first: usize,
) -> Vec<RankRun> {
    assert!(steps >= 2, "the steady peak needs a step after the first");
    assert!(
        rank_alloc::installed(),
        "the counting allocator is not installed"
    );
    let trainer = Trainer::new(dims.clone(), || OptimizerKind::AdamW.build());
    Launcher::Threads {
        ranks: dims.world_size(),
    }
    .run("planner-measure", |pg| {
        let r = first + pg.rank();
        let _rank = rank_alloc::enter_rank(r);
        let workspace = warm_matmul_workspace();
        let batch = |step, device: &burn::tensor::Device| {
            bonfire_models::data::pattern_batch(vocab, rows, seq, step, device)
        };
        let b0 = batch(0, &Device::flex().autodiff());
        let base = rank_alloc::live(r);
        let mut engine = trainer.build(model.clone(), &pg, &b0)?;
        drop(b0);
        let mut run = RankRun {
            workspace,
            ..RankRun::default()
        };
        let mut timed = f64::MAX;
        for step in 0..steps {
            let b = batch.replica_batch(step, engine.replica(), engine.device());
            let before = rank_alloc::live(r);
            rank_alloc::reset_peak(r);
            let start = Instant::now();
            engine.forward_backward(&b)?;
            drop(b);
            run.held = rank_alloc::live(r) - base;
            let peak = rank_alloc::peak(r);
            rank_alloc::reset_peak(r);
            engine.step(1e-4)?;
            if step > 0 {
                timed = f64::min(timed, start.elapsed().as_secs_f64());
                let optimizer = rank_alloc::peak(r) - base;
                run.backward_peak = run.backward_peak.max(peak - base);
                run.activation_peak = run.activation_peak.max(peak - before);
                run.step_peak = run.step_peak.max(optimizer);
            }
        }
        run.step_ms = timed * 1e3;
        Ok::<RankRun, TrainError>(run)
    })
    .expect("launch")
    .into_iter()
    .map(|r| r.expect("rank"))
    .collect()
}
