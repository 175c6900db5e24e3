//! Small helpers shared by the benchmarks and examples that measure collectives.

use std::time::Duration;

/// Parses a message size in bytes: a number with an optional `K`, `M` or `G` suffix (powers
/// of two), e.g. `4K`, `64M`.
///
/// ```
/// use bonfire_comm::testing::bench::parse_size;
/// assert_eq!(parse_size("4K"), Ok(4096));
/// assert_eq!(parse_size(" 64m "), Ok(64 << 20));
/// assert!(parse_size("lots").is_err());
/// ```
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (digits, scale) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits
        .parse::<usize>()
        .map(|n| n * scale)
        .map_err(|_| format!("size `{s}`: expected a number with an optional K, M or G suffix"))
}

/// Iterations per timed round so that a round lasts about `round`, assuming `bytes` move at
/// 4 GB/s plus `latency` per call, clamped to `3..=max`.
pub fn iterations(bytes: usize, round: Duration, latency: Duration, max: usize) -> usize {
    let estimate = bytes as f64 / 4e9 + latency.as_secs_f64();
    ((round.as_secs_f64() / estimate) as usize).clamp(3, max)
}
