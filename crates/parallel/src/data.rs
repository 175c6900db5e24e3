//! A model's batches: [`Rows`] (a batch cut by rows, for data-parallel replicas and
//! pipeline micro-batches), [`DataSource`] (where the global batch of a step comes from) and
//! [`Replica`] (which rows of it a data-parallel replica trains on).

use burn::tensor::kind::Basic;
use burn::tensor::{Device, Tensor};
use std::ops::Range;

/// A batch that can be cut by rows (dimension 0): each data-parallel replica takes its rows,
/// each pipeline micro-batch a part of those.
pub trait Rows: Clone + Send + 'static {
    /// Number of rows.
    fn rows(&self) -> usize;
    /// Rows `start .. start + len`.
    fn narrow_rows(&self, start: usize, len: usize) -> Self;
}

impl<const D: usize, K: Basic + 'static> Rows for Tensor<D, K>
where
    Tensor<D, K>: Send,
{
    fn rows(&self) -> usize {
        self.dims()[0]
    }
    fn narrow_rows(&self, start: usize, len: usize) -> Self {
        self.clone().narrow(0, start, len)
    }
}

impl<A: Rows, B: Rows> Rows for (A, B) {
    fn rows(&self) -> usize {
        self.0.rows()
    }
    fn narrow_rows(&self, start: usize, len: usize) -> Self {
        (
            self.0.narrow_rows(start, len),
            self.1.narrow_rows(start, len),
        )
    }
}

/// Where batches come from: the *global* batch of step `step`, created on `device`, and each
/// data-parallel replica's rows of it. Every rank must see the same global batch for the same
/// step.
pub trait DataSource<B> {
    /// The global batch of step `step`, created on `device`.
    fn batch(&self, step: usize, device: &Device) -> B;

    /// Replica `replica`'s rows of the global batch of `step` — what the training loop asks
    /// for. By default the global batch, cut; a source that can read rows alone (a token
    /// file) reads only these.
    fn replica_batch(&self, step: usize, replica: Replica, device: &Device) -> B
    where
        B: Rows,
    {
        let batch = self.batch(step, device);
        let rows = replica.rows(batch.rows());
        batch.narrow_rows(rows.start, rows.len())
    }
}

/// One data-parallel replica of `count`: which rows of a global batch it trains on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replica {
    /// The replica's index on the dp axis.
    pub index: usize,
    /// The number of replicas (dp).
    pub count: usize,
}

impl Replica {
    /// The whole batch: one replica.
    pub const WHOLE: Replica = Replica { index: 0, count: 1 };

    /// Its rows of a global batch of `rows` rows: an equal share, in replica order.
    ///
    /// # Panics
    /// If `count` does not divide `rows` (the trainer checks the batch before building).
    pub fn rows(&self, rows: usize) -> Range<usize> {
        assert!(
            self.count > 0 && rows.is_multiple_of(self.count),
            "a global batch of {rows} rows does not split over {} replicas",
            self.count
        );
        let per = rows / self.count;
        self.index * per..(self.index + 1) * per
    }
}

impl<B, F: Fn(usize, &Device) -> B> DataSource<B> for F {
    fn batch(&self, step: usize, device: &Device) -> B {
        self(step, device)
    }
}
