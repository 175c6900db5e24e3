//! The parity harness (see the contract in the repository's notes): a fixed model — the
//! contract's GPT, or a Llama or a Mixtral when the config is a Hugging Face `config.json` —
//! trained for a few SGD or AdamW steps under any layout, through the trainer's one loop,
//! writing the parameters, the step-0 gradients and the losses.

use crate::default_device;
use bonfire_comm::testing::{Closeness, Tolerance, assert_close};
use bonfire_layout::ParallelDims;
use bonfire_models::data;
use bonfire_models::data::TokenBatch;
use bonfire_models::gpt::Gpt;
use bonfire_models::gpt::config::GptConfig;
use bonfire_models::llama::{Llama, LlamaConfig};
use bonfire_models::mixtral::{Mixtral, MixtralConfig};
use bonfire_models::tensor_file::{self, HostTensor};
use bonfire_models::weights;
use bonfire_module::params::ParamValues;
use bonfire_parallel::ParallelModel;
use bonfire_train::{Engine, FitConfig, Hooks, Launcher, OptimizerKind, TrainError, Trainer, fit};
use burn::tensor::Device;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// One harness run's inputs (the command line).
#[derive(Debug, Clone)]
pub struct HarnessArgs {
    /// The model's sizes, a `cfg.json`.
    pub config: PathBuf,
    /// The initial parameters, a safetensors file.
    pub weights: PathBuf,
    /// The token batches, a `batch.safetensors` (`input_ids`, `targets` `[S, B, T']`).
    pub data: PathBuf,
    /// The parallel layout to train under.
    pub dims: ParallelDims,
    /// The optimizer (SGD or AdamW).
    pub optim: OptimizerKind,
    /// The Burn device every rank computes on (`flex` or `wgpu`).
    pub device: String,
    /// Number of steps to train (at most the data file's `S`).
    pub steps: usize,
    /// Learning rate.
    pub lr: f64,
    /// The safetensors file the result is written to.
    pub out: PathBuf,
}

/// What a run computed (rank 0's view; ranks agree).
#[derive(Debug, Clone, Default)]
pub struct HarnessResult {
    /// Parameter name → (shape, values) after all steps.
    pub params: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// Parameter name → step-0 gradient of the global loss.
    pub grad0: BTreeMap<String, Vec<f32>>,
    /// Global loss at each step, before its update.
    pub losses: Vec<f32>,
}

impl HarnessResult {
    /// The contract's output tensors: parameters, `grad0.<name>`, `loss`.
    pub fn tensors(&self) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
        let mut out = self.params.clone();
        for (name, g) in &self.grad0 {
            let shape = self.params[name].0.clone();
            out.insert(format!("grad0.{name}"), (shape, g.clone()));
        }
        out.insert(
            "loss".into(),
            (vec![self.losses.len()], self.losses.clone()),
        );
        out
    }
}

/// The Burn device `--device` names: `flex` (Burn's CPU backend) or `wgpu` (Burn's wgpu
/// backend, the first CPU adapter: Mesa's software Vulkan on a machine without a GPU; needs
/// a build with the `wgpu` feature) or `cuda` (the first NVIDIA GPU, through Burn's CUDA
/// backend; needs a build with the `cuda` feature), autodiff-enabled.
pub fn device(name: &str) -> Result<Device, String> {
    match name {
        "flex" => Ok(default_device()),
        #[cfg(feature = "wgpu")]
        "wgpu" => {
            if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
                // SAFETY: called from the main thread before any rank thread starts.
                unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
            }
            Ok(Device::wgpu(burn::tensor::DeviceKind::Cpu).autodiff())
        }
        #[cfg(not(feature = "wgpu"))]
        "wgpu" => Err(
            "--device wgpu: this binary was built without Burn's wgpu backend; rebuild with \
             `--features wgpu`"
                .into(),
        ),
        #[cfg(feature = "cuda")]
        "cuda" => cuda_device()
            .map(Device::autodiff)
            .map_err(|e| format!("--device cuda: {e}")),
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err(
            "--device cuda: this binary was built without Burn's CUDA backend; rebuild with \
             `--features cuda` (or use the GPU kit: `cargo xtask gpu-kit`, docs/gpu.md)"
                .into(),
        ),
        other => Err(format!(
            "--device {other}: expected `flex`, `wgpu` or `cuda`"
        )),
    }
}

/// The first NVIDIA GPU, once the CUDA driver is known to load and to see a GPU: without a
/// driver, Burn's CUDA backend panics on a thread of its own.
#[cfg(feature = "cuda")]
pub fn cuda_device() -> Result<Device, String> {
    match bonfire_comm::nccl::cuda_devices().map_err(|e| e.to_string())? {
        0 => Err("the CUDA driver sees no GPU".into()),
        _ => Ok(Device::cuda(0)),
    }
}

/// The model of a harness config: the contract's GPT (`cfg.json`), or a Llama or a Mixtral (a
/// Hugging Face `config.json` with `"model_type": "llama"` or `"mixtral"`).
#[derive(Debug, Clone)]
pub enum HarnessConfig {
    /// The contract's GPT.
    Gpt(GptConfig),
    /// A Hugging Face Llama.
    Llama(LlamaConfig),
    /// A Hugging Face Mixtral.
    Mixtral(MixtralConfig),
}

impl HarnessConfig {
    /// Reads `path`: a Hugging Face config when it names a `model_type`, else a GPT `cfg.json`.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let text = bonfire_models::read_config(path)?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("invalid config {}: {e}", path.display()))?;
        let what = path.display().to_string();
        if value.get("model_type").and_then(|t| t.as_str()) == Some("mixtral") {
            MixtralConfig::from_json(&what, &text).map(Self::Mixtral)
        } else if value.get("model_type").is_some() {
            LlamaConfig::from_json(&what, &text).map(Self::Llama)
        } else {
            GptConfig::from_json(&what, &text).map(Self::Gpt)
        }
    }

    /// The vocabulary and the longest sequence, which the data must fit.
    pub fn limits(&self) -> (usize, usize) {
        match self {
            Self::Gpt(c) => (c.vocab_size, c.max_seq_len),
            Self::Llama(c) => (c.vocab_size, c.max_position_embeddings),
            Self::Mixtral(c) => (c.base.vocab_size, c.base.max_position_embeddings),
        }
    }
}

/// Runs the harness and writes `args.out`.
pub fn run(args: &HarnessArgs) -> Result<HarnessResult, String> {
    let device = device(&args.device)?;
    let cfg = HarnessConfig::load(&args.config)?;
    let (vocab, max_seq) = cfg.limits();
    let batches = data::load_batches(&args.data, vocab, max_seq)?;
    if args.steps > batches.steps() {
        return Err(format!(
            "--steps {} but {} holds {} step(s)",
            args.steps,
            args.data.display(),
            batches.steps()
        ));
    }
    let (dims, optim, steps, lr) = (&args.dims, args.optim, args.steps, args.lr);
    let result = match &cfg {
        HarnessConfig::Gpt(c) => {
            let model = weights::load(Gpt::new(c, &device), &args.weights)?;
            train(&model, &batches, dims, optim, steps, lr)?
        }
        HarnessConfig::Llama(c) => {
            let model = weights::load(Llama::new(c, &device), &args.weights)?;
            train(&model, &batches, dims, optim, steps, lr)?
        }
        HarnessConfig::Mixtral(c) => {
            let model = weights::load(Mixtral::new(c, &device), &args.weights)?;
            train(&model, &batches, dims, optim, steps, lr)?
        }
    };
    tensor_file::write_f32(&args.out, &result.tensors())?;
    Ok(result)
}

/// Keeps the whole gradients of step 0.
#[derive(Default)]
struct FirstGradients(Vec<ParamValues>);

impl Hooks<TokenBatch> for FirstGradients {
    fn after_backward(
        &mut self,
        step: usize,
        engine: &mut dyn Engine<TokenBatch>,
    ) -> Result<(), TrainError> {
        if step == 0 {
            self.0 = engine.gradients()?;
        }
        Ok(())
    }
}

/// `steps` steps of `model` on `batches` under `dims` with Burn's `optim`, on rank threads,
/// through the trainer: whole parameters after the last step, whole step-0 gradients and the
/// global losses (rank 0's; every rank computes the same).
pub fn train<M: ParallelModel<Batch = TokenBatch> + Sync>(
    model: &M,
    batches: &data::Batches,
    dims: &ParallelDims,
    optim: OptimizerKind,
    steps: usize,
    lr: f64,
) -> Result<HarnessResult, String> {
    train_recorded(model, batches, dims, optim, steps, lr).map(|(result, _)| result)
}

/// What one rank thread did during a [`train_recorded`] run, read on that thread (so that
/// runs beside it in the same process do not count): the dtypes its layers and reductions
/// ran in, the activation-checkpointed regions it recomputed in backward, the deferred
/// weight gradients it computed in "W" steps.
#[derive(Debug, Clone, Copy, Default)]
pub struct RankRecord {
    /// The dtypes its parameters, activations and gradient reductions were seen in.
    pub precision: bonfire_module::precision::observe::Observed,
    /// Number of activation-checkpointed regions recomputed in backward.
    pub recomputations: u64,
    /// Number of deferred weight gradients computed in "W" steps.
    pub weight_grads: u64,
}

impl RankRecord {
    /// This thread's counts so far.
    fn now() -> Self {
        Self {
            precision: bonfire_module::precision::observe::observed(),
            recomputations: bonfire_recompute::recomputations(),
            weight_grads: bonfire_module::weight_grad::applied(),
        }
    }

    /// What this thread did since `earlier`.
    fn since(earlier: &Self) -> Self {
        let now = Self::now();
        Self {
            precision: now.precision.since(&earlier.precision),
            recomputations: now.recomputations - earlier.recomputations,
            weight_grads: now.weight_grads - earlier.weight_grads,
        }
    }
}

/// [`train`], with each rank's [`RankRecord`] of the run (in rank order).
pub fn train_recorded<M: ParallelModel<Batch = TokenBatch> + Sync>(
    model: &M,
    batches: &data::Batches,
    dims: &ParallelDims,
    optim: OptimizerKind,
    steps: usize,
    lr: f64,
) -> Result<(HarnessResult, Vec<RankRecord>), String> {
    let trainer = Trainer::new(dims.clone(), move || optim.build());
    let data = |s: usize, device: &Device| batches.rows(s, 0, batches.batch, device);
    let first = data(0, &default_device());
    trainer
        .check(model, dims.world_size(), &first)
        .map_err(|e| e.to_string())?;
    let ranks = dims.world_size();
    let outcomes = Launcher::Threads { ranks }
        .run("parity", |pg| -> Result<_, TrainError> {
            let start = RankRecord::now();
            let mut engine = trainer.build(model.clone(), &pg, &first)?;
            let mut grads = FirstGradients::default();
            let reports = fit(
                engine.as_mut(),
                &data,
                &FitConfig::new(steps, lr),
                &mut grads,
            )?;
            let params = engine.parameters()?;
            let result = HarnessResult {
                params: params
                    .into_iter()
                    .map(|p| (p.path, (p.shape, p.values)))
                    .collect(),
                grad0: grads.0.into_iter().map(|p| (p.path, p.values)).collect(),
                losses: reports.iter().map(|r| r.loss).collect(),
            };
            Ok((result, RankRecord::since(&start)))
        })
        .map_err(|e| e.to_string())?;
    let mut result = None;
    let mut records = Vec::with_capacity(ranks);
    for outcome in outcomes {
        let (r, record) = outcome.map_err(|e| e.to_string())?;
        result.get_or_insert(r);
        records.push(record);
    }
    Ok((result.expect("rank 0"), records))
}

/// Reads a result file back (for comparisons).
pub fn read_result(
    path: impl AsRef<std::path::Path>,
) -> Result<BTreeMap<String, Vec<f32>>, String> {
    Ok(tensor_file::read(path)?
        .into_iter()
        .filter_map(|(k, v)| match v {
            HostTensor::F32 { data, .. } => Some((k, data)),
            HostTensor::I64 { .. } => None,
        })
        .collect())
}

/// The learning rate of the GPT parity suites: 0.5 with SGD, 0.01 with AdamW.
pub fn gpt_lr(optim: OptimizerKind) -> f64 {
    match optim {
        OptimizerKind::Sgd => 0.5,
        OptimizerKind::AdamW => 0.01,
    }
}

/// Asserts a harness result equals the reference — losses, every step-0 gradient and every
/// parameter, shapes included — within `tol`; says how close they came.
pub fn assert_same_run(
    what: &str,
    got: &HarnessResult,
    want: &HarnessResult,
    tol: Tolerance,
) -> Closeness {
    same_run(what, got, want, |_| tol)
}

/// [`assert_same_run`] within a *normwise* `bound`: each element within relative `bound`, or
/// `bound` times the largest magnitude of its kind in the reference run (the losses, the
/// parameters, the step-0 gradients) — the bound of products computed in a reduced precision
/// (TF32 tensor cores), whose error scales with the operands rather than with each result: a
/// gradient that cancels (the key bias's, 0 in exact arithmetic: 1.6e-12 on Flex, 3.9e-9 on
/// CUDA) carries the error of the terms that cancelled. Parameters also pass within
/// `param_floor` (`f32::INFINITY`: not compared but for NaN — after AdamW, whose normalised
/// step turns the rounding of a near-zero gradient into a whole step of either sign; the
/// gradients and losses stay normwise).
pub fn assert_same_run_normwise(
    what: &str,
    got: &HarnessResult,
    want: &HarnessResult,
    bound: f32,
    param_floor: f32,
) -> Closeness {
    let params = largest_magnitude(want.params.values().flat_map(|(_, v)| v));
    let grads = largest_magnitude(want.grad0.values().flatten());
    let losses = largest_magnitude(&want.losses);
    same_run(what, got, want, |kind| {
        let scale = match kind {
            Kind::Loss => losses,
            Kind::Param => params,
            Kind::Grad => grads,
        };
        let tol = normwise(bound, scale);
        match kind {
            Kind::Param => Tolerance::new(bound, tol.abs.max(param_floor)),
            _ => tol,
        }
    })
}

/// The normwise tolerance `bound` for values whose scale (largest magnitude) is `scale`:
/// relative `bound`, or `bound · scale` absolute.
pub fn normwise(bound: f32, scale: f32) -> Tolerance {
    Tolerance::new(bound, bound * scale)
}

/// The largest magnitude of `values` (0 for none).
pub fn largest_magnitude<'a>(values: impl IntoIterator<Item = &'a f32>) -> f32 {
    values.into_iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// What a compared tensor of a harness result is.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Loss,
    Param,
    Grad,
}

/// The comparison of [`assert_same_run`], each tensor's tolerance from `tol` of its kind.
fn same_run(
    what: &str,
    got: &HarnessResult,
    want: &HarnessResult,
    tol: impl Fn(Kind) -> Tolerance,
) -> Closeness {
    // An empty reference would make every comparison below pass.
    assert!(
        !want.losses.is_empty() && !want.params.is_empty(),
        "{what}: empty reference"
    );
    assert_eq!(
        want.grad0.len(),
        want.params.len(),
        "{what}: reference grad0"
    );
    assert_eq!(got.grad0.len(), want.grad0.len(), "{what}: grad0 count");
    let mut worst = assert_close(
        &format!("{what} loss"),
        &got.losses,
        &want.losses,
        tol(Kind::Loss),
    );
    assert_eq!(
        got.params.len(),
        want.params.len(),
        "{what}: parameter count"
    );
    for (name, (shape, w)) in &want.params {
        let (gshape, g) = &got.params[name];
        assert_eq!(gshape, shape, "{what} {name} shape");
        worst = worst.max(assert_close(
            &format!("{what} {name}"),
            g,
            w,
            tol(Kind::Param),
        ));
        let (gg, wg) = (&got.grad0[name], &want.grad0[name]);
        worst = worst.max(assert_close(
            &format!("{what} grad0.{name}"),
            gg,
            wg,
            tol(Kind::Grad),
        ));
    }
    worst
}
