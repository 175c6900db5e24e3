//! The flight recorder: a per-rank ring of the last calls on a group.
//!
//! When a call times out or mismatches, the ring shows what this rank did just before, which
//! is usually enough to see which rank skipped or reordered a collective. It is fixed-size and
//! preallocated, so recording costs no allocation in steady state.

use crate::Fingerprint;
use std::collections::VecDeque;
use std::fmt::{self, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How many calls each rank remembers per group.
pub const RECORDER_CAPACITY: usize = 32;

/// The state of a recorded call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallState {
    /// The call has started and not returned yet (or never did).
    Started,
    /// The call returned successfully.
    Completed,
    /// The call returned an error.
    Failed,
}

/// One recorded call.
#[derive(Debug, Clone, Copy)]
pub struct CallRecord {
    /// What the call was.
    pub fingerprint: Fingerprint,
    /// Whether it is running, completed or failed.
    pub state: CallState,
    /// When it started.
    pub started: Instant,
    /// How long it took, once finished (`None` while running).
    pub duration: Option<Duration>,
}

/// A ring buffer of the last [`RECORDER_CAPACITY`] calls of one rank on one group.
#[derive(Debug)]
pub struct FlightRecorder {
    ring: Mutex<VecDeque<CallRecord>>,
    epoch: Instant,
}

impl Default for FlightRecorder {
    fn default() -> Self {
        Self {
            ring: Mutex::new(VecDeque::with_capacity(RECORDER_CAPACITY)),
            epoch: Instant::now(),
        }
    }
}

impl FlightRecorder {
    /// Records the start of a call; returns its slot token for [`FlightRecorder::finish`].
    pub fn start(&self, fingerprint: Fingerprint) -> Instant {
        let started = Instant::now();
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == RECORDER_CAPACITY {
            ring.pop_front();
        }
        ring.push_back(CallRecord {
            fingerprint,
            state: CallState::Started,
            started,
            duration: None,
        });
        started
    }

    /// Marks the call started at `started` as completed or failed.
    pub fn finish(&self, started: Instant, ok: bool) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(rec) = ring.iter_mut().rev().find(|r| r.started == started) {
            rec.state = if ok {
                CallState::Completed
            } else {
                CallState::Failed
            };
            rec.duration = Some(started.elapsed());
        }
    }

    /// The recorded calls, oldest first.
    pub fn records(&self) -> Vec<CallRecord> {
        self.ring
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect()
    }

    /// A human-readable dump, one call per line, oldest first.
    pub fn dump(&self, header: &str) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "flight recorder of {header} (oldest first):");
        let records = self.records();
        if records.is_empty() {
            out.push_str("  (no calls yet)\n");
        }
        for r in records {
            let at = r.started.duration_since(self.epoch);
            let _ = writeln!(out, "  {}", RecordLine { r: &r, at });
        }
        out
    }
}

struct RecordLine<'a> {
    r: &'a CallRecord,
    at: Duration,
}

impl fmt::Display for RecordLine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "t+{:>10.3}ms {:<40} {:?}",
            self.at.as_secs_f64() * 1e3,
            self.r.fingerprint.to_string(),
            self.r.state
        )?;
        if let Some(d) = self.r.duration {
            write!(f, " in {:.3}ms", d.as_secs_f64() * 1e3)?;
        }
        Ok(())
    }
}
