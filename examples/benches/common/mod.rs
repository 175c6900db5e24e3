//! What the benches share (and the tests that measure as they do, by path): a layout's
//! training speed ([`throughput`]), bytes ([`measure`]) and host transfers ([`ledger`]), and
//! the ZeRO formula on the GPT ([`formula`]).
#![allow(dead_code)]

pub mod formula;
pub mod layouts;
pub mod ledger;
pub mod measure;
pub mod throughput;
