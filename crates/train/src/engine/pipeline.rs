//! The engine with a pipeline: the model's pieces are split into the schedule's stages, this
//! rank keeps the chunks its pp coordinate runs, wraps them on the dp axis (DDP or ZeRO 1–3;
//! each micro-batch's forward runs through the wrapper, so ZeRO-3 gathers inside the
//! schedule) and runs the schedule on the pp axis; tensor-parallel pieces exchange their tp
//! shard's activations with the same tp rank of the next stage.

use super::export::ModelLayout;
use super::recompute::{Recomputing, StagePiece, recompute_flags};
use super::tie::Tie;
use super::{Engine, state_methods, wrapper_methods};
use crate::checkpoint::Stateful;
use crate::error::TrainError;
use crate::mesh::{ContextCut, RankMesh};
use crate::wrapper::{DpSpec, DpWrapper, Evaluating, Staged};
use bonfire_comm::ReduceOp;
use bonfire_layout::Axis;
use bonfire_layout::{LayoutError, ParallelDims};
use bonfire_module::DataParallel;
use bonfire_module::PrecisionDTypes;
use bonfire_module::params::{self, ParamValues};
use bonfire_module::tied::LendGuard;
use bonfire_parallel::{HeadLossFn, InputFn, LossFn, Pipeline, PipelineVisitor, Rows};
use bonfire_pipeline::Generate;
use bonfire_pipeline::{
    Block, BurnStage, Schedule, StageParams, chunks_for_rank, microbatch_sizes, microbatch_weights,
    run_schedule, run_unchecked, split_at,
};
use burn::tensor::Tensor;
use std::ops::Range;

/// What the trainer hands a pipeline to build this rank's engine.
pub(crate) struct PipelineContext {
    pub at: RankMesh,
    pub dp: DpSpec,
    pub layout: ModelLayout,
    /// Under expert parallelism: this rank's expert parameters and their replicas.
    pub experts: Option<bonfire_module::Subgroup>,
}

/// Where the stages of `dims`'s schedule begin, as piece indices of the pieces `names`: at
/// the pieces its split points name (module paths, in order) or, without names, its default
/// split ([`bonfire_layout::PpOptions::default_split`]: balanced by its piece costs, evenly
/// without them).
pub(crate) fn split_points(
    names: &[String],
    dims: &ParallelDims,
) -> Result<Vec<usize>, LayoutError> {
    let pp = dims.pp();
    let kind = dims
        .pp_options
        .schedule
        .expect("validated: a pipeline has a schedule");
    let stages = pp * kind.chunks();
    let error = |reason: String| Err(LayoutError::axis(Axis::Pp, pp, reason));
    if names.len() < stages {
        return error(format!(
            "the schedule needs {stages} stages, each with at least one pipeline piece, but \
             the model has {} pieces ({})",
            names.len(),
            names.join(", ")
        ));
    }
    let options = &dims.pp_options;
    match (&options.split_points, &options.piece_costs) {
        (Some(_), Some(_)) => {
            return error("split points name the cut and piece costs balance it: give one".into());
        }
        (None, Some(costs)) if costs.len() != names.len() => {
            return error(format!(
                "{} piece costs for {} pipeline pieces ({})",
                costs.len(),
                names.len(),
                names.join(", ")
            ));
        }
        _ => {}
    }
    let Some(named) = options.split_points.as_deref() else {
        return Ok(options.default_split(names.len(), kind, pp));
    };
    if named.len() + 1 != stages {
        return error(format!(
            "{} split points make {} stages, the schedule has {stages}",
            named.len(),
            named.len() + 1
        ));
    }
    let mut points = Vec::with_capacity(named.len());
    for name in named {
        let Some(i) = names.iter().position(|n| n == name) else {
            return error(format!(
                "split point `{name}` names no pipeline piece (pieces: {})",
                names.join(", ")
            ));
        };
        if i == 0 || points.last().is_some_and(|&p| p >= i) {
            return error(format!(
                "split points must follow the pieces' order after the first: `{name}` does not"
            ));
        }
        points.push(i);
    }
    Ok(points)
}

/// The model parameters each piece holds, as index ranges into the model's inventory; fails
/// unless the pieces hold exactly the model's parameters in its order. `state`: the same for
/// the state tensors (parameters without gradient) and the model's list of them.
fn piece_params<P: burn::module::Module>(
    pieces: &[(String, P)],
    layout: &ModelLayout,
    state: bool,
) -> Result<Vec<Range<usize>>, TrainError> {
    let (model, what) = match state {
        false => (&layout.infos, "parameters"),
        true => (&layout.buffers, "state tensors"),
    };
    let mut at = 0;
    let mut out = Vec::with_capacity(pieces.len());
    for (name, piece) in pieces {
        let own = match state {
            false => params::inventory(piece),
            true => params::buffers(piece),
        };
        let want = model.get(at..at + own.len());
        let same = want.is_some_and(|w| w.iter().zip(&own).all(|(a, b)| a.shape == b.shape));
        if !same {
            return Err(TrainError::Model(format!(
                "pipeline piece `{name}` does not hold the model's {what} {at}.. in order \
                 (pieces must cover the model's {what}, in the model's order)"
            )));
        }
        out.push(at..at + own.len());
        at += own.len();
    }
    if at != model.len() {
        return Err(TrainError::Model(format!(
            "the pipeline pieces hold {at} of the model's {} {what}",
            model.len()
        )));
    }
    Ok(out)
}

/// The trainer's [`PipelineVisitor`] that builds this rank's pipeline engine from a model's
/// pieces (see [`crate::Trainer::build`]).
pub(crate) struct BuildEngine<B> {
    pub ctx: PipelineContext,
    pub context: ContextCut<B>,
}

impl<B: Rows> PipelineVisitor<B> for BuildEngine<B> {
    type Output = Result<Box<dyn Engine<B>>, TrainError>;

    fn visit<P: Block<D> + 'static, const D: usize>(
        self,
        pipeline: Pipeline<P, D, B>,
    ) -> Self::Output {
        let Self { ctx, context } = self;
        let dims = &ctx.at.dims;
        let kind = dims
            .pp_options
            .schedule
            .expect("validated: a pipeline has a schedule");
        let schedule = kind.generate(dims.pp(), dims.microbatches());
        let names = pipeline.names();
        let points = split_points(&names, dims)?;
        let stage_of = |piece: usize| points.iter().filter(|&&p| p <= piece).count();
        let ties = super::tie::ties(
            &pipeline.pieces,
            &pipeline.borrowed,
            stage_of,
            schedule.stage_map,
        )?;
        let ranges = piece_params(&pipeline.pieces, &ctx.layout, false)?;
        let buffer_ranges = piece_params(&pipeline.pieces, &ctx.layout, true)?;
        let ac = dims.recompute;
        let flags = recompute_flags(&names, &pipeline.checkpointable, ac);
        let stage_starts: Vec<usize> = std::iter::once(0).chain(points.iter().copied()).collect();
        let pp_rank = ctx.at.coord(Axis::Pp);
        // The model parameters (and state tensors) of this rank's chunks, in the wrapper's
        // order.
        let held = |ranges: &[Range<usize>]| -> Vec<usize> {
            (0..schedule.stage_map.chunks())
                .flat_map(|c| {
                    let s = schedule.stage_map.stage(pp_rank, c);
                    let end = stage_starts.get(s + 1).copied().unwrap_or(names.len());
                    ranges[stage_starts[s]].start..ranges[end - 1].end
                })
                .collect()
        };
        let (indices, buffer_indices) = (held(&ranges), held(&buffer_ranges));
        // Which pieces of each of this rank's chunks recompute.
        let recompute: Vec<Vec<bool>> = (0..schedule.stage_map.chunks())
            .map(|c| {
                let s = schedule.stage_map.stage(pp_rank, c);
                let end = stage_starts.get(s + 1).copied().unwrap_or(names.len());
                flags[stage_starts[s]..end].to_vec()
            })
            .collect();
        let pieces: Vec<P> = pipeline.pieces.into_iter().map(|(_, p)| p).collect();
        let stages = split_at(pieces, &points)?;
        let chunks = chunks_for_rank(&stages, &schedule, pp_rank)?;
        drop(stages);
        let wrapper = ctx.dp.build_at(chunks, &ctx.at, ctx.experts)?;
        Ok(Box::new(PipelineEngine {
            at: ctx.at,
            schedule,
            wrapper,
            indices,
            buffer_indices,
            recompute,
            layout: ctx.layout,
            ties,
            input: pipeline.input,
            loss: pipeline.loss,
            head_loss: pipeline.head_loss,
            context,
        }))
    }
}

struct PipelineEngine<P: Block<D>, const D: usize, B> {
    at: RankMesh,
    schedule: Schedule,
    wrapper: DpWrapper<Vec<Vec<P>>>,
    /// The model parameter of each of the wrapper's parameters.
    indices: Vec<usize>,
    /// The model state tensor of each of the wrapper's.
    buffer_indices: Vec<usize>,
    /// Whether each piece of each local chunk recomputes (activation checkpointing).
    recompute: Vec<Vec<bool>>,
    layout: ModelLayout,
    /// Parameters a later stage borrows from an earlier one (a tied head).
    ties: Vec<Tie>,
    input: InputFn<B, D>,
    loss: LossFn<B, D>,
    /// The last piece and the loss as one, where the model fuses them
    /// ([`Pipeline::with_head_loss`]).
    head_loss: Option<HeadLossFn<P, B, D>>,
    /// How batches are cut under context parallelism.
    context: ContextCut<B>,
}

impl<P: Block<D>, const D: usize, B: Rows> PipelineEngine<P, D, B> {
    /// This replica's rows cut into the schedule's micro-batches, the first stage's inputs
    /// of them (empty elsewhere), and their loss weights.
    fn microbatches(&self, batch: &B) -> (Vec<B>, Vec<Tensor<D>>, Vec<f32>) {
        let (rows, m) = (batch.rows(), self.schedule.microbatches);
        let mut start = 0;
        let micro: Vec<B> = microbatch_sizes(rows, m)
            .into_iter()
            .map(|len| {
                let b = batch.narrow_rows(start, len);
                start += len;
                b
            })
            .collect();
        let pp_rank = self.at.coord(Axis::Pp);
        let first =
            (0..self.schedule.stage_map.chunks()).any(|c| self.schedule.is_first(pp_rank, c));
        let inputs = match first {
            true => micro.iter().map(|b| (self.input)(b)).collect(),
            false => Vec::new(),
        };
        (micro, inputs, microbatch_weights(rows, m))
    }

    /// The mean loss over the replicas, from the last stage's `loss` (a collective: the
    /// last stage's ranks, dp · cp · tp of them with tp ranks agreeing, hold the replicas'
    /// losses — each cp rank its tokens' mean, as many tokens on each).
    fn global_loss(&self, loss: Option<f64>) -> Result<f64, TrainError> {
        let dims = &self.at.dims;
        let replicas = (dims.data_replicas() * dims.cp() * dims.tp()) as f64;
        let mut global = [loss.map_or(0.0, |l| l / replicas)];
        self.at
            .mesh
            .world()
            .all_reduce(&mut global, ReduceOp::Sum)?;
        Ok(global[0])
    }

    /// The borrowed parameters' current values lent to the stages that borrow them (see
    /// [`Tie::lend`]), one entry per tie.
    fn lend(&mut self, track: bool) -> Result<Vec<Option<LendGuard>>, TrainError> {
        let ties = self.ties.clone();
        ties.iter()
            .map(|t| t.lend(&mut self.wrapper, &self.at, track))
            .collect()
    }

    /// Whether this rank hands its stages' values to the assembly (one rank per stage:
    /// the first of its dp, cp and tp groups).
    fn contributes(&self) -> bool {
        [Axis::DpReplicate, Axis::Dp, Axis::Cp, Axis::Tp]
            .iter()
            .all(|&a| self.at.coord(a) == 0)
    }

    /// Whether this rank writes its stages' state tensors to a checkpoint.
    fn writes_buffers(&self) -> bool {
        self.contributes()
    }

    /// Every state tensor whole from this rank's stages' `local` ones (a collective on the
    /// world).
    fn assemble_buffers(&self, local: Vec<Vec<f32>>) -> Result<Vec<ParamValues>, TrainError> {
        let world = (self.at.mesh.world(), self.contributes());
        self.layout
            .whole_buffers(local, &self.buffer_indices, Some(world))
    }

    /// Every parameter whole from this rank's `local` ones (a collective on tp, on ep for
    /// the experts, and on the world).
    fn assemble(&self, local: Vec<ParamValues>) -> Result<Vec<ParamValues>, TrainError> {
        let contributes = self.contributes();
        self.layout.whole_assembled(
            local,
            &self.indices,
            contributes,
            self.at.group(Axis::Tp),
            self.at.experts.as_ref().map(|g| &g.ep),
            self.at.mesh.world(),
        )
    }
}

impl<P: Block<D> + 'static, const D: usize, B: Rows> PipelineEngine<P, D, B> {
    /// Runs the schedule's forwards and backwards on `part` (this replica's rows or a part of
    /// them), its micro-batches' loss weights multiplied by `share`, accumulating the
    /// gradients in the wrapper; the last stage's weighted loss (`None` elsewhere).
    fn run_part(&mut self, part: &B, share: f32) -> Result<Option<f64>, TrainError> {
        let (micro, inputs, weights) = self.microbatches(part);
        let weights = weights.into_iter().map(|w| w * share).collect();
        let (loss_fn, head_loss) = (self.loss.clone(), self.head_loss.clone());
        let pp_rank = self.at.coord(Axis::Pp);
        let scale = self.at.loss_scale;
        let stage = BurnStage::new(
            Recomputing::new(Staged(&mut self.wrapper), &self.recompute),
            &self.schedule,
            pp_rank,
            self.at.device.clone(),
            weights,
        )
        .with_inputs(inputs)
        .with_dtype(self.at.dims.precision.param_dtype());
        let mut stage = with_losses(stage, micro, loss_fn, head_loss, scale);
        run_schedule(&self.at.mesh, Axis::Pp.name(), &self.schedule, &mut stage)?;
        Ok(stage.finish().1)
    }
}

/// `stage` with the last stage's loss of each micro-batch of `micro`, times `scale`: the
/// model's head and loss as one where it fuses them ([`Pipeline::with_head_loss`], made with
/// the last piece inside its forward), else the last piece's output, then `loss`.
fn with_losses<'a, P, H, const D: usize, B: 'a>(
    stage: BurnStage<'a, StagePiece<P>, H, D>,
    micro: Vec<B>,
    loss: LossFn<B, D>,
    head_loss: Option<HeadLossFn<P, B, D>>,
    scale: f32,
) -> BurnStage<'a, StagePiece<P>, H, D>
where
    P: Block<D> + 'static,
    H: StageParams<Vec<Vec<StagePiece<P>>>>,
{
    let scaled = move |loss: Tensor<1>| if scale == 1.0 { loss } else { loss * scale };
    match head_loss {
        Some(head) => stage.with_block_loss(move |mb, piece: &StagePiece<P>, x| {
            scaled(piece.loss(x, &micro[mb], &loss, Some(&head)))
        }),
        None => stage.with_loss(move |mb, out| scaled(loss(out, &micro[mb]))),
    }
}

impl<P: Block<D> + 'static, const D: usize, B: Rows> Engine<B> for PipelineEngine<P, D, B> {
    fn place(&self) -> &RankMesh {
        &self.at
    }

    fn forward_backward(&mut self, batch: &B) -> Result<f32, TrainError> {
        let (batch, _context) = self.at.context(batch, self.context);
        let _experts = self.at.expert_scope();
        let parts = self.at.accumulation_parts(batch.rows())?;
        let share = 1.0 / parts.len() as f32;
        let lent = self.lend(true)?;
        let mut total: Option<f64> = None;
        // Gradient accumulation: the whole schedule once per part, its micro-batches' loss
        // weights scaled by 1/K; the wrapper reduces once, after the last part.
        for (start, len) in parts {
            let part = batch.narrow_rows(start, len);
            if let Some(loss) = self.run_part(&part, share)? {
                *total.get_or_insert(0.0) += loss;
            }
        }
        for (tie, lent) in self.ties.iter().zip(lent) {
            tie.give_back(&mut self.wrapper, &self.at, lent)?;
        }
        self.wrapper.reduce()?;
        Ok((self.global_loss(total)? / self.at.loss_scale as f64) as f32)
    }

    fn evaluate(&mut self, batch: &B) -> Result<f32, TrainError> {
        let (batch, _context) = self.at.context(batch, self.context);
        let _experts = self.at.expert_scope();
        let (micro, inputs, weights) = self.microbatches(&batch);
        let _lent = self.lend(false)?;
        let (loss_fn, head_loss) = (self.loss.clone(), self.head_loss.clone());
        let pp_rank = self.at.coord(Axis::Pp);
        let forwards = Schedule::forward_only(self.schedule.stage_map, self.schedule.microbatches);
        let stage = BurnStage::new(
            Recomputing::new(Evaluating(&mut self.wrapper), &self.recompute),
            &forwards,
            pp_rank,
            self.at.device.clone(),
            weights,
        )
        .without_backward()
        .with_inputs(inputs)
        .with_dtype(self.at.dims.precision.param_dtype());
        let mut stage = with_losses(stage, micro, loss_fn, head_loss, 1.0);
        run_unchecked(self.at.group(Axis::Pp), &forwards, &mut stage)?;
        let (_, loss) = stage.finish();
        Ok(self.global_loss(loss)? as f32)
    }

    wrapper_methods!();
}

impl<P: Block<D> + 'static, const D: usize, B: Rows> Stateful for PipelineEngine<P, D, B> {
    state_methods!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use bonfire_layout::ScheduleKind;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("p{i}")).collect()
    }

    /// Without names the stages are cut evenly, or by the layout's piece costs; names and
    /// costs together, or a cost count other than the pieces', are one error each.
    #[test]
    fn the_default_cut_is_even_or_balanced_by_cost() {
        let dims = ParallelDims::new()
            .with_degree(Axis::Pp, 2)
            .with_schedule(ScheduleKind::OneFOneB);
        let six = names(6);
        assert_eq!(split_points(&six, &dims).unwrap(), vec![3]);
        let costs = vec![0, 3, 3, 3, 3, 4];
        let balanced = dims.clone().with_piece_costs(costs.clone());
        assert_eq!(split_points(&six, &balanced).unwrap(), vec![4]);
        let both = balanced.clone().with_split_points(vec!["p2".into()]);
        let err = split_points(&six, &both).unwrap_err().to_string();
        assert!(err.contains("give one"), "{err}");
        let err = split_points(&names(5), &balanced).unwrap_err().to_string();
        assert!(err.contains("6 piece costs for 5 pipeline pieces"), "{err}");
    }
}
