//! The parity harness (see `docs` / the parity contract): a fixed GPT trained for a few SGD
//! steps under a parallel layout, writing parameters, step-0 gradients and losses.

use crate::config::GptConfig;
use crate::dp_axis::DpAxis;
use crate::gpt::{Gpt, default_device};
use crate::mesh::Layout;
use crate::tensor_file::{self, HostTensor};
use crate::tp::{gather_host, parallelize_gpt};
use crate::{checkpoint, data};
use bonfire_comm::{ReduceOp, ThreadWorld};
use bonfire_ddp::params;
use bonfire_dtensor::DeviceMesh;
use bonfire_dtensor::parallel::sharded_params;
use burn::module::Module;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// One harness run's inputs (the command line).
#[derive(Debug, Clone)]
pub struct HarnessArgs {
    pub config: PathBuf,
    pub weights: PathBuf,
    pub data: PathBuf,
    pub layout: Layout,
    pub steps: usize,
    pub lr: f64,
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

/// Runs the harness and writes `args.out`.
pub fn run(args: &HarnessArgs) -> Result<HarnessResult, String> {
    args.layout.check_supported()?;
    if args.layout.mesh.pp > 1 {
        return crate::pipeline_harness::run(args);
    }
    let (cfg, batches, dp) = load_inputs(args)?;
    let tp = TpOptions::from_layout(&args.layout);
    crate::tp::check_tp(&cfg, tp.tp)?;
    if tp.sequence_parallel && batches.seq % tp.tp != 0 {
        return Err(format!(
            "sequence length {} is not divisible by tp={} (sequence parallelism shards it)",
            batches.seq, tp.tp
        ));
    }
    let device = default_device();
    let model = checkpoint::load(Gpt::new(&cfg, &device), &args.weights)?;
    let zero = args.layout.zero as usize;
    let result = train_parallel(&model, &batches, dp, tp, zero, args.steps, args.lr)?;
    tensor_file::write_f32(&args.out, &result.tensors())?;
    Ok(result)
}

/// Loads the config and the batches of a run and checks them against the layout: enough
/// steps, and a batch that the dp axis divides. Returns them with the dp degree.
pub(crate) fn load_inputs(args: &HarnessArgs) -> Result<(GptConfig, data::Batches, usize), String> {
    let cfg = GptConfig::load(&args.config)?;
    let batches = data::load_batches(&args.data, &cfg)?;
    if args.steps > batches.steps() {
        return Err(format!(
            "--steps {} but {} holds {} step(s)",
            args.steps,
            args.data.display(),
            batches.steps()
        ));
    }
    let dp = args.layout.mesh.dp;
    if batches.batch % dp != 0 {
        return Err(format!(
            "batch size {} is not divisible by dp={dp}",
            batches.batch
        ));
    }
    Ok((cfg, batches, dp))
}

/// The tensor-parallel part of a layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpOptions {
    pub tp: usize,
    pub sequence_parallel: bool,
    pub loss_parallel: bool,
}

impl TpOptions {
    /// No tensor parallelism.
    pub fn none() -> Self {
        Self {
            tp: 1,
            sequence_parallel: false,
            loss_parallel: false,
        }
    }
    pub fn from_layout(layout: &Layout) -> Self {
        Self {
            tp: layout.mesh.tp,
            sequence_parallel: layout.sequence_parallel,
            loss_parallel: layout.loss_parallel,
        }
    }
}

/// `steps` SGD steps of `model` on `batches` with `dp` data-parallel rank threads.
pub fn train(
    model: &Gpt,
    batches: &data::Batches,
    dp: usize,
    steps: usize,
    lr: f64,
) -> Result<HarnessResult, String> {
    train_parallel(model, batches, dp, TpOptions::none(), 0, steps, lr)
}

/// `steps` SGD steps of `model` on `batches` on a `dp × tp` mesh of rank threads (row-major,
/// axes named `dp` and `tp`): the GPT's tensor-parallel plan on the tp axis when `tp.tp > 1`,
/// DDP (`zero == 0`) or ZeRO stage `zero` on the dp axis (data rows r·B/dp .. (r+1)·B/dp for
/// dp coordinate r; ZeRO shards each rank's local, tensor-parallel parameters over dp).
/// Parameters and step-0 gradients come back whole (gathered over dp by ZeRO, over tp here).
pub fn train_parallel(
    model: &Gpt,
    batches: &data::Batches,
    dp: usize,
    tp: TpOptions,
    zero: usize,
    steps: usize,
    lr: f64,
) -> Result<HarnessResult, String> {
    let device = default_device();
    let rows = batches.batch / dp;
    let outcomes = ThreadWorld::new(dp * tp.tp)
        .timeout(Duration::from_secs(120))
        .name("parity")
        .launch(|pg| -> Result<HarnessResult, String> {
            let mesh =
                DeviceMesh::new(&pg, &[dp, tp.tp], &["dp", "tp"]).map_err(|e| e.to_string())?;
            let dp_group = mesh.group("dp").map_err(|e| e.to_string())?.clone();
            let tp_group = mesh.group("tp").map_err(|e| e.to_string())?.clone();
            let mut replica = model.clone().fork(&device);
            if tp.tp > 1 {
                replica =
                    parallelize_gpt(replica, &mesh, "tp", tp.sequence_parallel, tp.loss_parallel)?;
            }
            let shards = sharded_params(&replica);
            let infos = params::inventory(&replica);
            let mut wrapper = DpAxis::sgd(replica, dp_group.clone(), zero)?;
            let full = |name: &str,
                        shape: &[usize],
                        v: Vec<f32>|
             -> Result<(Vec<usize>, Vec<f32>), String> {
                match shards.get(name) {
                    Some(&dim) => {
                        let mut shape = shape.to_vec();
                        let v = gather_host(&v, &shape, dim, &tp_group)?;
                        shape[dim] *= tp_group.size();
                        Ok((shape, v))
                    }
                    None => Ok((shape.to_vec(), v)),
                }
            };
            let mut result = HarnessResult::default();
            for s in 0..steps {
                let dp_rank = mesh.coord("dp").map_err(|e| e.to_string())?;
                let (ids, targets) = batches.rows(s, dp_rank * rows, rows, &device);
                let loss = wrapper.forward(|m| m.loss(ids, targets));
                let mut global = params::to_host(loss.clone().detach());
                dp_group
                    .all_reduce(&mut global, ReduceOp::Avg)
                    .map_err(|e| e.to_string())?;
                result.losses.push(global[0]);
                wrapper.backward(loss)?;
                if s == 0 {
                    for (p, (name, g)) in infos.iter().zip(wrapper.gradients()?) {
                        let (_, g) = full(&name, &p.shape, g)?;
                        result.grad0.insert(name, g);
                    }
                }
                wrapper.step(lr)?;
            }
            let flat = wrapper.values()?;
            let mut at = 0;
            for p in &infos {
                let v = flat[at..at + p.numel()].to_vec();
                at += p.numel();
                result
                    .params
                    .insert(p.path.clone(), full(&p.path, &p.shape, v)?);
            }
            Ok(result)
        })
        .map_err(|e| e.to_string())?;
    outcomes.into_iter().next().expect("rank 0")
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
