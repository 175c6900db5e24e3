//! Process-wide MPI state: the control communicator, exit notices from peers, buffered sends
//! still in flight, the failure flag and the abort watchdog.
//!
//! Every MPI call of the backend goes through [`Runtime::call`], which serialises calls with a
//! mutex when the library did not grant `MPI_THREAD_MULTIPLE`.

use mpi::ffi;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::wire;

/// Tag of exit notices on the control communicator.
const EXIT_TAG: c_int = 7;

/// How long a peer's exit notice may precede a message it already sent before the peer is
/// declared gone (messages on different communicators are not ordered).
pub(crate) const EXIT_GRACE: Duration = Duration::from_millis(200);

/// A communicator handle (a pointer in OpenMPI) that may move between threads: MPI objects
/// are process-global and every call is made under the runtime's rules.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Comm(pub ffi::MPI_Comm);
// SAFETY: see above; the handle itself is an opaque, immutable token.
unsafe impl Send for Comm {}
// SAFETY: as for `Send`: an opaque handle, every call on it made under the runtime's rules.
unsafe impl Sync for Comm {}

/// A request handle that may move between threads (see [`Comm`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request(pub ffi::MPI_Request);
// SAFETY: an opaque request handle like [`Comm`]; it is tested or waited on only under the
// runtime's rules.
unsafe impl Send for Request {}
// SAFETY: as for `Send`.
unsafe impl Sync for Request {}

impl Request {
    pub(crate) fn null() -> Self {
        // SAFETY: reading an initialised extern constant.
        Request(unsafe { ffi::RSMPI_REQUEST_NULL })
    }
    pub(crate) fn is_null(&self) -> bool {
        // SAFETY: as above.
        self.0 == unsafe { ffi::RSMPI_REQUEST_NULL }
    }
}

struct ExitState {
    /// When each world rank's exit notice arrived.
    seen: Vec<Option<Instant>>,
    received: usize,
    /// The posted receive for the next notice (null once every peer's has arrived).
    req: Request,
    buf: Box<wire::Words>,
    /// Our own notices, in flight.
    sent: Vec<(Request, Box<wire::Words>)>,
}

/// State shared by every MPI group of this process.
pub(crate) struct Runtime {
    pub world_rank: usize,
    pub world_size: usize,
    /// A duplicate of `MPI_COMM_WORLD` for control traffic (exit notices).
    ctrl: Comm,
    /// `Some` when MPI calls must be serialised (no `MPI_THREAD_MULTIPLE`).
    serial: Option<Mutex<()>>,
    /// The value of `MPI_IN_PLACE` for this library, when known.
    in_place: Option<usize>,
    exits: Mutex<ExitState>,
    /// Buffered sends in flight and their buffers.
    sends: Mutex<Vec<(Request, Vec<u8>)>>,
    pool: Mutex<Vec<Vec<u8>>>,
    failed: AtomicBool,
    pub library: String,
}

static RUNTIME: OnceLock<Arc<Runtime>> = OnceLock::new();

/// The runtime, once [`super::MpiWorld::init`] ran.
#[allow(dead_code)]
pub(crate) fn get() -> Option<&'static Arc<Runtime>> {
    RUNTIME.get()
}

pub(crate) fn install(rt: Arc<Runtime>) {
    let _ = RUNTIME.set(rt);
}

/// Ends the whole job now: `MPI_Abort` on `MPI_COMM_WORLD`, then `exit` as a fallback.
pub fn abort_job(code: i32) -> ! {
    if RUNTIME.get().is_some() {
        // SAFETY: MPI is initialised; MPI_Abort may be called from any thread.
        unsafe {
            ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
        }
    }
    std::process::exit(code)
}

/// Grace period between a fatal error and `MPI_Abort` (`BONFIRE_MPI_ABORT_GRACE_SECS`).
fn abort_grace() -> Duration {
    std::env::var("BONFIRE_MPI_ABORT_GRACE_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s >= 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(Duration::from_secs(2))
}

fn library_version() -> String {
    let mut buf = vec![0u8; 8192];
    let mut len: c_int = 0;
    // SAFETY: the buffer is larger than MPI_MAX_LIBRARY_VERSION_STRING.
    unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr() as *mut _, &mut len) };
    buf.truncate(len.max(0) as usize);
    String::from_utf8_lossy(&buf)
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .trim_end_matches('\0')
        .to_string()
}

impl Runtime {
    /// Builds the runtime after `MPI_Init_thread`. `multiple`: whether the library granted
    /// `MPI_THREAD_MULTIPLE`.
    pub(crate) fn new(multiple: bool) -> Arc<Self> {
        let (mut rank, mut size) = (0, 0);
        // SAFETY: reads a constant handle the MPI bindings export (an immutable extern static).
        let mut ctrl: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: MPI is initialised; plain queries and a dup of the world communicator.
        unsafe {
            ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank);
            ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size);
            ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut ctrl);
        }
        let library = library_version();
        // MPI_IN_PLACE is a macro, not a symbol: OpenMPI defines it as (void*)1 and MPICH
        // (and its derivatives) as (void*)-1. Unknown libraries use a scratch copy instead.
        let in_place = if library.contains("Open MPI") {
            Some(1usize)
        } else if library.contains("MPICH") || library.contains("Intel(R) MPI") {
            Some(usize::MAX)
        } else {
            None
        };
        let rt = Arc::new(Runtime {
            world_rank: rank as usize,
            world_size: size as usize,
            ctrl: Comm(ctrl),
            serial: (!multiple).then(|| Mutex::new(())),
            in_place,
            exits: Mutex::new(ExitState {
                seen: vec![None; size as usize],
                received: 0,
                req: Request::null(),
                buf: Box::new([0; wire::WORDS]),
                sent: Vec::new(),
            }),
            sends: Mutex::new(Vec::new()),
            pool: Mutex::new(Vec::new()),
            failed: AtomicBool::new(false),
            library,
        });
        rt.post_exit_recv(&mut rt.exits.lock().unwrap_or_else(|e| e.into_inner()));
        rt
    }

    /// Runs `f` (which makes MPI calls) under the serialisation lock when one is needed.
    pub(crate) fn call<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.serial {
            Some(lock) => {
                let _guard = lock.lock().unwrap_or_else(|e| e.into_inner());
                f()
            }
            None => f(),
        }
    }

    /// `MPI_IN_PLACE` for this library, if known.
    pub(crate) fn in_place(&self) -> Option<*const c_void> {
        self.in_place.map(|v| v as *const c_void)
    }

    fn post_exit_recv(&self, st: &mut ExitState) {
        if st.received + 1 >= self.world_size {
            st.req = Request::null();
            return;
        }
        let mut req = Request::null().0;
        // SAFETY: the buffer is boxed and lives in the runtime until the request completes.
        self.call(|| unsafe {
            ffi::MPI_Irecv(
                st.buf.as_mut_ptr() as *mut c_void,
                wire::WORDS as c_int,
                ffi::RSMPI_UINT64_T,
                ffi::RSMPI_ANY_SOURCE,
                EXIT_TAG,
                self.ctrl.0,
                &mut req,
            )
        });
        st.req = Request(req);
    }

    /// Tests a request; `true` when it completed (it is then null).
    pub(crate) fn test(&self, req: &mut Request) -> bool {
        if req.is_null() {
            return true;
        }
        let mut flag: c_int = 0;
        // SAFETY: a valid request; status ignored.
        self.call(|| unsafe { ffi::MPI_Test(&mut req.0, &mut flag, ffi::RSMPI_STATUS_IGNORE) });
        flag != 0
    }

    /// Drives background traffic: completes buffered sends and collects exit notices.
    pub(crate) fn progress(&self) {
        {
            let mut sends = self.sends.lock().unwrap_or_else(|e| e.into_inner());
            if !sends.is_empty() {
                let mut i = 0;
                while i < sends.len() {
                    if self.test(&mut sends[i].0) {
                        let (_, buf) = sends.swap_remove(i);
                        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
                        if pool.len() < 16 {
                            pool.push(buf);
                        }
                    } else {
                        i += 1;
                    }
                }
            }
        }
        let mut st = self.exits.lock().unwrap_or_else(|e| e.into_inner());
        if st.req.is_null() {
            return;
        }
        let mut flag: c_int = 0;
        // SAFETY: a valid status struct to fill in.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: `st.req` is a live request (checked non-null above); `flag` and `status` are
        // live out-pointers.
        self.call(|| unsafe { ffi::MPI_Test(&mut st.req.0, &mut flag, &mut status) });
        if flag != 0 {
            let src = status.MPI_SOURCE as usize;
            if src < st.seen.len() && st.seen[src].is_none() {
                st.seen[src] = Some(Instant::now());
                st.received += 1;
            }
            self.post_exit_recv(&mut st);
        }
    }

    /// Whether world rank `r` shut down long enough ago that a message still missing from it
    /// will never come.
    pub(crate) fn gone(&self, world_rank: usize) -> bool {
        let st = self.exits.lock().unwrap_or_else(|e| e.into_inner());
        st.seen
            .get(world_rank)
            .copied()
            .flatten()
            .is_some_and(|t| t.elapsed() >= EXIT_GRACE)
    }

    /// A buffer for an outgoing message (reused from completed sends).
    pub(crate) fn buffer(&self) -> Vec<u8> {
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default()
    }

    /// Returns a buffer to the pool.
    pub(crate) fn recycle(&self, buf: Vec<u8>) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < 16 {
            pool.push(buf);
        }
    }

    /// Starts a buffered send of `buf` (owned until it completes).
    pub(crate) fn isend(&self, buf: Vec<u8>, dst: usize, tag: c_int, comm: Comm) {
        let mut req = Request::null().0;
        // SAFETY: the buffer is moved into `sends` (its heap storage does not move) and kept
        // until the request completes.
        self.call(|| unsafe {
            ffi::MPI_Isend(
                buf.as_ptr() as *const c_void,
                buf.len() as c_int,
                ffi::RSMPI_UINT8_T,
                dst as c_int,
                tag,
                comm.0,
                &mut req,
            )
        });
        self.sends
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((Request(req), buf));
    }

    pub(crate) fn has_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// Records a fatal error: prints it and ends the job after a grace period (so the caller
    /// can still report it). An MPI communicator cannot recover from a rank that is gone or
    /// stuck, so a timeout or a lost peer always ends the job.
    pub(crate) fn fail(&self, message: &str) {
        if self.failed.swap(true, Ordering::SeqCst) {
            return;
        }
        let grace = abort_grace();
        eprintln!(
            "bonfire-comm[mpi] rank {}: fatal communication error; the MPI job will be \
             aborted in {:.1}s:\n{message}",
            self.world_rank,
            grace.as_secs_f64()
        );
        let rank = self.world_rank;
        let _ = std::thread::Builder::new()
            .name("bonfire-mpi-abort".into())
            .spawn(move || {
                std::thread::sleep(grace);
                eprintln!("bonfire-comm[mpi] rank {rank}: calling MPI_Abort");
                abort_job(1);
            });
    }

    /// Normal shutdown: tells every peer this rank is done, then waits until every peer said
    /// the same and every buffered send completed, so `MPI_Finalize` cannot hang on a peer
    /// that is still waiting for this rank. If this rank failed, or a peer is waiting for it
    /// in a call it will never make, the job is aborted instead.
    pub(crate) fn shutdown(&self, timeout: Duration) {
        if self.has_failed() {
            eprintln!(
                "bonfire-comm[mpi] rank {}: shutting down after a fatal error; calling MPI_Abort",
                self.world_rank
            );
            abort_job(1);
        }
        {
            let mut st = self.exits.lock().unwrap_or_else(|e| e.into_inner());
            for dst in (0..self.world_size).filter(|&d| d != self.world_rank) {
                let notice = Box::new(wire::exit_notice(self.world_rank));
                let mut req = Request::null().0;
                // SAFETY: the boxed notice is kept in `sent` until the request completes.
                self.call(|| unsafe {
                    ffi::MPI_Isend(
                        notice.as_ptr() as *const c_void,
                        wire::WORDS as c_int,
                        ffi::RSMPI_UINT64_T,
                        dst as c_int,
                        EXIT_TAG,
                        self.ctrl.0,
                        &mut req,
                    )
                });
                st.sent.push((Request(req), notice));
            }
        }
        let started = Instant::now();
        let mut backoff = Backoff::new();
        loop {
            self.progress();
            let done = {
                let mut st = self.exits.lock().unwrap_or_else(|e| e.into_inner());
                let mut sent = std::mem::take(&mut st.sent);
                sent.retain_mut(|(req, _)| !self.test(req));
                st.sent = sent;
                st.sent.is_empty() && st.received + 1 >= self.world_size
            } && self
                .sends
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty();
            if done {
                return;
            }
            if self.has_failed() {
                abort_job(1);
            }
            if started.elapsed() > timeout {
                let missing: Vec<usize> = {
                    let st = self.exits.lock().unwrap_or_else(|e| e.into_inner());
                    (0..self.world_size)
                        .filter(|&r| r != self.world_rank && st.seen[r].is_none())
                        .collect()
                };
                eprintln!(
                    "bonfire-comm[mpi] rank {}: shutdown timed out after {timeout:?}: ranks \
                     {missing:?} did not finish, or a sent message was never received; \
                     calling MPI_Abort",
                    self.world_rank
                );
                abort_job(1);
            }
            backoff.snooze();
        }
    }
}

/// Polling pace: spin (yielding) briefly, then sleep with growing naps up to 1 ms, so a
/// waiting rank does not starve the others on a machine with few cores.
pub(crate) struct Backoff {
    polls: u32,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Self { polls: 0 }
    }
    pub(crate) fn snooze(&mut self) {
        self.polls += 1;
        if self.polls < 64 {
            std::hint::spin_loop();
        } else if self.polls < 256 {
            std::thread::yield_now();
        } else {
            let us = (self.polls as u64 - 255).min(1000);
            std::thread::sleep(Duration::from_micros(us));
        }
    }
}
