//! One NCCL call on raw device buffers: the rank's compute stream synchronised, the call
//! enqueued on the rank's NCCL stream with an event after it, the event polled (at once for a
//! blocking call, at the wait for an issued one) until it completes or the timeout aborts every
//! communicator of the rank; and the call check that runs before it (the members' headers,
//! all-gathered over NCCL).

use std::fmt;
use std::sync::atomic::Ordering;
use std::time::Instant;

use burn::tensor::{DType, Shape, TensorData};
use cubecl::server::Handle;
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::NcclCommunicator;
use crate::comm::call::{Operand, Round};
use crate::comm::header::{self, HEADER, Header};
use crate::comm::{Call, CollectiveKind, Communicator, Error, Group, ReduceOp};

/// An NCCL call enqueued and not yet waited for: its buffers, kept alive until it ends, and an
/// event recorded on the NCCL stream after it.
pub(super) struct Enqueued {
    pub(super) _buffers: Box<dyn std::any::Any + Send>,
    pub(super) event: cudarc::driver::CudaEvent,
}

pub(super) fn nccl_dtype(dtype: DType) -> Result<nccl_sys::ncclDataType_t, Error> {
    use nccl_sys::ncclDataType_t as T;
    Ok(match dtype {
        DType::F64 => T::ncclFloat64,
        DType::F32 => T::ncclFloat32,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::I64 => T::ncclInt64,
        DType::I32 => T::ncclInt32,
        DType::I8 => T::ncclInt8,
        DType::U64 => T::ncclUint64,
        DType::U32 => T::ncclUint32,
        DType::U8 => T::ncclUint8,
        other => return Err(Error::UnsupportedDType(other.name().to_owned())),
    })
}

fn nccl_op(op: ReduceOp) -> nccl_sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nccl_sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => nccl_sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => nccl_sys::ncclRedOp_t::ncclMax,
    }
}

impl NcclCommunicator {
    pub(super) fn comm(&self, group: Group) -> Result<nccl_sys::ncclComm_t, Error> {
        let slot = match group {
            Group::World => self.comms.len() - 1,
            Group::Axis(a) => {
                group.size(self.mesh())?;
                a
            }
        };
        Ok(self.comms[slot].0)
    }

    pub(super) fn library(&self, call: &str, reason: impl fmt::Debug) -> Error {
        Error::Library {
            library: "NCCL",
            call: call.to_owned(),
            reason: format!("{reason:?}"),
        }
    }

    /// Aborts every NCCL communicator of this rank (after a timeout): later calls fail at once.
    pub(crate) fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            for comm in self.all_comms() {
                // SAFETY: a live communicator, aborted once (guarded by `aborted`).
                let _ = unsafe { nccl::comm_abort(comm.0) };
            }
            tracing::error!(rank = self.rank(), "NCCL timed out: communicators aborted");
        }
    }

    pub(super) fn check_alive(&self) -> Result<(), Error> {
        if self.aborted.load(Ordering::SeqCst) {
            Err(Error::Unsupported(
                "this rank's NCCL communicators were aborted after a timeout".into(),
            ))
        } else {
            Ok(())
        }
    }

    /// `call` as one NCCL call on raw CubeCL handles of `dtype`: `count` elements in and out
    /// (all-reduce, broadcast), `count` in and `n × count` out (all-gather), `n × count` in and
    /// `count` out (reduce-scatter); waited for.
    pub(super) fn raw(
        &self,
        call: &Call,
        dtype: DType,
        count: usize,
        send: &Handle,
        recv: &Handle,
    ) -> Result<(), Error> {
        let enqueued = self.enqueue(call, dtype, count, send, recv)?;
        self.wait_enqueued(call, enqueued)
    }

    /// [`Self::raw`] without the wait: the call is enqueued on this rank's NCCL stream after
    /// the compute stream's work so far; the buffers stay alive and an event marks its end in
    /// the returned [`Enqueued`] ([`Self::wait_enqueued`]).
    pub(super) fn enqueue(
        &self,
        call: &Call,
        dtype: DType,
        count: usize,
        send: &Handle,
        recv: &Handle,
    ) -> Result<Enqueued, Error> {
        self.check_alive()?;
        let comm = self.comm(call.group())?;
        let kind = call.kind();
        let datatype = nccl_dtype(dtype)?;
        let (buffers, src, dst) = self.bind(send, recv)?;
        let (src, dst) = (src as *const std::ffi::c_void, dst as *mut std::ffi::c_void);
        let stream = self.stream.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: `src`/`dst` are live device allocations of the sizes `count` implies (the
        // callers size them); `comm` is this rank's communicator for `group`, used under the
        // call lock; `stream` belongs to the same context.
        let result = unsafe {
            match kind {
                CollectiveKind::AllReduce => {
                    let op = nccl_op(call.reduce_op());
                    nccl::all_reduce(src, dst, count, datatype, op, comm, stream)
                }
                CollectiveKind::AllGather => {
                    nccl::all_gather(src, dst, count, datatype, comm, stream)
                }
                CollectiveKind::ReduceScatter => {
                    let op = nccl_op(call.reduce_op());
                    nccl::reduce_scatter(src, dst, count, datatype, op, comm, stream)
                }
                CollectiveKind::Broadcast => {
                    let root = call.root() as i32;
                    nccl::broadcast(src, dst, count, datatype, root, comm, stream)
                }
                other => {
                    return Err(Error::Unsupported(format!("{other} as one NCCL call")));
                }
            }
        };
        result.map_err(|e| self.library(&kind.to_string(), e.0))?;
        self.enqueued(buffers)
    }

    /// The rank's CUDA context bound to this thread, the compute stream's work so far finished
    /// (the input's producers), and `send`'s and `recv`'s device resources — kept alive until
    /// the call completes — with their addresses.
    fn bind(
        &self,
        send: &Handle,
        recv: &Handle,
    ) -> Result<(Box<dyn std::any::Any + Send>, *const u8, *mut u8), Error> {
        let cuda = |e: cudarc::driver::DriverError| self.library("CUDA context", e);
        self.ctx.bind_to_thread().map_err(cuda)?;
        cubecl::future::block_on(self.client.sync()).map_err(|e| self.library("CubeCL sync", e))?;
        let server = |e| self.library("CubeCL get_resource", e);
        let send_res = self.client.get_resource(send.clone()).map_err(server)?;
        let recv_res = self.client.get_resource(recv.clone()).map_err(server)?;
        let (src, dst) = (
            send_res.resource().ptr as *const u8,
            recv_res.resource().ptr as *mut u8,
        );
        Ok((Box::new((send_res, recv_res)), src, dst))
    }

    /// The call just enqueued on the NCCL stream, with an event after it, holding `buffers`.
    fn enqueued(&self, buffers: Box<dyn std::any::Any + Send>) -> Result<Enqueued, Error> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| self.library("cuEventRecord", e))?;
        Ok(Enqueued {
            _buffers: buffers,
            event,
        })
    }

    /// An all-to-all of rows (`row` elements of `dtype` each, `call`'s splits) from `send` into
    /// `recv`: one grouped `ncclSend`/`ncclRecv` per member with rows to move, enqueued on the
    /// rank's NCCL stream after the compute stream's work so far.
    pub(super) fn enqueue_all_to_all(
        &self,
        call: &Call,
        dtype: DType,
        row: usize,
        send: &Handle,
        recv: &Handle,
    ) -> Result<Enqueued, Error> {
        self.check_alive()?;
        let splits = call.splits().expect("an all-to-all carries its splits");
        let comm = self.comm(call.group())?;
        let datatype = nccl_dtype(dtype)?;
        let width = row * dtype.size();
        let (buffers, src, dst) = self.bind(send, recv)?;
        let stream = self.stream.cu_stream() as nccl_sys::cudaStream_t;
        let failed = |what: &str| {
            let what = what.to_owned();
            move |e: nccl::NcclError| self.library(&what, e.0)
        };
        nccl::group_start().map_err(failed("ncclGroupStart"))?;
        let (mut sent, mut received) = (0, 0);
        for (peer, (&out, &into)) in splits.send.iter().zip(&splits.recv).enumerate() {
            // SAFETY: `src` holds `Σ send` rows and `dst` `Σ recv` rows of `width` bytes (the
            // callers size them); each piece lies inside its buffer; `comm` is this rank's
            // communicator for the group (peers are group indices), used under the call lock on
            // the stream of the same context.
            unsafe {
                if out > 0 {
                    let ptr = src.add(sent * width) as *const std::ffi::c_void;
                    nccl::send(ptr, out * row, datatype, peer as i32, comm, stream)
                        .map_err(failed("ncclSend"))?;
                }
                if into > 0 {
                    let ptr = dst.add(received * width) as *mut std::ffi::c_void;
                    nccl::recv(ptr, into * row, datatype, peer as i32, comm, stream)
                        .map_err(failed("ncclRecv"))?;
                }
            }
            sent += out;
            received += into;
        }
        nccl::group_end().map_err(failed("ncclGroupEnd"))?;
        self.enqueued(buffers)
    }

    /// An all-to-all's check: the header round, then (with call checks on) every member's
    /// splits all-gathered and checked to fit; with checks off, this member's own splits only.
    pub(super) fn check_all_to_all(&self, call: &Call) -> Result<(), Error> {
        let round = self.round(call)?;
        let n = call.group().size(self.mesh())?;
        let splits = call.splits().expect("an all-to-all carries its splits");
        if !self.options.check_calls {
            let rows = call.buffer().and_then(|b| b.shape().first().copied());
            let fits = splits.send.len() == n
                && splits.recv.len() == n
                && rows == Some(splits.send.iter().sum());
            return if fits {
                Ok(())
            } else {
                Err(Error::Mismatch {
                    op: CollectiveKind::AllToAll,
                    group: call.group().label(self.mesh())?.to_owned(),
                    detail: format!(
                        "splits send {:?} / recv {:?} for {n} members and {rows:?} rows",
                        splits.send, splits.recv
                    ),
                })
            };
        }
        let bytes = header::to_bytes(&splits.words(n));
        let send = self.upload(&bytes);
        let recv = self.client.empty(bytes.len() * n);
        let exchange = Call::all_gather(call.group(), Operand::new(DType::I64, &[2 * n]), 0);
        self.raw(&exchange, DType::I64, 2 * n, &send, &recv)?;
        let all = self.download_bytes(recv, bytes.len() * n)?;
        let all_splits = header::words(&all)
            .chunks_exact(2 * n)
            .map(|w| crate::comm::Splits::from_words(w, n))
            .collect();
        round.with_splits(all_splits).check_buffers()
    }

    /// Waits for an [`Enqueued`] call's end, aborting every communicator past the timeout.
    pub(super) fn wait_enqueued(&self, call: &Call, enqueued: Enqueued) -> Result<(), Error> {
        let group = call.group().label(self.mesh()).unwrap_or("?").to_owned();
        self.wait_event(call.kind(), group, enqueued)
    }

    /// [`Self::wait_enqueued`] for a call of kind `op` on the group labelled `group`.
    pub(super) fn wait_event(
        &self,
        op: CollectiveKind,
        group: String,
        enqueued: Enqueued,
    ) -> Result<(), Error> {
        let start = Instant::now();
        loop {
            match enqueued.event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.library("cuEventQuery", e)),
            }
            if start.elapsed() > self.options.timeout {
                self.abort();
                return Err(Error::Timeout {
                    op,
                    group,
                    rank: self.rank(),
                    waited: start.elapsed(),
                    missing: Vec::new(),
                });
            }
            std::thread::yield_now();
        }
    }

    pub(super) fn upload(&self, bytes: &[u8]) -> Handle {
        self.client.create_from_slice(bytes)
    }

    /// The first `len` bytes of a device buffer.
    pub(super) fn download_bytes(&self, handle: Handle, len: usize) -> Result<Vec<u8>, Error> {
        let bytes = self
            .client
            .read_one(handle)
            .map_err(|e| self.library("CubeCL read", e))?;
        Ok(bytes[..len].to_vec())
    }

    pub(super) fn download(
        &self,
        handle: Handle,
        shape: Shape,
        dtype: DType,
    ) -> Result<TensorData, Error> {
        let len = shape.num_elements() * dtype.size();
        Ok(TensorData::from_bytes_vec(
            self.download_bytes(handle, len)?,
            shape,
            dtype,
        ))
    }

    /// The round of `call`: the members' calls, exchanged as headers and checked to be the
    /// same call on every member, or only this member's when checks are off (a broadcast always
    /// exchanges them: the root's tells the others what to receive).
    pub(super) fn round(&self, call: &Call) -> Result<Round<'_>, Error> {
        let (_, mine) = self.sequence.header(call)?;
        if !self.options.check_calls && call.kind() != CollectiveKind::Broadcast {
            return Ok(Round::new(
                self.mesh(),
                self.rank(),
                call.clone(),
                vec![call.clone()],
            ));
        }
        let n = call.group().size(self.mesh())?;
        let bytes = header::to_bytes(&mine);
        let send = self.upload(&bytes);
        let recv = self.client.empty(bytes.len() * n);
        let exchange = Call::all_gather(call.group(), Operand::new(DType::I64, &[HEADER]), 0);
        self.raw(&exchange, DType::I64, HEADER, &send, &recv)?;
        let all = self.download_bytes(recv, bytes.len() * n)?;
        let headers: Vec<Header> = all
            .chunks_exact(bytes.len())
            .map(header::from_bytes)
            .collect();
        header::round(self.mesh(), self.rank(), call, &headers)
    }
}
