//! A language model's training data: your own text or token files packed into sequences by
//! `bonfire-data`, or the generated corpus (the zero-setup default), as a [`DataSource`]
//! whose replicas each read only their own rows (`train`'s `--data`, `--eval-data`).

use super::{Batches, TokenBatch};
use bonfire_data::generated::{self, CharTokenizer};
use bonfire_data::{PackedSequences, TokenFile, Tokenizer};
use bonfire_parallel::{DataSource, Replica, Rows};
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::path::Path;

/// Where a run's batches come from; `rows` sequences of `seq` tokens a step.
pub enum TrainData {
    /// The generated corpus ([`generated::generate`], [`CharTokenizer`]): random windows drawn
    /// from (seed, step).
    Generated {
        /// The corpus' tokens.
        tokens: Vec<i64>,
        /// Sequences per step.
        rows: usize,
        /// Tokens per sequence.
        seq: usize,
        /// The draws' seed.
        seed: u64,
    },
    /// Tokens packed into non-overlapping sequences in a seeded per-epoch shuffle: step `s`
    /// is positions `s · rows ..` of the stream of epochs, so a replica reads its rows alone
    /// and a resumed run continues the stream exactly.
    Packed {
        /// The sequences.
        sequences: PackedSequences,
        /// Sequences per step.
        rows: usize,
        /// What the data is, for the run's record and messages.
        label: String,
    },
}

impl TrainData {
    /// The generated corpus: about 400 000 characters from `seed`.
    pub fn generated(rows: usize, seq: usize, seed: u64) -> Self {
        let tokens = CharTokenizer.encode(&generated::generate(400_000, seed));
        Self::Generated {
            tokens,
            rows,
            seq,
            seed,
        }
    }

    /// The tokens of `path` for a model of `vocab_size` tokens, packed into sequences of
    /// `seq` and shuffled from `seed`: a `*.bin` token file (nanoGPT's or llm.c's, its ids
    /// checked against the vocabulary), or text — a file, or a directory of them — tokenized
    /// with `tokenizer` (needed for text) and cached beside it. One clear error for a missing
    /// file, a token outside the vocabulary, a tokenizer larger than the model's vocabulary,
    /// or data shorter than one sequence.
    pub fn packed(
        path: &Path,
        tokenizer: Option<&Tokenizer>,
        vocab_size: usize,
        rows: usize,
        seq: usize,
        seed: u64,
    ) -> Result<Self, String> {
        let is_tokens = path.extension().is_some_and(|e| e == "bin") && !path.is_dir();
        let tokens = match tokenizer {
            Some(t) if t.vocab_size() > vocab_size => {
                return Err(format!(
                    "--tokenizer {}: {} tokens, more than the model's vocabulary of {vocab_size}",
                    t.path().display(),
                    t.vocab_size()
                ));
            }
            Some(t) => bonfire_data::load_tokens(path, t).map_err(|e| e.to_string())?,
            None if is_tokens => TokenFile::open(path, vocab_size).map_err(|e| e.to_string())?,
            None => {
                return Err(format!(
                    "{}: text needs --tokenizer tokenizer.json (a `*.bin` token file does not)",
                    path.display()
                ));
            }
        };
        let count = tokens.len();
        let sequences = PackedSequences::new(tokens, seq, seed).map_err(|e| e.to_string())?;
        Ok(Self::Packed {
            sequences,
            rows,
            label: format!("{} ({count} tokens)", path.display()),
        })
    }

    /// The same data at `rows` sequences a step (a resumed run's global batch).
    pub fn with_rows(mut self, global_rows: usize) -> Self {
        match &mut self {
            Self::Generated { rows, .. } | Self::Packed { rows, .. } => *rows = global_rows,
        }
        self
    }

    /// What the data is: `generated`, or the file and its token count.
    pub fn label(&self) -> String {
        match self {
            Self::Generated { .. } => "generated".into(),
            Self::Packed { label, .. } => label.clone(),
        }
    }

    /// The number of tokens of the data (the generated corpus: one per character).
    pub fn tokens(&self) -> usize {
        match self {
            Self::Generated { tokens, .. } => tokens.len(),
            Self::Packed { sequences, .. } => sequences.tokens().len(),
        }
    }

    /// The number of sequences of an epoch (`None` for the generated corpus, which draws).
    pub fn sequences(&self) -> Option<usize> {
        match self {
            Self::Generated { .. } => None,
            Self::Packed { sequences, .. } => Some(sequences.len()),
        }
    }

    /// Whether the batches come from the generated corpus.
    pub fn is_generated(&self) -> bool {
        matches!(self, Self::Generated { .. })
    }

    /// Where step `step` starts in the data: `(epoch, position)` (`None` when generated).
    pub fn position(&self, step: usize) -> Option<(usize, usize)> {
        match self {
            Self::Generated { .. } => None,
            Self::Packed {
                sequences, rows, ..
            } => Some(sequences.position(step, *rows)),
        }
    }
}

impl DataSource<TokenBatch> for TrainData {
    fn batch(&self, step: usize, device: &Device) -> TokenBatch {
        self.replica_batch(step, Replica::WHOLE, device)
    }

    fn replica_batch(&self, step: usize, replica: Replica, device: &Device) -> TokenBatch
    where
        TokenBatch: Rows,
    {
        match self {
            Self::Generated {
                tokens,
                rows,
                seq,
                seed,
            } => {
                let batch = generated_batch(tokens, *rows, *seq, *seed, step, device);
                let mine = replica.rows(*rows);
                batch.narrow_rows(mine.start, mine.len())
            }
            Self::Packed {
                sequences, rows, ..
            } => {
                let mine = replica.rows(*rows);
                let n = mine.len();
                let (ids, targets) = sequences.batch(step, *rows, mine);
                let make = |v: Vec<i64>| {
                    let shape = [n, sequences.seq_len()];
                    Tensor::<2, Int>::from_data(TensorData::new(v, shape), device)
                };
                (make(ids), make(targets))
            }
        }
    }
}

/// The global batch of step `step` of the generated corpus' `tokens`: `rows` windows of
/// `seq` drawn from (`seed`, `step`) ([`generated::step_windows`]).
pub fn generated_batch(
    tokens: &[i64],
    rows: usize,
    seq: usize,
    seed: u64,
    step: usize,
    device: &Device,
) -> TokenBatch {
    let (ids, targets) = generated::step_windows(tokens, rows, seq, seed, step);
    Batches::new(ids, targets, [1, rows, seq]).rows(0, 0, rows, device)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each replica's rows, read alone, are its share of the global batch, for packed and
    /// generated data.
    #[test]
    fn replicas_read_their_rows_of_the_global_batch() {
        let device = Device::flex().autodiff();
        let tokens: Vec<u32> = (0..500).map(|i| (i * 7 % 31) as u32).collect();
        let packed = TrainData::Packed {
            sequences: PackedSequences::new(tokens, 5, 3).unwrap(),
            rows: 6,
            label: "test".into(),
        };
        for data in [packed, TrainData::generated(6, 5, 1)] {
            for step in [0, 3, 40] {
                let whole = bonfire_module::params::to_host(
                    data.batch(step, &device).0.float().reshape([30]),
                );
                let parts: Vec<f32> = (0..3)
                    .flat_map(|index| {
                        let (ids, _) =
                            data.replica_batch(step, Replica { index, count: 3 }, &device);
                        assert_eq!(ids.dims(), [2, 5]);
                        bonfire_module::params::to_host(ids.float().reshape([10]))
                    })
                    .collect();
                assert_eq!(parts, whole, "{} step {step}", data.label());
            }
        }
    }
}
