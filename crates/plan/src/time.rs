//! Step time. Collectives by the ring algorithm's α–β cost ([`all_reduce`],
//! [`all_gather`] — reduce-scatter costs the same —, [`p2p`]) on the link a group crosses;
//! compute from FLOPs at the device's sustained rate; the pipeline's bubble by its schedule;
//! data-parallel communication hidden behind backward up to the cluster's overlap fraction;
//! the optimizer step bound by memory bandwidth.

use crate::cluster::LinkSpec;

/// Seconds for a ring all-reduce of `bytes` over `n` ranks: `2(n−1)/n · bytes/B + 2(n−1)·α`.
pub fn all_reduce(bytes: f64, n: usize, link: &LinkSpec) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let k = (n - 1) as f64;
    2.0 * k / n as f64 * bytes / link.bandwidth + 2.0 * k * link.latency
}

/// Seconds for a ring all-gather (or reduce-scatter) whose whole result is `bytes`:
/// `(n−1)/n · bytes/B + (n−1)·α`.
pub fn all_gather(bytes: f64, n: usize, link: &LinkSpec) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let k = (n - 1) as f64;
    k / n as f64 * bytes / link.bandwidth + k * link.latency
}

/// Seconds to send `bytes` to one peer.
pub fn p2p(bytes: f64, link: &LinkSpec) -> f64 {
    bytes / link.bandwidth + link.latency
}

/// A step's predicted time, by part, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTime {
    /// Forward, backward and recomputation of the slowest pipeline rank, all micro-batches.
    pub compute: f64,
    /// Idle time of the pipeline's fill and drain.
    pub bubble: f64,
    /// Tensor-parallel collectives (on the critical path).
    pub tp_comm: f64,
    /// Pipeline sends between stages.
    pub pp_comm: f64,
    /// Data-parallel (DDP / ZeRO) communication not hidden behind backward.
    pub dp_comm: f64,
    /// The optimizer step.
    pub optimizer: f64,
    /// Data-parallel communication hidden behind compute (not in the total: it breaks ties —
    /// of two equally fast layouts, the one that moves less is the safer bet).
    pub dp_hidden: f64,
}

impl StepTime {
    pub fn total(&self) -> f64 {
        self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm + self.optimizer
    }

    /// The largest part's name and seconds.
    pub fn bound(&self) -> (&'static str, f64) {
        [
            ("compute", self.compute),
            ("pipeline bubble", self.bubble),
            ("tensor-parallel communication", self.tp_comm),
            ("pipeline communication", self.pp_comm),
            ("data-parallel communication", self.dp_comm),
            ("optimizer step", self.optimizer),
        ]
        .into_iter()
        .fold(("compute", f64::MIN), |a, b| if b.1 > a.1 { b } else { a })
    }
}
