//! A rank's pipeline stages outside the training step: forward-only passes through the stages
//! (evaluation, generation: [`StagePasses`]) and the whole model's parameters gathered on rank 0
//! ([`gather_stage_parameters`]). Both run on the `Distributed` backend, messages on the rank's
//! point-to-point channel.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::backend::Distributed;
use crate::comm::Group;
use crate::device::DistDevice;
use crate::error::Error;
use crate::mesh::PIPELINE_AXIS;

/// Forward-only passes through a rank's stages: a batch goes through the stages in order, each
/// rank running its stages in order, receiving each one's input from the stage before and sending
/// its output on.
pub struct StagePasses<'a, X: Backend> {
    /// This rank's stage numbers, in chunk order (chunk `c` is stage `c·p + r`).
    numbers: &'a [usize],
    /// The schedule's stage count.
    stages: usize,
    /// The global ranks of the pipeline group, by pipeline index.
    members: Vec<usize>,
    device: &'a DistDevice<X>,
}

impl<'a, X: Backend> StagePasses<'a, X> {
    /// The passes of the rank of `device` that holds stages `numbers` of `stages`.
    pub fn new(
        device: &'a DistDevice<X>,
        numbers: &'a [usize],
        stages: usize,
    ) -> Result<Self, Error> {
        let mesh = device.mesh();
        let axis = mesh.axis_index(PIPELINE_AXIS)?;
        Ok(Self {
            numbers,
            stages,
            members: Group::Axis(axis).ranks(mesh, device.rank())?,
            device,
        })
    }

    /// The rank's device.
    pub fn device(&self) -> &'a DistDevice<X> {
        self.device
    }

    /// The global ranks of this rank's pipeline group, by pipeline index (the last holds the
    /// last stage).
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// One pass: `run(c, input)` runs this rank's chunk `c` on the previous stage's output, or
    /// with `None` on the first stage (which reads its own input). The last stage's output on the
    /// rank that holds it, `None` elsewhere.
    pub fn forward(
        &self,
        mut run: impl FnMut(usize, Option<Tensor<Distributed<X>, 3>>) -> Tensor<Distributed<X>, 3>,
    ) -> Result<Option<Tensor<Distributed<X>, 3>>, Error> {
        let p2p = self.device.context().comm().point_to_point()?;
        let p = self.members.len();
        for (c, &stage) in self.numbers.iter().enumerate() {
            let input = if stage == 0 {
                None
            } else {
                let data = p2p.recv(self.members[(stage - 1) % p])?;
                Some(Tensor::from_data(data, self.device))
            };
            let out = run(c, input);
            if stage + 1 == self.stages {
                return Ok(Some(out));
            }
            p2p.send(self.members[(stage + 1) % p], out.into_data())?;
        }
        Ok(None)
    }
}

/// Every parameter of the whole model on rank 0, in the whole model's visiting order (the
/// stages' parameters carry the whole model's ids, as [`crate::pipeline::StagePlan`]'s chunks
/// drawn from one model do): the other ranks of rank 0's pipeline group send theirs; every
/// other rank returns nothing. `copy(chunk)` names a parameter a chunk holds as a copy of one
/// another stage holds (a tied table's second copy), left out.
pub fn gather_stage_parameters<X: Backend, B: Backend, M: Module<B>>(
    device: &DistDevice<X>,
    chunks: &[M],
    copy: impl Fn(&M) -> Option<ParamId>,
) -> Result<Vec<Vec<f32>>, Error> {
    struct Collect(Vec<(u64, Vec<f32>)>, Option<ParamId>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if Some(param.id) == self.1 {
                return;
            }
            let values = param.val().into_data().convert::<f32>();
            let values = values.to_vec().expect("f32 values");
            self.0.push((param.id.val(), values));
        }
    }
    let mut mine = Collect(Vec::new(), None);
    for chunk in chunks {
        mine.1 = copy(chunk);
        chunk.visit(&mut mine);
    }
    let mesh = device.mesh();
    let axis = mesh.axis_index(PIPELINE_AXIS)?;
    let members = Group::Axis(axis).ranks(mesh, device.rank())?;
    if !members.contains(&0) {
        return Ok(Vec::new());
    }
    let p2p = device.context().comm().point_to_point()?;
    let mut all = mine.0;
    let scalar = |data: TensorData| -> Result<i64, Error> {
        data.to_vec::<i64>()
            .ok()
            .and_then(|v| v.first().copied())
            .ok_or_else(|| Error::Mismatch {
                op: crate::error::CollectiveKind::Recv,
                group: PIPELINE_AXIS.into(),
                detail: "a parameter count or id that is not one integer".into(),
            })
    };
    if device.rank() != 0 {
        p2p.send(0, TensorData::new(vec![all.len() as i64], [1]))?;
        for (id, values) in all {
            let n = values.len();
            p2p.send(0, TensorData::new(vec![id as i64], [1]))?;
            p2p.send(0, TensorData::new(values, [n]))?;
        }
        return Ok(Vec::new());
    }
    for &from in &members[1..] {
        let n = scalar(p2p.recv(from)?)? as usize;
        for _ in 0..n {
            let id = scalar(p2p.recv(from)?)? as u64;
            let values = p2p
                .recv(from)?
                .convert::<f32>()
                .to_vec()
                .expect("f32 values");
            all.push((id, values));
        }
    }
    all.sort_by_key(|(id, _)| *id);
    Ok(all.into_iter().map(|(_, v)| v).collect())
}
