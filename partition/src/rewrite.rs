//! Writes the relabelled dataset in one sequential pass over the source per component, so
//! partitioning a graph larger than memory needs O(V) memory plus fixed-size buffers: inside
//! each relabelling bucket ([`Relabel::buckets`]) new ids follow old ids in order, so every
//! bucket of the output fills sequentially ([`grandis_store::RangeWriter`]) while the source
//! is read front to back, its pages released behind the cursor.

use grandis_store::{Dataset, DatasetWriter};
use rayon::prelude::*;

use crate::{Relabel, Result, PASS_BLOCK_EDGES};

/// The bucket of new id `new`.
fn bucket_of(r: &Relabel, new: u32) -> usize {
    r.buckets.partition_point(|&b| b <= new as u64) - 1
}

/// Writes the offsets and sources of the relabelled graph: row `new` is the old row of
/// `new_to_old[new]`, mapped to new ids and re-sorted. Returns the new offsets.
pub(crate) fn graph(ds: &Dataset, r: &Relabel, writer: &mut DatasetWriter) -> Result<Vec<u64>> {
    let src = ds.graph();
    let n = src.num_vertices();
    let mut offsets = Vec::with_capacity(n + 1);
    offsets.push(0u64);
    let mut total = 0u64;
    for &old in &r.new_to_old {
        total += src.degree(old) as u64;
        offsets.push(total);
    }
    writer.write_offsets(&offsets)?;
    let edge_starts: Vec<u64> = r.buckets.iter().map(|&v| offsets[v as usize]).collect();
    let mut out = writer.indices_by_range(&edge_starts)?;
    let mut mapped: Vec<u32> = Vec::new();
    let mut progress = grandis_telemetry::Progress::new("relabel edges", Some(total));
    for rows in src.row_blocks(0..n, PASS_BLOCK_EDGES) {
        let base = src.offsets[rows.start];
        let end = src.offsets[rows.end];
        mapped.clear();
        mapped.extend_from_slice(&src.indices[base as usize..end as usize]);
        let row_offsets = &src.offsets[rows.start..=rows.end];
        for_each_row_mut(row_offsets, &mut mapped, |row| {
            for s in row.iter_mut() {
                *s = r.old_to_new[*s as usize];
            }
            row.sort_unstable();
        });
        for (i, old) in rows.clone().enumerate() {
            let (a, b) = (row_offsets[i] - base, row_offsets[i + 1] - base);
            let bucket = bucket_of(r, r.old_to_new[old]);
            out.push(bucket, &mapped[a as usize..b as usize])?;
        }
        progress.inc(end - base);
        ds.release_rows(rows);
    }
    progress.finish();
    writer.finish_indices(out)?;
    Ok(offsets)
}

/// Writes the feature rows in new order.
pub(crate) fn features(ds: &Dataset, r: &Relabel, writer: &mut DatasetWriter) -> Result<()> {
    let f = ds.manifest().feature_dim as usize;
    let features = ds.features();
    // A dataset without features has dimension 0 (see `DatasetWriter::finish`): all buckets
    // are then empty.
    let starts: Vec<u64> = r.buckets.iter().map(|&v| v * f as u64).collect();
    let mut out = writer.features_by_range(&starts)?;
    if !features.is_empty() {
        let n = features.len() / f;
        let rows_per_block = ((64usize << 20) / (4 * f)).max(1);
        let mut progress = grandis_telemetry::Progress::new("relabel features", Some(n as u64));
        for first in (0..n).step_by(rows_per_block) {
            let rows = first..(first + rows_per_block).min(n);
            for old in rows.clone() {
                let bucket = bucket_of(r, r.old_to_new[old]);
                out.push(bucket, &features[old * f..(old + 1) * f])?;
            }
            progress.inc(rows.len() as u64);
            ds.release_rows(rows);
        }
        progress.finish();
    }
    writer.finish_features_by_range(out, f as u64)?;
    Ok(())
}

/// Calls `f` on every row of `data` (rows delimited by `offsets`, relative to
/// `offsets[0]`), in parallel over groups of rows.
fn for_each_row_mut(offsets: &[u64], data: &mut [u32], f: impl Fn(&mut [u32]) + Sync) {
    let rows = offsets.len() - 1;
    let per_group = rows.div_ceil(rayon::current_num_threads() * 4).max(1);
    let mut pieces: Vec<(std::ops::Range<usize>, &mut [u32])> = Vec::new();
    let mut rest = data;
    for first in (0..rows).step_by(per_group) {
        let end = (first + per_group).min(rows);
        let len = (offsets[end] - offsets[first]) as usize;
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
        pieces.push((first..end, head));
        rest = tail;
    }
    pieces.into_par_iter().for_each(|(group, piece)| {
        let mut at = 0usize;
        for i in group {
            let len = (offsets[i + 1] - offsets[i]) as usize;
            f(&mut piece[at..at + len]);
            at += len;
        }
    });
}
