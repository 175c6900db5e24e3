//! # bonfire-layout
//!
//! The vocabulary of a training layout that the trainer (`bonfire-train`, `bonfire-pipeline`)
//! and the planner (`bonfire-plan`) share, with no dependencies, so that both spell it once:
//! the pipeline schedule kinds ([`ScheduleKind`]: name, parse, chunks per rank, stage map,
//! theoretical bubble), the ZeRO stages ([`ZeroStage`]) and the even split of pipeline
//! pieces into stages ([`even_split_points`]). Generating a kind's program is `bonfire-pipeline`'s; what a
//! kind holds in memory is the planner's.

#![forbid(unsafe_code)]

mod schedule;
mod split;
mod zero;

pub use schedule::ScheduleKind;
pub use split::even_split_points;
pub use zero::ZeroStage;
