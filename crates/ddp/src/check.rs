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
    // Someone differs: share rank 0's list so every rank can say what differs.
    let text = lines.join("\n").into_bytes();
    let mut len = [text.len() as i64];
    pg.broadcast(&mut len, 0)?;
    let mut root = if pg.rank() == 0 {
        text
    } else {
        vec![0u8; len[0] as usize]
    };
    pg.broadcast(&mut root, 0)?;
    let root_lines: Vec<String> = String::from_utf8_lossy(&root)
        .lines()
        .map(str::to_string)
        .collect();
    let differing: Vec<usize> = all
        .chunks(2)
        .enumerate()
        .filter(|(_, c)| *c != &all[0..2])
        .map(|(r, _)| r)
        .collect();
    let only_root: Vec<&String> = root_lines.iter().filter(|l| !lines.contains(l)).collect();
    let only_me: Vec<&String> = lines.iter().filter(|l| !root_lines.contains(l)).collect();
    let mut msg = format!(
        "ranks {differing:?} differ from rank 0 ({} parameters there, {} on rank {})",
        root_lines.len(),
        lines.len(),
        pg.rank()
    );
    if !only_root.is_empty() || !only_me.is_empty() {
        msg += &format!(
            "; on rank 0 only: {:?}; on rank {} only: {:?}",
            only_root.iter().take(5).collect::<Vec<_>>(),
            pg.rank(),
            only_me.iter().take(5).collect::<Vec<_>>()
        );
    } else if pg.rank() != 0 && differing.contains(&pg.rank()) {
        msg += "; same parameters in a different order";
    }
    Err(DdpError::ParamMismatch(msg))
}
