//! Traffic accounting: bytes and messages per epoch × link class × layer × phase × direction,
//! seconds spent waiting per link class, and seconds spent inside fabric calls.
//!
//! Each [`crate::Endpoint`] accumulates into a private `CounterSet`; [`Counters`] is the
//! plain, serde-serialisable snapshot handed to callers. Snapshots are sorted by key so that
//! their JSON is stable, and [`Counters::sum`] adds snapshots of many ranks key by key.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::tag::{Phase, Tag};

/// The link classes counted by: `grandis_wire`'s, the one definition.
pub use grandis_wire::LinkClass;

/// Direction of a transfer as seen by the rank that counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Bytes this rank sent.
    Sent,
    /// Bytes this rank received.
    Received,
}

/// Traffic of one (link class, layer, phase) within one epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkRecord {
    /// Link class (decided by the servers of sender and receiver).
    pub class: LinkClass,
    /// Layer of the tag.
    pub layer: u32,
    /// Phase of the tag.
    pub phase: Phase,
    /// Payload bytes sent (`f32` = 4 bytes; headers are not counted).
    pub bytes_sent: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// Messages sent (including empty ones).
    pub messages_sent: u64,
    /// Messages received.
    pub messages_received: u64,
    /// Seconds blocked receiving from peers of this class, including emulated link time.
    pub wait_seconds: f64,
}

/// Calls and wall time spent inside fabric operations of one (layer, phase) within one epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    /// Layer of the tag.
    pub layer: u32,
    /// Phase of the tag.
    pub phase: Phase,
    /// Number of fabric calls (exchange, all_reduce_sum, ...).
    pub calls: u64,
    /// Wall seconds inside those calls (sends, waits, reductions).
    pub seconds: f64,
}

/// Everything counted in one epoch.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochCounters {
    /// The epoch (from [`Tag::epoch`]).
    pub epoch: u32,
    /// Payload bytes SENT over inter-server links (bytes put on the wire; summed over all
    /// ranks this is the cluster's inter-server traffic, each byte counted once).
    pub bytes_inter_server: u64,
    /// Payload bytes SENT over intra-server links.
    pub bytes_intra_server: u64,
    /// Wall seconds inside fabric calls of this epoch (summed over ranks by [`Counters::sum`]).
    pub seconds: f64,
    /// Per (class, layer, phase) detail, sorted by that key.
    pub links: Vec<LinkRecord>,
    /// Per (layer, phase) call time, sorted by that key.
    pub calls: Vec<CallRecord>,
}

impl EpochCounters {
    /// Bytes of `class` in direction `dir`, over all layers and phases.
    pub fn bytes(&self, class: LinkClass, dir: Direction) -> u64 {
        self.bytes_where(dir, |r| r.class == class)
    }

    /// Bytes in direction `dir` over the records selected by `keep`.
    pub fn bytes_where(&self, dir: Direction, keep: impl Fn(&LinkRecord) -> bool) -> u64 {
        self.links
            .iter()
            .filter(|r| keep(r))
            .map(|r| match dir {
                Direction::Sent => r.bytes_sent,
                Direction::Received => r.bytes_received,
            })
            .sum()
    }

    /// Bytes of one (class, layer, phase) in direction `dir`.
    pub fn bytes_for(&self, class: LinkClass, layer: u32, phase: Phase, dir: Direction) -> u64 {
        self.bytes_where(dir, |r| {
            r.class == class && r.layer == layer && r.phase == phase
        })
    }

    /// Seconds blocked receiving from peers of `class`.
    pub fn wait_seconds(&self, class: LinkClass) -> f64 {
        self.links
            .iter()
            .filter(|r| r.class == class)
            .map(|r| r.wait_seconds)
            .sum()
    }
}

/// Snapshot of an endpoint's counters (or a sum over endpoints), sorted by epoch.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    /// One entry per epoch that saw any traffic or call, ascending.
    pub epochs: Vec<EpochCounters>,
}

impl Counters {
    /// The counters of `epoch`, if it saw any traffic.
    pub fn epoch(&self, epoch: u32) -> Option<&EpochCounters> {
        self.epochs.iter().find(|e| e.epoch == epoch)
    }

    /// Bytes of `class` in direction `dir`, over all epochs.
    pub fn bytes(&self, class: LinkClass, dir: Direction) -> u64 {
        self.epochs.iter().map(|e| e.bytes(class, dir)).sum()
    }

    /// Total inter-server bytes sent, over all epochs.
    pub fn bytes_inter_server(&self) -> u64 {
        self.epochs.iter().map(|e| e.bytes_inter_server).sum()
    }

    /// Total intra-server bytes sent, over all epochs.
    pub fn bytes_intra_server(&self) -> u64 {
        self.epochs.iter().map(|e| e.bytes_intra_server).sum()
    }

    /// Adds `other` into `self`, key by key (bytes, messages and seconds are summed).
    pub fn merge(&mut self, other: &Counters) {
        let mut set = CounterSet::default();
        set.absorb(self);
        set.absorb(other);
        *self = set.snapshot();
    }

    /// Sum of many snapshots, e.g. of all ranks. Seconds become rank-seconds.
    pub fn sum<'a>(all: impl IntoIterator<Item = &'a Counters>) -> Counters {
        let mut set = CounterSet::default();
        for c in all {
            set.absorb(c);
        }
        set.snapshot()
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct LinkCell {
    bytes_sent: u64,
    bytes_received: u64,
    messages_sent: u64,
    messages_received: u64,
    wait_seconds: f64,
}

#[derive(Clone, Copy, Debug, Default)]
struct CallCell {
    calls: u64,
    seconds: f64,
}

/// Accumulator behind an endpoint. Keys are ordered so that snapshots are sorted for free.
#[derive(Clone, Debug, Default)]
pub(crate) struct CounterSet {
    links: BTreeMap<(u32, LinkClass, u32, Phase), LinkCell>,
    calls: BTreeMap<(u32, u32, Phase), CallCell>,
}

impl CounterSet {
    fn link(&mut self, tag: Tag, class: LinkClass) -> &mut LinkCell {
        self.links
            .entry((tag.epoch, class, tag.layer, tag.phase))
            .or_default()
    }

    pub(crate) fn add_sent(&mut self, tag: Tag, class: LinkClass, bytes: usize) {
        let cell = self.link(tag, class);
        cell.bytes_sent += bytes as u64;
        cell.messages_sent += 1;
    }

    pub(crate) fn add_received(&mut self, tag: Tag, class: LinkClass, bytes: usize) {
        let cell = self.link(tag, class);
        cell.bytes_received += bytes as u64;
        cell.messages_received += 1;
    }

    pub(crate) fn add_wait(&mut self, tag: Tag, class: LinkClass, waited: Duration) {
        self.link(tag, class).wait_seconds += waited.as_secs_f64();
    }

    pub(crate) fn add_call(&mut self, tag: Tag, spent: Duration) {
        let cell = self
            .calls
            .entry((tag.epoch, tag.layer, tag.phase))
            .or_default();
        cell.calls += 1;
        cell.seconds += spent.as_secs_f64();
    }

    /// Adds a snapshot key by key.
    fn absorb(&mut self, c: &Counters) {
        for e in &c.epochs {
            for r in &e.links {
                let cell = self
                    .links
                    .entry((e.epoch, r.class, r.layer, r.phase))
                    .or_default();
                cell.bytes_sent += r.bytes_sent;
                cell.bytes_received += r.bytes_received;
                cell.messages_sent += r.messages_sent;
                cell.messages_received += r.messages_received;
                cell.wait_seconds += r.wait_seconds;
            }
            for r in &e.calls {
                let cell = self.calls.entry((e.epoch, r.layer, r.phase)).or_default();
                cell.calls += r.calls;
                cell.seconds += r.seconds;
            }
        }
    }

    pub(crate) fn snapshot(&self) -> Counters {
        let mut epochs: BTreeMap<u32, EpochCounters> = BTreeMap::new();
        fn entry(epochs: &mut BTreeMap<u32, EpochCounters>, epoch: u32) -> &mut EpochCounters {
            epochs.entry(epoch).or_insert_with(|| EpochCounters {
                epoch,
                ..Default::default()
            })
        }
        for (&(epoch, class, layer, phase), cell) in &self.links {
            let e = entry(&mut epochs, epoch);
            match class {
                LinkClass::InterServer => e.bytes_inter_server += cell.bytes_sent,
                LinkClass::IntraServer => e.bytes_intra_server += cell.bytes_sent,
            }
            e.links.push(LinkRecord {
                class,
                layer,
                phase,
                bytes_sent: cell.bytes_sent,
                bytes_received: cell.bytes_received,
                messages_sent: cell.messages_sent,
                messages_received: cell.messages_received,
                wait_seconds: cell.wait_seconds,
            });
        }
        for (&(epoch, layer, phase), cell) in &self.calls {
            let e = entry(&mut epochs, epoch);
            e.seconds += cell.seconds;
            e.calls.push(CallRecord {
                layer,
                phase,
                calls: cell.calls,
                seconds: cell.seconds,
            });
        }
        Counters {
            epochs: epochs.into_values().collect(),
        }
    }
}
