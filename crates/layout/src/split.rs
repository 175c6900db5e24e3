//! [`even_split_points`]: where `n` items are cut into `parts` runs of nearly equal length.

/// The `parts − 1` indices where `n` items are cut into `parts` consecutive runs whose
/// lengths differ by at most one, the first runs the longer: the trainer's default pipeline
/// stages and the planner's model of them.
///
/// ```
/// assert_eq!(bonfire_layout::even_split_points(10, 4), vec![3, 6, 8]);
/// assert_eq!(bonfire_layout::even_split_points(4, 1), Vec::<usize>::new());
/// ```
pub fn even_split_points(n: usize, parts: usize) -> Vec<usize> {
    let mut at = 0;
    (0..parts.saturating_sub(1))
        .map(|i| {
            at += n / parts + usize::from(i < n % parts);
            at
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_differ_by_at_most_one_and_cover_everything() {
        for n in 1..20 {
            for parts in 1..=n {
                let mut cuts = vec![0];
                cuts.extend(even_split_points(n, parts));
                cuts.push(n);
                let lens: Vec<usize> = cuts.windows(2).map(|w| w[1] - w[0]).collect();
                assert_eq!(lens.len(), parts);
                assert_eq!(lens.iter().sum::<usize>(), n);
                assert!(
                    lens.windows(2).all(|w| w[0] >= w[1] && w[0] - w[1] <= 1),
                    "{lens:?}"
                );
            }
        }
    }
}
