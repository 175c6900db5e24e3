//! TCP rendezvous: rank 0 shares a small blob (the NCCL unique id) with every rank, given
//! `MASTER_ADDR` / `MASTER_PORT` — the torchrun convention — so a GPU job can bootstrap
//! without MPI. Pure `std`, always compiled (and tested on CPU).
//!
//! Protocol (one round, all integers little-endian):
//! - rank 0 listens on `0.0.0.0:MASTER_PORT`; every other rank connects to
//!   `MASTER_ADDR:MASTER_PORT`, retrying until the deadline (rank 0 may start later);
//! - a client sends `b"BONFIRE\x01"`, its rank (u32), the world size (u32) and the job key
//!   (u64, e.g. a digest of the launch; 0 if unused);
//! - rank 0 checks each hello (size and key agree, rank in range and not seen before) and,
//!   once all `size − 1` peers are in, answers each with status 0, the payload length (u32)
//!   and the payload. A bad hello is answered with status 1 and a message, and fails the
//!   rendezvous on rank 0 too. Nothing waits forever: every step honours the deadline.

use crate::{CommError, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"BONFIRE\x01";
const BACKEND: &str = "tcp-rendezvous";

fn error(message: String) -> CommError {
    CommError::Backend {
        backend: BACKEND,
        message,
    }
}

/// Where rank 0 listens and what every rank agrees on.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    /// Host name or address of rank 0, which the other ranks connect to.
    pub master_addr: String,
    /// TCP port rank 0 listens on.
    pub master_port: u16,
    /// This process's rank (0 serves the payload).
    pub rank: usize,
    /// Number of ranks taking part.
    pub size: usize,
    /// Must be equal on every rank (guards against two jobs sharing a port).
    pub key: u64,
    /// Deadline of the whole rendezvous, from the start of [`Rendezvous::share`].
    pub timeout: Duration,
}

impl Rendezvous {
    /// From `MASTER_ADDR`, `MASTER_PORT`, with the given rank and size.
    pub fn from_env(rank: usize, size: usize, timeout: Duration) -> Result<Self> {
        let addr = std::env::var("MASTER_ADDR")
            .map_err(|_| error("MASTER_ADDR is not set (needed for the TCP rendezvous)".into()))?;
        let port = std::env::var("MASTER_PORT")
            .map_err(|_| error("MASTER_PORT is not set (needed for the TCP rendezvous)".into()))?;
        let port = port
            .trim()
            .parse::<u16>()
            .map_err(|_| error(format!("MASTER_PORT={port:?} is not a port number")))?;
        Ok(Self {
            master_addr: addr,
            master_port: port,
            rank,
            size,
            key: 0,
            timeout,
        })
    }

    /// Rank 0 passes `Some(payload)` and returns it; the others pass `None` and receive it.
    pub fn share(&self, payload: Option<&[u8]>) -> Result<Vec<u8>> {
        if self.size == 0 || self.rank >= self.size {
            return Err(error(format!(
                "rank {} is out of range for {} ranks",
                self.rank, self.size
            )));
        }
        let deadline = Instant::now() + self.timeout;
        match (self.rank, payload) {
            (0, Some(payload)) => self.serve(payload, deadline).map(|_| payload.to_vec()),
            (0, None) => Err(error("rank 0 must provide the payload".into())),
            (_, Some(_)) => Err(error("only rank 0 provides the payload".into())),
            (_, None) => self.fetch(deadline),
        }
    }

    fn serve(&self, payload: &[u8], deadline: Instant) -> Result<()> {
        let listener = TcpListener::bind(("0.0.0.0", self.master_port)).map_err(|e| {
            error(format!(
                "rank 0 cannot listen on port {}: {e}",
                self.master_port
            ))
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| error(format!("set_nonblocking: {e}")))?;
        let mut peers: Vec<Option<TcpStream>> = (0..self.size).map(|_| None).collect();
        let mut joined = 1;
        while joined < self.size {
            match listener.accept() {
                Ok((mut stream, from)) => {
                    stream
                        .set_nonblocking(false)
                        .map_err(|e| error(format!("socket: {e}")))?;
                    match self.read_hello(&mut stream, deadline) {
                        Ok(rank) if rank != 0 && peers[rank].is_none() => {
                            peers[rank] = Some(stream);
                            joined += 1;
                        }
                        Ok(rank) => {
                            let why = format!(
                                "rank {rank} joined twice (second time from {from}) or claims to be rank 0"
                            );
                            let _ = reply_error(&mut stream, &why);
                            return Err(error(why));
                        }
                        Err(why) => {
                            let _ = reply_error(&mut stream, &why);
                            return Err(error(format!("bad hello from {from}: {why}")));
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> =
                            (1..self.size).filter(|&r| peers[r].is_none()).collect();
                        return Err(error(format!(
                            "rank 0 timed out after {:?} on port {}: ranks {missing:?} did not connect",
                            self.timeout, self.master_port
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(error(format!("accept: {e}"))),
            }
        }
        let len = u32::try_from(payload.len()).map_err(|_| error("payload too large".into()))?;
        for stream in peers.iter_mut().flatten() {
            let mut msg = Vec::with_capacity(5 + payload.len());
            msg.push(0u8);
            msg.extend_from_slice(&len.to_le_bytes());
            msg.extend_from_slice(payload);
            stream
                .write_all(&msg)
                .map_err(|e| error(format!("sending the payload: {e}")))?;
        }
        Ok(())
    }

    /// Reads and checks a hello; returns the peer's rank or why it is refused.
    fn read_hello(&self, stream: &mut TcpStream, deadline: Instant) -> Result<usize, String> {
        let mut hello = [0u8; 24];
        read_exact_by(stream, &mut hello, deadline).map_err(|e| format!("reading hello: {e}"))?;
        if &hello[..8] != MAGIC {
            return Err("not a Bonfire rendezvous client (bad magic)".into());
        }
        let rank = u32::from_le_bytes(hello[8..12].try_into().expect("4 bytes")) as usize;
        let size = u32::from_le_bytes(hello[12..16].try_into().expect("4 bytes")) as usize;
        let key = u64::from_le_bytes(hello[16..24].try_into().expect("8 bytes"));
        if size != self.size {
            return Err(format!(
                "rank {rank} says the world has {size} ranks, rank 0 says {}",
                self.size
            ));
        }
        if key != self.key {
            return Err(format!(
                "rank {rank} has job key {key:#x}, rank 0 has {:#x}",
                self.key
            ));
        }
        if rank >= self.size {
            return Err(format!("rank {rank} is out of range for {size} ranks"));
        }
        Ok(rank)
    }

    fn fetch(&self, deadline: Instant) -> Result<Vec<u8>> {
        let target = format!("{}:{}", self.master_addr, self.master_port);
        let mut stream = loop {
            let addrs: Vec<SocketAddr> = target
                .to_socket_addrs()
                .map_err(|e| error(format!("cannot resolve MASTER_ADDR {target}: {e}")))?
                .collect();
            let attempt = addrs
                .iter()
                .find_map(|a| TcpStream::connect_timeout(a, Duration::from_millis(500)).ok());
            if let Some(stream) = attempt {
                break stream;
            }
            if Instant::now() >= deadline {
                return Err(error(format!(
                    "rank {} could not connect to rank 0 at {target} within {:?}",
                    self.rank, self.timeout
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut hello = Vec::with_capacity(24);
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&(self.rank as u32).to_le_bytes());
        hello.extend_from_slice(&(self.size as u32).to_le_bytes());
        hello.extend_from_slice(&self.key.to_le_bytes());
        stream
            .write_all(&hello)
            .map_err(|e| error(format!("sending hello to {target}: {e}")))?;
        let mut head = [0u8; 5];
        read_exact_by(&mut stream, &mut head, deadline).map_err(|e| {
            error(format!(
                "rank {} waiting for rank 0 at {target} (the other ranks may not all have \
                 joined): {e}",
                self.rank
            ))
        })?;
        let len = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes")) as usize;
        let mut body = vec![0u8; len];
        read_exact_by(&mut stream, &mut body, deadline)
            .map_err(|e| error(format!("reading from rank 0: {e}")))?;
        if head[0] != 0 {
            return Err(error(format!(
                "rank 0 refused rank {}: {}",
                self.rank,
                String::from_utf8_lossy(&body)
            )));
        }
        Ok(body)
    }
}

fn reply_error(stream: &mut TcpStream, why: &str) -> std::io::Result<()> {
    let mut msg = vec![1u8];
    msg.extend_from_slice(&(why.len() as u32).to_le_bytes());
    msg.extend_from_slice(why.as_bytes());
    stream.write_all(&msg)
}

/// `read_exact` that gives up at `deadline`.
fn read_exact_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "timed out",
            ));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[at..]) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed",
                ));
            }
            Ok(n) => at += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn rv(port: u16, rank: usize, size: usize, secs: f64) -> Rendezvous {
        Rendezvous {
            master_addr: "127.0.0.1".into(),
            master_port: port,
            rank,
            size,
            key: 7,
            timeout: Duration::from_secs_f64(secs),
        }
    }

    #[test]
    fn every_rank_gets_the_payload_even_if_rank_0_starts_last() {
        let port = free_port();
        let id: Vec<u8> = (0..128u8).collect();
        let results: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
            let clients: Vec<_> = (1..4)
                .map(|r| s.spawn(move || rv(port, r, 4, 10.0).share(None)))
                .collect();
            std::thread::sleep(Duration::from_millis(200));
            let root = rv(port, 0, 4, 10.0).share(Some(&id));
            std::iter::once(root)
                .chain(clients.into_iter().map(|h| h.join().unwrap()))
                .collect()
        });
        for r in results {
            assert_eq!(r.unwrap(), id);
        }
    }

    #[test]
    fn disagreeing_world_size_fails_both_sides() {
        let port = free_port();
        let (root, client) = std::thread::scope(|s| {
            let c = s.spawn(move || rv(port, 1, 3, 5.0).share(None));
            let root = rv(port, 0, 2, 5.0).share(Some(b"id"));
            (root, c.join().unwrap())
        });
        let (root, client) = (
            root.unwrap_err().to_string(),
            client.unwrap_err().to_string(),
        );
        assert!(root.contains("3 ranks"), "{root}");
        assert!(client.contains("rank 0 refused"), "{client}");
    }

    #[test]
    fn duplicate_rank_is_refused() {
        let port = free_port();
        let (root, a, b) = std::thread::scope(|s| {
            let a = s.spawn(move || rv(port, 1, 3, 3.0).share(None));
            let b = s.spawn(move || rv(port, 1, 3, 3.0).share(None));
            let root = rv(port, 0, 3, 3.0).share(Some(b"id"));
            (root, a.join().unwrap(), b.join().unwrap())
        });
        assert!(root.unwrap_err().to_string().contains("twice"));
        assert!(a.is_err() || b.is_err());
    }

    #[test]
    fn missing_ranks_time_out_with_names_and_an_absent_root_times_out() {
        let port = free_port();
        let t = Instant::now();
        let err = rv(port, 0, 3, 0.5)
            .share(Some(b"id"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("ranks [1, 2] did not connect"), "{err}");
        assert!(t.elapsed() < Duration::from_secs(3));
        let port = free_port();
        let err = rv(port, 2, 3, 0.5).share(None).unwrap_err().to_string();
        assert!(err.contains("could not connect"), "{err}");
    }

    #[test]
    fn argument_checks() {
        assert!(rv(1, 3, 3, 1.0).share(None).is_err());
        assert!(rv(1, 0, 3, 1.0).share(None).is_err());
        assert!(rv(1, 1, 3, 1.0).share(Some(b"x")).is_err());
    }
}
