//! AdamW with its state offloaded to host memory (ZeRO-Offload, Ren et al. 2021; FSDP2's
//! `CPUOffloadPolicy` for the optimizer): each rank keeps the two moments of its shard of every
//! parameter in host memory and runs the step there.
//!
//! Per parameter and step: the gradient's local piece (and the parameter's, on the gradient's
//! layout: a shard under ZeRO and FSDP) is read to the host, the host AdamW updates the
//! parameter and the moments in place
//! ([`adamw_host`](wildfire_kernels::flex::optim::adamw_host): vectorised, chunks on rayon's
//! threads, the very function Flex's fused AdamW kernel runs per element — so on Flex a run with
//! the optimizer offloaded is bitwise the run without), and the new parameter piece is written back
//! to the device. The device keeps no optimizer state: the decorator's accounting shows the
//! moments in [`RankContext::host_bytes`](wildfire_parallel::RankContext::host_bytes) instead of
//! its live bytes.
//!
//! The parameters themselves are the f32 masters (Wildfire's precision policy keeps f32
//! parameters and casts per op), so "offloading the master weights" is the parameters' own
//! offload (`--offload params`, [`wildfire_parallel::offload_parameters`]): a parameter piece
//! kept in host memory is read from there, and its new value stays there
//! ([`DTensor::with_host`]) — no device transfer in the step at all. Otherwise the rank's
//! thread reads each parameter's piece and its gradient's (waiting for them) and hands the host
//! step and the upload of the new piece to the optimizer's own thread (`wildfire-offload-adamw`), through the
//! backend's pinned staging memory where it has one ([`wildfire_parallel::comm::upload`]: queued,
//! not waited for) and on the rank's device stream; meanwhile it reads the next parameter's. The
//! new piece comes back deferred ([`DTensor::deferred_like`]): its first use (the next forward,
//! a checkpoint, a ZeRO-1/2 gather) waits for it, and the moments' readers wait for their
//! update. On a GPU one parameter's transfers overlap the host step of the one before
//! (ZeRO-Offload's pipeline); under ZeRO-1/2 the gather right after each step waits, so there
//! the steps stay serial. The numbers are those of the serial step, bit for bit.
//!
//! The clipping coefficient and the skip flag come from the fused tail
//! ([`crate::fused_unscale_check`], through the shared [`TailInputs`]) as the host computed them
//! (no device read); without them (a pipeline stage, whose runner clips before the step) the step
//! takes its gradient as given. The state is a [`StateCodec`] with AdamW's tensor names: a
//! checkpoint saved with the optimizer offloaded resumes without, and the other way round.

use std::sync::{Arc, Mutex, MutexGuard, mpsc};

use burn::module::AutodiffModule;
use burn::optim::SimpleOptimizer;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::prelude::*;
use burn::record::{PrecisionSettings, Record};
use burn::tensor::TensorPrimitive;
use serde::{Deserialize, Serialize};
use wildfire_parallel::{
    DTensor, DistDevice, Distributed, EncodedState, HostBytes, Layout, StateCodec, StateSpec,
};

use crate::fused_tail::{FusedAdamWConfig, TailInputs};

/// AdamW stepped on the host, its moments in host memory (see the module docs).
#[derive(Clone, Debug)]
pub struct OffloadAdamW<X: Backend> {
    config: FusedAdamWConfig,
    inputs: TailInputs<X>,
    worker: Arc<Worker>,
}

/// The name under which a rank counts ([`OpCounters::work`](wildfire_parallel::OpCounters))
/// the offloaded steps handed to the optimizer's thread (one per parameter and step whose piece
/// lives on the device).
pub const HANDED_TO_ITS_THREAD: &str = "offloaded adamw: steps handed to its thread";

/// A host step and the upload of its result, run off the rank's thread.
type Job = Box<dyn FnOnce() + Send>;

/// The thread that runs the offloaded steps of parameters whose pieces live on the device: the
/// rank's thread reads a parameter's piece and gradient and hands the host AdamW and the
/// upload of the new piece here, then reads the next parameter's while this one computes (the
/// transfers of one parameter overlap the host step of the one before, ZeRO-Offload's
/// pipeline). At most one step waits behind the running one (a bounded queue), so at most
/// three parameters' host buffers are in flight. Started at the first step; it ends with the
/// optimizer.
#[derive(Debug, Default)]
struct Worker {
    jobs: Mutex<Option<mpsc::SyncSender<Job>>>,
}

impl Worker {
    fn run(&self, job: Job) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let sender = jobs.get_or_insert_with(|| {
            let (sender, queue) = mpsc::sync_channel::<Job>(1);
            std::thread::Builder::new()
                .name("wildfire-offload-adamw".into())
                .spawn(move || {
                    for job in queue {
                        job();
                    }
                })
                .expect("spawning the offloaded AdamW's thread");
            sender
        });
        if let Err(mpsc::SendError(job)) = sender.send(job) {
            // The thread is gone (a step panicked there): run it here.
            job();
        }
    }
}

/// [`OffloadAdamW`] as a Burn optimizer over `Autodiff<Distributed<X>>`.
pub type OffloadAdamWOptimizer<X, M> =
    OptimizerAdaptor<OffloadAdamW<X>, M, burn::backend::Autodiff<Distributed<X>>>;

impl<X: Backend> OffloadAdamW<X> {
    /// The Burn optimizer and the handle [`crate::fused_unscale_check`] fills before each step
    /// (the moments' dtype of `config` must be f32: the host keeps f32 moments).
    pub fn optimizer<M>(config: FusedAdamWConfig) -> (OffloadAdamWOptimizer<X, M>, TailInputs<X>)
    where
        M: AutodiffModule<burn::backend::Autodiff<Distributed<X>>>,
    {
        assert_eq!(
            config.moments,
            crate::MomentDtype::F32,
            "the offloaded AdamW keeps f32 moments"
        );
        crate::fused_tail::with_tail_inputs(|inputs| Self {
            config,
            inputs,
            worker: Arc::default(),
        })
    }
}

/// Where a host buffer's values belong on the mesh: the padded local shape of `layout`'s piece
/// of a tensor of `global_shape`, on `device`.
#[derive(Clone, Debug)]
struct Site<X: Backend> {
    local_shape: Vec<usize>,
    global_shape: Vec<usize>,
    layout: Layout,
    device: DistDevice<X>,
}

impl<X: Backend> Site<X> {
    /// Where `t`'s piece is.
    fn of(t: &DTensor<X>) -> Self {
        Self {
            local_shape: t.local_shape().to_vec(),
            global_shape: t.global_shape().to_vec(),
            layout: t.layout().clone(),
            device: t.device().clone(),
        }
    }

    /// `values` as a distributed tensor on the device (for a checkpoint).
    fn upload(&self, values: &[f32]) -> DTensor<X> {
        let data = TensorData::new(values.to_vec(), self.local_shape.clone());
        let local = X::float_from_data(data, self.device.inner());
        DTensor::from_local_padded(local, self.layout.clone(), &self.global_shape, &self.device)
            .unwrap_or_else(|e| wildfire_parallel::internal::raise(e))
    }
}

/// One parameter's moments in host memory: this rank's pieces, and where they belong.
pub struct HostMoments<X: Backend> {
    m: Vec<f32>,
    v: Vec<f32>,
    site: Site<X>,
    _held: HostBytes,
}

impl<X: Backend> HostMoments<X> {
    fn new(m: Vec<f32>, v: Vec<f32>, site: Site<X>) -> Self {
        let held = HostBytes::new(site.device.context(), 4 * (m.len() + v.len()));
        Self {
            m,
            v,
            site,
            _held: held,
        }
    }
}

impl<X: Backend> Clone for HostMoments<X> {
    fn clone(&self) -> Self {
        Self::new(self.m.clone(), self.v.clone(), self.site.clone())
    }
}

/// One parameter's moments, shared by the state's clones and by the step that updates them on
/// the [`Worker`]: every reader waits for that update first ([`Shared::lock`]). The worker holds
/// the inner handles only ([`Update`]), so a state's clones alone decide its copy on write.
struct Shared<X: Backend> {
    moments: Arc<Mutex<HostMoments<X>>>,
    gate: Arc<Gate>,
}

/// Whether a step in flight on the worker will still update the moments, and the readers'
/// wake-up when it has.
#[derive(Default)]
struct Gate {
    updating: Mutex<bool>,
    updated: std::sync::Condvar,
}

/// The worker's handle on one parameter's moments, for one update.
struct Update<X: Backend> {
    moments: Arc<Mutex<HostMoments<X>>>,
    gate: Arc<Gate>,
}

impl<X: Backend> Shared<X> {
    fn new(moments: HostMoments<X>) -> Arc<Self> {
        Arc::new(Self {
            moments: Arc::new(Mutex::new(moments)),
            gate: Arc::default(),
        })
    }

    /// The moments, once any step in flight has updated them.
    fn lock(&self) -> MutexGuard<'_, HostMoments<X>> {
        let mut updating = self.gate.updating.lock().unwrap();
        while *updating {
            updating = self.gate.updated.wait(updating).unwrap();
        }
        drop(updating);
        self.moments.lock().unwrap()
    }

    /// The handle of a step that will update the moments on the worker; readers wait for it.
    fn begin_update(&self) -> Update<X> {
        *self.gate.updating.lock().unwrap() = true;
        Update {
            moments: self.moments.clone(),
            gate: self.gate.clone(),
        }
    }
}

impl<X: Backend> Update<X> {
    /// `f` on the moments, then the readers let in (also when `f` panics).
    fn run<T>(self, f: impl FnOnce(&mut HostMoments<X>) -> T) -> T {
        let _open = Open(&self.gate);
        f(&mut self.moments.lock().unwrap())
    }
}

/// Lets the readers of a [`Gate`] in when dropped.
struct Open<'a>(&'a Gate);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        *self.0.updating.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.0.updated.notify_all();
    }
}

/// One parameter's offloaded AdamW state: its step count and its moments on the host (shared
/// between a record's clones until one is stepped: copy on write).
#[derive(Clone)]
pub struct OffloadState<X: Backend, const D: usize> {
    /// Steps taken.
    pub time: usize,
    moments: Arc<Shared<X>>,
}

/// [`OffloadState`] as plain data (Burn's record serialisation).
#[derive(Clone, Serialize, Deserialize)]
pub struct OffloadStateItem {
    time: usize,
    m: Vec<f32>,
    v: Vec<f32>,
    local_shape: Vec<usize>,
    global_shape: Vec<usize>,
    layout: Layout,
}

impl<X: Backend, const D: usize> Record<Distributed<X>> for OffloadState<X, D> {
    type Item<S: PrecisionSettings> = OffloadStateItem;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        let h = self.moments.lock();
        OffloadStateItem {
            time: self.time,
            m: h.m.clone(),
            v: h.v.clone(),
            local_shape: h.site.local_shape.clone(),
            global_shape: h.site.global_shape.clone(),
            layout: h.site.layout.clone(),
        }
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, device: &DistDevice<X>) -> Self {
        let site = Site {
            local_shape: item.local_shape,
            global_shape: item.global_shape,
            layout: item.layout,
            device: device.clone(),
        };
        let moments = HostMoments::new(item.m, item.v, site);
        Self {
            time: item.time,
            moments: Shared::new(moments),
        }
    }
}

/// This rank's piece of `t` as f32 host values (one read from the device).
fn to_host<X: Backend>(t: &DTensor<X>) -> Vec<f32> {
    if let Some(data) = t.host_data() {
        // An offloaded parameter (`--offload params`): already in host memory.
        return data.convert::<f32>().into_vec::<f32>().expect("f32 values");
    }
    t.device().context().count_host_read();
    // `into_local` waits for a value still in flight (a new piece this optimizer's thread is
    // still computing, a gradient's reduction).
    let local = Tensor::<X, 1>::from_primitive(TensorPrimitive::Float(t.clone().into_local()));
    local
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 values")
}

impl<X: Backend> SimpleOptimizer<Distributed<X>> for OffloadAdamW<X> {
    type State<const D: usize> = OffloadState<X, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: DistTensor<X, D>,
        grad: DistTensor<X, D>,
        state: Option<Self::State<D>>,
    ) -> (DistTensor<X, D>, Option<Self::State<D>>) {
        // On the gradient's layout, as the fused AdamW: under ZeRO-1/2 a shard of a replicated
        // parameter (sliced locally); the moments are kept for that piece.
        let (p, g) = crate::fused_tail::on_grad_layout(&tensor, &grad);
        let site = Site::of(&g);
        let n: usize = site.local_shape.iter().product();
        let time = state.as_ref().map_or(0, |s| s.time) + 1;
        let moments = match state {
            Some(s) => {
                let h = s.moments.lock();
                if h.site.layout == site.layout && h.site.local_shape == site.local_shape {
                    drop(h);
                    s.moments
                } else {
                    // Moments loaded for another layout than the step's: bring them here once.
                    let relaid = |values: &[f32]| {
                        let t = h.site.upload(values);
                        to_host(&crate::fused_tail::on_layout(t, &site.layout))
                    };
                    let (m, v) = (relaid(&h.m), relaid(&h.v));
                    Shared::new(HostMoments::new(m, v, site.clone()))
                }
            }
            None => Shared::new(HostMoments::new(vec![0.0; n], vec![0.0; n], site.clone())),
        };
        // The host's own values (the tail computed them there): no device read per parameter.
        let (scale, skip) = self.inputs.current_on_host().unwrap_or((1.0, 0.0));
        let state = OffloadState { time, moments };
        if skip != 0.0 {
            return (wrap(p), Some(state));
        }
        // Copy on write: a record's clone (a checkpoint snapshot) keeps the values it saw.
        let moments = if Arc::strong_count(&state.moments) == 1 {
            state.moments
        } else {
            Shared::new(state.moments.lock().clone())
        };
        let (values, grad) = (to_host(&p), to_host(&g));
        let step = self.config.step(lr, time);
        let adamw = move |h: &mut HostMoments<X>, mut values: Vec<f32>| {
            wildfire_kernels::flex::optim::adamw_host(
                &mut values,
                &grad,
                &mut h.m,
                &mut h.v,
                scale,
                step,
            );
            values
        };
        if p.is_offloaded() {
            // `--offload params`: the new piece stays in host memory, made here.
            let values = adamw(&mut moments.lock(), values);
            let p = p.with_host(TensorData::new(values, site.local_shape));
            return (wrap(p), Some(OffloadState { time, moments }));
        }
        // On the worker: the host step, then the new piece written back through pinned staging
        // memory where the backend has it (CUDA: the copy is queued, not waited for), on this
        // thread's device stream (`on_callers_stream`: ordered with its kernels). The value
        // handed back waits for it at its first use; the moments' readers wait for it too.
        let (sender, result) = mpsc::channel();
        let (device, shape) = (site.device.inner().clone(), site.local_shape);
        let update = moments.begin_update();
        let job = wildfire_parallel::comm::on_callers_stream(move |()| {
            let values = update.run(|h| adamw(h, values));
            let data = TensorData::new(values, shape);
            let _ = sender.send(wildfire_parallel::comm::upload::<X>(data, &device));
        });
        site.device.context().count_work(HANDED_TO_ITS_THREAD, 1);
        self.worker.run(Box::new(move || job(())));
        let dtype = p.local_dtype();
        let p = p.deferred_like(
            dtype,
            Box::new(move || {
                result
                    .recv()
                    .expect("the offloaded AdamW's thread stopped before the step's result")
            }),
        );
        (wrap(p), Some(OffloadState { time, moments }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, _device: &DistDevice<X>) -> Self::State<D> {
        state
    }
}

/// A tensor on `Distributed<X>`, and its encoded optimizer state.
type DistTensor<X, const D: usize> = Tensor<Distributed<X>, D>;
type Encoded<X> = EncodedState<Distributed<X>>;

fn wrap<X: Backend, const D: usize>(t: DTensor<X>) -> DistTensor<X, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

impl<X: Backend> StateCodec<Distributed<X>> for OffloadAdamW<X> {
    fn state_specs(_shape: &[usize]) -> Vec<StateSpec> {
        wildfire_parallel::adamw_specs()
    }

    /// The moments uploaded as distributed tensors on the layout they were kept for.
    fn encode<const D: usize>(state: Self::State<D>) -> Result<Encoded<X>, String> {
        let h = state.moments.lock();
        let tensors = vec![h.site.upload(&h.m), h.site.upload(&h.v)];
        Ok(EncodedState::all(state.time, tensors))
    }

    /// The loaded moments read to the host (the checkpoint built them on the optimizer-state
    /// layout; the first step brings them to its gradient's layout if that differs).
    fn decode<const D: usize>(state: Encoded<X>) -> Result<Self::State<D>, String> {
        let time = state.steps;
        let [m, v]: [DTensor<X>; 2] = state
            .require("AdamW", &["moment_1", "moment_2"])?
            .try_into()
            .map_err(|_| "counted".to_string())?;
        let moments = HostMoments::new(to_host(&m), to_host(&v), Site::of(&m));
        Ok(OffloadState {
            time,
            moments: Shared::new(moments),
        })
    }
}
