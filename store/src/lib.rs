//! The on-disk dataset format of grandis and the in-memory views every other crate reads.
//!
//! A dataset is a directory: a JSON manifest (`dataset.json`, versioned, with counts and a
//! checksum per file) and one typed, headered binary array per component (CSR offsets and
//! sources, features, labels, splits, and a link-prediction split when there is one), opened by mmap so that a graph of hundreds of millions
//! of edges opens in milliseconds. `Dataset::open` checks headers and counts; `verify` checks
//! checksums and every id. Writers build in a staging directory and rename at the end, so a
//! failed import never leaves a half-written dataset. This crate also owns the single
//! edge-list-to-CSR path ([`EdgeListBuilder`], external-memory for graphs beyond RAM) that
//! importers and generators share.

pub mod array;
pub mod atomic;
pub mod csr;
pub mod dataset;
pub mod edges;
pub mod error;
pub mod link;
pub mod prefetch;
pub mod rows;
pub mod split;
pub mod types;
pub mod verified;

pub use array::{
    release_pages, ArraySummary, ArrayWriter, MappedArray, RangeWriter, SCAN_CHUNK_BYTES,
};
pub use atomic::{write_file_atomic, write_file_atomic_with, AtomicDir};
pub use csr::{concat_parts, CsrGraph, CsrView, DegreeStats, MAX_VERTICES};
pub use dataset::{
    Dataset, DatasetInfo, DatasetView, DatasetWriter, InMemoryDataset, Manifest, SplitSizes,
};
pub use edges::{
    graph_from_edges, EdgeError, EdgeListBuilder, EdgeOptions, SelfLoops, SortedEdges,
    DEFAULT_RUN_BYTES,
};
pub use error::{Result, StoreError};
pub use link::{
    split_edges, split_relation, EdgeSplitOptions, LinkPart, LinkSizes, LinkSplit, LinkSplitView,
};
pub use prefetch::prefetch;
pub use rows::{RowReader, RESIDENCY_SAMPLE};
pub use split::Split;
pub use types::{Relation, TypeSchema, Types, VertexType};
pub use verified::Verification;
