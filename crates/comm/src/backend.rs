//! The trait a transport implements to become a process-group backend.
//!
//! A backend moves bytes and meets its peers; everything else — argument checks, sequence
//! numbers, fingerprints, the flight recorder, async work and the typed API — lives once in
//! [`ProcessGroup`](crate::ProcessGroup). A backend must:
//! - compare the caller's [`Fingerprint`] with every peer's before moving data, and return
//!   [`CallContext::mismatch`] on every rank when they differ;
//! - give up after [`CallContext::timeout`] naming the ranks that did not arrive
//!   ([`CallContext::timeout_error`]) and abort the group so peers fail fast too;
//! - turn a peer's failure into [`CallContext::peer_failed`] rather than waiting forever.

use crate::device::{DeviceBuf, DeviceCollective};
use crate::{BufMut, BufRef, Collective, CommError, Fingerprint, FlightRecorder, Result};
use std::time::Duration;

/// What a backend needs to know about the call it is running, and helpers to build errors
/// that carry the group name and the flight recorder.
pub struct CallContext<'a> {
    /// The caller's description of this call, to compare with every peer's.
    pub fingerprint: Fingerprint,
    /// How long to wait for the peers before giving up with a timeout.
    pub timeout: Duration,
    /// Name of the group the call runs on, for error messages.
    pub group: &'a str,
    /// The caller's rank in that group.
    pub rank: usize,
    /// The group's flight recorder, dumped into timeout and mismatch errors.
    pub recorder: &'a FlightRecorder,
}

impl CallContext<'_> {
    fn dump(&self) -> String {
        self.recorder
            .dump(&format!("rank {} on group `{}`", self.rank, self.group))
    }

    /// Ranks `missing` did not reach this call within `waited`.
    pub fn timeout_error(&self, missing: Vec<usize>, waited: Duration) -> CommError {
        CommError::Timeout {
            group: self.group.to_string(),
            rank: self.rank,
            fingerprint: Box::new(self.fingerprint),
            waited,
            missing,
            recorder: self.dump(),
        }
    }

    /// Rank `peer` described this call as `remote`.
    pub fn mismatch(&self, peer: usize, remote: Fingerprint) -> CommError {
        CommError::Mismatch {
            group: self.group.to_string(),
            rank: self.rank,
            local: Box::new(self.fingerprint),
            peer,
            remote: Box::new(remote),
            recorder: self.dump(),
        }
    }

    /// Rank `peer` failed (panicked, exited, aborted) while this call needed it.
    pub fn peer_failed(&self, peer: usize, reason: impl Into<String>) -> CommError {
        CommError::PeerFailed {
            group: self.group.to_string(),
            rank: self.rank,
            peer,
            fingerprint: Box::new(self.fingerprint),
            reason: reason.into(),
        }
    }

    /// Checks the count matrix of an uneven all-to-all: what rank `i` sends to rank `j`
    /// (`sent(i, j)`) must be what `j` expects from `i` (`expected(i, j)`). Every rank checks
    /// every pair, so all ranks fail the same call with the same error.
    pub fn check_all_to_all_counts(
        &self,
        n: usize,
        sent: impl Fn(usize, usize) -> usize,
        expected: impl Fn(usize, usize) -> usize,
    ) -> Result<()> {
        for i in 0..n {
            for j in 0..n {
                let (sent, expected) = (sent(i, j), expected(i, j));
                if sent != expected {
                    return Err(CommError::CountMismatch {
                        group: self.group.to_string(),
                        seq: self.fingerprint.seq,
                        sender: i,
                        receiver: j,
                        sent,
                        expected,
                    });
                }
            }
        }
        Ok(())
    }

    /// The group was aborted earlier.
    pub fn aborted(&self, reason: impl Into<String>) -> CommError {
        CommError::Aborted {
            group: self.group.to_string(),
            reason: reason.into(),
        }
    }
}

/// A transport for one rank's membership in one group.
pub trait Backend: Send + Sync + 'static {
    /// Short backend name (`"threads"`, `"mpi"`, `"nccl"`).
    fn name(&self) -> &'static str;
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Runs a validated collective.
    fn collective(&self, call: Collective<'_>, ctx: &CallContext<'_>) -> Result<()>;
    /// Sends `buf` to group rank `dst`; `ctx.fingerprint` carries the tag and channel sequence.
    fn send(&self, buf: BufRef<'_>, dst: usize, ctx: &CallContext<'_>) -> Result<()>;
    /// Receives into `buf` from group rank `src`; the sender's fingerprint must match.
    fn recv(&self, buf: BufMut<'_>, src: usize, ctx: &CallContext<'_>) -> Result<()>;
    /// Creates the backend of a sub-group of the (validated, distinct, containing this rank)
    /// group ranks `ranks`, numbered in the given order. Every member calls this with the same
    /// list, in the same order relative to its other `new_group` calls. Any waiting this needs
    /// (members agreeing on the list, communicator bootstrap) gives up after `timeout` — the
    /// parent group's.
    fn new_group(&self, ranks: &[usize], timeout: Duration) -> Result<Box<dyn Backend>>;
    /// The world rank of every group rank (for messages that must name processes).
    fn world_ranks(&self) -> Vec<usize>;

    /// After a failure: agrees with the other survivors on who is alive and returns this
    /// rank's membership in a fresh group of them (the contract: [`crate::shrink`]). Waits at
    /// most `timeout` for live ranks that have not joined; `group` names the group in errors.
    /// Backends that cannot shrink say so.
    fn shrink(&self, group: &str, timeout: Duration) -> Result<Shrink> {
        let _ = (group, timeout);
        Err(CommError::Unsupported {
            backend: self.name(),
            what: "shrinking a group after a failure (a dead rank ends the job here: resume \
                   from the last checkpoint on fewer processes)"
                .into(),
        })
    }

    /// Whether this transport reads and writes device memory itself ([`crate::device`]):
    /// NCCL does; host transports (threads, MPI) do not, and their callers stage.
    fn takes_device_buffers(&self) -> bool {
        false
    }

    /// Runs a validated collective on device buffers (see [`crate::device`]).
    ///
    /// # Safety
    /// Every buffer is an allocation of this backend's device holding its `len` elements,
    /// written before the call and not touched by anything else until it returns.
    unsafe fn device_collective(
        &self,
        call: DeviceCollective<'_>,
        ctx: &CallContext<'_>,
    ) -> Result<()> {
        let _ = (call, ctx);
        Err(self.no_device_buffers())
    }

    /// Sends the device buffer `buf` to group rank `dst` (see [`Backend::send`]).
    ///
    /// # Safety
    /// As [`Backend::device_collective`].
    unsafe fn device_send(&self, buf: DeviceBuf, dst: usize, ctx: &CallContext<'_>) -> Result<()> {
        let _ = (buf, dst, ctx);
        Err(self.no_device_buffers())
    }

    /// Receives into the device buffer `buf` from group rank `src` (see [`Backend::recv`]).
    ///
    /// # Safety
    /// As [`Backend::device_collective`].
    unsafe fn device_recv(&self, buf: DeviceBuf, src: usize, ctx: &CallContext<'_>) -> Result<()> {
        let _ = (buf, src, ctx);
        Err(self.no_device_buffers())
    }

    /// The error of a device-buffer call on a host transport.
    fn no_device_buffers(&self) -> CommError {
        CommError::Unsupported {
            backend: self.name(),
            what: "device buffers (a host transport: stage through host memory)".into(),
        }
    }
}

/// What a backend's shrink produced: the new group's transport and the agreement.
pub struct Shrink {
    /// This rank's membership in the new group.
    pub backend: Box<dyn Backend>,
    /// The old group's ranks that are in the new group, in order (new rank = position).
    pub survivors: Vec<usize>,
    /// The old group's ranks left out, each with why (it panicked, returned, …).
    pub failed: Vec<(usize, String)>,
}
