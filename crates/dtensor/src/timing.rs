//! Per-step timings of a data-parallel wrapper (forward, backward, each gradient bucket's
//! collective) and their Chrome-trace form, so that overlap can be measured and seen on one
//! timeline: DDP's all-reduces and ZeRO-2's reduce-scatters alike.

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::Instant;

/// A process-wide time origin, so every rank's timestamps share one timeline.
pub fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_us() -> f64 {
    epoch().elapsed().as_secs_f64() * 1e6
}

/// A time span in microseconds since [`epoch`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Span {
    /// Start, in µs since [`epoch`].
    pub start_us: f64,
    /// End, in µs since [`epoch`].
    pub end_us: f64,
}

impl Span {
    /// Length in µs (0 if the span ends before it starts).
    pub fn duration_us(&self) -> f64 {
        (self.end_us - self.start_us).max(0.0)
    }
    /// Length of the intersection with `other`.
    pub fn overlap_us(&self, other: &Span) -> f64 {
        (self.end_us.min(other.end_us) - self.start_us.max(other.start_us)).max(0.0)
    }
}

/// What one rank did in one step.
#[derive(Debug, Clone, Default)]
pub struct StepTiming {
    /// The rank in the wrapper's process group.
    pub rank: usize,
    /// The step's index, from 0.
    pub step: u64,
    /// The model's forward through the wrapper.
    pub forward: Span,
    /// The autodiff backward pass (`loss.backward()`), during which buckets launch.
    pub backward: Span,
    /// Each bucket's collective, in bucket order (as run on the communication thread).
    pub buckets: Vec<Span>,
    /// What the buckets ran, for the trace (`all_reduce` when empty).
    pub collective: &'static str,
    /// When each bucket was handed to the communication thread (µs since the epoch): during
    /// backward when overlapping. The all-reduce itself starts when that thread gets a core.
    pub launches: Vec<f64>,
    /// From the end of backward until every bucket was back (the exposed communication).
    pub wait: Span,
}

impl StepTiming {
    /// Fraction of the buckets' communication time that ran while backward was still
    /// computing.
    pub fn hidden_fraction(&self) -> f64 {
        let total: f64 = self.buckets.iter().map(Span::duration_us).sum();
        if total == 0.0 {
            return 1.0;
        }
        let hidden: f64 = self
            .buckets
            .iter()
            .map(|b| b.overlap_us(&self.backward))
            .sum();
        hidden / total
    }
}

/// From `start_us` until now.
pub fn span_since(start_us: f64) -> Span {
    Span {
        start_us,
        end_us: now_us(),
    }
}

/// Now, in µs since [`epoch`].
pub fn now() -> f64 {
    now_us()
}

impl From<crate::plane::Ran> for Span {
    /// When the communication thread ran a collective, on this timeline.
    fn from(ran: crate::plane::Ran) -> Self {
        let us = |i: Instant| i.saturating_duration_since(epoch()).as_secs_f64() * 1e6;
        Span {
            start_us: us(ran.start),
            end_us: us(ran.end),
        }
    }
}

/// Writes step timings of any ranks as a Chrome-trace JSON (open in Perfetto or
/// chrome://tracing): one process per rank, a "compute" and a "comm" track each.
pub fn chrome_trace(steps: &[StepTiming]) -> String {
    let mut events = Vec::new();
    let mut ranks: Vec<usize> = steps.iter().map(|s| s.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for r in &ranks {
        events.push(format!(
            r#"{{"name":"process_name","ph":"M","pid":{r},"args":{{"name":"rank {r}"}}}}"#
        ));
        for (tid, name) in [(0, "compute"), (1, "comm")] {
            events.push(format!(
                r#"{{"name":"thread_name","ph":"M","pid":{r},"tid":{tid},"args":{{"name":"{name}"}}}}"#
            ));
        }
    }
    let mut push = |name: String, pid: usize, tid: usize, span: &Span| {
        if span.end_us > span.start_us {
            events.push(format!(
                r#"{{"name":"{name}","ph":"X","pid":{pid},"tid":{tid},"ts":{:.1},"dur":{:.1}}}"#,
                span.start_us,
                span.duration_us()
            ));
        }
    };
    for s in steps {
        push(format!("forward {}", s.step), s.rank, 0, &s.forward);
        push(format!("backward {}", s.step), s.rank, 0, &s.backward);
        push(format!("wait {}", s.step), s.rank, 0, &s.wait);
        let collective = if s.collective.is_empty() {
            "all_reduce"
        } else {
            s.collective
        };
        for (b, span) in s.buckets.iter().enumerate() {
            push(format!("{collective} bucket {b}"), s.rank, 1, span);
        }
    }
    format!("{{\"traceEvents\":[\n{}\n]}}\n", events.join(",\n"))
}

/// How much of the overlapped ring shifts' transfer time ran while this thread computed
/// (context parallelism's K/V blocks and their gradients): from the post of each shift until
/// both its send and its receive had finished, against the part of that before the thread
/// came to wait for it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShiftOverlap {
    /// Shifts finished.
    pub shifts: usize,
    /// Their transfers' total time, µs.
    pub transfer_us: f64,
    /// The part of it before this thread waited, µs.
    pub hidden_us: f64,
}

impl ShiftOverlap {
    /// `hidden / transfer` (`None` when no shift ran).
    pub fn hidden_fraction(&self) -> Option<f64> {
        (self.shifts > 0).then(|| {
            if self.transfer_us > 0.0 {
                self.hidden_us / self.transfer_us
            } else {
                1.0
            }
        })
    }
}

thread_local! {
    static SHIFTS: Cell<ShiftOverlap> = const {
        Cell::new(ShiftOverlap { shifts: 0, transfer_us: 0.0, hidden_us: 0.0 })
    };
}

/// Adds one shift posted at `posted`, waited for from `waited`, finished at `finished`.
pub(crate) fn record_shift(posted: Instant, waited: Instant, finished: Instant) {
    let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
    let transfer = us(finished.saturating_duration_since(posted));
    let hidden = us(finished.min(waited).saturating_duration_since(posted));
    SHIFTS.with(|s| {
        let mut o = s.get();
        o.shifts += 1;
        o.transfer_us += transfer;
        o.hidden_us += hidden;
        s.set(o);
    });
}

/// This thread's [`ShiftOverlap`] since the last call, reset.
pub fn take_shift_overlap() -> ShiftOverlap {
    SHIFTS.with(|s| s.take())
}
