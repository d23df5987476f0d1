//! The input of plan building: which (server, device) owns which contiguous global id range.

use std::ops::Range;

use crate::error::{MaskingError, Result};

/// Contiguous, server-major ownership of global vertex ids, as produced by the two-level
/// partitioner after relabelling. Rank `r = server * devices + device` owns `ranges[r]`; the
/// ranges tile `0..num_vertices` in rank order (empty ranges are allowed). Kept independent of
/// the partition crate so that plans can be built from any relabelled graph.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Layout {
    servers: usize,
    devices: usize,
    ranges: Vec<Range<u32>>,
}

impl Layout {
    /// Validates that `ranges` has `servers * devices` entries tiling `0..n` in order.
    pub fn new(servers: usize, devices: usize, ranges: Vec<Range<u32>>) -> Result<Layout> {
        if servers == 0 || devices == 0 {
            return Err(MaskingError::Layout(format!(
                "servers ({servers}) and devices per server ({devices}) must both be at least 1"
            )));
        }
        // Devices are stored as u16 inside the FLX builder's per-vertex slots.
        if devices > u16::MAX as usize - 1 {
            return Err(MaskingError::Layout(format!(
                "{devices} devices per server is more than the supported {}",
                u16::MAX - 1
            )));
        }
        let ranks = servers
            .checked_mul(devices)
            .ok_or_else(|| MaskingError::Layout(format!("{servers} x {devices} ranks overflow")))?;
        if ranges.len() != ranks {
            return Err(MaskingError::Layout(format!(
                "{} ranges given for {servers} servers x {devices} devices = {ranks} ranks",
                ranges.len()
            )));
        }
        let mut next = 0u32;
        for (rank, r) in ranges.iter().enumerate() {
            if r.start != next || r.end < r.start {
                return Err(MaskingError::Layout(format!(
                    "range of rank {rank} is {}..{}: ranges must be contiguous and in rank order \
                     (expected it to start at {next})",
                    r.start, r.end
                )));
            }
            next = r.end;
        }
        Ok(Layout {
            servers,
            devices,
            ranges,
        })
    }

    /// From `ranks + 1` boundaries (`bounds[r]..bounds[r + 1]` is rank r's range).
    pub fn from_bounds(servers: usize, devices: usize, bounds: &[u32]) -> Result<Layout> {
        if bounds.len() < 2 {
            return Err(MaskingError::Layout(format!(
                "{} boundaries given; need servers * devices + 1",
                bounds.len()
            )));
        }
        if bounds[0] != 0 {
            return Err(MaskingError::Layout(format!(
                "the first boundary is {}, not 0",
                bounds[0]
            )));
        }
        let ranges = bounds.windows(2).map(|w| w[0]..w[1]).collect();
        Layout::new(servers, devices, ranges)
    }

    /// Equal-sized contiguous ranges (sizes differ by at most one), for tests and benchmarks.
    pub fn even(num_vertices: u32, servers: usize, devices: usize) -> Result<Layout> {
        let ranks = (servers * devices).max(1) as u64;
        let n = num_vertices as u64;
        let bounds: Vec<u32> = (0..=ranks).map(|r| (n * r / ranks) as u32).collect();
        Layout::from_bounds(servers, devices, &bounds)
    }

    pub fn servers(&self) -> usize {
        self.servers
    }
    pub fn devices(&self) -> usize {
        self.devices
    }
    pub fn num_ranks(&self) -> usize {
        self.ranges.len()
    }
    pub fn num_vertices(&self) -> u32 {
        self.ranges.last().map_or(0, |r| r.end)
    }
    pub fn ranges(&self) -> &[Range<u32>] {
        &self.ranges
    }
    /// Rank of device `device` of server `server`.
    pub fn rank(&self, server: usize, device: usize) -> usize {
        server * self.devices + device
    }
    pub fn server_of_rank(&self, rank: usize) -> usize {
        rank / self.devices
    }
    pub fn device_of_rank(&self, rank: usize) -> usize {
        rank % self.devices
    }
    pub fn range(&self, rank: usize) -> Range<u32> {
        self.ranges[rank].clone()
    }
    /// The inner vertices of a server (all its devices' ranges, which are adjacent).
    pub fn server_range(&self, server: usize) -> Range<u32> {
        let first = self.rank(server, 0);
        let last = self.rank(server, self.devices - 1);
        self.ranges[first].start..self.ranges[last].end
    }
    /// Rank owning global vertex `v` (`v < num_vertices`), by binary search.
    pub fn owner(&self, v: u32) -> usize {
        debug_assert!(v < self.num_vertices());
        // Ends are non-decreasing; the first range ending after v starts at or before v
        // because the ranges tile 0..n, so empty ranges are skipped correctly.
        self.ranges.partition_point(|r| r.end <= v)
    }
    pub fn server_of(&self, v: u32) -> usize {
        self.server_of_rank(self.owner(v))
    }
    /// Device index within its server of the owner of `v`.
    pub fn device_of(&self, v: u32) -> usize {
        self.device_of_rank(self.owner(v))
    }
    /// Whether two ranks share a server (their link is intra-server).
    pub fn same_server(&self, a: usize, b: usize) -> bool {
        self.server_of_rank(a) == self.server_of_rank(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_skips_empty_ranges() {
        let l = Layout::from_bounds(2, 2, &[0, 3, 3, 3, 8]).unwrap();
        assert_eq!(l.owner(0), 0);
        assert_eq!(l.owner(2), 0);
        assert_eq!(l.owner(3), 3);
        assert_eq!(l.owner(7), 3);
        assert_eq!(l.server_of(5), 1);
        assert_eq!(l.device_of(5), 1);
        assert_eq!(l.server_range(0), 0..3);
        assert_eq!(l.server_range(1), 3..8);
    }

    #[test]
    fn rejects_gaps_and_wrong_counts() {
        assert!(Layout::new(1, 2, vec![0..2, 3..4]).is_err());
        let one_range: Vec<Range<u32>> = std::iter::once(0..2).collect();
        assert!(Layout::new(1, 2, one_range).is_err());
        assert!(Layout::new(0, 2, vec![]).is_err());
        assert!(Layout::from_bounds(1, 1, &[1, 4]).is_err());
        let e = Layout::even(10, 2, 3).unwrap();
        assert_eq!(e.num_vertices(), 10);
        assert_eq!(e.num_ranks(), 6);
    }
}
