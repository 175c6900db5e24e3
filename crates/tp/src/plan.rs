//! [`ParallelPlan`] (module paths with wildcards → styles), its validation, and
//! [`parallelize_module`].

use super::layers::{
    Applied, KEY_CONTAINER, LayerKind, ParallelState, set_state, state_of, with_fresh_keys,
};
use super::style::{ParallelStyle, PrepareModuleInput, PrepareModuleOutput};
use bonfire_dtensor::{DTensorError, DeviceMesh, chunk_range};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
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

/// A tensor-parallel plan: module paths (dotted, as Burn names fields: `blocks.0.attn.q`) to
/// styles. A `*` matches any characters within one path segment, so `blocks.*.attn.q`
/// matches every block's `q`, and `blocks.*.mlp.fc*` both MLP layers.
#[derive(Debug, Clone, Default)]
pub struct ParallelPlan {
    entries: Vec<(String, ParallelStyle)>,
}

impl ParallelPlan {
    /// An empty plan; add entries with [`ParallelPlan::add`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `pattern => style`.
    pub fn add(mut self, pattern: impl Into<String>, style: impl Into<ParallelStyle>) -> Self {
        self.entries.push((pattern.into(), style.into()));
        self
    }

    /// The entries in order.
    pub fn entries(&self) -> &[(String, ParallelStyle)] {
        &self.entries
    }
}

impl<S: Into<String>, T: Into<ParallelStyle>> FromIterator<(S, T)> for ParallelPlan {
    fn from_iter<I: IntoIterator<Item = (S, T)>>(iter: I) -> Self {
        Self {
            entries: iter
                .into_iter()
                .map(|(p, s)| (p.into(), s.into()))
                .collect(),
        }
    }
}

/// Whether dotted `path` matches `pattern` (`*` = any characters within one segment).
pub fn path_matches(pattern: &str, path: &str) -> bool {
    let p: Vec<&str> = pattern.split('.').collect();
    let s: Vec<&str> = path.split('.').collect();
    p.len() == s.len() && p.iter().zip(&s).all(|(p, s)| segment_matches(p, s))
}

fn segment_matches(pattern: &str, s: &str) -> bool {
    let Some((head, rest)) = pattern.split_once('*') else {
        return pattern == s;
    };
    let Some(s) = s.strip_prefix(head) else {
        return false;
    };
    if rest.is_empty() {
        return true;
    }
    (0..=s.len()).any(|i| s.is_char_boundary(i) && segment_matches(rest, &s[i..]))
}

/// What the visitor saw: module paths, each module's kind (from its fields' container
/// type), each parallel-aware layer's key, and every float parameter's path and shape.
#[derive(Default, Debug)]
struct Survey {
    stack: Vec<String>,
    modules: BTreeSet<String>,
    types: BTreeMap<String, String>,
    keys: BTreeMap<String, u64>,
    params: BTreeMap<String, Vec<usize>>,
}

impl Survey {
    fn of<M: Module>(module: &M) -> Self {
        let mut s = Survey::default();
        module.visit(&mut s);
        s
    }
    fn path(&self) -> String {
        self.stack.join(".")
    }
    fn kind(&self, path: &str) -> Option<LayerKind> {
        self.types
            .get(path)
            .and_then(|c| LayerKind::from_container(c))
    }
    fn describe(&self, path: &str) -> String {
        match self.types.get(path) {
            Some(c) => format!("a {}", c.trim_start_matches("Struct:")),
            None if self.params.contains_key(path) => "a parameter, not a module".into(),
            None => "a module with no parallel-aware layer type".into(),
        }
    }
    fn children(&self, path: &str) -> Vec<&String> {
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
pub(super) struct Assignment {
    pub(super) kind: LayerKind,
    pub(super) applied: Applied,
}

/// The validated assignments by layer path, each with the plan entry (pattern) that made it.
type Assignments = BTreeMap<String, (String, Assignment)>;

/// A module a plan entry matched, as its style sees it while assigning itself: what the
/// survey knows of it, what is assigned so far, and the tensor-parallel group.
pub(super) struct Site<'a> {
    survey: &'a Survey,
    held: &'a Assignments,
    pattern: &'a str,
    path: &'a str,
    style: &'static str,
    /// The tensor-parallel group size.
    pub(super) parts: usize,
    /// This rank's index in the tensor-parallel group.
    pub(super) rank: usize,
}

impl Site<'_> {
    /// The module's path.
    pub(super) fn path(&self) -> &str {
        self.path
    }

    /// The module's parallel-aware layer kind, if it is one.
    pub(super) fn kind(&self) -> Option<LayerKind> {
        self.survey.kind(self.path)
    }

    /// The error of the style not fitting this module.
    pub(super) fn wrong_module(&self) -> ParallelError {
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
    pub(super) fn layout_error(&self, message: impl Into<String>) -> ParallelError {
        ParallelError::StylePlacement {
            pattern: self.pattern.to_string(),
            path: self.path.to_string(),
            message: message.into(),
        }
    }

    /// The length of dim `dim` (named `what`) of the module's weight, which must divide over
    /// the group.
    pub(super) fn weight_len(&self, dim: usize, what: &str) -> Result<usize, ParallelError> {
        let name = format!("{}.weight", self.path);
        let len = self.survey.params.get(&name).map(|s| s[dim]).unwrap_or(0);
        if len % self.parts != 0 {
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
    pub(super) fn io_path(&self) -> Result<String, ParallelError> {
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
    pub(super) fn held_io(
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

/// The modules `pattern` matches; an error naming a few module paths if none.
fn matched_modules<'a>(
    survey: &'a Survey,
    pattern: &str,
) -> Result<Vec<&'a String>, ParallelError> {
    let matched: Vec<&String> = survey
        .modules
        .iter()
        .filter(|m| path_matches(pattern, m))
        .collect();
    if matched.is_empty() {
        let examples: Vec<&str> = survey
            .modules
            .iter()
            .filter(|m| !survey.params.contains_key(*m) && !m.ends_with(".key"))
            .take(6)
            .map(|s| s.as_str())
            .collect();
        return Err(ParallelError::NoMatch {
            pattern: pattern.to_string(),
            examples: examples.join(", "),
        });
    }
    Ok(matched)
}

/// Matches every plan entry to module paths and lets its style assign itself to each; every
/// layer gets one assignment (two entries preparing one `ParallelIo` merge).
fn validate(
    survey: &Survey,
    plan: &ParallelPlan,
    parts: usize,
    rank: usize,
) -> Result<Assignments, ParallelError> {
    let mut out: Assignments = BTreeMap::new();
    for (pattern, style) in plan.entries() {
        for path in matched_modules(survey, pattern)? {
            let site = Site {
                survey,
                held: &out,
                pattern,
                path,
                style: style.name(),
                parts,
                rank,
            };
            let (target, assignment) = style.assign(&site)?;
            // Entries preparing one ParallelIo merge: the new assignment already holds what
            // the earlier ones prepared there, and replaces theirs.
            let merges = matches!(assignment.applied, Applied::Io { .. });
            if !merges && let Some((first, _)) = out.get(&target) {
                return Err(ParallelError::Conflict {
                    path: target,
                    first: first.clone(),
                    second: pattern.clone(),
                });
            }
            if !survey.keys.contains_key(&target) {
                return Err(site.wrong_module());
            }
            out.insert(target, (pattern.clone(), assignment));
        }
    }
    Ok(out)
}

/// The dim along which a layer of `kind` under `applied` shards its parameter `field`.
fn shard_dim(kind: LayerKind, applied: &Applied, field: &str) -> Option<usize> {
    match (kind, applied, field) {
        (LayerKind::Linear, Applied::Colwise(_), "weight" | "bias") => Some(0),
        (LayerKind::Linear, Applied::Rowwise { .. }, "weight") => Some(1),
        (LayerKind::Embedding, Applied::Colwise(_), "weight") => Some(1),
        (LayerKind::Embedding, Applied::Rowwise { .. }, "weight") => Some(0),
        _ => None,
    }
}

struct Sharder<'a> {
    stack: Vec<String>,
    assignments: &'a Assignments,
    parts: usize,
    rank: usize,
}

impl ModuleMapper for Sharder<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.stack.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (Some(field), owner) = (
            self.stack.last(),
            self.stack[..self.stack.len().saturating_sub(1)].join("."),
        ) else {
            return param;
        };
        let Some((_, a)) = self.assignments.get(&owner) else {
            return param;
        };
        let Some(dim) = shard_dim(a.kind, &a.applied, field) else {
            return param;
        };
        let (id, old, mapper) = param.consume();
        let require_grad = old.is_require_grad();
        let r = chunk_range(old.dims()[dim], self.parts, self.rank);
        let mut new = old.narrow(dim, r.start, r.len()).detach();
        if require_grad {
            new = new.require_grad();
        }
        Param::from_mapped_value(id, new, mapper)
    }
}

/// Applies `plan` to `module` over the mesh axis `axis` (e.g. `"tp"`): validates every entry
/// (a pattern that matches nothing, a style on a module that cannot take it, a dim that does
/// not divide, an unsupported layout — all before anything is sharded), then replaces the
/// matched layers' parameters by this rank's shards and records their styles (see
/// [`crate::layers`]). The result's layers get fresh keys: the module passed in,
/// and any other copy of it, keep behaving as they did. Call it on each rank's own `fork` of the model, after
/// loading a checkpoint, on the rank's thread.
pub fn parallelize_module<M: Module>(
    module: M,
    mesh: &DeviceMesh,
    axis: &str,
    plan: &ParallelPlan,
) -> Result<M, ParallelError> {
    let group = mesh.group(axis)?.clone();
    let (parts, rank) = (group.size(), group.rank());
    let survey = Survey::of(&module);
    let assignments = validate(&survey, plan, parts, rank)?;
    let mut sharder = Sharder {
        stack: Vec::new(),
        assignments: &assignments,
        parts,
        rank,
    };
    let (module, keys) = with_fresh_keys(|| module.map(&mut sharder));
    for (path, (_, a)) in &assignments {
        set_state(
            keys[&survey.keys[path]],
            ParallelState {
                group: group.clone(),
                applied: a.applied,
            },
        );
    }
    Ok(module)
}

/// Every parameter of `module` that is sharded on this thread, with the dim it is sharded
/// along (over the tensor-parallel group its layer was parallelized on). Parameters absent
/// here are whole on every rank.
pub fn sharded_params<M: Module>(module: &M) -> BTreeMap<String, usize> {
    let survey = Survey::of(module);
    let mut out = BTreeMap::new();
    for path in survey.params.keys() {
        let Some((owner, field)) = path.rsplit_once('.') else {
            continue;
        };
        let (Some(kind), Some(key)) = (survey.kind(owner), survey.keys.get(owner)) else {
            continue;
        };
        if let Some(state) = state_of(*key)
            && let Some(dim) = shard_dim(kind, &state.applied, field)
        {
            out.insert(path.clone(), dim);
        }
    }
    out
}
