//! The gate's count of tests: every `cargo test` run's `test result:` lines, plus one test per
//! check that runs outside the test harness (an MPI job, a failure scenario, a comparison of
//! runs). `cargo xtask test` ends with the total as one plain line, `N passed, N failed`.

use std::sync::Mutex;

static TALLY: Mutex<(usize, usize)> = Mutex::new((0, 0));

/// Adds `passed` and `failed` tests.
pub fn add(passed: usize, failed: usize) {
    let mut t = TALLY.lock().unwrap();
    t.0 += passed;
    t.1 += failed;
}

/// Counts the tests of one `cargo test` output line (`test result: ok. 3 passed; 1 failed; …`).
/// Returns whether the line was such a summary.
pub fn count_line(line: &str) -> bool {
    let Some(rest) = line.trim().strip_prefix("test result: ") else {
        return false;
    };
    let number = |word: &str| -> usize {
        rest.split(';')
            .map(str::trim)
            .find_map(|part| {
                let part = part
                    .trim_start_matches("ok.")
                    .trim_start_matches("FAILED.")
                    .trim();
                part.strip_suffix(word)?.trim().parse().ok()
            })
            .unwrap_or(0)
    };
    add(number("passed"), number("failed"));
    true
}

/// Tests failed so far.
pub fn failed() -> usize {
    TALLY.lock().unwrap().1
}

/// The total line.
pub fn total() -> String {
    let t = TALLY.lock().unwrap();
    format!("{} passed, {} failed", t.0, t.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_cargo_summaries() {
        assert!(count_line(
            "test result: ok. 13 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.42s"
        ));
        assert!(count_line(
            "test result: FAILED. 7 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out"
        ));
        assert!(!count_line("running 3 tests"));
        assert_eq!(total(), "20 passed, 2 failed");
    }
}
