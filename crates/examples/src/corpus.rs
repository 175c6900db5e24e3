//! corpus
