//! What [`Classifier`] needs to be trained by `bonfire-train` with DDP or ZeRO: its loss on a
//! batch. That is all — no change to the model's code. (Tensor parallelism would add a plan
//! over `burn::nn` layers replaced by `bonfire_tp`'s parallel-aware ones, and
//! pipeline parallelism the model cut into pieces: see docs/train.md.)

use super::model::Classifier;
use bonfire_parallel::ParallelModel;
use burn::tensor::{Int, Tensor};

impl ParallelModel for Classifier {
    /// Inputs `[B, features]` and labels `[B]`.
    type Batch = (Tensor<2>, Tensor<1, Int>);

    fn loss(&self, (x, labels): Self::Batch) -> Tensor<1> {
        Classifier::loss(self, x, labels)
    }
}
