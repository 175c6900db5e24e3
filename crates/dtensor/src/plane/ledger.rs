//! The transfer ledger: every host↔device byte Bonfire moves, counted by direction and
//! reason, each device→host read (a host synchronization) counted by reason, and the payload
//! its collectives carry.
//!
//! A [`TransferLedger`] counts what the current thread — and the helper threads that join it
//! with [`LedgerHandle::enter`] (ZeRO-3's prefetcher) — moves while it is alive, like
//! [`crate::CommCounter`]. Each rank thread counts its own traffic; ledgers nest.
//!
//! A transfer is counted only where bytes cross between host memory and a device: on Burn's
//! CPU backend (`Flex`) a tensor's buffer *is* host memory, so reading it is no transfer;
//! on wgpu or CUDA every staged byte is.

use bonfire_comm::OpKind;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

/// Which way bytes crossed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    /// Read from a device into host memory.
    DeviceToHost,
    /// Written from host memory to a device.
    HostToDevice,
}

/// Why bytes crossed (or, for payload, what a collective carried).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// A collective's buffer staged through the host (the backend cannot reach the device).
    Collective,
    /// A pipeline activation or gradient crossing stages.
    Activation,
    /// Optimizer state or updates moved to or from an offload device.
    Offload,
    /// Parameters or gradients read whole for the user (compare, export, evaluate).
    Export,
    /// Checkpoint files written or read.
    Checkpoint,
    /// A loss value read for reporting.
    Report,
    /// Expert parallelism's routed token counts (its all-to-alls' sizes) and the indices
    /// built from them.
    Routing,
    /// Initial parameters drawn on the host from a seed (`bonfire_module::params::seeded`).
    Init,
}

impl Reason {
    /// The reason as one lowercase word (`collective`, `activation`…), for labels.
    pub fn name(self) -> &'static str {
        match self {
            Reason::Collective => "collective",
            Reason::Activation => "activation",
            Reason::Offload => "offload",
            Reason::Export => "export",
            Reason::Checkpoint => "checkpoint",
            Reason::Report => "report",
            Reason::Routing => "routing",
            Reason::Init => "init",
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    moved: BTreeMap<(Direction, Reason), u64>,
    reads: BTreeMap<Reason, u64>,
    payload: u64,
    carried: BTreeMap<OpKind, u64>,
}

type Shared = Arc<Mutex<Counts>>;

thread_local! {
    static ACTIVE: RefCell<Vec<Shared>> = const { RefCell::new(Vec::new()) };
}

fn each(f: impl Fn(&mut Counts)) {
    ACTIVE.with(|active| {
        for counts in active.borrow().iter() {
            f(&mut counts.lock().unwrap());
        }
    });
}

/// Records `bytes` crossing in `direction` for `reason` on every ledger of this thread.
pub fn record(direction: Direction, reason: Reason, bytes: usize) {
    if bytes > 0 {
        each(|c| {
            *c.moved.entry((direction, reason)).or_insert(0) += bytes as u64;
            if direction == Direction::DeviceToHost {
                *c.reads.entry(reason).or_insert(0) += 1;
            }
        });
    }
}

/// Records `bytes` carried by a collective on every ledger of this thread.
pub fn record_payload(bytes: usize) {
    each(|c| c.payload += bytes as u64);
}

/// Records `bytes` carried by a call of kind `op` (its whole buffer: an all-gather's gathered
/// output, a reduce-scatter's input) on every ledger of this thread: in the payload and by
/// kind ([`Transfers::carried`]).
pub fn record_carried(op: OpKind, bytes: usize) {
    each(|c| {
        c.payload += bytes as u64;
        *c.carried.entry(op).or_insert(0) += bytes as u64;
    });
}

/// Counts the transfers of this thread (and of helper threads that join it) while alive.
#[must_use = "counting stops when the ledger drops"]
pub struct TransferLedger {
    counts: Shared,
}

impl TransferLedger {
    /// Starts counting on the current thread.
    pub fn start() -> Self {
        let counts: Shared = Arc::default();
        ACTIVE.with(|a| a.borrow_mut().push(counts.clone()));
        Self { counts }
    }

    /// What was counted so far.
    pub fn snapshot(&self) -> Transfers {
        let c = self.counts.lock().unwrap();
        Transfers {
            moved: c.moved.clone(),
            reads: c.reads.clone(),
            payload: c.payload,
            by_op: c.carried.clone(),
        }
    }
}

impl Drop for TransferLedger {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.borrow_mut().retain(|c| !Arc::ptr_eq(c, &self.counts)));
    }
}

/// The ledgers active on this thread, to hand to a helper thread ([`LedgerHandle::enter`]).
pub fn current() -> LedgerHandle {
    LedgerHandle(ACTIVE.with(|a| a.borrow().clone()))
}

/// The ledgers of another thread.
#[derive(Clone, Default)]
pub struct LedgerHandle(Vec<Shared>);

impl LedgerHandle {
    /// Makes this thread count into the handle's ledgers until the guard drops.
    pub fn enter(&self) -> LedgerGuard {
        ACTIVE.with(|a| a.borrow_mut().extend(self.0.iter().cloned()));
        LedgerGuard(self.0.clone())
    }
}

/// Removes a [`LedgerHandle`]'s ledgers from the thread when dropped.
#[must_use = "the thread stops counting into the handle's ledgers when the guard drops"]
pub struct LedgerGuard(Vec<Shared>);

impl Drop for LedgerGuard {
    fn drop(&mut self) {
        ACTIVE.with(|a| {
            a.borrow_mut()
                .retain(|c| !self.0.iter().any(|d| Arc::ptr_eq(c, d)))
        });
    }
}

/// Counted transfers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transfers {
    /// Bytes moved between host and device, per direction and reason.
    pub moved: BTreeMap<(Direction, Reason), u64>,
    /// Device→host reads by reason: each one waits for the device to finish what it was
    /// asked (a host synchronization).
    pub reads: BTreeMap<Reason, u64>,
    /// Bytes carried by collectives and pipeline sends, whether staged or not.
    pub payload: u64,
    /// The part of `payload` recorded by kind of call (the data plane's and the differentiable
    /// collectives' host paths; CUDA's device collectives and the pipeline stages' own
    /// activation sends count in `payload` only).
    pub by_op: BTreeMap<OpKind, u64>,
}

impl Transfers {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &Transfers) {
        for (key, bytes) in &other.moved {
            *self.moved.entry(*key).or_insert(0) += bytes;
        }
        for (reason, n) in &other.reads {
            *self.reads.entry(*reason).or_insert(0) += n;
        }
        self.payload += other.payload;
        for (op, bytes) in &other.by_op {
            *self.by_op.entry(*op).or_insert(0) += bytes;
        }
    }
    /// Bytes carried by calls of kind `op` ([`Transfers::by_op`]).
    pub fn carried(&self, op: OpKind) -> u64 {
        self.by_op.get(&op).copied().unwrap_or(0)
    }
    /// Bytes moved in `direction`, for every reason.
    pub fn total(&self, direction: Direction) -> u64 {
        self.moved
            .iter()
            .filter(|((d, _), _)| *d == direction)
            .map(|(_, b)| b)
            .sum()
    }
    /// Device→host reads (host synchronizations) for `reason`.
    pub fn reads_of(&self, reason: Reason) -> u64 {
        self.reads.get(&reason).copied().unwrap_or(0)
    }
    /// Device→host reads for every reason.
    pub fn reads_total(&self) -> u64 {
        self.reads.values().sum()
    }
    /// Bytes moved in `direction` for `reason`.
    pub fn of(&self, direction: Direction, reason: Reason) -> u64 {
        self.moved.get(&(direction, reason)).copied().unwrap_or(0)
    }
}

impl fmt::Display for Transfers {
    /// `d2h=B h2d=B payload=B`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "d2h={} h2d={} payload={}",
            self.total(Direction::DeviceToHost),
            self.total(Direction::HostToDevice),
            self.payload
        )
    }
}
