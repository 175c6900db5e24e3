//! The parity harness (see the contract in the repository's notes): a fixed model — the
//! contract's GPT, or a Llama or a Mixtral when the config is a Hugging Face `config.json` —
//! trained for a few SGD or AdamW steps under any layout, through the trainer's one loop,
//! writing the parameters, the step-0 gradients and the losses.

use crate::default_device;
use bonfire_layout::ParallelDims;
use bonfire_models::ModelConfig;
use bonfire_models::data;
use bonfire_models::data::TokenBatch;
use bonfire_models::gpt::Gpt;
use bonfire_models::llama::Llama;
use bonfire_models::mixtral::Mixtral;
use bonfire_models::tensor_file::{self, HostTensor};
use bonfire_models::weights;
use bonfire_parallel::ParallelModel;
use bonfire_train::parity::{self, Outcome, RankRecord};
use bonfire_train::{OptimizerKind, OptimizerSpec};
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
    /// The optimizer (SGD or AdamW; AdamW's settings are the recipe's).
    pub optim: OptimizerKind,
    /// The Burn device every rank computes on (`flex` or `wgpu`).
    pub device: String,
    /// Number of steps to train (at most the data file's `S`).
    pub steps: usize,
    /// The peak learning rate.
    pub lr: f64,
    /// The training recipe: the rate's schedule, AdamW's settings, clipping, accumulation.
    pub recipe: crate::cli::RecipeArgs,
    /// The safetensors file the result is written to.
    pub out: PathBuf,
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

/// Runs the harness and writes `args.out`.
pub fn run(args: &HarnessArgs) -> Result<Outcome, String> {
    let device = device(&args.device)?;
    let cfg = ModelConfig::load(&args.config)?;
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
    let dims = &args.dims;
    let optim = args.recipe.optimizer(args.optim)?;
    let config = args
        .recipe
        .fit(bonfire_train::FitConfig::new(args.steps, args.lr))?;
    let result = match &cfg {
        ModelConfig::Gpt(c) => {
            let model = weights::load(Gpt::new(c, &device), &args.weights)?;
            train_with(&model, &batches, dims, optim, &config)?.0
        }
        ModelConfig::Llama(c) => {
            let model = weights::load(Llama::new(c, &device), &args.weights)?;
            train_with(&model, &batches, dims, optim, &config)?.0
        }
        ModelConfig::Mixtral(c) => {
            let model = weights::load(Mixtral::new(c, &device), &args.weights)?;
            train_with(&model, &batches, dims, optim, &config)?.0
        }
    };
    tensor_file::write_f32(&args.out, &result.tensors())?;
    Ok(result)
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
) -> Result<Outcome, String> {
    train_recorded(model, batches, dims, optim, steps, lr).map(|(result, _)| result)
}

/// [`train`], with each rank's [`RankRecord`] of the run (in rank order).
pub fn train_recorded<M: ParallelModel<Batch = TokenBatch> + Sync>(
    model: &M,
    batches: &data::Batches,
    dims: &ParallelDims,
    optim: OptimizerKind,
    steps: usize,
    lr: f64,
) -> Result<(Outcome, Vec<RankRecord>), String> {
    let config = bonfire_train::FitConfig::new(steps, lr);
    train_with(model, batches, dims, optim, &config)
}

/// [`train_recorded`] with the loop's whole configuration (steps, peak rate, schedule).
pub fn train_with<M: ParallelModel<Batch = TokenBatch> + Sync>(
    model: &M,
    batches: &data::Batches,
    dims: &ParallelDims,
    optim: impl Into<OptimizerSpec>,
    config: &bonfire_train::FitConfig,
) -> Result<(Outcome, Vec<RankRecord>), String> {
    let data = |s: usize, device: &Device| batches.rows(s, 0, batches.batch, device);
    parity::record_with(model, &data, dims, optim, config)
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
