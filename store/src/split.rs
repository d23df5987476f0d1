//! Seeded train/validation/test splits for datasets that come without one.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Train, validation and test vertex ids, each sorted ascending.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub train: Vec<u32>,
    pub val: Vec<u32>,
    pub test: Vec<u32>,
}

/// The Planetoid-style split (Yang et al. 2016, used for Cora by Kipf & Welling):
/// `per_class` random labelled vertices of each class for training, then `val` and `test`
/// vertices drawn at random from the rest. Unlabelled vertices (label < 0) are never drawn.
pub fn per_class_split(
    labels: &[i32],
    num_classes: usize,
    per_class: usize,
    val: usize,
    test: usize,
    seed: u64,
) -> Split {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<u32> = (0..labels.len() as u32)
        .filter(|&v| labels[v as usize] >= 0)
        .collect();
    order.shuffle(&mut rng);
    let mut taken = vec![0usize; num_classes];
    let mut split = Split::default();
    let mut rest = Vec::with_capacity(order.len());
    for v in order {
        let c = labels[v as usize] as usize;
        if c < num_classes && taken[c] < per_class {
            taken[c] += 1;
            split.train.push(v);
        } else {
            rest.push(v);
        }
    }
    let val_end = val.min(rest.len());
    let test_end = (val_end + test).min(rest.len());
    split.val = rest[..val_end].to_vec();
    split.test = rest[val_end..test_end].to_vec();
    split.train.sort_unstable();
    split.val.sort_unstable();
    split.test.sort_unstable();
    split
}

/// Random fractional split of all labelled vertices (e.g. 0.6 / 0.2 / 0.2). `test` defaults
/// to the rest; a smaller one leaves vertices in no split (papers100M labels 1.4% of its
/// vertices, and evaluating on the other 98% would dominate every epoch).
pub fn fraction_split(labels: &[i32], train: f64, val: f64, test: Option<f64>, seed: u64) -> Split {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<u32> = (0..labels.len() as u32)
        .filter(|&v| labels[v as usize] >= 0)
        .collect();
    order.shuffle(&mut rng);
    let n = order.len();
    let n_train = ((n as f64) * train).round() as usize;
    let n_val = (((n as f64) * val).round() as usize).min(n - n_train.min(n));
    let n_train = n_train.min(n);
    let rest = n - n_train - n_val;
    let n_test = test.map_or(rest, |t| (((n as f64) * t).round() as usize).min(rest));
    let mut split = Split {
        train: order[..n_train].to_vec(),
        val: order[n_train..n_train + n_val].to_vec(),
        test: order[n_train + n_val..n_train + n_val + n_test].to_vec(),
    };
    split.train.sort_unstable();
    split.val.sort_unstable();
    split.test.sort_unstable();
    split
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_class_split_takes_per_class_then_val_test() {
        let labels: Vec<i32> = (0..300).map(|i| i % 3).collect();
        let s = per_class_split(&labels, 3, 20, 50, 100, 7);
        assert_eq!(s.train.len(), 60);
        for c in 0..3 {
            assert_eq!(
                s.train.iter().filter(|&&v| labels[v as usize] == c).count(),
                20
            );
        }
        assert_eq!((s.val.len(), s.test.len()), (50, 100));
        let mut all: Vec<u32> = s
            .train
            .iter()
            .chain(&s.val)
            .chain(&s.test)
            .copied()
            .collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 210);
        assert_eq!(s, per_class_split(&labels, 3, 20, 50, 100, 7));
        assert_ne!(s, per_class_split(&labels, 3, 20, 50, 100, 8));
    }

    #[test]
    fn fraction_split_covers_all_labelled() {
        let mut labels = vec![0i32; 100];
        labels[5] = -1;
        let s = fraction_split(&labels, 0.6, 0.2, None, 1);
        assert_eq!(s.train.len() + s.val.len() + s.test.len(), 99);
        assert!(!s.train.contains(&5) && !s.val.contains(&5) && !s.test.contains(&5));
        let small = fraction_split(&labels, 0.6, 0.2, Some(0.1), 1);
        assert_eq!((small.train, small.val), (s.train, s.val));
        assert_eq!(small.test.len(), 10);
        assert!(small.test.iter().all(|v| s.test.contains(v)));
    }
}
