//! The job's data plane: this server's QUIC node (mutual TLS with the cluster's certificates)
//! connected to the job's other servers, and one cancellable fabric endpoint per local rank.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use grandis_fabric::{Endpoint, Topology};
use grandis_quic::{NodeConfig, NodeIdentity, QuicNode};
use grandis_wire::Assignment;

use super::{check_cancel, Cancellable, JobContext};

/// Binds the node on the daemon's reserved data port, connects it to every server of the job
/// (bounded by `connect_timeout_ms`) and returns it with this server's rank endpoints.
pub(super) fn connect(
    ctx: &JobContext,
    a: &Assignment,
    topology: Topology,
) -> anyhow::Result<(QuicNode, Vec<Endpoint>)> {
    let cfg = &ctx.config;
    let identity = NodeIdentity::load(&cfg.cert_dir, &cfg.label).with_context(|| {
        format!(
            "loading this node's certificate from {}",
            cfg.cert_dir.display()
        )
    })?;
    let roster: Vec<String> = a.servers.iter().map(|x| x.label.clone()).collect();
    let addrs = a
        .servers
        .iter()
        .map(|x| {
            crate::config::resolve(&x.data_addr)
                .with_context(|| format!("data address of server '{}'", x.label))
        })
        .collect::<anyhow::Result<Vec<SocketAddr>>>()?;
    let me = a.server_index as usize;
    let mut node_cfg = NodeConfig::new(topology, roster, me, ctx.data_addr, identity);
    node_cfg.idle_timeout = cfg.peer_timeout();
    node_cfg.keep_alive = (cfg.peer_timeout() / 4).max(Duration::from_millis(5));
    node_cfg.handshake_timeout = cfg.connect_timeout().min(Duration::from_secs(10));
    // Sessions are keyed by job and attempt: a peer still on a previous job, or on an
    // earlier run of this one, is refused at the hello.
    node_cfg.session = a.session();
    // Release the reserved port just before the node binds it.
    drop(
        ctx.reserved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(),
    );
    let node = QuicNode::bind(node_cfg).context("starting the data plane")?;
    let transports = node.take_transports()?;
    let cancelled = || ctx.cancel.load(Ordering::SeqCst);
    node.establish(&addrs, cfg.connect_timeout(), &cancelled)
        .context("connecting to the job's other servers")?;
    check_cancel(ctx)?;
    tracing::info!(servers = topology.servers, "data plane connected");
    let endpoints = transports
        .into_iter()
        .map(|t| {
            let rank = t.rank();
            let t = Cancellable {
                inner: t,
                cancel: ctx.cancel.clone(),
            };
            Endpoint::with_transport(topology, rank, Box::new(t), cfg.recv_timeout())
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((node, endpoints))
}
