//! The defaults of every job field that has one, in one place: `JobSpec::default`, the
//! spec reader and every command-line front end take them from here.

use super::kinds::{Mode, ModelKind, PartitionMethod, Priority};

pub const MODEL: ModelKind = ModelKind::Sage;
pub const LAYERS: u32 = 2;
pub const HIDDEN: u32 = 64;
/// GAT: attention heads of each hidden layer (concatenated), as in the GAT paper.
pub const HEADS: u32 = 8;
/// GAT: attention heads of the last layer (averaged).
pub const OUTPUT_HEADS: u32 = 1;
pub const DROPOUT: f64 = 0.5;
pub const LR: f64 = 0.01;
pub const WEIGHT_DECAY: f64 = 5e-4;
pub const MODE: Mode = Mode::Flx;
pub const EPOCHS: u32 = 100;
/// Evaluate after every epoch (and after the last).
pub const EVAL_EVERY: u32 = 1;
pub const SEED: u64 = 0;
pub const SERVERS: u32 = 1;
pub const DEVICES: u32 = 1;
pub const PARTITION: PartitionMethod = PartitionMethod::Metis;
/// Target vertices per batch of cob (per server) and mb (per device).
pub const BATCH_SIZE: u32 = 1024;
/// EAS: external vertices at most this many hops from the server (the paper's h).
pub const EAS_HOPS: u32 = 1;
/// EAS: at most this many external in-neighbours per vertex (the paper's f).
pub const EAS_FANOUT: u32 = 15;
pub const EAS_PRIORITY: Priority = Priority::Degree;
/// Layer-wise sampling: sources per vertex at every layer.
pub const FANOUT: u32 = 25;
/// GraphSAINT: random-walk length.
pub const SAINT_WALK_LENGTH: u32 = 2;
/// GraphSAINT: roots per server when neither `batch_size` nor `roots` is given (the
/// budget is then `roots × (walk_length + 1)`).
pub const SAINT_ROOTS: u32 = 3000;
/// Times a cluster job is put back in the queue after losing a server (or the
/// coordinator) before it fails.
pub const MAX_RETRIES: u32 = 2;
/// auto: how many times faster than the fastest exact plan a sampled one must be
/// predicted to be chosen.
pub const EXACT_PREFERENCE: f64 = 1.2;
