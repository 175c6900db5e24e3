//! [`PlanError`]: what can go wrong when planning — a description with a missing or
//! impossible value (one error naming the field), or a request nothing can satisfy.

use thiserror::Error;

/// An error of the planner.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PlanError {
    /// A model, cluster or request value that is missing, of the wrong type or impossible.
    /// `what` is the description (`model gpt3.json`, `cluster`, `request`), `field` its name.
    #[error("{what}: field `{field}`: {reason}")]
    Field {
        /// The description the value belongs to (`model gpt3.json`, `cluster`, `request`).
        what: String,
        /// The field's name.
        field: String,
        /// What is wrong with its value (missing, wrong type, out of range, unknown).
        reason: String,
    },
    /// A file that cannot be read or is not a JSON object.
    #[error("{what}: {reason}")]
    File {
        /// The description the file holds (`model gpt3.json`, `cluster`).
        what: String,
        /// Why it cannot be used: not valid JSON, or not an object.
        reason: String,
    },
    /// No layout fits: what does not fit where.
    #[error("no layout fits: {reason}")]
    Infeasible {
        /// What does not fit where: the smallest layout's bytes against a rank's, or why no
        /// layout splits the model and the batch.
        reason: String,
    },
}

impl PlanError {
    /// A [`PlanError::Field`] error.
    pub fn field(what: &str, field: &str, reason: impl Into<String>) -> Self {
        PlanError::Field {
            what: what.to_string(),
            field: field.to_string(),
            reason: reason.into(),
        }
    }
}
