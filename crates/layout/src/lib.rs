//! # bonfire-layout
//!
//! The vocabulary of a training layout that the trainer (`bonfire-train`, `bonfire-pipeline`)
//! and the planner (`bonfire-plan`) share, with no dependencies, so that both spell it once:
//! the pipeline schedule kinds ([`ScheduleKind`]: name, parse, chunks per rank, stage map,
//! theoretical bubble) and the ZeRO stages ([`ZeroStage`]). Generating a kind's program is `bonfire-pipeline`'s; what a
//! kind holds in memory is the planner's.

#![forbid(unsafe_code)]

mod schedule;
mod zero;

pub use schedule::ScheduleKind;
pub use zero::ZeroStage;
