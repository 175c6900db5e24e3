//! Construction-time checks: every rank must hold the same parameter set and shapes, or DDP
//! would silently average unrelated tensors (or hang on mismatched sizes).

use crate::error::DdpError;
use crate::params::ParamInfo;
use bonfire_comm::ProcessGroup;

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
/// list (paths and shapes, in order) differs.
pub(crate) fn check_same_params(pg: &ProcessGroup, infos: &[ParamInfo]) -> Result<(), DdpError> {
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
    Err(DdpError::ParamMismatch(msg))
}

/// `root`'s lines, on every rank.
fn share(pg: &ProcessGroup, lines: &[String], root: usize) -> Result<Vec<String>, DdpError> {
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
