//! The NCCL unique id and how ranks agree on it: rank 0 creates it (`ncclGetUniqueId`) and
//! shares it over an existing [`ProcessGroup`] or the TCP rendezvous, with a failure on
//! rank 0 reaching every rank instead of leaving them waiting.

use super::{error, probe};
use crate::rendezvous::Rendezvous;
use crate::{ProcessGroup, Result};
use cudarc::nccl::{result as nccl, sys as nsys};

/// The 128-byte id every rank of a new NCCL communicator must share.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({:02x?}…)", &self.0[..8])
    }
}

/// Status byte in front of a shared id: 0 = valid, 1 = rank 0 failed to create one.
const ID_OK: u8 = 0;
const ID_FAILED: u8 = 1;

impl UniqueId {
    /// Creates a new id (`ncclGetUniqueId`); needs the libraries.
    pub fn new() -> Result<UniqueId> {
        probe()?;
        let id = nccl::get_uniqueid().map_err(|e| error(format!("ncclGetUniqueId: {e:?}")))?;
        let mut bytes = [0u8; 128];
        for (b, c) in bytes.iter_mut().zip(id.internal.iter()) {
            *b = *c as u8;
        }
        Ok(UniqueId(bytes))
    }

    pub(super) fn to_sys(self) -> nsys::ncclUniqueId {
        let mut id = nsys::ncclUniqueId { internal: [0; 128] };
        for (c, b) in id.internal.iter_mut().zip(self.0) {
            *c = b as _;
        }
        id
    }

    /// Rank 0 of `pg` creates the id and broadcasts it; every rank returns it. If rank 0
    /// cannot create one (no NCCL there), every rank returns that error instead of hanging.
    pub fn share_over(pg: &ProcessGroup) -> Result<UniqueId> {
        Self::share_over_with(pg, UniqueId::new)
    }

    /// [`UniqueId::share_over`] with the id made by `make` on rank 0 (testable without NCCL).
    pub fn share_over_with(
        pg: &ProcessGroup,
        make: impl FnOnce() -> Result<UniqueId>,
    ) -> Result<UniqueId> {
        let mut msg = [0u8; 129];
        let mut failure = None;
        if pg.rank() == 0 {
            match make() {
                Ok(id) => msg[1..].copy_from_slice(&id.0),
                Err(e) => {
                    msg[0] = ID_FAILED;
                    let text = e.to_string();
                    let n = text.len().min(128);
                    msg[1..1 + n].copy_from_slice(&text.as_bytes()[..n]);
                    failure = Some(e);
                }
            }
        }
        pg.broadcast(&mut msg, 0)?;
        if let Some(e) = failure {
            return Err(e);
        }
        if msg[0] != ID_OK {
            let text = String::from_utf8_lossy(&msg[1..]);
            return Err(error(format!(
                "rank 0 could not create the NCCL id: {}",
                text.trim_end_matches('\0')
            )));
        }
        let mut id = [0u8; 128];
        id.copy_from_slice(&msg[1..]);
        Ok(UniqueId(id))
    }

    /// Shares the id over the TCP rendezvous `rv` (rank 0 creates it).
    pub fn share_tcp(rv: &Rendezvous) -> Result<UniqueId> {
        Self::share_tcp_with(rv, UniqueId::new)
    }

    /// [`UniqueId::share_tcp`] with the id made by `make` on rank 0 (testable without NCCL).
    pub fn share_tcp_with(
        rv: &Rendezvous,
        make: impl FnOnce() -> Result<UniqueId>,
    ) -> Result<UniqueId> {
        let bytes = if rv.rank == 0 {
            let id = make()?;
            rv.share(Some(&id.0))?
        } else {
            rv.share(None)?
        };
        let id: [u8; 128] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| error(format!("rendezvous sent {} bytes, not 128", bytes.len())))?;
        Ok(UniqueId(id))
    }
}
