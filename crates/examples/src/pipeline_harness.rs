//! Pipeline parallelism (`--mesh pp=N`, `dp=N,pp=M`, `tp=N,pp=M`, `dp=N,tp=M,pp=K`) in the
//! parity harness.
//!
//! The GPT is cut into `L + 2` pieces ([`Piece`]): the embeddings, each transformer block and
//! the head. They are split evenly into the `p·v` stages of the chosen schedule (`v` = 2 for
//! interleaved and ZB-V, else 1; the embedding goes with the first blocks, the head with the
//! last), placed on the pipeline ranks by the schedule and trained with
//! [`bonfire_pipeline::run_schedule`] on micro-batches. The ranks form a row-major
//! `dp × pp × tp` mesh: each replica (dp) runs its rows of the batch and the gradients are
//! averaged over dp before the SGD step; with `tp > 1` the model is first parallelized with the
//! GPT's tensor-parallel plan (logits gathered, no sequence parallelism) and then cut, so each
//! stage's pieces hold their tp shards and every tp rank of a stage exchanges its (replicated)
//! activations with the same tp rank of the next stage. Step-0 gradients and the final
//! parameters are gathered over tp and summed over the world into one flat buffer (replica 0's
//! tp rank 0 contributes, every other rank adds zeros, so the sum is exact) and named after
//! the whole model's parameters.

use crate::block::Block as GptBlock;
use crate::config::GptConfig;
use crate::gpt::{Gpt, cross_entropy, default_device};
use crate::harness::{HarnessArgs, HarnessResult};
use crate::layers::{Embedding, LayerNorm, Linear};
use crate::tp::{check_tp, gather_host, parallelize_gpt};
use crate::{checkpoint, data, tensor_file};
use bonfire_comm::{ProcessGroup, ReduceOp, ThreadWorld};
use bonfire_ddp::params;
use bonfire_dtensor::DeviceMesh;
use bonfire_dtensor::parallel::sharded_params;
use bonfire_pipeline::{
    Block, BurnStage, ScheduleKind, all_reduce_grads, chunks_for_rank, microbatch_sizes,
    microbatch_weights, run_schedule, split_at, split_batch,
};
use bonfire_zero::{Stage, Zero, ZeroConfig};
use burn::module::Module;
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Int, Tensor};
use std::time::Duration;

/// The token and position embeddings (the first piece).
#[derive(Module, Debug)]
pub struct EmbedPiece {
    pub tok_emb: Embedding,
    pub pos_emb: Embedding,
}

/// The final LayerNorm and the output projection (the last piece).
#[derive(Module, Debug)]
pub struct HeadPiece {
    pub ln_f: LayerNorm,
    pub head: Linear,
}

/// One piece of the GPT as a pipeline block: activations are `[B, T, d]`; the embedding
/// reads token ids as floats `[B, T, 1]`, the head writes logits `[B, T, V]`.
// A handful of pieces per rank: the size difference of the variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Piece {
    Embed(EmbedPiece),
    Layer(GptBlock),
    Head(HeadPiece),
}

impl Block<3> for Piece {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        match self {
            Piece::Embed(e) => {
                let [b, t, _] = x.dims();
                let ids: Tensor<2, Int> = x.reshape([b, t]).int();
                e.tok_emb.forward(ids) + e.pos_emb.first_rows(t).unsqueeze::<3>()
            }
            Piece::Layer(block) => block.forward(x),
            Piece::Head(h) => h.head.forward(h.ln_f.forward(x)),
        }
    }
}

/// The GPT's pieces in order: embeddings, blocks, head (parameters in the model's order).
pub fn pieces(model: Gpt) -> Vec<Piece> {
    let Gpt {
        tok_emb,
        pos_emb,
        blocks,
        ln_f,
        head,
    } = model;
    let mut out = vec![Piece::Embed(EmbedPiece { tok_emb, pos_emb })];
    out.extend(blocks.into_iter().map(Piece::Layer));
    out.push(Piece::Head(HeadPiece { ln_f, head }));
    out
}

/// Split points cutting `n` pieces into `stages` contiguous, even stages (sizes differ by at
/// most one, the first ones larger).
pub fn split_points(n: usize, stages: usize) -> Vec<usize> {
    let mut at = 0;
    (0..stages - 1)
        .map(|i| {
            at += n / stages + usize::from(i < n % stages);
            at
        })
        .collect()
}

/// The pipeline options of a layout, validated against the model and the batch.
#[derive(Debug, Clone, Copy)]
pub struct PpOptions {
    pub pp: usize,
    pub kind: ScheduleKind,
    pub microbatches: usize,
}

impl PpOptions {
    /// Parses `--schedule` (default micro-batches: `pp`) and checks that the GPT has a piece
    /// for every stage and each replica a row for every micro-batch.
    pub fn new(
        pp: usize,
        schedule: Option<&str>,
        microbatches: Option<usize>,
        cfg: &GptConfig,
        rows: usize,
    ) -> Result<Self, String> {
        let name = schedule
            .ok_or_else(|| format!("--mesh pp={pp} needs --schedule gpipe|1f1b|interleaved|zb"))?;
        let kind = ScheduleKind::parse(name).ok_or_else(|| {
            format!("--schedule {name}: unknown (known: gpipe, 1f1b, interleaved[:V], zb, zb-v)")
        })?;
        let stages = pp * kind.chunks();
        let pieces = cfg.n_layers + 2;
        if pieces < stages {
            return Err(format!(
                "--mesh pp={pp} with --schedule {name} needs {stages} stages, each with at least \
                 one piece (the embedding, a layer or the head): at least {} layers, but \
                 n_layers is {}",
                stages.saturating_sub(2),
                cfg.n_layers
            ));
        }
        let microbatches = microbatches.unwrap_or(pp);
        if microbatches == 0 || microbatches > rows {
            return Err(format!(
                "--microbatches {microbatches}: must be between 1 and the {rows} batch row(s) \
                 of each pipeline"
            ));
        }
        Ok(Self {
            pp,
            kind,
            microbatches,
        })
    }
}

/// Runs the harness for a layout with a pp axis (called by [`crate::harness::run`]).
pub fn run(args: &HarnessArgs) -> Result<HarnessResult, String> {
    let (cfg, batches, dp) = crate::harness::load_inputs(args)?;
    let pp = PpOptions::new(
        args.layout.mesh.pp,
        args.layout.schedule.as_deref(),
        args.layout.microbatches,
        &cfg,
        batches.batch / dp,
    )?;
    let tp = args.layout.mesh.tp;
    check_tp(&cfg, tp)?;
    let model = checkpoint::load(Gpt::new(&cfg, &default_device()), &args.weights)?;
    let zero = match args.layout.zero {
        0 => None,
        n => Some(
            Stage::from_index(n as usize).ok_or_else(|| format!("--zero {n}: must be 0..=3"))?,
        ),
    };
    let result = train_pipeline(&model, &batches, dp, tp, pp, zero, args.steps, args.lr)?;
    tensor_file::write_f32(&args.out, &result.tensors())?;
    Ok(result)
}

/// A piece's values (parameters or gradients, `local` in its module order) made whole:
/// tensor-parallel shards all-gathered over `tp_group` (a collective on it).
fn whole_piece(piece: &Piece, local: &[f32], tp_group: &ProcessGroup) -> Result<Vec<f32>, String> {
    if tp_group.size() == 1 {
        return Ok(local.to_vec());
    }
    let shards = sharded_params(piece);
    let mut out = Vec::new();
    let mut at = 0;
    for p in params::inventory(piece) {
        let values = &local[at..at + p.numel()];
        at += p.numel();
        match shards.get(&p.path) {
            Some(&dim) => out.extend(gather_host(values, &p.shape, dim, tp_group)?),
            None => out.extend_from_slice(values),
        }
    }
    Ok(out)
}

/// `f` applied to every piece of `chunks`, keeping the chunk structure.
fn map_pieces<T>(chunks: &[Vec<Piece>], mut f: impl FnMut(&Piece) -> T) -> Vec<Vec<T>> {
    chunks
        .iter()
        .map(|chunk| chunk.iter().map(&mut f).collect())
        .collect()
}

/// Every piece's host gradient from `grads` (zeros where a parameter got none).
fn host_grads(chunks: &[Vec<Piece>], grads: &mut GradientsParams) -> Vec<Vec<Vec<f32>>> {
    map_pieces(chunks, |piece| {
        let pinfos = params::inventory(piece);
        params::take_grads(piece, &pinfos, grads)
            .into_iter()
            .zip(&pinfos)
            .flat_map(|(g, p)| g.unwrap_or_else(|| vec![0.0; p.numel()]))
            .collect()
    })
}

/// `flat` (values of every parameter of `chunks`, in module order) cut piece by piece.
fn split_by_piece(chunks: &[Vec<Piece>], flat: &[f32]) -> Vec<Vec<Vec<f32>>> {
    let mut at = 0;
    map_pieces(chunks, |piece| {
        let n: usize = params::inventory(piece).iter().map(|p| p.numel()).sum();
        at += n;
        flat[at - n..at].to_vec()
    })
}

/// SGD on this rank's pieces: p ← p − lr·grad.
fn sgd(chunks: Vec<Vec<Piece>>, grads: &[Vec<Vec<f32>>], lr: f32) -> Vec<Vec<Piece>> {
    chunks
        .into_iter()
        .zip(grads)
        .map(|(chunk, g_chunk)| {
            chunk
                .into_iter()
                .zip(g_chunk)
                .map(|(piece, g)| {
                    let pinfos = params::inventory(&piece);
                    let values: Vec<f32> = params::flatten_values(&piece, &pinfos)
                        .iter()
                        .zip(g)
                        .map(|(v, g)| v - lr * g)
                        .collect();
                    params::assign_values(piece, &pinfos, &values)
                })
                .collect()
        })
        .collect()
}

/// `steps` SGD steps of `model` on `batches` on a `dp × pp × tp` mesh of rank threads under
/// `pp`'s schedule, the dp axis plain (gradients all-reduced) or, with `zero_stage`, ZeRO
/// stage 1 or 2. Returns rank 0's result (whole parameters, step-0 gradients, losses).
#[allow(clippy::too_many_arguments)]
pub fn train_pipeline(
    model: &Gpt,
    batches: &data::Batches,
    dp: usize,
    tp: usize,
    pp: PpOptions,
    zero_stage: Option<Stage>,
    steps: usize,
    lr: f64,
) -> Result<HarnessResult, String> {
    let device = default_device();
    let rows = batches.batch / dp;
    let m = pp.microbatches;
    let schedule = pp.kind.generate(pp.pp, m);
    let n_pieces = model.blocks.len() + 2;
    let points = split_points(n_pieces, schedule.stages());
    // First piece of each stage, and the offset of each piece in the model's flat layout.
    let stage_start: Vec<usize> = std::iter::once(0).chain(points.iter().copied()).collect();
    let infos = params::inventory(model);
    let mut piece_offset = vec![0usize];
    for piece in pieces(model.clone()) {
        let n: usize = params::inventory(&piece).iter().map(|p| p.numel()).sum();
        piece_offset.push(piece_offset.last().unwrap() + n);
    }
    let total = *piece_offset.last().unwrap();
    let model_total: usize = infos.iter().map(|p| p.numel()).sum();
    if total != model_total {
        return Err(format!(
            "pipeline pieces hold {total} values, the model {model_total}"
        ));
    }
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let outcomes = ThreadWorld::new(dp * pp.pp * tp)
        .timeout(Duration::from_secs(120))
        .name("parity-pp")
        .launch(|pg| -> Result<HarnessResult, String> {
            let mesh =
                DeviceMesh::new(&pg, &[dp, pp.pp, tp], &["dp", "pp", "tp"]).map_err(|e| err(&e))?;
            let group = |axis: &str| mesh.group(axis).cloned().map_err(|e| err(&e));
            let (dp_group, pp_group, tp_group) = (group("dp")?, group("pp")?, group("tp")?);
            let (dp_rank, pp_rank) = (dp_group.rank(), pp_group.rank());
            let mut replica = model.clone().fork(&device);
            if tp > 1 {
                replica = parallelize_gpt(replica, &mesh, "tp", false, false)?;
            }
            let stages = split_at(pieces(replica), &points).map_err(|e| err(&e))?;
            let mut chunks = chunks_for_rank(&stages, &schedule, pp_rank).map_err(|e| err(&e))?;
            drop(stages);
            // The global piece index of each of this rank's pieces, chunk by chunk.
            let first_piece: Vec<usize> = (0..chunks.len())
                .map(|c| stage_start[schedule.placement.stage(pp_rank, c)])
                .collect();
            // This rank's pieces' whole values (replica 0's tp rank 0 only) at their place in
            // the flat layout; `per_piece` gives a piece's local values.
            let scatter = |chunks: &[Vec<Piece>],
                           per_piece: &dyn Fn(usize, usize) -> Vec<f32>|
             -> Result<Vec<f32>, String> {
                let mut flat = vec![0.0f32; total];
                if dp_rank == 0 {
                    for (c, chunk) in chunks.iter().enumerate() {
                        for (j, piece) in chunk.iter().enumerate() {
                            let k = first_piece[c] + j;
                            let v = whole_piece(piece, &per_piece(c, j), &tp_group)?;
                            if tp_group.rank() == 0 {
                                flat[piece_offset[k]..piece_offset[k + 1]].copy_from_slice(&v);
                            }
                        }
                    }
                }
                Ok(flat)
            };
            // ZeRO (stages 1–2) on the dp axis: each pipeline rank's pieces are partitioned over
            // the replicas holding the same stages; the schedule runs on a copy of its model.
            let mut zero = match zero_stage {
                None => None,
                Some(stage) => {
                    let z = Zero::new(
                        chunks,
                        SgdConfig::new().build(),
                        dp_group.clone(),
                        ZeroConfig::new(stage),
                    )
                    .map_err(|e| err(&e))?;
                    chunks = z.model().clone();
                    Some(z)
                }
            };
            let mut result = HarnessResult::default();
            for s in 0..steps {
                let (ids, targets) = batches.rows(s, dp_rank * rows, rows, &device);
                let t = batches.seq;
                let inputs = split_batch(ids.float().reshape([rows, t, 1]), m);
                let targets_mb: Vec<Tensor<2, Int>> = microbatch_sizes(rows, m)
                    .into_iter()
                    .scan(0, |start, len| {
                        let piece = targets.clone().narrow(0, *start, len);
                        *start += len;
                        Some(piece)
                    })
                    .collect();
                let mut stage = BurnStage::new(
                    chunks,
                    &schedule,
                    pp_rank,
                    device.clone(),
                    microbatch_weights(rows, m),
                )
                .with_inputs(inputs)
                .with_loss(|mb, logits| cross_entropy(logits, targets_mb[mb].clone()));
                run_schedule(&pp_group, &schedule, &mut stage).map_err(|e| err(&e))?;
                let (done, grads, loss) = stage.finish();
                // Average the gradients over dp: all-reduced here, or by ZeRO (which keeps
                // its shard of them); host copies per piece where they are needed.
                let host = match zero.as_mut() {
                    None => {
                        let mut grads = all_reduce_grads(&dp_group, &done, grads, ReduceOp::Avg)
                            .map_err(|e| err(&e))?;
                        host_grads(&done, &mut grads)
                    }
                    Some(z) => {
                        z.reduce_gradients(grads).map_err(|e| err(&e))?;
                        if s == 0 {
                            let full = z.full_gradients().map_err(|e| err(&e))?;
                            let flat: Vec<f32> = full.into_iter().flat_map(|(_, g)| g).collect();
                            split_by_piece(&done, &flat)
                        } else {
                            Vec::new()
                        }
                    }
                };
                // The global loss: the mean of the replicas' losses (last stages only, every
                // tp rank of them holding the same value).
                let mut global = [loss.unwrap_or(0.0) as f32 / (dp * tp) as f32];
                pg.all_reduce(&mut global, ReduceOp::Sum)
                    .map_err(|e| err(&e))?;
                result.losses.push(global[0]);
                if s == 0 {
                    let mut flat = scatter(&done, &|c, j| host[c][j].clone())?;
                    pg.all_reduce(&mut flat, ReduceOp::Sum)
                        .map_err(|e| err(&e))?;
                    let mut at = 0;
                    for p in &infos {
                        result
                            .grad0
                            .insert(p.path.clone(), flat[at..at + p.numel()].to_vec());
                        at += p.numel();
                    }
                }
                chunks = match zero.as_mut() {
                    None => sgd(done, &host, lr as f32),
                    Some(z) => {
                        z.step(lr).map_err(|e| err(&e))?;
                        z.model().clone()
                    }
                };
            }
            let mut flat = scatter(&chunks, &|c, j| {
                let piece = &chunks[c][j];
                params::flatten_values(piece, &params::inventory(piece))
            })?;
            pg.all_reduce(&mut flat, ReduceOp::Sum)
                .map_err(|e| err(&e))?;
            let mut at = 0;
            for p in &infos {
                result.params.insert(
                    p.path.clone(),
                    (p.shape.clone(), flat[at..at + p.numel()].to_vec()),
                );
                at += p.numel();
            }
            Ok(result)
        })
        .map_err(|e| e.to_string())?;
    outcomes.into_iter().next().expect("rank 0")
}
