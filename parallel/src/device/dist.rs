//! `DistDevice`: the device of `Distributed<B>` (an inner device and the rank's context,
//! registered so it round-trips through Burn's `DeviceId`), the thread's current device, and the
//! thread-local scopes of recomputation and deferred weight gradients.

use super::*;

/// The device of `Distributed<B>`: an inner device plus this rank's [`RankContext`].
///
/// Burn requires devices to round-trip through a small [`DeviceId`], so every device is
/// registered in a process-wide table; `Default` is a world-size-1 device over the inner
/// backend's default device.
pub struct DistDevice<B: Backend> {
    pub(crate) inner: B::Device,
    pub(crate) ctx: Arc<RankContext>,
    id: u16,
}

impl<B: Backend> Clone for DistDevice<B> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            ctx: self.ctx.clone(),
            id: self.id,
        }
    }
}

impl<B: Backend> std::fmt::Debug for DistDevice<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Distributed({:?}, {:?})", self.inner, self.ctx)
    }
}

impl<B: Backend> PartialEq for DistDevice<B> {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

/// One registered device: its rank context, held weakly (a device id must not keep a finished
/// launch's ranks alive), and its inner device (`B::Device`, type-erased).
struct Slot {
    ctx: Weak<RankContext>,
    inner: Box<dyn Any + Send + Sync>,
}

/// The process-wide device table. A slot whose context is gone (every device and tensor of that
/// rank dropped) is reused, so launching again and again never runs out of the 65,536 ids a
/// `DeviceId` can name. Each backend's `Default` device is kept alive here for the process.
#[derive(Default)]
struct Registry {
    slots: Vec<Slot>,
    defaults: HashMap<TypeId, (u16, Arc<RankContext>)>,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry::default()));

/// Slots of the device table, live or free (for tests).
#[cfg(test)]
pub(crate) fn registered_slots() -> usize {
    REGISTRY.lock().unwrap().slots.len()
}

impl<B: Backend> DistDevice<B> {
    /// A device for this rank: `inner` runs the local ops, `comm` talks to the other ranks.
    pub fn new(inner: B::Device, comm: Arc<dyn Communicator>) -> Self {
        Self::register(inner, RankContext::new(comm))
    }

    fn register(inner: B::Device, ctx: Arc<RankContext>) -> Self {
        let mut registry = REGISTRY.lock().unwrap();
        let slot = Slot {
            ctx: Arc::downgrade(&ctx),
            inner: Box::new(inner.clone()),
        };
        let free = registry
            .slots
            .iter()
            .position(|s| s.ctx.strong_count() == 0);
        let index = match free {
            Some(i) => {
                registry.slots[i] = slot;
                i
            }
            None => {
                registry.slots.push(slot);
                registry.slots.len() - 1
            }
        };
        let id = u16::try_from(index).expect("more than 65536 distributed devices alive at once");
        Self { inner, ctx, id }
    }

    /// The inner backend's device.
    pub fn inner(&self) -> &B::Device {
        &self.inner
    }

    /// This rank's context (rank, mesh, communicator, counters).
    pub fn context(&self) -> &Arc<RankContext> {
        &self.ctx
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.ctx.rank()
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        self.ctx.mesh()
    }
}

impl<B: Backend> Default for DistDevice<B> {
    fn default() -> Self {
        let key = TypeId::of::<B>();
        let existing = REGISTRY.lock().unwrap().defaults.get(&key).map(|d| d.0);
        if let Some(id) = existing {
            return <Self as burn::tensor::backend::Device>::from_id(DeviceId::new(TYPE_ID, id));
        }
        let world = InProcessWorld::new(DeviceMesh::single(), crate::comm::DEFAULT_TIMEOUT);
        let device = Self::new(B::Device::default(), Arc::new(world.communicator(0)));
        REGISTRY
            .lock()
            .unwrap()
            .defaults
            .insert(key, (device.id, device.ctx.clone()));
        device
    }
}

impl<B: Backend> burn::tensor::backend::Device for DistDevice<B> {
    fn from_id(device_id: DeviceId) -> Self {
        let registry = REGISTRY.lock().unwrap();
        registry
            .slots
            .get(device_id.index_id as usize)
            .and_then(|slot| {
                let inner = slot.inner.downcast_ref::<B::Device>()?.clone();
                let ctx = slot.ctx.upgrade()?;
                Some(Self {
                    inner,
                    ctx,
                    id: device_id.index_id,
                })
            })
            .unwrap_or_else(|| panic!("unknown distributed device {device_id}"))
    }

    fn to_id(&self) -> DeviceId {
        DeviceId::new(TYPE_ID, self.id)
    }
}

impl<B: Backend> DeviceOps for DistDevice<B> {}

thread_local! {
    static CURRENT: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// Make `device` this thread's current device: the device reported for int and bool tensors
/// (which stay plain per-rank tensors of the inner backend), until the returned guard is
/// dropped. The launcher does this per rank and drops the guard when the rank's body ends, so
/// the rank's context (and the device collectives installed on it: NCCL's communicators) is
/// released there, on the rank's thread, and not by a thread-local destructor at thread exit,
/// when the CUDA driver may already be gone.
pub fn set_current_device<B: Backend>(device: &DistDevice<B>) -> CurrentDevice {
    let previous = CURRENT.with(|c| c.replace(Some(Box::new(device.clone()))));
    CurrentDevice(previous)
}

/// While alive, a device is this thread's current device ([`set_current_device`]); dropped, the
/// thread's previous current device (usually none) is restored and the device released.
#[must_use = "the device stops being current when the guard is dropped"]
pub struct CurrentDevice(Option<Box<dyn Any>>);

impl Drop for CurrentDevice {
    fn drop(&mut self) {
        let previous = self.0.take();
        // Taken out of the cell before it is dropped: dropping a rank's last device runs its
        // context's destructors, which must not find the cell borrowed.
        let current = CURRENT.with(|c| c.replace(previous));
        drop(current);
    }
}

/// This thread's current device, or the world-size-1 default.
pub fn current_device<B: Backend>() -> DistDevice<B> {
    CURRENT
        .with(|c| {
            c.borrow()
                .as_ref()
                .and_then(|d| d.downcast_ref::<DistDevice<B>>().cloned())
        })
        .unwrap_or_default()
}

thread_local! {
    static RECOMPUTING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// While alive, this thread is re-running a forward region for activation recomputation
/// (between the backward passes of one step): forward ops may follow a backward pass whose
/// gradients are not yet synchronised, since they belong to the same step.
#[must_use = "the scope ends when the guard is dropped"]
pub struct RecomputeScope(());

impl RecomputeScope {
    /// Enter the scope on this thread.
    pub fn enter() -> Self {
        RECOMPUTING.with(|c| c.set(c.get() + 1));
        RecomputeScope(())
    }
}

impl Drop for RecomputeScope {
    fn drop(&mut self) {
        RECOMPUTING.with(|c| c.set(c.get() - 1));
    }
}

pub(crate) fn is_recomputing() -> bool {
    RECOMPUTING.with(|c| c.get() > 0)
}

/// Weight gradients deferred by a zero-bubble schedule's `I` action
/// ([`RankContext::end_deferring_weight_gradients`]), computed by [`DeferredWeights::run`] (its
/// `W` action). Those already used (a weight used twice in the graph sums its gradients at once)
/// are computed already.
#[must_use = "deferred weight gradients are computed when run (or at their first use)"]
pub struct DeferredWeights(pub(super) Vec<Arc<dyn Resolve>>);

impl DeferredWeights {
    /// How many weight gradients were deferred.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none was.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Compute them now, in the order they were deferred.
    pub fn run(self) -> Result<usize, crate::Error> {
        let n = self.0.len();
        self.0.iter().try_for_each(|d| d.resolve())?;
        Ok(n)
    }
}

impl std::fmt::Debug for DeferredWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeferredWeights({})", self.0.len())
    }
}
