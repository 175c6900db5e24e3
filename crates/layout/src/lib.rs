//! # bonfire-layout
//!
//! The vocabulary of a training layout that the trainer (`bonfire-train`, `bonfire-pipeline`)
//! and the planner (`bonfire-plan`) share, with no dependencies, so that both spell it once:
//! today the pipeline schedule kinds ([`ScheduleKind`]: name, parse, chunks per rank, stage
//! map, theoretical bubble). Generating a kind's program is `bonfire-pipeline`'s; what a
//! kind holds in memory is the planner's.

#![forbid(unsafe_code)]

mod schedule;

pub use schedule::ScheduleKind;
