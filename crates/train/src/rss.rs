//! The host memory a step held: Linux's resident high-water mark of the process (`VmHWM` in
//! `/proc/self/status`), reset at a step's start (`5` written to `/proc/self/clear_refs`).
//! Elsewhere there is none to read.

/// Resets the process's resident high-water mark to what it holds now (Linux; nothing
/// elsewhere).
pub(crate) fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The process's resident high-water mark since the last [`reset_peak`], in bytes (`None`
/// where the system does not say).
pub fn peak_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
