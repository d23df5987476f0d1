//! A rank's halo exchanges, per layer: the forward sends owned rows and receives halo rows
//! (with SANCUS's skips when a staleness bound is set), the backward returns the halo rows'
//! gradients to their owners.

use super::*;

impl<B: Backend> Worker<'_, B> {
    /// Sends the owned rows peers need for layer `l` (gathered from `input`, the layer's input,
    /// or from the features buffer when `None`: owned ids are the same in both) and writes the
    /// halo rows that arrive into their compact rows of the same buffer. With `stale`, rows for
    /// other servers go out only when SANCUS's bound says so ([`crate::stale`]) and cached rows
    /// stand in for those a peer skipped.
    pub(super) fn exchange_forward(
        &mut self,
        l: usize,
        input: Option<&mut B::Buf>,
        d: usize,
        tag: Tag,
        stale: bool,
    ) -> anyhow::Result<()> {
        let b = self.b;
        let lr = &self.rt.layers[l];
        let plan = &self.rt.plans[lr.plan];
        let rows = &self.rt.blocks[lr.block].rows;
        let buf = match input {
            Some(x) => x,
            None => &mut self.rt.features,
        };
        let topo = self.ep.topology();
        let me = self.ep.server();
        let stale_on = stale && self.stale.is_some();
        let stale_peer = |peer: usize| stale_on && topo.server_of(peer) != me;
        let mut packed = Vec::new();
        for (i, s) in plan.sends.iter().enumerate() {
            if let Some(idx) = &lr.send_idx[i] {
                let n = b.index_len(idx) * d;
                let mut rows = b.alloc(n)?;
                b.gather_rows(buf, d, idx, &mut rows)?;
                let mut len = n;
                if let Some(st) = self.stale.as_mut().filter(|_| stale_peer(s.peer)) {
                    let mut host = vec![0f32; n];
                    b.download(&rows, 0, &mut host)?;
                    if !st.send(l, i, host) {
                        // An empty message: "use what you have".
                        len = 0;
                    }
                }
                packed.push((s.peer, rows, len));
            }
        }
        let sends: Vec<_> = packed
            .iter()
            .map(|(p, rows, n)| (*p, rows, 0..*n))
            .collect();
        let mut expect = Vec::new();
        let mut arrivals = Vec::new();
        for (i, (g, h)) in plan.halo.iter().zip(&rows.halo).enumerate() {
            if h.len > 0 {
                let len = h.len as usize * d;
                let skippable = stale_peer(g.peer);
                expect.push((
                    g.peer,
                    match skippable {
                        true => Expected::ExactlyOrNone(len),
                        false => Expected::Exactly(len),
                    },
                ));
                arrivals.push((i, h.compact_start as usize * d, len, skippable));
            }
        }
        let got = self
            .links
            .exchange(b, &mut self.ep, &sends, &expect, tag)
            .with_context(|| format!("forward halo exchange of layer {l}"))?;
        for ((group, at, len, skippable), arrived) in arrivals.into_iter().zip(got) {
            match arrived {
                Arrived::Host(data) => match (skippable, self.stale.as_mut()) {
                    (true, Some(st)) => b.upload_into(buf, at, st.arrived(l, group, data)?)?,
                    _ => b.upload_into(buf, at, &data)?,
                },
                Arrived::Device(rows) => b.copy_range(&rows, 0, buf, at, len)?,
            }
        }
        Ok(())
    }

    /// Sends the gradients of the halo rows of `gx` (layer `l`'s compact input gradient) back
    /// to their owners and adds the gradients received for this rank's owned rows into `gx`.
    pub(super) fn exchange_backward(
        &mut self,
        l: usize,
        gx: &mut B::Buf,
        d: usize,
        tag: Tag,
    ) -> anyhow::Result<()> {
        let b = self.b;
        let lr = &self.rt.layers[l];
        let plan = &self.rt.plans[lr.plan];
        let rows = &self.rt.blocks[lr.block].rows;
        // Rows the forward took from the stale cache were constants: no gradient goes back
        // for them, and their owner expects none.
        let mut stale = self.stale.as_mut();
        let mut sends = Vec::new();
        for (g, (group, h)) in plan.halo.iter().zip(&rows.halo).enumerate() {
            let (at, len) = (h.compact_start as usize * d, h.len as usize * d);
            match stale.as_deref_mut().filter(|st| st.skipped_halo(l, g)) {
                Some(st) => st.saved(len as u64 * 4),
                None if len > 0 => sends.push((group.peer, &*gx, at..at + len)),
                None => {}
            }
        }
        let skipped = |i: usize| stale.as_ref().is_some_and(|st| st.skipped_send(l, i));
        let mut expect = Vec::new();
        let mut lists = Vec::new();
        for (i, s) in plan.sends.iter().enumerate() {
            if let Some(idx) = lr.send_idx[i].as_ref().filter(|_| !skipped(i)) {
                expect.push((s.peer, Expected::Exactly(b.index_len(idx) * d)));
                lists.push(i);
            }
        }
        let got = self
            .links
            .exchange(b, &mut self.ep, &sends, &expect, tag)
            .with_context(|| format!("backward halo exchange of layer {l}"))?;
        let lr = &self.rt.layers[l];
        for (i, arrived) in lists.into_iter().zip(got) {
            let idx = lr.send_idx[i].as_ref().context("send index")?;
            let grads = match arrived {
                Arrived::Host(data) => b.upload(&data)?,
                Arrived::Device(grads) => grads,
            };
            b.scatter_add_rows(&grads, d, idx, gx)?;
        }
        Ok(())
    }
}
