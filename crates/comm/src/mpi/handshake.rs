//! Phase 1 of every collective (see `backend.rs`): the fingerprint handshake. Every rank
//! exchanges its encoded fingerprint with every peer through nonblocking point-to-point
//! calls polled against the group's timeout, so a mismatch, a missing rank or a peer that
//! shut down is reported before any data moves.

use super::backend::MpiBackend;
use super::runtime::{Backoff, Request};
use super::scratch::Scratch;
use crate::backend::CallContext;
use crate::wire;
use crate::{CommError, Result};
use mpi::ffi;
use std::os::raw::{c_int, c_void};
use std::time::Instant;

/// Tag of handshake messages on a group's collective communicator.
const HANDSHAKE_TAG: c_int = 1;

impl MpiBackend {
    /// Polls `reqs` (each waiting on group rank `peers[i]`) until all completed.
    fn wait_all(
        &self,
        reqs: &mut [Request],
        peers: &[usize],
        ctx: &CallContext<'_>,
        started: Instant,
    ) -> Result<()> {
        let deadline = started + ctx.timeout;
        let mut backoff = Backoff::new();
        loop {
            self.rt.progress();
            let mut pending = false;
            for req in reqs.iter_mut() {
                if !self.rt.test(req) {
                    pending = true;
                }
            }
            if !pending {
                return Ok(());
            }
            let waiting = || {
                let mut m: Vec<usize> = reqs
                    .iter()
                    .zip(peers)
                    .filter(|(r, _)| !r.is_null())
                    .map(|(_, &p)| p)
                    .collect();
                m.sort_unstable();
                m.dedup();
                m
            };
            if let Some(&gone) = waiting().iter().find(|&&p| self.rt.gone(self.world[p])) {
                return Err(self.fatal(ctx.peer_failed(
                    gone,
                    format!(
                        "it shut down (world rank {}) without making this call",
                        self.world[gone]
                    ),
                )));
            }
            if Instant::now() >= deadline {
                return Err(self.fatal(ctx.timeout_error(waiting(), started.elapsed())));
            }
            backoff.snooze();
        }
    }

    /// Phase 1: exchange fingerprints with every peer; returns the first disagreeing peer.
    pub(super) fn handshake(&self, s: &mut Scratch, ctx: &CallContext<'_>) -> Result<()> {
        let started = Instant::now();
        let n = self.size;
        *s.mine = wire::encode(&ctx.fingerprint);
        s.theirs.resize(n, [0; wire::WORDS]);
        s.reqs.clear();
        s.peers.clear();
        for peer in (0..n).filter(|&p| p != self.rank) {
            let (mut rreq, mut sreq) = (Request::null().0, Request::null().0);
            let recv = s.theirs[peer].as_mut_ptr() as *mut c_void;
            let send = s.mine.as_ptr() as *const c_void;
            // SAFETY: the buffers live in the scratch, which outlives the requests (they are
            // completed below, or the job is aborted with the scratch still alive).
            self.rt.call(|| unsafe {
                ffi::MPI_Irecv(
                    recv,
                    wire::WORDS as c_int,
                    ffi::RSMPI_UINT64_T,
                    peer as c_int,
                    HANDSHAKE_TAG,
                    self.coll.0,
                    &mut rreq,
                );
                ffi::MPI_Isend(
                    send,
                    wire::WORDS as c_int,
                    ffi::RSMPI_UINT64_T,
                    peer as c_int,
                    HANDSHAKE_TAG,
                    self.coll.0,
                    &mut sreq,
                );
            });
            s.reqs.push(Request(rreq));
            s.peers.push(peer);
            s.reqs.push(Request(sreq));
            s.peers.push(peer);
        }
        let (mut reqs, peers) = (std::mem::take(&mut s.reqs), std::mem::take(&mut s.peers));
        let waited = self.wait_all(&mut reqs, &peers, ctx, started);
        s.reqs = reqs;
        s.peers = peers;
        if waited.is_err() {
            // Requests are still posted on the scratch buffers: keep them alive for good.
            std::mem::forget(std::mem::take(s));
        }
        waited?;
        for peer in (0..n).filter(|&p| p != self.rank) {
            match wire::decode(&s.theirs[peer]) {
                Some(fp) if fp == ctx.fingerprint => {}
                Some(fp) => return Err(ctx.mismatch(peer, fp)),
                None => {
                    return Err(self.fatal(CommError::Backend {
                        backend: "mpi",
                        message: format!("rank {peer} sent a malformed handshake"),
                    }));
                }
            }
        }
        Ok(())
    }
}
