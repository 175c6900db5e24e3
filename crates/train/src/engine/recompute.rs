//! Activation checkpointing in both engines, applied from outside the model (like
//! torchtitan, per transformer block, after tensor parallelism and inside the dp wrapper):
//! the model's pipeline pieces that it names checkpointable ([`crate::Pipeline`]) are the
//! layers `Recompute` counts, in model order, whatever the stage; a chosen
//! piece runs as one `bonfire_recompute::recompute` region.
//!
//! - Without a pipeline, [`loss`] runs the model's loss through its pieces (a clone of the
//!   wrapper's module cut by `ParallelModel::pipeline`: the clone shares the parameters, the
//!   wrapper's hooks and gathers see them as usual), or the model's own loss when
//!   checkpointing is off.
//! - Under a pipeline, [`Recomputing`] lends the stage its chunks as [`StagePiece`]s that
//!   know whether they recompute.

use bonfire_layout::LayoutError;
use bonfire_layout::{ParallelDims, Recompute};
use bonfire_parallel::{HeadLossFn, LossFn, ParallelModel, Pipeline, PipelineVisitor};
use bonfire_pipeline::{Block, PipelineError, StageParams};
use burn::module::{Devices, Module, ModuleMapper, ModuleVisitor};
use burn::tensor::{Device, Gradients, Tensor};

/// Whether each piece (of `names`, in model order) recomputes under `ac`: the k-th piece of
/// `checkpointable` met in model order when `ac.applies_to(k)`.
pub(crate) fn recompute_flags(
    names: &[String],
    checkpointable: &[String],
    ac: Recompute,
) -> Vec<bool> {
    let mut k = 0;
    names
        .iter()
        .map(|name| {
            if !checkpointable.contains(name) {
                return false;
            }
            k += 1;
            ac.applies_to(k - 1)
        })
        .collect()
}

/// A model's pipeline pieces by name: all of them and the checkpointable ones, in order (the
/// [`PipelineVisitor`] that reads them).
pub(crate) struct Names;

impl<B> PipelineVisitor<B> for Names {
    type Output = (Vec<String>, Vec<String>);
    fn visit<P: Block<D> + 'static, const D: usize>(
        self,
        pipeline: Pipeline<P, D, B>,
    ) -> Self::Output {
        let names = pipeline.pieces.iter().map(|(n, _)| n.clone()).collect();
        (names, pipeline.checkpointable)
    }
}

/// Checks that a model can checkpoint what `dims` asks: with checkpointing on, it has
/// pipeline pieces (`names`: all of them and the checkpointable ones), names checkpointable
/// ones, and only pieces it has.
pub(crate) fn check(
    names: Option<(Vec<String>, Vec<String>)>,
    dims: &ParallelDims,
) -> Result<(), LayoutError> {
    let ac = dims.recompute;
    if !ac.is_on() {
        return Ok(());
    }
    let error = |reason: String| LayoutError::Recompute {
        setting: ac.to_string(),
        reason,
    };
    let Some((names, checkpointable)) = names else {
        return Err(error(
            "the model names no checkpointable layer: it has no pipeline pieces \
             (ParallelModel::pipeline, with Pipeline::with_checkpointable)"
                .into(),
        ));
    };
    if checkpointable.is_empty() {
        return Err(error(
            "the model names no checkpointable layer (Pipeline::with_checkpointable)".into(),
        ));
    }
    match checkpointable.iter().find(|c| !names.contains(c)) {
        Some(unknown) => Err(error(format!(
            "checkpointable layer `{unknown}` names no pipeline piece (pieces: {})",
            names.join(", ")
        ))),
        None => Ok(()),
    }
}

/// The loss of `batch` through a model's pipeline pieces in order, the ones `ac` chooses
/// recomputed (the [`PipelineVisitor`] of [`loss`]).
struct PieceLoss<'a, B> {
    batch: &'a B,
    ac: Recompute,
}

impl<B> PipelineVisitor<B> for PieceLoss<'_, B> {
    type Output = Tensor<1>;
    fn visit<P: Block<D> + 'static, const D: usize>(
        self,
        pipeline: Pipeline<P, D, B>,
    ) -> Self::Output {
        let names: Vec<String> = pipeline.pieces.iter().map(|(n, _)| n.clone()).collect();
        let flags = recompute_flags(&names, &pipeline.checkpointable, self.ac);
        let x = (pipeline.input)(self.batch);
        let Some(((_, last), body)) = pipeline.pieces.split_last() else {
            return (pipeline.loss)(x, self.batch);
        };
        let x = body
            .iter()
            .zip(&flags)
            .fold(x, |x, ((_, piece), &r)| forward_piece(piece, x, r));
        let recompute = flags.last().copied().unwrap_or(false);
        let head_loss = pipeline.head_loss.as_ref();
        last_piece_loss(last, recompute, x, self.batch, &pipeline.loss, head_loss)
    }
}

/// The loss of the last piece `piece` on its input `x`: the model's fused
/// [`head_loss`](Pipeline::head_loss) where it has one (and the piece is not recomputed),
/// else the piece's forward (recomputed when `recompute`), then `loss`.
pub(crate) fn last_piece_loss<P: Block<D> + 'static, const D: usize, B>(
    piece: &P,
    recompute: bool,
    x: Tensor<D>,
    batch: &B,
    loss: &LossFn<B, D>,
    head_loss: Option<&HeadLossFn<P, B, D>>,
) -> Tensor<1> {
    match head_loss {
        Some(head_loss) if !recompute => head_loss(piece, x, batch),
        _ => loss(forward_piece(piece, x, recompute), batch),
    }
}

/// The loss of `batch` on `model` (a replica's module, inside its wrapper's forward): the
/// model's own loss, or with checkpointing on, the loss through its pipeline pieces with
/// the chosen ones recomputed.
pub(crate) fn loss<M: ParallelModel>(model: &M, batch: M::Batch, ac: Recompute) -> Tensor<1> {
    if !ac.is_on() {
        return model.loss(batch);
    }
    let visitor = PieceLoss { batch: &batch, ac };
    model
        .clone()
        .pipeline(visitor)
        .expect("checked: activation checkpointing needs pipeline pieces")
}

/// `piece` as a stage runs it: recomputed in backward when `recompute`. As a module it is
/// `piece` itself (same parameters, same paths).
#[derive(Clone, Debug)]
pub(crate) struct StagePiece<P> {
    piece: P,
    recompute: bool,
}

impl<P: Module> Module for StagePiece<P> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.piece.collect_devices(devices)
    }
    fn fork(self, device: &Device) -> Self {
        let recompute = self.recompute;
        let piece = self.piece.fork(device);
        Self { piece, recompute }
    }
    fn to_device(self, device: &Device) -> Self {
        let recompute = self.recompute;
        let piece = self.piece.to_device(device);
        Self { piece, recompute }
    }
    fn train(self) -> Self {
        let recompute = self.recompute;
        let piece = self.piece.train();
        Self { piece, recompute }
    }
    fn valid(&self) -> Self {
        let piece = self.piece.valid();
        Self {
            piece,
            recompute: self.recompute,
        }
    }
    fn materialize(self) -> Self {
        let recompute = self.recompute;
        let piece = self.piece.materialize();
        Self { piece, recompute }
    }
    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.piece.visit(visitor)
    }
    fn map<M: ModuleMapper>(self, mapper: &mut M) -> Self {
        let recompute = self.recompute;
        let piece = self.piece.map(mapper);
        Self { piece, recompute }
    }
}

impl<P> StagePiece<P> {
    /// [`last_piece_loss`] of this piece.
    pub(crate) fn loss<B, const D: usize>(
        &self,
        x: Tensor<D>,
        batch: &B,
        loss: &LossFn<B, D>,
        head_loss: Option<&HeadLossFn<P, B, D>>,
    ) -> Tensor<1>
    where
        P: Block<D> + 'static,
    {
        last_piece_loss(&self.piece, self.recompute, x, batch, loss, head_loss)
    }
}

/// `x` through `piece`, recomputed in backward when `recompute`.
pub(crate) fn forward_piece<P, const D: usize>(
    piece: &P,
    x: Tensor<D>,
    recompute: bool,
) -> Tensor<D>
where
    P: Block<D> + 'static,
{
    match recompute {
        true => bonfire_recompute::recompute(piece, x, |p: &P, x| p.forward(x)),
        false => piece.forward(x),
    }
}

impl<P: Block<D> + 'static, const D: usize> Block<D> for StagePiece<P> {
    fn forward(&self, x: Tensor<D>) -> Tensor<D> {
        forward_piece(&self.piece, x, self.recompute)
    }
}

/// A stage's chunk holder lending its chunks as [`StagePiece`]s: `flags[c][j]` says whether
/// piece `j` of local chunk `c` recomputes. The pieces are clones sharing the holder's
/// parameters (a ZeRO-3 module's stay value-less).
pub(crate) struct Recomputing<'a, H> {
    inner: H,
    flags: &'a [Vec<bool>],
}

impl<'a, H> Recomputing<'a, H> {
    pub fn new(inner: H, flags: &'a [Vec<bool>]) -> Self {
        Self { inner, flags }
    }
}

impl<P: Module, H: StageParams<Vec<Vec<P>>>> StageParams<Vec<Vec<StagePiece<P>>>>
    for Recomputing<'_, H>
{
    fn forward<R>(&mut self, f: impl FnOnce(&Vec<Vec<StagePiece<P>>>) -> R) -> R {
        let flags = self.flags;
        self.inner.forward(|chunks| {
            let lent = chunks
                .iter()
                .zip(flags)
                .map(|(chunk, flags)| {
                    chunk
                        .iter()
                        .zip(flags)
                        .map(|(piece, &recompute)| StagePiece {
                            piece: piece.clone(),
                            recompute,
                        })
                        .collect()
                })
                .collect();
            f(&lent)
        })
    }

    fn accumulate(&mut self, grads: &mut Gradients) -> Result<(), PipelineError> {
        self.inner.accumulate(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_count_checkpointable_pieces_in_model_order() {
        let names: Vec<String> = ["embed", "b0", "b1", "b2", "b3", "head"]
            .map(String::from)
            .to_vec();
        let blocks: Vec<String> = ["b0", "b1", "b2", "b3"].map(String::from).to_vec();
        let every = |k| recompute_flags(&names, &blocks, Recompute::Every(k));
        assert_eq!(every(1), [false, true, true, true, true, false]);
        assert_eq!(every(2), [false, true, false, true, false, false]);
        assert_eq!(every(3), [false, true, false, false, true, false]);
        let off = recompute_flags(&names, &blocks, Recompute::Off);
        assert!(off.iter().all(|f| !f));
    }
}
