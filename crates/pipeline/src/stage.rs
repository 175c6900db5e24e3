//! Stages of Burn modules: splitting a model (a sequence of blocks) into stages, and
//! [`BurnStage`], the [`StageCompute`] that runs a rank's chunks with Burn's autodiff.
//!
//! Activations cross stage boundaries as host data. The receiving stage turns its input into
//! a fresh `require_grad` leaf, so each (micro-batch, chunk) is its own autodiff graph; after
//! the next stage's backward, the gradient of its input comes back and the sender
//! back-propagates `sum(output ⊙ grad_output)`, whose gradient with respect to `output` is
//! exactly `grad_output`. Weight gradients are accumulated over micro-batches; the optimizer
//! steps once per batch.
//!
//! ## Zero-bubble B/W split
//! Under a schedule with split backward steps (ZB-H1, ZB-V), each micro-batch's forward runs
//! inside [`bonfire_module::weight_grad::deferring`]: the linear layers
//! (`bonfire_tp::ParallelLinear`, which carry almost all of a transformer's
//! FLOPs) multiply by their weight as a constant and keep their input and, in backward, their
//! output gradient. [`StageCompute::backward_input`] ("B") then runs a backward that computes
//! the input gradient and the gradients of the cheap parameters (biases, norms, embeddings)
//! but no weight-gradient matmul; [`StageCompute::backward_weight`] ("W") computes each
//! `dW = xᵀ·dy` from what B kept (plain tensor ops, no second backward) and hands all of the
//! micro-batch's gradients to the holder at once — bitwise the gradients of the undivided
//! backward. Weights that are not parameter leaves (ZeRO-3's gathered values, activation-
//! checkpointed pieces recomputed in backward) and other layer types (`burn::nn::Linear`)
//! still get their gradients in B. [`BurnStage::with_weight_grad_split`] turns the split off.

use crate::runtime::{Activation, PipelineError, StageCompute};
use crate::schedule::{Action, Schedule};
use bonfire_dtensor::plane::{self, ledger::Reason};
use bonfire_module::weight_grad::{self, WeightGrads};
use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, Device, Gradients, Tensor, TensorData};
use std::collections::HashMap;

/// A block of a pipelined model: maps an activation to an activation of the same rank `D`.
/// Use an enum of your block types (embedding, transformer block, head) if they differ.
pub trait Block<const D: usize>: Module {
    /// The block's forward.
    fn forward(&self, x: Tensor<D>) -> Tensor<D>;
}

/// Runs a chunk (a sequence of blocks).
pub fn forward_chunk<M: Block<D>, const D: usize>(blocks: &[M], x: Tensor<D>) -> Tensor<D> {
    blocks.iter().fold(x, |x, b| b.forward(x))
}

/// Splits `blocks` before each index of `points` (strictly increasing, in `1..len`):
/// `split_at(b, &[2, 5])` gives `b[0..2]`, `b[2..5]`, `b[5..]`.
pub fn split_at<M>(blocks: Vec<M>, points: &[usize]) -> Result<Vec<Vec<M>>, PipelineError> {
    let n = blocks.len();
    let mut prev = 0;
    for &p in points {
        if p <= prev || p >= n {
            return Err(PipelineError::Invalid(format!(
                "split points {points:?} must increase strictly within 1..{n}"
            )));
        }
        prev = p;
    }
    let mut stages = Vec::with_capacity(points.len() + 1);
    let mut rest = blocks;
    for &p in points.iter().rev() {
        let tail = rest.split_off(p);
        stages.push(tail);
    }
    stages.push(rest);
    stages.reverse();
    Ok(stages)
}

/// Split points that cut `sizes` (a cost per block, e.g. its parameter count) into `stages`
/// contiguous non-empty runs minimizing the largest run's total.
pub fn balance(sizes: &[usize], stages: usize) -> Result<Vec<usize>, PipelineError> {
    let n = sizes.len();
    if stages == 0 || stages > n {
        return Err(PipelineError::Invalid(format!(
            "cannot split {n} blocks into {stages} non-empty stages"
        )));
    }
    let prefix: Vec<usize> = std::iter::once(0)
        .chain(sizes.iter().scan(0, |acc, &s| {
            *acc += s;
            Some(*acc)
        }))
        .collect();
    // best[k][i]: smallest max-run over splitting the first i blocks into k runs.
    let inf = usize::MAX;
    let mut best = vec![vec![inf; n + 1]; stages + 1];
    let mut cut = vec![vec![0usize; n + 1]; stages + 1];
    best[0][0] = 0;
    for k in 1..=stages {
        for i in k..=n {
            for j in (k - 1)..i {
                if best[k - 1][j] == inf {
                    continue;
                }
                let cost = best[k - 1][j].max(prefix[i] - prefix[j]);
                if cost < best[k][i] {
                    best[k][i] = cost;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut points = Vec::with_capacity(stages - 1);
    let mut i = n;
    for k in (2..=stages).rev() {
        i = cut[k][i];
        points.push(i);
    }
    points.reverse();
    Ok(points)
}

/// Splits `blocks` into `stages` stages balanced by parameter count.
pub fn split_balanced<M: Module>(
    blocks: Vec<M>,
    stages: usize,
) -> Result<Vec<Vec<M>>, PipelineError> {
    let sizes: Vec<usize> = blocks.iter().map(|b| b.num_params()).collect();
    let points = balance(&sizes, stages)?;
    split_at(blocks, &points)
}

/// The chunks `rank` holds under `schedule`'s stage map, in local chunk order, taken from
/// all the stages (`stages.len()` must be the schedule's stage count).
pub fn chunks_for_rank<M: Clone>(
    stages: &[Vec<M>],
    schedule: &Schedule,
    rank: usize,
) -> Result<Vec<Vec<M>>, PipelineError> {
    if stages.len() != schedule.stages() {
        return Err(PipelineError::Invalid(format!(
            "{} stages given, schedule `{}` has {}",
            stages.len(),
            schedule.name,
            schedule.stages()
        )));
    }
    Ok((0..schedule.stage_map.chunks())
        .map(|c| stages[schedule.stage_map.stage(rank, c)].clone())
        .collect())
}

/// Splits a batch along dimension 0 into `m` micro-batches whose sizes differ by at most one
/// (the first ones larger), like `torch.tensor_split`.
pub fn split_batch<const D: usize>(batch: Tensor<D>, m: usize) -> Vec<Tensor<D>> {
    microbatch_sizes(batch.dims()[0], m)
        .into_iter()
        .scan(0, |start, len| {
            let piece = batch.clone().narrow(0, *start, len);
            *start += len;
            Some(piece)
        })
        .collect()
}

/// Rows per micro-batch when `rows` are split `m` ways (sizes differ by at most one).
pub fn microbatch_sizes(rows: usize, m: usize) -> Vec<usize> {
    (0..m)
        .map(|i| rows / m + usize::from(i < rows % m))
        .collect()
}

/// Loss weights that make the sum of per-micro-batch mean losses equal the mean over the
/// whole batch: `rows_i / rows` (all `1/m` when `m` divides the batch).
pub fn microbatch_weights(rows: usize, m: usize) -> Vec<f32> {
    microbatch_sizes(rows, m)
        .into_iter()
        .map(|n| n as f32 / rows as f32)
        .collect()
}

/// The loss of one micro-batch on the last stage: `(micro-batch, output) -> mean loss` as a
/// one-element tensor.
pub type LossFn<'a, const D: usize> = Box<dyn FnMut(usize, Tensor<D>) -> Tensor<1> + 'a>;

/// The last stage's last block and the loss as one: `(micro-batch, block, the block's input)
/// -> mean loss` — a head fused with its loss, whose output (the logits) never exists whole.
pub type BlockLossFn<'a, M, const D: usize> =
    Box<dyn FnMut(usize, &M, Tensor<D>) -> Tensor<1> + 'a>;

/// How the last stage makes a micro-batch's loss.
enum StageLoss<'a, M, const D: usize> {
    /// From the last block's output ([`BurnStage::with_loss`]).
    Output(LossFn<'a, D>),
    /// With the last block ([`BurnStage::with_block_loss`]).
    Block(BlockLossFn<'a, M, D>),
}

/// What one chunk's forward made: its output, or (the last block and the loss as one) the
/// micro-batch's loss.
enum Computed<const D: usize> {
    Output(Tensor<D>),
    Loss(Tensor<1>),
}

/// Who holds a rank's chunks for computation: the chunks themselves ([`LocalChunks`]), or a
/// data-parallel wrapper of them (DDP, ZeRO: `bonfire-train` adapts any
/// `bonfire_module::DataParallel`). The stage runs each micro-batch's forward through it and
/// hands it each backward's gradients; nothing is reduced here.
pub trait StageParams<M> {
    /// Runs one micro-batch's forward on the held module (ZeRO-3 gathers parameters here).
    fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R;
    /// Keeps the module's gradients out of one micro-batch's backward (summed).
    fn accumulate(&mut self, grads: &mut Gradients) -> Result<(), PipelineError>;
}

/// Chunks held by the stage itself, with their gradients summed over micro-batches.
pub struct LocalChunks<M: Module> {
    chunks: M,
    grads: GradientsAccumulator<M>,
}

impl<M: Module> LocalChunks<M> {
    /// Holds `chunks`, with no gradient accumulated yet.
    pub fn new(chunks: M) -> Self {
        Self {
            chunks,
            grads: GradientsAccumulator::new(),
        }
    }
    /// The chunks and the gradients accumulated over the micro-batches.
    pub fn into_parts(mut self) -> (M, GradientsParams) {
        let grads = self.grads.grads();
        (self.chunks, grads)
    }
}

impl<M: Module> StageParams<M> for LocalChunks<M> {
    fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> R {
        f(&self.chunks)
    }
    fn accumulate(&mut self, grads: &mut Gradients) -> Result<(), PipelineError> {
        let params = GradientsParams::from_module(grads, &self.chunks);
        self.grads.accumulate(&self.chunks, params);
        Ok(())
    }
}

enum Saved<const D: usize> {
    Output(Tensor<D>),
    Loss(Tensor<1>),
}

/// Runs a rank's chunks of Burn blocks under the pipeline runtime, for one batch. `H` holds
/// the chunks (`Vec<Vec<M>>`, chunk `c` being the rank's `c`-th local stage).
pub struct BurnStage<'a, M: Block<D>, H: StageParams<Vec<Vec<M>>>, const D: usize> {
    params: H,
    first: Vec<bool>,
    last: Vec<bool>,
    device: Device,
    inputs: Vec<Tensor<D>>,
    loss: Option<StageLoss<'a, M, D>>,
    weights: Vec<f32>,
    saved: HashMap<(usize, usize), (Option<Tensor<D>>, Saved<D>)>,
    /// Zero-bubble: the gradients of a "B" waiting for their "W".
    pending: HashMap<(usize, usize), Gradients>,
    /// Whether forwards defer their linear layers' weight gradients (the schedule splits
    /// this rank's backward into B and W).
    split: bool,
    /// Zero-bubble: the weight gradients each forward deferred, computed in "W".
    deferred: HashMap<(usize, usize), WeightGrads>,
    loss_total: f64,
    /// Whether a backward follows (off for evaluation: forwards keep nothing).
    backward: bool,
    /// The dtype the blocks compute in (activations and their gradients travel as f32 and
    /// are cast back to it on arrival; a half type round-trips exactly).
    dtype: DType,
    _blocks: std::marker::PhantomData<fn() -> M>,
}

impl<'a, M: Block<D>, H: StageParams<Vec<Vec<M>>>, const D: usize> BurnStage<'a, M, H, D> {
    /// `params`: this rank's chunks (see [`chunks_for_rank`]), held on `device` (autodiff);
    /// `rank`: this rank in the pipeline group; `weights[mb]`: the loss weight of each
    /// micro-batch (see [`microbatch_weights`]).
    pub fn new(
        params: H,
        schedule: &Schedule,
        rank: usize,
        device: Device,
        weights: Vec<f32>,
    ) -> Self {
        let v = schedule.stage_map.chunks();
        Self {
            first: (0..v).map(|c| schedule.is_first(rank, c)).collect(),
            last: (0..v).map(|c| schedule.is_last(rank, c)).collect(),
            params,
            device,
            inputs: Vec::new(),
            loss: None,
            weights,
            saved: HashMap::new(),
            pending: HashMap::new(),
            split: schedule.actions.get(rank).is_some_and(|actions| {
                actions
                    .iter()
                    .any(|a| matches!(a, Action::BackwardInput { .. }))
            }),
            deferred: HashMap::new(),
            loss_total: 0.0,
            backward: true,
            dtype: DType::F32,
            _blocks: std::marker::PhantomData,
        }
    }

    /// The micro-batches' inputs (needed on the rank holding the first stage).
    pub fn with_inputs(mut self, inputs: Vec<Tensor<D>>) -> Self {
        self.inputs = inputs;
        self
    }

    /// The dtype the blocks compute in (mixed precision), F32 by default.
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Whether a schedule with split backward steps (ZB-H1, ZB-V) really splits them: on by
    /// default; off, "B" runs the whole backward and "W" only hands its gradients over (the
    /// order of the schedule is kept, the weight-gradient arithmetic is not moved).
    pub fn with_weight_grad_split(mut self, split: bool) -> Self {
        self.split &= split;
        self
    }

    /// Forwards only (evaluation, [`Schedule::forward_only`]): nothing is kept for a
    /// backward; [`finish`](Self::finish) gives the loss.
    pub fn without_backward(mut self) -> Self {
        self.backward = false;
        self
    }

    /// The loss (needed on the rank holding the last stage).
    pub fn with_loss(mut self, loss: impl FnMut(usize, Tensor<D>) -> Tensor<1> + 'a) -> Self {
        self.loss = Some(StageLoss::Output(Box::new(loss)));
        self
    }

    /// The loss made with the last block instead (needed on the rank holding the last
    /// stage): `loss(mb, last block, its input)` replaces that block's forward and
    /// [`with_loss`](Self::with_loss)'s loss, inside the held module's forward (so ZeRO-3
    /// holds the block's gathered parameters while it runs) — a head fused with its loss.
    pub fn with_block_loss(
        mut self,
        loss: impl FnMut(usize, &M, Tensor<D>) -> Tensor<1> + 'a,
    ) -> Self {
        self.loss = Some(StageLoss::Block(Box::new(loss)));
        self
    }

    /// The holder (with the gradients of every micro-batch: the sum over micro-batches of the
    /// gradients of `weight[mb] · loss[mb]`) and, on the last stage, the batch loss
    /// `Σ weight[mb]·loss[mb]`.
    pub fn finish(self) -> (H, Option<f64>) {
        let loss = self.last.iter().any(|&l| l).then_some(self.loss_total);
        (self.params, loss)
    }

    /// An activation that crossed a stage boundary, on this stage's device (counted in the
    /// transfer ledger where the device is not host memory).
    fn to_tensor(&self, a: Activation) -> Tensor<D> {
        let data = TensorData::new(a.data, a.shape);
        plane::from_data::<D>(data, &self.device, Reason::Activation).cast(self.dtype)
    }

    /// An activation leaving this stage, on the host (counted likewise, and as payload:
    /// what the send carries).
    fn to_host(t: Tensor<D>) -> Result<Activation, PipelineError> {
        let shape = t.dims().to_vec();
        plane::ledger::record_payload(4 * t.shape().num_elements());
        let data = plane::to_data(t, Reason::Activation)
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| PipelineError::Invalid(format!("activation is not f32: {e:?}")))?;
        Ok(Activation { shape, data })
    }

    /// The backward of (`mb`, `chunk`): the input's gradient, and the rest of the gradients.
    fn run_backward(
        &mut self,
        mb: usize,
        chunk: usize,
        grad_output: Option<Activation>,
    ) -> Result<(Option<Activation>, Gradients), PipelineError> {
        let (input, saved) = self.saved.remove(&(mb, chunk)).ok_or_else(|| {
            PipelineError::Invalid(format!(
                "backward of (mb={mb}, chunk={chunk}) before its forward"
            ))
        })?;
        let root: Tensor<1> = match (saved, grad_output) {
            (Saved::Loss(loss), _) => loss,
            (Saved::Output(out), Some(g)) => (out * self.to_tensor(g)).sum(),
            (Saved::Output(_), None) => {
                return Err(PipelineError::Invalid(format!(
                    "backward of (mb={mb}, chunk={chunk}) got no output gradient"
                )));
            }
        };
        let mut grads = root.backward();
        let grad_input = match input {
            Some(x) => {
                let dims = x.dims();
                let g = x
                    .grad_remove(&mut grads)
                    .unwrap_or_else(|| Tensor::zeros(dims, &self.device));
                Some(Self::to_host(g)?)
            }
            None => None,
        };
        Ok((grad_input, grads))
    }
}

impl<M: Block<D>, H: StageParams<Vec<Vec<M>>>, const D: usize> StageCompute
    for BurnStage<'_, M, H, D>
{
    fn forward(
        &mut self,
        mb: usize,
        chunk: usize,
        input: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        let x = match input {
            None => self.inputs.get(mb).cloned().ok_or_else(|| {
                PipelineError::Invalid(format!("no input for micro-batch {mb} on the first stage"))
            })?,
            Some(a) => self.to_tensor(a).require_grad(),
        };
        let leaf = (!self.first[chunk]).then(|| x.clone());
        let last = self.last[chunk];
        let params = &mut self.params;
        let block_loss = match (last, self.loss.as_mut()) {
            (true, Some(StageLoss::Block(f))) => Some(f),
            _ => None,
        };
        let run = move || {
            params.forward(|chunks| {
                let blocks = &chunks[chunk];
                match (block_loss, blocks.split_last()) {
                    (None, _) => Ok(Computed::Output(forward_chunk(blocks, x))),
                    (Some(f), Some((tail, body))) => {
                        Ok(Computed::Loss(f(mb, tail, forward_chunk(body, x))))
                    }
                    (Some(_), None) => Err(PipelineError::Invalid(format!(
                        "the last stage's chunk {chunk} has no block to make the loss with"
                    ))),
                }
            })
        };
        let computed = if self.split {
            let (computed, deferred) = weight_grad::deferring(run);
            self.deferred.insert((mb, chunk), deferred);
            computed?
        } else {
            run()?
        };
        if last {
            let weight = *self.weights.get(mb).ok_or_else(|| {
                PipelineError::Invalid(format!("no loss weight for micro-batch {mb}"))
            })?;
            let loss = match (computed, self.loss.as_mut()) {
                (Computed::Loss(loss), _) => loss,
                (Computed::Output(out), Some(StageLoss::Output(loss_fn))) => loss_fn(mb, out),
                (Computed::Output(_), _) => {
                    return Err(PipelineError::Invalid(
                        "the last stage needs a loss (with_loss or with_block_loss)".into(),
                    ));
                }
            };
            let loss = loss.mul_scalar(weight);
            let value = plane::to_host(loss.clone().detach(), Reason::Report)[0];
            self.loss_total += f64::from(value);
            if self.backward {
                self.saved.insert((mb, chunk), (leaf, Saved::Loss(loss)));
            }
            Ok(None)
        } else {
            let Computed::Output(out) = computed else {
                unreachable!("only the last chunk makes a loss")
            };
            let host = Self::to_host(out.clone())?;
            if self.backward {
                self.saved.insert((mb, chunk), (leaf, Saved::Output(out)));
            }
            Ok(Some(host))
        }
    }

    fn backward(
        &mut self,
        mb: usize,
        chunk: usize,
        grad_output: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        let (grad_input, mut grads) = self.run_backward(mb, chunk, grad_output)?;
        if let Some(deferred) = self.deferred.remove(&(mb, chunk)) {
            deferred.apply(&mut grads);
        }
        self.params.accumulate(&mut grads)?;
        Ok(grad_input)
    }

    fn backward_input(
        &mut self,
        mb: usize,
        chunk: usize,
        grad_output: Option<Activation>,
    ) -> Result<Option<Activation>, PipelineError> {
        let (grad_input, grads) = self.run_backward(mb, chunk, grad_output)?;
        self.pending.insert((mb, chunk), grads);
        Ok(grad_input)
    }

    fn backward_weight(&mut self, mb: usize, chunk: usize) -> Result<(), PipelineError> {
        let mut grads = self.pending.remove(&(mb, chunk)).ok_or_else(|| {
            PipelineError::Invalid(format!(
                "BackwardWeight(mb={mb}, chunk={chunk}) before its BackwardInput"
            ))
        })?;
        if let Some(deferred) = self.deferred.remove(&(mb, chunk)) {
            deferred.apply(&mut grads);
        }
        self.params.accumulate(&mut grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_points() {
        let stages = split_at((0..6).collect(), &[2, 5]).unwrap();
        assert_eq!(stages, vec![vec![0, 1], vec![2, 3, 4], vec![5]]);
        assert!(split_at((0..6).collect::<Vec<_>>(), &[3, 3]).is_err());
        assert!(split_at((0..6).collect::<Vec<_>>(), &[6]).is_err());
        assert_eq!(split_at((0..2).collect::<Vec<_>>(), &[]).unwrap().len(), 1);
    }

    #[test]
    fn balance_by_cost() {
        assert_eq!(balance(&[1, 1, 1, 1, 10], 2).unwrap(), vec![4]);
        assert_eq!(balance(&[10, 1, 1, 1, 1], 2).unwrap(), vec![1]);
        assert_eq!(balance(&[3, 3, 3, 3], 4).unwrap(), vec![1, 2, 3]);
        assert_eq!(balance(&[2, 2, 2, 2, 2, 2], 3).unwrap(), vec![2, 4]);
        assert!(balance(&[1, 2], 3).is_err());
    }

    #[test]
    fn microbatches() {
        assert_eq!(microbatch_sizes(8, 3), vec![3, 3, 2]);
        assert_eq!(microbatch_sizes(8, 4), vec![2; 4]);
        assert_eq!(microbatch_weights(8, 3), vec![0.375, 0.375, 0.25]);
    }
}
