//! Agreeing on a model across a group: every rank must hold the same parameters (paths and
//! shapes, in order), or a data-parallel wrapper would silently average unrelated tensors (or
//! hang on mismatched sizes); then every rank takes the root's values.

use super::{ParamInfo, assign_flat, flat, inventory};
use crate::Subgroup;
use bonfire_comm::ProcessGroup;
use bonfire_dtensor::{DTensorError, Result};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};

fn describe(infos: &[ParamInfo]) -> Vec<String> {
    infos
        .iter()
        .map(|p| format!("{} {:?}", p.path, p.shape))
        .collect()
}

fn fnv1a(lines: &[String]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in lines.iter().flat_map(|l| l.bytes().chain([b'\n'])) {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Fails on every rank alike, naming the differences with rank 0, if any rank's parameter
/// list (paths and shapes, in order) differs. A collective on `pg`.
pub fn check_same(pg: &ProcessGroup, infos: &[ParamInfo]) -> Result<()> {
    let lines = describe(infos);
    let mine = [fnv1a(&lines) as i64, lines.len() as i64];
    let mut all = vec![0i64; 2 * pg.size()];
    pg.all_gather(&mine, &mut all)?;
    if all.chunks(2).all(|c| c == mine) {
        return Ok(());
    }
    // Someone differs: rank 0 and the first differing rank share their lists, so that every
    // rank can name the same differences.
    let differing: Vec<usize> = all
        .chunks(2)
        .enumerate()
        .filter(|(_, c)| *c != &all[0..2])
        .map(|(r, _)| r)
        .collect();
    let other = differing[0];
    let root_lines = share(pg, &lines, 0)?;
    let other_lines = share(pg, &lines, other)?;
    let only_root: Vec<&String> = root_lines
        .iter()
        .filter(|l| !other_lines.contains(l))
        .collect();
    let only_other: Vec<&String> = other_lines
        .iter()
        .filter(|l| !root_lines.contains(l))
        .collect();
    let mut msg = format!(
        "ranks {differing:?} differ from rank 0 ({} parameters on rank 0, {} on rank {other})",
        root_lines.len(),
        other_lines.len(),
    );
    if only_root.is_empty() && only_other.is_empty() {
        msg += "; same parameters in a different order";
    } else {
        msg += &format!(
            "; on rank 0 only: {:?}; on rank {other} only: {:?}",
            only_root.iter().take(5).collect::<Vec<_>>(),
            only_other.iter().take(5).collect::<Vec<_>>()
        );
    }
    Err(DTensorError::ParamMismatch(msg))
}

/// `root`'s lines, on every rank.
fn share(pg: &ProcessGroup, lines: &[String], root: usize) -> Result<Vec<String>> {
    let text = lines.join("\n").into_bytes();
    let mut len = [text.len() as i64];
    pg.broadcast(&mut len, root)?;
    let mut buf = if pg.rank() == root {
        text
    } else {
        vec![0u8; len[0] as usize]
    };
    pg.broadcast(&mut buf, root)?;
    Ok(String::from_utf8_lossy(&buf)
        .lines()
        .map(str::to_string)
        .collect())
}

/// Checks that every rank of `pg` holds the same parameters ([`check_same`]) and gives every
/// rank rank 0's values. Returns the module (same ids, devices and `require_grad`) with its
/// parameter inventory. A collective on `pg`; a group of one only takes the inventory.
pub fn sync_from_root<M: Module>(module: M, pg: &ProcessGroup) -> Result<(M, Vec<ParamInfo>)> {
    let infos = inventory(&module);
    if pg.size() == 1 {
        return Ok((module, infos));
    }
    check_same(pg, &infos)?;
    let values = bonfire_dtensor::plane::broadcast(flat(&module, &infos), 0, pg)?;
    Ok((assign_flat(module, &infos, &values), infos))
}

/// [`sync_from_root`] with a [`Subgroup`]'s parameters apart (expert parallelism's): every
/// rank of `pg` must hold the same parameters (paths and shapes); the others take rank 0's
/// values over `pg`, the subgroup's (each rank its own slice) the values of rank 0 of their
/// [`replicas`](Subgroup::replicas). Without a subgroup, [`sync_from_root`]. A collective on
/// `pg`, then on the replicas.
pub fn sync_from_root_with<M: Module>(
    module: M,
    pg: &ProcessGroup,
    subgroup: Option<&Subgroup>,
) -> Result<(M, Vec<ParamInfo>)> {
    let Some(subgroup) = subgroup else {
        return sync_from_root(module, pg);
    };
    let infos = inventory(&module);
    if pg.size() > 1 {
        check_same(pg, &infos)?;
    }
    let (mine, shared): (Vec<ParamInfo>, Vec<ParamInfo>) = infos
        .iter()
        .cloned()
        .partition(|p| subgroup.contains(&p.id));
    let mut module = module;
    for (part, group) in [(shared, pg), (mine, &subgroup.replicas)] {
        if part.is_empty() {
            continue;
        }
        // Assigned even where the group is one rank: experts are narrow views of the buffer
        // every parameter was synchronized in (`bonfire_ep::shard_experts`), which they would
        // otherwise keep alive whole until the first step; their own copy frees it.
        let values = match group.size() {
            1 => flat(&module, &part).detach(),
            _ => bonfire_dtensor::plane::broadcast(flat(&module, &part), 0, group)?,
        };
        module = assign_flat(module, &part, &values);
    }
    Ok((module, infos))
}

/// The device of `module`'s first float parameter (`None` for a module without any).
pub fn model_device<M: Module>(module: &M) -> Option<Device> {
    struct First(Option<Device>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() {
                self.0 = Some(param.lazy_device());
            }
        }
    }
    let mut first = First(None);
    module.visit(&mut first);
    first.0
}
