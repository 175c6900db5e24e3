//! Stage 3 frees each layer's gathered parameters when the layer is done, measured with a
//! counting allocator: a model that runs its layers through `bonfire_module::layer` holds
//! about one layer (plus the prefetched next) of full parameters during forward; the same
//! model without layer scopes holds all of them until forward returns. Both train to the
//! same parameters.
//!
//! Its own test binary: the allocator counts the whole process, so nothing else may run
//! beside it.

use bonfire_comm::ThreadWorld;
use bonfire_comm::testing::rank_alloc::{self, RankAllocator};
use bonfire_layout::MixedPrecision;
use bonfire_layout::ZeroStage;
use bonfire_module::DataParallel;
use bonfire_module::PrecisionDTypes;
use bonfire_module::layer;
use bonfire_zero::{Zero, ZeroConfig};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor};
use std::sync::Mutex;
use std::time::Duration;

#[global_allocator]
static HEAP: RankAllocator = RankAllocator;

const WIDTH: usize = 512;
/// Enough layers that a rank's gradient shard (LAYERS/RANKS layers) does not hide the
/// difference between holding a couple of layers' full gradients and holding them all; the
/// two rank threads' peaks may or may not coincide, so bounds leave a layer of slack.
const LAYERS: usize = 12;
const RANKS: usize = 2;
/// One layer's parameters (weight + bias), f32.
const LAYER_BYTES: usize = (WIDTH * WIDTH + WIDTH) * 4;

#[derive(Module, Debug)]
struct Deep {
    layers: Vec<Linear>,
}

impl Deep {
    fn loss(&self, mut x: Tensor<2>, scoped: bool) -> Tensor<1> {
        for l in &self.layers {
            x = if scoped {
                gelu(layer(l, &x).forward(x))
            } else {
                gelu(l.forward(x))
            };
        }
        x.powi_scalar(2).mean()
    }
}

struct Run {
    /// Heap growth during the measured forward, all ranks together.
    heap_peak: usize,
    /// Heap growth during the following backward, all ranks together.
    backward_peak: usize,
    /// The wrapper's own account of live gathered bytes (per rank).
    tracked_peak: usize,
    /// Heap growth kept from the end of forward until backward, all ranks together.
    held: usize,
    values: Vec<f32>,
}

/// Balanced checkpointing: backward re-gathers instead of keeping the gathered values.
fn device() -> Device {
    Device::flex().autodiff().gradient_checkpointing()
}

/// The allocator counts the whole process: one measurement at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn run(model: &Deep, stage: ZeroStage, scoped: bool) -> Run {
    run_in(model, stage, scoped, MixedPrecision::f32())
}

fn run_in(model: &Deep, stage: ZeroStage, scoped: bool, precision: MixedPrecision) -> Run {
    let device = device();
    let out = ThreadWorld::new(RANKS)
        .timeout(Duration::from_secs(120))
        .launch(|pg| {
            let config = ZeroConfig::new(stage)
                .with_prefetch(true)
                .with_bucket_bytes(LAYER_BYTES)
                .with_precision(precision);
            let replica = model.clone().fork(&device);
            let mut z = Zero::new(replica, SgdConfig::new().build(), pg.clone(), config).unwrap();
            let x = |s: usize| {
                let rows: Vec<f32> = (0..2 * WIDTH)
                    .map(|i| (((i * 7 + s * 3 + pg.rank() * 11) % 13) as f32 - 6.0) / 6.0)
                    .collect();
                Tensor::<2>::from_data(burn::tensor::TensorData::new(rows, [2, WIDTH]), &device)
                    .cast(precision.param_dtype())
            };
            // Step 1 records the layer order; step 2 prefetches by it and is measured.
            z.train_step(0.1, |m: &Deep| m.loss(x(0), scoped)).unwrap();
            let input = x(1);
            pg.barrier().unwrap();
            let base = rank_alloc::process_live();
            if pg.rank() == 0 {
                rank_alloc::reset_process_peak();
            }
            pg.barrier().unwrap();
            let loss = z.forward(|m: &Deep| m.loss(input, scoped));
            pg.barrier().unwrap();
            let heap_peak = rank_alloc::process_peak().saturating_sub(base);
            let held = rank_alloc::process_live().saturating_sub(base);
            let tracked_peak = z.memory().gathered_peak;
            pg.barrier().unwrap();
            let base = rank_alloc::process_live();
            if pg.rank() == 0 {
                rank_alloc::reset_process_peak();
            }
            pg.barrier().unwrap();
            z.backward(loss).unwrap();
            pg.barrier().unwrap();
            let backward_peak = rank_alloc::process_peak().saturating_sub(base);
            z.step(0.1).unwrap();
            let values = z.full_values().unwrap();
            (heap_peak, backward_peak, tracked_peak, held, values)
        })
        .unwrap();
    let (heap_peak, backward_peak, tracked_peak, held, values) = out.into_iter().next().unwrap();
    Run {
        heap_peak,
        held,
        backward_peak,
        tracked_peak,
        values,
    }
}

fn model() -> Deep {
    let device = device();
    Deep {
        layers: (0..LAYERS)
            .map(|_| LinearConfig::new(WIDTH, WIDTH).init(&device))
            .collect(),
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

#[test]
fn stage3_frees_each_layer_after_use() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = model();
    let plain = run(&model, ZeroStage::Zero3, false);
    let scoped = run(&model, ZeroStage::Zero3, true);
    eprintln!(
        "forward heap growth, {RANKS} ranks: without layer scopes {:.2} MiB (tracked {:.2} MiB/rank), \
         with {:.2} MiB (tracked {:.2} MiB/rank); one layer = {:.2} MiB",
        mib(plain.heap_peak),
        mib(plain.tracked_peak),
        mib(scoped.heap_peak),
        mib(scoped.tracked_peak),
        mib(LAYER_BYTES)
    );
    eprintln!(
        "backward heap growth: without layer scopes {:.2} MiB, with {:.2} MiB",
        mib(plain.backward_peak),
        mib(scoped.backward_peak)
    );
    // The wrapper's account: everything without scopes; with them, one layer and the
    // prefetched next.
    assert_eq!(plain.tracked_peak, LAYERS * LAYER_BYTES);
    assert_eq!(scoped.tracked_peak, 2 * LAYER_BYTES);
    // The allocator agrees: without scopes every rank's heap grows by all layers ...
    assert!(
        plain.heap_peak >= RANKS * LAYERS * LAYER_BYTES * 9 / 10,
        "without scopes the gathered model is held: {} bytes",
        plain.heap_peak
    );
    // ... with them by about the tracked peak (plus transient communication buffers of one
    // layer and the small activations), far from the whole model.
    assert!(
        scoped.heap_peak <= RANKS * (scoped.tracked_peak + 3 * LAYER_BYTES / 2),
        "with scopes the forward holds {} bytes, tracked {} per rank",
        scoped.heap_peak,
        scoped.tracked_peak
    );
    assert!(scoped.heap_peak * 2 < plain.heap_peak);
    // Backward: gradients leave layer by layer (the gathers are anchored at the layers'
    // inputs), so a rank holds its gradient shard plus a few layers' full parameters and
    // gradients, not every layer's full gradient until the end.
    let own = LAYERS * LAYER_BYTES / RANKS;
    assert!(
        scoped.backward_peak <= RANKS * (own + 5 * LAYER_BYTES),
        "backward holds {} bytes",
        scoped.backward_peak
    );
    assert!(
        scoped.backward_peak + RANKS * 2 * LAYER_BYTES <= plain.backward_peak,
        "backward with scopes {} bytes, without {}",
        scoped.backward_peak,
        plain.backward_peak
    );
    // Releasing early changes nothing numerically.
    assert_eq!(plain.values, scoped.values);
}

#[test]
fn stage2_reduces_gradients_layer_by_layer() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = model();
    let plain = run(&model, ZeroStage::Zero2, false);
    let scoped = run(&model, ZeroStage::Zero2, true);
    eprintln!(
        "stage 2 backward heap growth, {RANKS} ranks: without layer scopes {:.2} MiB, with {:.2} MiB",
        mib(plain.backward_peak),
        mib(scoped.backward_peak)
    );
    // Without hooks every full gradient exists when backward returns; with them each
    // layer's bucket is reduce-scattered and dropped during backward.
    // (the two rank threads' peaks need not coincide: three quarters of the sum)
    assert!(
        plain.backward_peak >= RANKS * LAYERS * LAYER_BYTES * 3 / 4,
        "{}",
        plain.backward_peak
    );
    // With them a rank holds its gradient shard (LAYERS/RANKS layers, kept for the step)
    // plus the couple of layers' full gradients in flight.
    let own = LAYERS * LAYER_BYTES / RANKS;
    assert!(
        scoped.backward_peak <= RANKS * (own + 3 * LAYER_BYTES),
        "with hooks {} bytes, own shard {own} per rank",
        scoped.backward_peak
    );
    assert!(
        scoped.backward_peak + RANKS * 2 * LAYER_BYTES <= plain.backward_peak,
        "with hooks {} bytes, without {}",
        scoped.backward_peak,
        plain.backward_peak
    );
    assert_eq!(plain.values, scoped.values);
}

#[test]
fn stage3_bf16_keeps_no_gathered_copy_until_backward() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = model();
    let f32_run = run(&model, ZeroStage::Zero3, true);
    let bf16 = run_in(&model, ZeroStage::Zero3, true, MixedPrecision::bf16());
    eprintln!(
        "held from forward to backward, {RANKS} ranks: f32 {:.2} MiB, bf16 {:.2} MiB; \
         the bf16 model gathered = {:.2} MiB per rank",
        mib(f32_run.held),
        mib(bf16.held),
        mib(LAYERS * LAYER_BYTES / 2)
    );
    // The gather hands out bf16 inside the recomputable collective, so backward re-gathers
    // (and re-casts) instead of keeping each layer's half-precision parameters: what stays
    // is activations, far below the gathered model on each rank.
    assert!(
        bf16.held < RANKS * LAYERS * LAYER_BYTES / 2 / 4,
        "bf16 ZeRO-3 keeps {} bytes from forward to backward",
        bf16.held
    );
    assert!(bf16.held <= f32_run.held + RANKS * LAYER_BYTES / 2);
}
