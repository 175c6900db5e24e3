//! [`ParallelPlan`] (module paths with wildcards → styles), its validation, and
//! [`parallelize_module`].

use crate::assign::{Assignments, ParallelError, Site, Survey};
use crate::state::{Applied, LayerKind, ParallelState, set_state, state_of, with_fresh_keys};
use crate::style::ParallelStyle;
use bonfire_dtensor::{DeviceMesh, chunk_range};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use std::collections::BTreeMap;

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

    /// The plan without its entry for `pattern` (a model variant that lacks the module: a
    /// tied head has no `lm_head`).
    pub fn without(mut self, pattern: &str) -> Self {
        self.entries.retain(|(p, _)| p != pattern);
        self
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
