//! Placing operations in Burn's backward.
//!
//! Burn runs backward deepest node first, so *where* a node sits in the graph decides *when*
//! its backward runs. Data parallelism wants a layer's gradients to leave as soon as that
//! layer's backward is done, while earlier layers still compute. Two identity operations,
//! each with a second *anchor* input (the layer's input activation) that only positions the
//! node and receives no gradient:
//!
//! - [`anchored`]: the gradient passes through (ZeRO-3 anchors the input of a parameter's
//!   all-gather, so that the gather's reduce-scatter runs right after the layer).
//! - [`hooked`]: the gradient is handed to a closure instead of being stored.
//!
//! [`SinkHook`] puts `hooked` on every parameter of the layers a wrapper sees and feeds a
//! [`GradSink`]: DDP's all-reduce buckets and ZeRO-2's reduce-scatter buckets.

mod anchor;
mod hook;
mod sink;

pub use anchor::{AnchorBackend, anchored};
pub use hook::{GradHook, GradHookBackend, hooked, hooked_dispatch};
pub use sink::{GradSink, SharedSink, SinkHook};
