//! A plan entry's style checked against the module it matched ([`Site`]: what the survey of
//! the model knows of it) and turned into the layer's [`Assignment`] — every check runs here,
//! before any parameter is sharded, and fails as a [`ParallelError`].

use crate::state::{Applied, KEY_CONTAINER, LayerKind};
use crate::style::{
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput, ReplicateParallel,
    RowwiseParallel, SequenceParallel, StylePlacement,
};
use bonfire_dtensor::{DTensorError, chunk_range};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use std::collections::{BTreeMap, BTreeSet};

/// Why a plan could not be applied. Every check runs before any parameter is sharded.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ParallelError {
    /// A plan entry matches no module path.
    #[error("plan entry `{pattern}` matches no module (module paths look like: {examples})")]
    NoMatch {
        /// The entry's path pattern.
        pattern: String,
        /// A few of the model's module paths, comma-separated, to show what paths look like.
        examples: String,
    },
    /// A style applied to a module that cannot take it.
    #[error("plan entry `{pattern}`: {style} cannot be applied to `{path}` ({found})")]
    WrongModule {
        /// The entry's path pattern.
        pattern: String,
        /// The path of the matched module.
        path: String,
        /// The style's name (`ColwiseParallel`, `RowwiseParallel`…).
        style: &'static str,
        /// What the module is instead (e.g. "a Linear", "a parameter, not a module").
        found: String,
    },
    /// A dimension that must split evenly over the tensor-parallel group does not.
    #[error("`{path}`: {what} ({len}) is not divisible by the tensor-parallel size {parts}")]
    NotDivisible {
        /// The path of the weight (`<module>.weight`).
        path: String,
        /// Which dimension it is (`out_features`, `in_features`, `vocabulary size`…).
        what: String,
        /// The dimension's length.
        len: usize,
        /// The tensor-parallel group size it must divide by.
        parts: usize,
    },
    /// An input or output layout the style does not support.
    #[error("plan entry `{pattern}` on `{path}`: {message}")]
    StylePlacement {
        /// The entry's path pattern.
        pattern: String,
        /// The path of the matched module.
        path: String,
        /// What about the layout is not supported.
        message: String,
    },
    /// Two plan entries give one module two styles.
    #[error("`{path}` is matched by `{first}` and `{second}`")]
    Conflict {
        /// The path of the layer both entries assign a style to.
        path: String,
        /// The pattern of the earlier entry.
        first: String,
        /// The pattern of the later entry.
        second: String,
    },
    /// The mesh axis is unknown.
    #[error(transparent)]
    Mesh(#[from] DTensorError),
}

/// What the visitor saw: module paths, each module's kind (from its fields' container
/// type), each parallel-aware layer's key, and every float parameter's path and shape.
#[derive(Default, Debug)]
pub(crate) struct Survey {
    pub(crate) stack: Vec<String>,
    pub(crate) modules: BTreeSet<String>,
    pub(crate) types: BTreeMap<String, String>,
    pub(crate) keys: BTreeMap<String, u64>,
    pub(crate) params: BTreeMap<String, Vec<usize>>,
}

impl Survey {
    pub(crate) fn of<M: Module>(module: &M) -> Self {
        let mut s = Survey::default();
        module.visit(&mut s);
        s
    }
    pub(crate) fn path(&self) -> String {
        self.stack.join(".")
    }
    pub(crate) fn kind(&self, path: &str) -> Option<LayerKind> {
        self.types
            .get(path)
            .and_then(|c| LayerKind::from_container(c))
    }
    pub(crate) fn describe(&self, path: &str) -> String {
        match self.types.get(path) {
            Some(c) => format!("a {}", c.trim_start_matches("Struct:")),
            None if self.params.contains_key(path) => "a parameter, not a module".into(),
            None => "a module with no parallel-aware layer type".into(),
        }
    }
    pub(crate) fn children(&self, path: &str) -> Vec<&String> {
        let depth = path.split('.').count() + 1;
        self.modules
            .iter()
            .filter(|m| m.starts_with(&format!("{path}.")) && m.split('.').count() == depth)
            .collect()
    }
}

impl ModuleVisitor for Survey {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        if container_type == KEY_CONTAINER {
            let owner = self.stack[..self.stack.len().saturating_sub(1)].join(".");
            if let Ok(k) = name.parse() {
                self.keys.insert(owner, k);
            }
        } else {
            self.types.insert(self.path(), container_type.to_string());
            self.stack.push(name.to_string());
            self.modules.insert(self.path());
            return;
        }
        self.stack.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.params.insert(self.path(), param.dims().to_vec());
    }
}

/// One validated assignment: the layer at `path` gets `applied`.
#[derive(Debug, Clone)]
pub(crate) struct Assignment {
    pub(crate) kind: LayerKind,
    pub(crate) applied: Applied,
}

/// The validated assignments by layer path, each with the plan entry (pattern) that made it.
pub(crate) type Assignments = BTreeMap<String, (String, Assignment)>;

/// A module a plan entry matched, as its style sees it while assigning itself: what the
/// survey knows of it, what is assigned so far, and the tensor-parallel group.
pub(crate) struct Site<'a> {
    pub(crate) survey: &'a Survey,
    pub(crate) held: &'a Assignments,
    pub(crate) pattern: &'a str,
    pub(crate) path: &'a str,
    pub(crate) style: &'static str,
    /// The tensor-parallel group size.
    pub(crate) parts: usize,
    /// This rank's index in the tensor-parallel group.
    pub(crate) rank: usize,
}

impl Site<'_> {
    /// The module's path.
    pub(crate) fn path(&self) -> &str {
        self.path
    }

    /// The module's parallel-aware layer kind, if it is one.
    pub(crate) fn kind(&self) -> Option<LayerKind> {
        self.survey.kind(self.path)
    }

    /// The error of the style not fitting this module.
    pub(crate) fn wrong_module(&self) -> ParallelError {
        self.wrong_module_found(self.survey.describe(self.path))
    }

    /// The error of the style not fitting this module, which is `found`.
    fn wrong_module_found(&self, found: String) -> ParallelError {
        ParallelError::WrongModule {
            pattern: self.pattern.to_string(),
            path: self.path.to_string(),
            style: self.style,
            found,
        }
    }

    /// The error of a layout the style does not support here.
    pub(crate) fn layout_error(&self, message: impl Into<String>) -> ParallelError {
        ParallelError::StylePlacement {
            pattern: self.pattern.to_string(),
            path: self.path.to_string(),
            message: message.into(),
        }
    }

    /// The length of dim `dim` (named `what`) of the module's weight, which must divide over
    /// the group.
    pub(crate) fn weight_len(&self, dim: usize, what: &str) -> Result<usize, ParallelError> {
        let name = format!("{}.weight", self.path);
        let len = self.survey.params.get(&name).map(|s| s[dim]).unwrap_or(0);
        if !len.is_multiple_of(self.parts) {
            return Err(ParallelError::NotDivisible {
                path: name,
                what: what.into(),
                len,
                parts: self.parts,
            });
        }
        Ok(len)
    }

    /// The path of the `ParallelIo` that prepares this module's input and output: the module
    /// itself, or its one `ParallelIo` child.
    pub(crate) fn io_path(&self) -> Result<String, ParallelError> {
        if self.kind() == Some(LayerKind::Io) {
            return Ok(self.path.to_string());
        }
        let survey = self.survey;
        let ios: Vec<&String> = survey
            .children(self.path)
            .into_iter()
            .filter(|c| survey.kind(c) == Some(LayerKind::Io))
            .collect();
        match ios.as_slice() {
            [one] => Ok((*one).clone()),
            [] => Err(self.wrong_module_found(format!(
                "{} without a ParallelIo field: add `io: ParallelIo` and \
                 call `self.io.input(x)` / `self.io.output(y)` in forward",
                survey.describe(self.path)
            ))),
            _ => Err(self.wrong_module()),
        }
    }

    /// What earlier entries already prepare at the `ParallelIo` at `io`: (input, output).
    pub(crate) fn held_io(
        &self,
        io: &str,
    ) -> (Option<PrepareModuleInput>, Option<PrepareModuleOutput>) {
        match self.held.get(io) {
            Some((
                _,
                Assignment {
                    applied: Applied::Io { input, output },
                    ..
                },
            )) => (*input, *output),
            _ => (None, None),
        }
    }
}

impl ParallelStyle {
    /// Checks the style fits the matched module at `site`; the path of the layer it applies to
    /// (the module, or its `ParallelIo`) and that layer's assignment.
    pub(crate) fn assign(&self, site: &Site) -> Result<(String, Assignment), ParallelError> {
        let at_site = |assignment| Ok((site.path().to_string(), assignment));
        match (self, site.kind()) {
            (Self::Colwise(s), Some(k @ (LayerKind::Linear | LayerKind::Embedding))) => {
                at_site(s.assign(site, k)?)
            }
            (Self::Rowwise(s), Some(k @ (LayerKind::Linear | LayerKind::Embedding))) => {
                at_site(s.assign(site, k)?)
            }
            (Self::Sequence(s), Some(k @ (LayerKind::Norm | LayerKind::Embedding))) => {
                at_site(s.assign(k))
            }
            (Self::Replicate(s), Some(LayerKind::Linear)) => at_site(s.assign(site)?),
            (Self::PrepareInput(p), _) => p.assign(site),
            (Self::PrepareOutput(p), _) => p.assign(site),
            _ => Err(site.wrong_module()),
        }
    }
}

/// Column- and row-wise layers both hand back local Burn tensors: an error unless
/// `use_local_output`.
fn require_local_output(site: &Site, use_local_output: bool) -> Result<(), ParallelError> {
    if use_local_output {
        Ok(())
    } else {
        Err(site.layout_error(
            "use_local_output = false: Bonfire layers return local Burn tensors; \
             wrap the output with DTensor::from_local instead",
        ))
    }
}

impl ColwiseParallel {
    /// Checks the layouts and the split dim of the linear or embedding (`kind`) at `site`.
    fn assign(&self, site: &Site, kind: LayerKind) -> Result<Assignment, ParallelError> {
        require_local_output(site, self.use_local_output)?;
        if kind == LayerKind::Linear {
            site.weight_len(0, "out_features")?;
            if self.input_layout == StylePlacement::Partial
                || self.input_layout.shard_dim(3) == Some(2)
            {
                return Err(site.layout_error(format!(
                    "input layout {:?}: a column-wise layer takes a replicated or \
                     sequence-sharded input",
                    self.input_layout
                )));
            }
        } else {
            site.weight_len(1, "embedding dim")?;
            if self.input_layout != StylePlacement::Replicate {
                return Err(site.layout_error("an embedding's ids must be Replicate"));
            }
        }
        if self.output_layout == StylePlacement::Partial {
            return Err(site.layout_error("output layout Partial: use Replicate or Shard"));
        }
        Ok(Assignment {
            kind,
            applied: Applied::Colwise(*self),
        })
    }
}

impl RowwiseParallel {
    /// Checks the layouts and the split dim of the linear or embedding (`kind`) at `site`; an
    /// embedding also gets the first vocabulary row this rank holds.
    fn assign(&self, site: &Site, kind: LayerKind) -> Result<Assignment, ParallelError> {
        require_local_output(site, self.use_local_output)?;
        if self.output_layout == StylePlacement::Partial
            || self.output_layout.shard_dim(3) == Some(2)
        {
            return Err(site.layout_error(format!(
                "output layout {:?}: a row-wise layer's output is Replicate or \
                 sharded on the sequence (Shard(1))",
                self.output_layout
            )));
        }
        let offset = if kind == LayerKind::Linear {
            site.weight_len(1, "in_features")?;
            if self.input_layout == StylePlacement::Partial {
                return Err(site.layout_error("input layout Partial"));
            }
            0
        } else {
            let rows = site.weight_len(0, "vocabulary size")?;
            if self.input_layout != StylePlacement::Replicate {
                return Err(site.layout_error("an embedding's ids must be Replicate"));
            }
            chunk_range(rows, site.parts, site.rank).start
        };
        Ok(Assignment {
            kind,
            applied: Applied::Rowwise {
                style: *self,
                offset,
            },
        })
    }
}

impl SequenceParallel {
    /// The assignment of a norm or embedding (`kind`): nothing to check.
    fn assign(&self, kind: LayerKind) -> Assignment {
        Assignment {
            kind,
            applied: Applied::Sequence(*self),
        }
    }
}

impl PrepareModuleInput {
    /// Checks the desired layout; the `ParallelIo` of the module at `site`, preparing this
    /// input and any output an earlier entry prepared there.
    fn assign(&self, site: &Site) -> Result<(String, Assignment), ParallelError> {
        let io = site.io_path()?;
        let (_, output) = site.held_io(&io);
        if self.desired_input_layout == StylePlacement::Partial {
            return Err(site.layout_error("desired input layout Partial"));
        }
        Ok((io, io_assignment(Some(*self), output)))
    }
}

impl PrepareModuleOutput {
    /// Checks the desired layout; the `ParallelIo` of the module at `site`, preparing this
    /// output and any input an earlier entry prepared there.
    fn assign(&self, site: &Site) -> Result<(String, Assignment), ParallelError> {
        let io = site.io_path()?;
        let (input, _) = site.held_io(&io);
        if self.desired_output_layout == StylePlacement::Partial {
            return Err(site.layout_error("desired output layout Partial"));
        }
        Ok((io, io_assignment(input, Some(*self))))
    }
}

/// The assignment of a `ParallelIo` preparing `input` and `output`.
fn io_assignment(
    input: Option<PrepareModuleInput>,
    output: Option<PrepareModuleOutput>,
) -> Assignment {
    Assignment {
        kind: LayerKind::Io,
        applied: Applied::Io { input, output },
    }
}

impl From<ColwiseParallel> for ParallelStyle {
    fn from(s: ColwiseParallel) -> Self {
        ParallelStyle::Colwise(s)
    }
}
impl From<RowwiseParallel> for ParallelStyle {
    fn from(s: RowwiseParallel) -> Self {
        ParallelStyle::Rowwise(s)
    }
}
impl From<SequenceParallel> for ParallelStyle {
    fn from(s: SequenceParallel) -> Self {
        ParallelStyle::Sequence(s)
    }
}
impl From<ReplicateParallel> for ParallelStyle {
    fn from(s: ReplicateParallel) -> Self {
        ParallelStyle::Replicate(s)
    }
}
impl From<PrepareModuleInput> for ParallelStyle {
    fn from(s: PrepareModuleInput) -> Self {
        ParallelStyle::PrepareInput(s)
    }
}
impl From<PrepareModuleOutput> for ParallelStyle {
    fn from(s: PrepareModuleOutput) -> Self {
        ParallelStyle::PrepareOutput(s)
    }
}

impl ReplicateParallel {
    /// Checks the input layout of the linear at `site`.
    fn assign(&self, site: &Site) -> Result<Assignment, ParallelError> {
        if self.input_layout == StylePlacement::Partial || self.input_layout.shard_dim(3) == Some(2)
        {
            return Err(site.layout_error(format!(
                "input layout {:?}: a replicated layer takes a replicated or sequence-sharded \
                 input",
                self.input_layout
            )));
        }
        Ok(Assignment {
            kind: LayerKind::Linear,
            applied: Applied::Replicate(*self),
        })
    }
}
