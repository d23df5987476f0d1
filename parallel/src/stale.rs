//! SANCUS's staleness-bounded halo exchange (`--staleness BOUND,MAX_SKIPS`, fb and flx).
//!
//! SANCUS (in `distdgl-bytegnn-sancus.txt`, §4.3) skips a worker's broadcast of its block of
//! embeddings while they stay within a staleness bound, and the other workers compute with the
//! copy they cached (historical embeddings). Here the block is what one rank sends one peer at
//! one layer: the boundary rows of that (layer, peer) pair. The owner re-sends them only when
//! they have moved by more than the bound since it last sent them — the paper's
//! variation-gap staleness (Definition 3), made relative (`‖H − H_sent‖ / ‖H_sent‖`, Frobenius)
//! so one bound fits every layer's scale — and at least every `max_skips + 1` epochs (the
//! epoch bound of Definition 1 on top, so no row grows arbitrarily old). A skipped send is an
//! empty message: the receiver reads it and writes the rows it cached instead.
//!
//! Only pairs on different servers are stale: inside a server the halo travels over the fast
//! links, and staleness there would cost accuracy for little. Cached rows are constants of the
//! epoch that uses them (as historical embeddings are in GNNAutoScale and SANCUS), so their
//! gradients are not sent back either: the backward exchange of a skipped pair is skipped on
//! both sides, which both know from the forward. Evaluation and inference stay exact.
//!
//! Both sides key their state by (layer, index of the send list or halo group in the plan),
//! which only means the same thing while the plans do: [`StaleHalo::follow`] forgets it all
//! when the step's plans change (FLX-EAS resampling).

use std::sync::Arc;

use anyhow::bail;
use grandis_wire::Staleness;

use crate::steps::Step;

/// What one rank's stale exchange did over the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct StaleCounts {
    /// (layer, peer) sends between servers made, and skipped.
    pub sent: u64,
    pub skipped: u64,
    /// Payload bytes not sent between servers because of skips: forward rows and the
    /// gradients of those rows in the backward.
    pub saved_bytes: u64,
}

/// Rows last sent to one peer at one layer, and the skips since.
struct Sent {
    rows: Vec<f32>,
    skips: u32,
}

/// One rank's SANCUS state.
pub(crate) struct StaleHalo {
    bound: Staleness,
    /// The step the state belongs to.
    step: Option<Arc<Step>>,
    /// `sent[layer][send list]`.
    sent: Vec<Vec<Option<Sent>>>,
    /// `received[layer][halo group]`: the rows last received.
    received: Vec<Vec<Option<Vec<f32>>>>,
    /// This step's forward decisions, read by its backward: `[layer][send list]` skipped
    /// and `[layer][halo group]` skipped.
    skipped_sends: Vec<Vec<bool>>,
    skipped_halo: Vec<Vec<bool>>,
    pub counts: StaleCounts,
}

/// Grows `v` to hold index `i` and returns that slot.
fn slot<T: Default>(v: &mut Vec<Vec<T>>, l: usize, i: usize) -> &mut T {
    if v.len() <= l {
        v.resize_with(l + 1, Vec::new);
    }
    let row = &mut v[l];
    if row.len() <= i {
        row.resize_with(i + 1, T::default);
    }
    &mut row[i]
}

impl StaleHalo {
    pub fn new(bound: Staleness) -> StaleHalo {
        StaleHalo {
            bound,
            step: None,
            sent: Vec::new(),
            received: Vec::new(),
            skipped_sends: Vec::new(),
            skipped_halo: Vec::new(),
            counts: StaleCounts::default(),
        }
    }

    /// Keeps the state while `step` is the one it was built for; forgets it otherwise.
    pub fn follow(&mut self, step: &Arc<Step>) {
        if !self.step.as_ref().is_some_and(|s| Arc::ptr_eq(s, step)) {
            self.step = Some(step.clone());
            self.sent.clear();
            self.received.clear();
        }
        self.skipped_sends.clear();
        self.skipped_halo.clear();
    }

    /// Whether `rows`, what send list `i` of layer `l` carries now, must go out; records them
    /// as sent when so, counts a skip otherwise.
    pub fn send(&mut self, l: usize, i: usize, rows: Vec<f32>) -> bool {
        let bound = self.bound;
        let entry = slot(&mut self.sent, l, i);
        let send = match entry {
            None => true,
            Some(s) if s.skips >= bound.max_skips => true,
            Some(s) => relative_change(&s.rows, &rows) > bound.bound,
        };
        if send {
            *entry = Some(Sent { rows, skips: 0 });
            self.counts.sent += 1;
        } else {
            if let Some(s) = entry {
                s.skips += 1;
            }
            self.counts.skipped += 1;
            self.counts.saved_bytes += rows.len() as u64 * 4;
            *slot(&mut self.skipped_sends, l, i) = true;
        }
        send
    }

    /// The rows of halo group `g` of layer `l` from a message that arrived: the message
    /// itself (cached for later), or for an empty message (a skipped send) the cached rows.
    pub fn arrived(&mut self, l: usize, g: usize, data: Vec<f32>) -> anyhow::Result<&[f32]> {
        let skipped = data.is_empty();
        let cached = slot(&mut self.received, l, g);
        if !skipped {
            *cached = Some(data);
        } else if cached.is_none() {
            bail!(
                "a peer skipped sending layer {l}'s halo group {g}, which it never sent: \
                 nothing cached to use instead"
            );
        }
        if skipped {
            *slot(&mut self.skipped_halo, l, g) = true;
        }
        // Present: stored above, or checked.
        Ok(slot(&mut self.received, l, g)
            .as_deref()
            .unwrap_or_default())
    }

    /// Whether this step's forward skipped send list `i` of layer `l`.
    pub fn skipped_send(&self, l: usize, i: usize) -> bool {
        self.skipped_sends
            .get(l)
            .and_then(|r| r.get(i))
            .copied()
            .unwrap_or(false)
    }

    /// Whether this step's forward used cached rows for halo group `g` of layer `l`.
    pub fn skipped_halo(&self, l: usize, g: usize) -> bool {
        self.skipped_halo
            .get(l)
            .and_then(|r| r.get(g))
            .copied()
            .unwrap_or(false)
    }

    /// Counts gradient bytes the backward did not send for cached rows.
    pub fn saved(&mut self, bytes: u64) {
        self.counts.saved_bytes += bytes;
    }
}

/// `‖new − old‖ / ‖old‖` (Frobenius); 0 when both are zero, infinite when only `old` is.
fn relative_change(old: &[f32], new: &[f32]) -> f64 {
    if old.len() != new.len() {
        return f64::INFINITY;
    }
    let (mut diff, mut base) = (0f64, 0f64);
    for (&a, &b) in old.iter().zip(new) {
        let d = f64::from(b) - f64::from(a);
        diff += d * d;
        base += f64::from(a) * f64::from(a);
    }
    if diff == 0.0 {
        0.0
    } else if base == 0.0 {
        f64::INFINITY
    } else {
        (diff / base).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn halo(bound: f64, max_skips: u32) -> StaleHalo {
        StaleHalo::new(Staleness { bound, max_skips })
    }

    #[test]
    fn sends_when_moved_past_the_bound_or_skipped_too_often() {
        let mut st = halo(0.1, 2);
        assert!(st.send(0, 0, vec![1.0, 0.0]), "nothing sent yet");
        // 5% change: within the bound, skipped twice, then sent by the epoch bound.
        assert!(!st.send(0, 0, vec![1.05, 0.0]));
        assert!(st.skipped_send(0, 0));
        assert!(!st.send(0, 0, vec![1.05, 0.0]));
        assert!(st.send(0, 0, vec![1.05, 0.0]), "max skips reached");
        // Compared with what was last SENT (1.05), not the last value seen.
        assert!(!st.send(0, 0, vec![1.1, 0.0]));
        assert!(
            st.send(0, 0, vec![1.2, 0.0]),
            "moved 14% since the last send"
        );
        assert_eq!(
            st.counts,
            StaleCounts {
                sent: 3,
                skipped: 3,
                saved_bytes: 3 * 8
            }
        );
        // Other layers and peers are independent.
        assert!(st.send(1, 0, vec![1.0, 0.0]) && st.send(0, 1, vec![1.0, 0.0]));
    }

    #[test]
    fn receivers_reuse_what_they_last_received() {
        let mut st = halo(0.5, 3);
        assert!(
            st.arrived(0, 0, Vec::new()).is_err(),
            "a skip before any send is an error"
        );
        assert_eq!(st.arrived(0, 0, vec![1.0, 2.0]).unwrap(), [1.0, 2.0]);
        assert!(!st.skipped_halo(0, 0));
        assert_eq!(st.arrived(0, 0, Vec::new()).unwrap(), [1.0, 2.0]);
        assert!(st.skipped_halo(0, 0));
    }

    #[test]
    fn a_new_step_forgets_everything() {
        let step = |_: ()| Arc::new(Step::new(Vec::new(), 0));
        let (a, b) = (step(()), step(()));
        let mut st = halo(1.0, 5);
        st.follow(&a);
        assert!(st.send(0, 0, vec![1.0]));
        assert!(!st.send(0, 0, vec![1.0]));
        st.follow(&a);
        assert!(!st.skipped_send(0, 0), "decisions are per step");
        assert!(!st.send(0, 0, vec![1.0]), "same plans: still cached");
        st.follow(&b);
        assert!(st.send(0, 0, vec![1.0]), "new plans: sent afresh");
    }

    #[test]
    fn relative_change_is_scale_free() {
        assert_eq!(relative_change(&[0.0], &[0.0]), 0.0);
        assert!(relative_change(&[0.0], &[1.0]).is_infinite());
        let small = relative_change(&[1.0, 1.0], &[1.5, 1.0]);
        let large = relative_change(&[64.0, 64.0], &[96.0, 64.0]);
        assert!((small - large).abs() < 1e-9);
    }
}
