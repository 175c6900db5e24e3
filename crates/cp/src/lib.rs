//! # bonfire-cp
//!
//! Context parallelism: every sequence split over the ranks of a `cp` group, for every
//! activation, attention included.
//!
//! - [`ContextSplit`]: which tokens of a sequence each cp rank holds. Balanced (the default of
//!   Megatron-Core and torchtitan for causal models): the sequence is cut into `2·cp` equal
//!   chunks and rank `r` holds chunks `r` and `2·cp − 1 − r`, so every rank does the same
//!   causal attention work; unbalanced: rank `r` holds the `r`-th `T/cp` tokens. Positions
//!   (position embeddings, rotary angles) follow the chunks ([`ContextSplit::positions`]).
//! - [`ring_attention`]: attention of a rank's queries over the whole sequence's keys without
//!   any rank holding them all: the K/V blocks travel around the cp ring, the next block's
//!   transfer posted before the current block is computed ([`ring_shift_start`]), each
//!   merged into the output with an online softmax (running max and sum); backward sends
//!   dK/dV around the ring back to their owners, overlapped the same way (the shift's own
//!   backward). [`take_shift_overlap`] says how much of the transfers computation hid.
//!
//! - [`ContextScope`]: entered on a rank's thread for its forward and backward, it makes
//!   [`attention`] ring attention and [`positions`] the chunks' — what a model calls instead
//!   of its own attention and `0..T` to take part.
//!
//! [`ring_shift_start`]: bonfire_dtensor::functional::ring_shift_start
//! [`take_shift_overlap`]: bonfire_dtensor::timing::take_shift_overlap

mod ring;
mod scope;
mod split;

pub use ring::{RING_TAG, ring_attention};
pub use scope::{ContextScope, ScopeGuard, attention, positions};
pub use split::ContextSplit;
