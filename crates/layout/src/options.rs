//! The options of the axes and of the whole layout: [`TpOptions`], [`PpOptions`],
//! [`Recompute`].

use crate::ScheduleKind;
use std::fmt;

/// Options of the tp axis.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct TpOptions {
    /// Norms and position tables on sequence shards, activations between layers sharded
    /// along the sequence (Megatron-SP).
    pub sequence_parallel: bool,
    /// The head's logits stay vocabulary-sharded and the loss is computed on the shards.
    pub loss_parallel: bool,
}

/// Options of the pp axis.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct PpOptions {
    /// The schedule (required with pp > 1).
    pub schedule: Option<ScheduleKind>,
    /// Micro-batches per step (default: the pp degree).
    pub microbatches: Option<usize>,
    /// Where stages begin, as module paths of the model's pipeline pieces (e.g.
    /// `["blocks.2"]`); default: pieces split evenly, or balanced by `piece_costs`.
    pub split_points: Option<Vec<String>>,
    /// Each pipeline piece's cost (a model's forward FLOPs per token of each,
    /// `bonfire_plan::ModelSpec::piece_costs`): the stages are cut where the busiest rank
    /// carries the least ([`crate::balanced_split_points`]) instead of evenly by count.
    pub piece_costs: Option<Vec<u64>>,
}

impl PpOptions {
    /// Where `pieces` pipeline pieces are cut into the stages of `kind` on `pp` ranks when no
    /// split points name the cut: balanced by [`Self::piece_costs`] when there is one cost a
    /// piece, evenly otherwise (the trainer checks the count first).
    pub fn default_split(&self, pieces: usize, kind: ScheduleKind, pp: usize) -> Vec<usize> {
        match &self.piece_costs {
            Some(costs) if costs.len() == pieces => {
                let costs: Vec<f64> = costs.iter().map(|&c| c as f64).collect();
                crate::balanced_split_points(&costs, kind, pp)
            }
            _ => crate::even_split_points(pieces, pp * kind.chunks()),
        }
    }
}

/// Which layers recompute their activations in backward instead of keeping them
/// (activation checkpointing), counted over the model's checkpointable layers (the GPT's
/// transformer blocks) in order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Recompute {
    /// Every activation is kept.
    #[default]
    Off,
    /// Layers 0, k, 2k, … recompute (`Every(1)`: every layer).
    Every(usize),
}

impl Recompute {
    /// Whether checkpointable layer `i` recomputes.
    pub fn applies_to(&self, i: usize) -> bool {
        match *self {
            Recompute::Off => false,
            Recompute::Every(k) => k > 0 && i.is_multiple_of(k),
        }
    }
    /// Whether any layer recomputes.
    pub fn is_on(&self) -> bool {
        matches!(*self, Recompute::Every(k) if k > 0)
    }
}

impl fmt::Display for Recompute {
    /// `off`, `every` (every layer) or `every-k`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Recompute::Off | Recompute::Every(0) => f.write_str("off"),
            Recompute::Every(1) => f.write_str("every"),
            Recompute::Every(k) => write!(f, "every-{k}"),
        }
    }
}
