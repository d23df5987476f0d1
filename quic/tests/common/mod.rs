//! Helpers shared by the integration tests: certificates in a temporary directory and nodes on
//! 127.0.0.1 with ports chosen at run time.
#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

use grandis_fabric::{Envelope, Header, Op, Payload, Tag, Topology};
use grandis_quic::{init_cluster, NodeConfig, NodeIdentity, QuicNode};

pub fn roster(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// A node config with short timeouts, so that failing tests fail fast.
pub fn config(dir: &Path, topology: Topology, names: &[&str], server: usize) -> NodeConfig {
    let identity = NodeIdentity::load(dir, names[server]).expect("load identity");
    let mut c = NodeConfig::new(
        topology,
        roster(names),
        server,
        "127.0.0.1:0".parse().unwrap(),
        identity,
    );
    c.handshake_timeout = Duration::from_secs(10);
    c.idle_timeout = Duration::from_secs(20);
    c.keep_alive = Duration::from_secs(2);
    c
}

/// One CA and one node per server; returns the bound nodes (not yet connected).
pub fn nodes(dir: &Path, topology: Topology, names: &[&str]) -> Vec<QuicNode> {
    init_cluster(dir, names).expect("init certs");
    (0..topology.servers)
        .map(|s| QuicNode::bind(config(dir, topology, names, s)).expect("bind"))
        .collect()
}

/// Connects all nodes (higher index dials lower) and waits for the full mesh.
pub fn mesh(nodes: &[QuicNode]) {
    let addrs: Vec<_> = nodes.iter().map(QuicNode::local_addr).collect();
    std::thread::scope(|s| {
        for n in nodes {
            let addrs = &addrs;
            s.spawn(move || {
                n.establish(addrs, Duration::from_secs(20), &|| false)
                    .expect("establish")
            });
        }
    });
}

pub fn env(epoch: u32, payload: Payload) -> Envelope {
    Envelope {
        header: Header {
            tag: Tag::other(epoch, 0),
            op: Op::PointToPoint,
        },
        payload,
    }
}

pub const WAIT: Duration = Duration::from_secs(20);
