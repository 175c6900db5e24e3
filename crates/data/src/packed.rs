//! Tokens packed into training sequences, shuffled per epoch, read by step and by row.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use crate::{DataError, Tokens};

/// Tokens cut into non-overlapping training sequences of `seq_len`, in a seeded shuffle per
/// epoch.
///
/// Sequence `i` is tokens `[i·seq_len, i·seq_len + seq_len + 1)`: its inputs are the first
/// `seq_len`, its targets the last `seq_len` (the inputs shifted by one). The windows do not
/// overlap except for that one token; the tokens after the last whole window are dropped.
///
/// The sequences are read as one stream of epochs: epoch `e` is every sequence once, in the
/// order [`PackedSequences::order`]`(e)`, a Fisher–Yates shuffle driven by SplitMix64 seeded
/// from `(seed, e)`. The global batch of step `s` is positions `s·B .. (s+1)·B` of that
/// stream (crossing into the next epoch where it ends), so a run resumed at step `s` reads
/// exactly what it would have, and a data-parallel replica can read its own rows alone.
#[derive(Debug)]
pub struct PackedSequences {
    tokens: Tokens,
    seq_len: usize,
    seed: u64,
    len: usize,
    /// The orders of the last epochs asked for (most recent last), to share between calls.
    orders: Mutex<Vec<(usize, Arc<[usize]>)>>,
}

/// How many epoch orders are kept: a batch spans at most two epochs unless it is larger
/// than an epoch.
const KEPT_ORDERS: usize = 2;

impl PackedSequences {
    /// Packs `tokens` (a [`crate::TokenFile`] or a `Vec<u32>`) into sequences of `seq_len`,
    /// shuffled from `seed`. Fewer than `seq_len + 1` tokens is an error saying how many
    /// there are and how many one sequence needs.
    pub fn new(tokens: impl Into<Tokens>, seq_len: usize, seed: u64) -> Result<Self, DataError> {
        let tokens = tokens.into();
        if seq_len == 0 {
            return Err(DataError::ZeroSeqLen);
        }
        let needed = seq_len + 1;
        if tokens.len() < needed {
            return Err(DataError::TooShort {
                tokens: tokens.len(),
                seq_len,
                needed,
            });
        }
        // Window i needs i·seq_len + seq_len + 1 <= n tokens.
        let len = (tokens.len() - 1) / seq_len;
        Ok(PackedSequences {
            tokens,
            seq_len,
            seed,
            len,
            orders: Mutex::new(Vec::new()),
        })
    }

    /// The number of sequences (in each epoch).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: construction refuses data shorter than one sequence.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The length of each sequence's inputs (and targets).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The seed of the shuffles.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The tokens packed.
    pub fn tokens(&self) -> &Tokens {
        &self.tokens
    }

    /// The inputs and targets of sequence `index` (in file order, not shuffled).
    ///
    /// # Panics
    /// If `index >= self.len()`.
    pub fn sequence(&self, index: usize) -> (Vec<i64>, Vec<i64>) {
        assert!(
            index < self.len,
            "sequence {index} of {} sequences",
            self.len
        );
        let mut inputs = Vec::with_capacity(self.seq_len);
        let mut targets = Vec::with_capacity(self.seq_len);
        self.push_sequence(index, &mut inputs, &mut targets);
        (inputs, targets)
    }

    /// The order of epoch `epoch`: `order[k]` is the sequence at position `k` of the epoch,
    /// a permutation of `0..len()`.
    pub fn order(&self, epoch: usize) -> Arc<[usize]> {
        let mut orders = self.orders.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, order)) = orders.iter().find(|(e, _)| *e == epoch) {
            return order.clone();
        }
        let order: Arc<[usize]> = shuffle(self.len, self.seed, epoch).into();
        if orders.len() == KEPT_ORDERS {
            orders.remove(0);
        }
        orders.push((epoch, order.clone()));
        order
    }

    /// Where step `step` of global batch `global_batch` starts in the stream of epochs: the
    /// epoch and the position in it of its first sequence.
    ///
    /// # Panics
    /// If `global_batch` is 0, or `step · global_batch` overflows `usize`.
    pub fn position(&self, step: usize, global_batch: usize) -> (usize, usize) {
        let first = self.first(step, global_batch);
        (first / self.len, first % self.len)
    }

    /// Rows `rows` of the global batch of step `step` (of `global_batch` sequences): inputs
    /// and targets, each row-major `[rows.len(), seq_len]`. Row `r` is the sequence at
    /// position `step · global_batch + r` of the stream of epochs. A data-parallel replica
    /// asks for its own rows (`rank · B/dp .. (rank + 1) · B/dp`); the replicas' rows together
    /// are the whole batch.
    ///
    /// # Panics
    /// If `global_batch` is 0, `rows` does not lie in `0..global_batch`, or
    /// `step · global_batch` overflows `usize`.
    pub fn batch(
        &self,
        step: usize,
        global_batch: usize,
        rows: Range<usize>,
    ) -> (Vec<i64>, Vec<i64>) {
        assert!(
            rows.start <= rows.end && rows.end <= global_batch,
            "rows {rows:?} of a global batch of {global_batch}"
        );
        let first = self.first(step, global_batch);
        let mut inputs = Vec::with_capacity(rows.len() * self.seq_len);
        let mut targets = Vec::with_capacity(rows.len() * self.seq_len);
        let mut current: Option<(usize, Arc<[usize]>)> = None;
        for row in rows {
            let position = first
                .checked_add(row)
                .expect("the stream position overflows usize");
            let (epoch, index) = (position / self.len, position % self.len);
            let order = match &current {
                Some((e, order)) if *e == epoch => order.clone(),
                _ => {
                    let order = self.order(epoch);
                    current = Some((epoch, order.clone()));
                    order
                }
            };
            self.push_sequence(order[index], &mut inputs, &mut targets);
        }
        (inputs, targets)
    }

    fn first(&self, step: usize, global_batch: usize) -> usize {
        assert!(global_batch > 0, "a global batch of 0 sequences");
        step.checked_mul(global_batch)
            .unwrap_or_else(|| panic!("step {step} × global batch {global_batch} overflows usize"))
    }

    fn push_sequence(&self, index: usize, inputs: &mut Vec<i64>, targets: &mut Vec<i64>) {
        let start = index * self.seq_len;
        self.tokens.extend_i64(start..start + self.seq_len, inputs);
        self.tokens
            .extend_i64(start + 1..start + self.seq_len + 1, targets);
    }
}

/// SplitMix64's output function: a bijective mix of 64 bits.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64 (Steele, Lea, Flood 2014; Vigna's reference `splitmix64.c`).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }

    /// Uniform in `0..n` (`n > 0`), without bias: Lemire's multiply-and-reject.
    fn below(&mut self, n: u64) -> u64 {
        let mut m = u128::from(self.next()) * u128::from(n);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next()) * u128::from(n);
            }
        }
        (m >> 64) as u64
    }
}

/// The Fisher–Yates permutation of `0..len` for epoch `epoch` of `seed`. The generator's
/// state is the seed and the epoch mixed twice, so that the epochs' streams are unrelated
/// (not one stream shifted).
fn shuffle(len: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut rng = SplitMix64(mix64(mix64(seed) ^ epoch as u64));
    let mut order: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference() {
        // Vigna's splitmix64.c from the state 1234567.
        let mut rng = SplitMix64(1234567);
        let got: Vec<u64> = (0..5).map(|_| rng.next()).collect();
        assert_eq!(
            got,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423,
                4593380528125082431,
                16408922859458223821
            ]
        );
    }

    #[test]
    fn below_stays_below_and_hits_every_value() {
        let mut rng = SplitMix64(7);
        let mut seen = [0usize; 7];
        for _ in 0..700 {
            seen[rng.below(7) as usize] += 1; // out of bounds if a value is 7 or more
        }
        assert!(seen.iter().all(|&c| c > 0), "{seen:?}");
        // n = 1 is always 0; a power of two never rejects.
        assert_eq!(rng.below(1), 0);
        assert!(rng.below(1 << 63) < 1 << 63);
    }

    /// The shuffle is part of the format of a run: a run resumed after an upgrade must read
    /// what it would have. This pins it (the values were also computed by a separate Python
    /// transcription of splitmix64 + Lemire + Fisher–Yates).
    #[test]
    fn the_shuffle_is_pinned() {
        assert_eq!(shuffle(10, 0, 0), PINNED_SEED0_EPOCH0);
        assert_eq!(shuffle(10, 0, 1), PINNED_SEED0_EPOCH1);
    }

    const PINNED_SEED0_EPOCH0: [usize; 10] = [4, 9, 2, 5, 1, 7, 6, 0, 3, 8];
    const PINNED_SEED0_EPOCH1: [usize; 10] = [9, 4, 0, 5, 2, 1, 6, 8, 3, 7];
}
