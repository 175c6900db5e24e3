//! Token batches of the language models ([`TokenBatch`]): the harness's `batch.safetensors` (`input_ids`, `targets`, int64
//! `[S, B, T']`) and their per-rank row slices; [`pattern_batch`], a batch from a fixed rule
//! for the memory benches and tests; [`TrainData`], a run's data (your text or token files, or
//! the generated corpus) as a source of batches.

mod train;

pub use train::{TrainData, generated_batch};

use crate::tensor_file::{self, HostTensor};
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::path::Path;

/// A batch of a language model: token ids and targets, `[B, T]` each.
pub type TokenBatch = (Tensor<2, Int>, Tensor<2, Int>);

/// `S` steps of `B × T'` token ids and targets.
#[derive(Debug, Clone)]
pub struct Batches {
    /// Input token ids, row-major `[S, B, T']`.
    pub input_ids: Vec<i64>,
    /// Target token ids, row-major `[S, B, T']`.
    pub targets: Vec<i64>,
    /// Number of steps `S` (also [`Batches::steps`]).
    pub steps_: usize,
    /// Sequences per step `B` (the global batch).
    pub batch: usize,
    /// Tokens per sequence `T'`.
    pub seq: usize,
}

impl Batches {
    /// Wraps `[S, B, T]` row-major ids and targets.
    pub fn new(input_ids: Vec<i64>, targets: Vec<i64>, shape: [usize; 3]) -> Self {
        let [steps_, batch, seq] = shape;
        assert_eq!(input_ids.len(), steps_ * batch * seq);
        assert_eq!(targets.len(), input_ids.len());
        Self {
            input_ids,
            targets,
            steps_,
            batch,
            seq,
        }
    }

    /// Number of steps `S`.
    pub fn steps(&self) -> usize {
        self.steps_
    }

    /// Rows `first .. first + n` of step `s`, as `[n, T]` int tensors.
    pub fn rows(
        &self,
        s: usize,
        first: usize,
        n: usize,
        device: &Device,
    ) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let start = (s * self.batch + first) * self.seq;
        let end = start + n * self.seq;
        let make = |v: &[i64]| {
            Tensor::<2, Int>::from_data(
                TensorData::new(v[start..end].to_vec(), [n, self.seq]),
                device,
            )
        };
        (make(&self.input_ids), make(&self.targets))
    }
}

/// Reads a harness data file and checks it against a model of `vocab_size` tokens and
/// sequences of at most `max_seq_len`.
pub fn load_batches(
    path: impl AsRef<Path>,
    vocab_size: usize,
    max_seq_len: usize,
) -> Result<Batches, String> {
    let path = path.as_ref();
    let mut tensors = tensor_file::read(path)?;
    let mut take = |name: &str| match tensors.remove(name) {
        Some(HostTensor::I64 { shape, data }) if shape.len() == 3 => Ok((shape, data)),
        Some(t) => Err(format!(
            "{}: `{name}` must be int64 [S, B, T'], found {:?}",
            path.display(),
            t.shape()
        )),
        None => Err(format!("{}: no tensor `{name}`", path.display())),
    };
    let (shape, ids) = take("input_ids")?;
    let (tshape, targets) = take("targets")?;
    if shape != tshape {
        return Err(format!(
            "{}: input_ids {shape:?} and targets {tshape:?} differ in shape",
            path.display()
        ));
    }
    if shape[2] > max_seq_len {
        return Err(format!(
            "{}: sequence length {} exceeds the model's longest sequence {max_seq_len}",
            path.display(),
            shape[2],
        ));
    }
    let bad = ids
        .iter()
        .chain(&targets)
        .find(|&&t| t < 0 || t as usize >= vocab_size);
    if let Some(t) = bad {
        return Err(format!(
            "{}: token {t} is outside the vocabulary 0..{vocab_size}",
            path.display(),
        ));
    }
    Ok(Batches::new(ids, targets, [shape[0], shape[1], shape[2]]))
}

/// The global batch of `step`, `rows` sequences of `seq` tokens (inputs, targets) from a
/// fixed rule — no randomness, the same on every rank and run (the memory bench and the
/// planner's validation, where only shapes matter).
pub fn pattern_batch(
    vocab: usize,
    rows: usize,
    seq: usize,
    step: usize,
    device: &Device,
) -> TokenBatch {
    let make = |a: usize, b: usize| {
        let v: Vec<i64> = (0..rows * seq)
            .map(|i| ((i * a + step * b + 1) % vocab) as i64)
            .collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [rows, seq]), device)
    };
    (make(31, 7), make(17, 3))
}
