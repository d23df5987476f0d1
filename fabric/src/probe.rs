//! Measuring the links a job's ranks will use, over the transport they will use: a short
//! collective every rank of the topology calls ([`Endpoint::probe_links`]). Each class is
//! measured in a ring, so every link of the class carries the same traffic at once, as in a
//! halo exchange: the devices of a server each send to the next one, then the servers' heads
//! each send to the next server's head. Per class: the one-way time of a one-value message
//! (the median of a few rounds after a warm-up: one round the scheduler delayed on a busy
//! machine moves a mean, and with it the bandwidth the latency is taken out of, but not the
//! median) and the payload bandwidth of large messages (the fastest of [`BANDWIDTH_ROUNDS`],
//! sized to the link: at most the caller's size).

use std::time::Instant;

use grandis_wire::LinkRate;

use crate::{Endpoint, Phase, Result, Tag};

/// Tags of the probe's traffic carry this epoch: apart from training's, evaluation's and
/// inference's.
pub const PROBE_EPOCH: u32 = 1 << 29;

/// Rounds of the latency measurement (after one warm-up round).
const PINGS: usize = 8;

/// Messages of the bandwidth measurement; the fastest counts. The first one over a fresh
/// connection pays its transport's ramp-up (QUIC's slow start, queues filling behind a rate
/// limiter), which a job's sustained exchanges do not; later ones now and then a congestion
/// back-off. Three rounds of half a second left one server in three measuring 0.78x a shaped
/// 20 mbit link (tests/netns); six of a fifth of a second, 0.91-1.0x.
const BANDWIDTH_ROUNDS: usize = 6;

/// The first bandwidth message (at most the caller's size); each later one is sized to last
/// about [`ROUND_SECONDS`] at the rate measured so far (between this and the caller's size),
/// so a slow link is not probed for seconds and a fast one still with large messages.
const FIRST_BYTES: usize = 1 << 20;
const ROUND_SECONDS: f64 = 0.2;

/// What one rank measured: the classes it took part in.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LinkProbe {
    /// Its link to the next device of its server (absent with one device per server).
    pub intra: Option<LinkRate>,
    /// Its server's link to the next server (heads only; absent with one server).
    pub inter: Option<LinkRate>,
}

impl Endpoint {
    /// Measures this rank's links with messages of at most `bytes` for the bandwidth.
    /// Collective: every rank of the topology must call it.
    pub fn probe_links(&mut self, bytes: usize) -> Result<LinkProbe> {
        let tag = Tag::new(PROBE_EPOCH, 0, Phase::Other);
        let topo = self.topology();
        let (server, device) = (self.server(), self.device());
        let values = (bytes / 4).max(1);
        self.barrier(tag)?;
        let intra = match topo.devices {
            0 | 1 => None,
            g => {
                let next = topo.rank_of(server, (device + 1) % g);
                let prev = topo.rank_of(server, (device + g - 1) % g);
                Some(self.ring(next, prev, values, tag, Ring::Devices)?)
            }
        };
        self.barrier(tag)?;
        let inter = match topo.servers {
            s if s > 1 && self.is_head() => {
                let next = topo.head_of((server + 1) % s);
                let prev = topo.head_of((server + s - 1) % s);
                Some(self.ring(next, prev, values, tag, Ring::Heads)?)
            }
            _ => None,
        };
        self.barrier(tag)?;
        Ok(LinkProbe { intra, inter })
    }

    /// One ring measurement: send to `next`, receive from `prev`.
    fn ring(
        &mut self,
        next: usize,
        prev: usize,
        values: usize,
        tag: Tag,
        ring: Ring,
    ) -> Result<LinkRate> {
        let mut hop = || -> Result<f64> {
            let start = Instant::now();
            self.send(next, vec![0.0], tag)?;
            self.recv_exact(prev, 1, tag)?;
            Ok(start.elapsed().as_secs_f64())
        };
        hop()?;
        let mut pings = (0..PINGS).map(|_| hop()).collect::<Result<Vec<f64>>>()?;
        pings.sort_by(f64::total_cmp);
        let latency = (pings[(PINGS - 1) / 2] + pings[PINGS / 2]) / 2.0;
        // A large message pays the link's fixed cost once; the fastest ping is the best bound
        // on it. Taking the median out instead overstated the bandwidth whenever the scheduler
        // delayed a few pings (a busy CI machine measured 1.35x the emulated rate): with the
        // floor a delay can only understate a round, and the fastest round counts.
        let fixed_cost = pings[0];
        let first = (FIRST_BYTES / 4).clamp(1, values);
        let (mut size, mut best) = (first, 0.0f64);
        for _ in 0..BANDWIDTH_ROUNDS {
            // Every member starts the round together: a round times this member's sending
            // *and* `prev`'s, so a `prev` that started late (its previous round ended later,
            // or the scheduler held it) read as a slow link. Unaligned, one of three daemons
            // sharing two cores measured 0.72x the shaped rate, and the plan, which takes
            // the slowest server's, overpredicted every candidate by a third.
            self.meet(ring, tag)?;
            let start = Instant::now();
            self.send(next, vec![0.0; size], tag)?;
            // `prev` sized its message by its own measurements.
            let got = self.recv(prev, tag)?.len();
            let transfer = (start.elapsed().as_secs_f64() - fixed_cost).max(1e-9);
            best = best.max((got * 4) as f64 / transfer);
            size = ((best * ROUND_SECONDS / 4.0) as usize).clamp(first, values);
        }
        Ok(LinkRate {
            bandwidth_bytes_per_s: best,
            latency_s: latency,
        })
    }
}

/// The members of a ring: the devices of every server at once, or the servers' heads.
#[derive(Debug, Clone, Copy)]
enum Ring {
    Devices,
    Heads,
}

impl Endpoint {
    /// Waits until every member of `ring` has come here.
    fn meet(&mut self, ring: Ring, tag: Tag) -> Result<()> {
        match ring {
            // Every rank is in one of the device rings (with more than one device a server).
            Ring::Devices => self.barrier(tag),
            Ring::Heads => self.heads_all_reduce_sum(&mut [], tag),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Fabric, FabricConfig, LinkModel};
    use std::time::Duration;

    /// On emulated links the probe measures what the emulator was given: bandwidth within
    /// 25 %, latency at least the configured one and not far above it.
    #[test]
    fn the_probe_measures_the_emulated_links() {
        let (intra_bw, inter_bw) = (400e6, 50e6);
        let (intra_lat, inter_lat) = (Duration::from_micros(200), Duration::from_millis(2));
        let fabric = Fabric::new(FabricConfig {
            servers: 2,
            devices: 2,
            intra: LinkModel::new(intra_bw, intra_lat),
            inter: LinkModel::new(inter_bw, inter_lat),
            ..FabricConfig::default()
        })
        .unwrap();
        let probes = fabric.run(|mut ep| Ok(ep.probe_links(8 << 20)?)).unwrap();
        for (rank, p) in probes.iter().enumerate() {
            let intra = p.intra.expect("every rank measures its intra-server link");
            let ratio = intra.bandwidth_bytes_per_s / intra_bw;
            assert!(
                (0.75..1.25).contains(&ratio),
                "rank {rank} intra: {intra:?}"
            );
            assert!(
                intra.latency_s >= intra_lat.as_secs_f64() && intra.latency_s < 0.01,
                "rank {rank} intra: {intra:?}"
            );
            match (rank % 2 == 0, p.inter) {
                (true, Some(inter)) => {
                    let ratio = inter.bandwidth_bytes_per_s / inter_bw;
                    assert!(
                        (0.75..1.25).contains(&ratio),
                        "rank {rank} inter: {inter:?}"
                    );
                    assert!(
                        inter.latency_s >= inter_lat.as_secs_f64() && inter.latency_s < 0.02,
                        "rank {rank} inter: {inter:?}"
                    );
                }
                (false, None) => {}
                (head, inter) => panic!("rank {rank} (head: {head}) measured inter {inter:?}"),
            }
        }
    }

    /// One server of one device has nothing to measure.
    #[test]
    fn a_single_rank_measures_nothing() {
        let fabric = Fabric::new(FabricConfig::default()).unwrap();
        let probes = fabric.run(|mut ep| Ok(ep.probe_links(1024)?)).unwrap();
        assert_eq!(probes, vec![LinkProbe::default()]);
    }
}
