//! What a rank really computed in: a per-thread record of the dtypes its layers ran with and
//! its gradient reductions reduced in, so that a test can see a [`super::MixedPrecision`]
//! policy in force rather than only its effect on the numbers.
//!
//! Every record is a handful of counters per thread (one atomic add per tensor seen):
//!
//! - **params** — each parameter value a parallel-aware layer
//!   (`bonfire_tp::ParallelLinear`, `ParallelLayerNorm`, `ParallelRmsNorm`,
//!   `ParallelEmbedding`) computes with in `forward`: the compute copy, after whatever a
//!   wrapper did to it (DDP's cast replica, ZeRO's half-precision model or stage 3's gathered
//!   value, the tensor-parallel shard).
//! - **activations** — each float input such a layer receives in `forward`.
//! - **reduced** — each gradient buffer a data-parallel wrapper hands to its reduction: DDP's
//!   buckets, ZeRO 0–1's packed vector and stage 2's buckets, and for stage 3 the piece each
//!   gather starts from, whose dtype is the one its backward reduce-scatters the gradient in.
//!
//! Ranks as threads each record on their own thread, so tests running side by side in one
//! binary do not mix; a helper thread records into its rank's record through [`observer`].

use burn::tensor::DType;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// How many tensors of each float dtype a record saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DtypeCounts {
    /// Tensors in f32.
    pub f32: u64,
    /// Tensors in bf16.
    pub bf16: u64,
    /// Tensors in f16.
    pub f16: u64,
    /// Any other dtype.
    pub other: u64,
}

impl DtypeCounts {
    /// Tensors seen, of every dtype.
    pub fn total(&self) -> u64 {
        self.f32 + self.bf16 + self.f16 + self.other
    }

    /// Tensors seen in `dtype`.
    pub fn of(&self, dtype: DType) -> u64 {
        match dtype {
            DType::F32 => self.f32,
            DType::BF16 => self.bf16,
            DType::F16 => self.f16,
            _ => self.other,
        }
    }

    /// Whether at least one tensor was seen and every one was in `dtype`.
    pub fn only(&self, dtype: DType) -> bool {
        self.of(dtype) > 0 && self.of(dtype) == self.total()
    }

    fn minus(&self, earlier: &DtypeCounts) -> DtypeCounts {
        DtypeCounts {
            f32: self.f32 - earlier.f32,
            bf16: self.bf16 - earlier.bf16,
            f16: self.f16 - earlier.f16,
            other: self.other - earlier.other,
        }
    }
}

/// A snapshot of one thread's record (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Observed {
    /// Parameter values the parallel-aware layers computed with.
    pub params: DtypeCounts,
    /// Float inputs those layers received.
    pub activations: DtypeCounts,
    /// Gradient buffers handed to a data-parallel reduction.
    pub reduced: DtypeCounts,
}

impl Observed {
    /// What was recorded after `earlier` (a snapshot of the same thread).
    pub fn since(&self, earlier: &Observed) -> Observed {
        Observed {
            params: self.params.minus(&earlier.params),
            activations: self.activations.minus(&earlier.activations),
            reduced: self.reduced.minus(&earlier.reduced),
        }
    }
}

/// Counters: [params, activations, reduced] × [f32, bf16, f16, other].
#[derive(Default)]
struct Tally([[AtomicU64; 4]; 3]);

const PARAMS: usize = 0;
const ACTIVATIONS: usize = 1;
const REDUCED: usize = 2;

/// A thread's record, shareable with the helper threads working for it.
#[derive(Clone, Default)]
pub struct PrecisionObserver(Arc<Tally>);

impl std::fmt::Debug for PrecisionObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.observed().fmt(f)
    }
}

impl PrecisionObserver {
    fn add(&self, what: usize, dtype: DType) {
        let slot = match dtype {
            DType::F32 => 0,
            DType::BF16 => 1,
            DType::F16 => 2,
            _ => 3,
        };
        self.0.0[what][slot].fetch_add(1, Ordering::Relaxed);
    }

    /// A parameter value a layer computes with.
    pub fn param(&self, dtype: DType) {
        self.add(PARAMS, dtype);
    }

    /// A float input a layer receives.
    pub fn activation(&self, dtype: DType) {
        self.add(ACTIVATIONS, dtype);
    }

    /// A gradient buffer handed to a data-parallel reduction.
    pub fn reduced(&self, dtype: DType) {
        self.add(REDUCED, dtype);
    }

    /// The counts so far.
    pub fn observed(&self) -> Observed {
        let counts = |what: usize| {
            let c = &self.0.0[what];
            let n = |slot: usize| c[slot].load(Ordering::Relaxed);
            DtypeCounts {
                f32: n(0),
                bf16: n(1),
                f16: n(2),
                other: n(3),
            }
        };
        Observed {
            params: counts(PARAMS),
            activations: counts(ACTIVATIONS),
            reduced: counts(REDUCED),
        }
    }
}

thread_local! {
    static OBSERVER: PrecisionObserver = PrecisionObserver::default();
}

/// This thread's record (clone it into a helper thread that works for this rank).
pub fn observer() -> PrecisionObserver {
    OBSERVER.with(PrecisionObserver::clone)
}

/// What this thread has recorded so far; [`Observed::since`] an earlier snapshot gives one
/// run's share.
pub fn observed() -> Observed {
    OBSERVER.with(PrecisionObserver::observed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_per_thread() {
        let before = observed();
        observer().param(DType::BF16);
        observer().activation(DType::BF16);
        let helper = observer();
        std::thread::spawn(move || {
            helper.reduced(DType::F32);
            // The helper's own record is another thread's.
            observer().reduced(DType::F16);
        })
        .join()
        .unwrap();
        let got = observed().since(&before);
        assert!(got.params.only(DType::BF16) && got.activations.only(DType::BF16));
        assert!(got.reduced.only(DType::F32), "{got:?}");
        assert!(!got.params.only(DType::F32));
        assert!(
            !DtypeCounts::default().only(DType::F32),
            "nothing seen is no pass"
        );
    }
}
