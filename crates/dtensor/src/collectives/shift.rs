//! The host side of the overlapped ring shift ([`CollectiveKind::ShiftStart`] and
//! [`CollectiveKind::ShiftFinish`]): the start posts a send and a receive on the group's send
//! and receive threads and keeps their handles in this thread's table, under the tag; the
//! finish takes them back, waits, and records how much of the transfer ran while this thread
//! computed ([`crate::timing::take_shift_overlap`]).
//!
//! [`CollectiveKind::ShiftStart`]: super::CollectiveKind::ShiftStart
//! [`CollectiveKind::ShiftFinish`]: super::CollectiveKind::ShiftFinish

use super::buffers::{check, slice, slice_mut};
use crate::debug::record;
use crate::timing::record_shift;
use bonfire_comm::{Element as CommElement, OpKind, ProcessGroup, Work};
use burn::tensor::{Element as BurnElement, TensorData};
use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Instant;

/// A shift in flight: its two handles (typed `Work<Vec<T>>`) and when it was posted.
struct Posted {
    sent: Box<dyn Any>,
    received: Box<dyn Any>,
    at: Instant,
}

/// Which posted shift: the tag, and the group's size and this rank in it.
type Key = (u64, usize, usize);

thread_local! {
    static POSTED: RefCell<HashMap<Key, Posted>> = RefCell::new(HashMap::new());
}

fn key(pg: &ProcessGroup, tag: u64) -> Key {
    (tag, pg.size(), pg.rank())
}

/// Posts `data` to rank `+ offset` and a receive from rank `- offset` (`offset_tag`), and
/// returns `data` (`keep`) or zeros of its shape.
pub(super) fn start<T>(
    pg: &ProcessGroup,
    data: TensorData,
    (offset, tag): (usize, u64),
    keep: bool,
) -> TensorData
where
    T: CommElement + BurnElement + Copy,
{
    let (me, n) = (pg.rank(), pg.size());
    let (dst, src) = ((me + offset) % n, (me + n - offset % n) % n);
    let at = Instant::now();
    let values: Vec<T> = slice::<T>(&data).to_vec();
    let len = values.len();
    let (sent, received) = if dst == me {
        (Work::ready(Ok(Vec::new())), Work::ready(Ok(values)))
    } else {
        record(OpKind::Send);
        record(OpKind::Recv);
        let received = pg.recv_async(vec![<T as CommElement>::from_f64(0.0); len], src, tag);
        (pg.send_async(values, dst, tag), received)
    };
    let posted = Posted {
        sent: Box::new(sent),
        received: Box::new(received),
        at,
    };
    let clash = POSTED.with(|p| p.borrow_mut().insert(key(pg, tag), posted));
    assert!(
        clash.is_none(),
        "bonfire-dtensor: a ring shift with tag {tag:#x} is already in flight on this rank"
    );
    if keep {
        data
    } else {
        TensorData::new(
            vec![<T as CommElement>::from_f64(0.0); len],
            data.shape().clone(),
        )
    }
}

/// The value of a finished call, or the panic every failed collective raises.
fn done<V>(result: bonfire_comm::Result<V>, what: &str) -> V {
    match result {
        Ok(v) => v,
        Err(e) => {
            check(Err(e), what);
            unreachable!("check panics on an error")
        }
    }
}

/// Waits for the shift of `tag` posted on this thread; returns what arrived, or `data` plus
/// it (`add`).
pub(super) fn finish<T>(pg: &ProcessGroup, mut data: TensorData, tag: u64, add: bool) -> TensorData
where
    T: CommElement + BurnElement + Copy,
{
    let posted = POSTED
        .with(|p| p.borrow_mut().remove(&key(pg, tag)))
        .unwrap_or_else(|| {
            panic!("bonfire-dtensor: no ring shift with tag {tag:#x} was started on this rank")
        });
    let typed = |b: Box<dyn Any>| {
        *b.downcast::<Work<Vec<T>>>()
            .expect("bonfire-dtensor: a ring shift finished in another dtype than it started")
    };
    let waited = Instant::now();
    let sent = typed(posted.sent).wait_timed();
    let (received, got) = done(typed(posted.received).wait_timed(), "ring recv");
    let (_, put) = done(sent, "ring send");
    record_shift(posted.at, waited, got.max(put));
    if !add {
        return TensorData::new(received, data.shape().clone());
    }
    for (d, r) in slice_mut::<T>(&mut data).iter_mut().zip(&received) {
        *d = <T as CommElement>::from_f64(CommElement::to_f64(*d) + CommElement::to_f64(*r));
    }
    data
}
