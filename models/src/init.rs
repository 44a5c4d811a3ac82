//! Initial values of a model's parameters, drawn piece by piece: every element's value is a
//! function of its parameter's stream and its flat index, so a rank can draw only the pieces it
//! holds (sharded initialisation) and get exactly what the whole tensor would hold there.

use std::collections::BTreeMap;

use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use wildfire_parallel::{DTensor, DeviceMesh, DistDevice, DistributedBackend, Layout};

use crate::Error;

/// One parameter's initial values: N(0, std²) from its own splitmix64 stream (Box–Muller on
/// consecutive pairs of draws: element 2k is the cosine of pair k, 2k + 1 the sine), or a
/// constant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Values {
    Normal { stream: u64, std: f32 },
    Constant(f32),
}

impl Values {
    /// The values at flat indices `start..start + out.len()`.
    pub(crate) fn fill(&self, start: usize, out: &mut [f32]) {
        match *self {
            Values::Constant(c) => out.fill(c),
            Values::Normal { stream, std } => {
                wildfire_parallel::rng::box_muller(stream, start, out.len(), |k, r, trig| {
                    out[k] = (r * trig) as f32 * std;
                });
            }
        }
    }
}

/// What lays a model out as it is built: given every parameter's path and shape (in
/// construction order) and the mesh, each one's layout.
pub trait LayoutFn:
    FnOnce(&[(String, Vec<usize>)], &DeviceMesh) -> Result<Vec<Layout>, wildfire_parallel::Error>
{
}

impl<F> LayoutFn for F where
    F: FnOnce(
        &[(String, Vec<usize>)],
        &DeviceMesh,
    ) -> Result<Vec<Layout>, wildfire_parallel::Error>
{
}

/// A model built in the layouts `layouts` gives, each rank drawing only its pieces: `record`
/// builds it once with [`Shapes`] (the parameters' paths and shapes, nothing drawn), `draw` once
/// more with [`Pieces`] in those layouts.
pub(crate) fn build_in_layouts<B: DistributedBackend, M>(
    device: &B::Device,
    layouts: impl LayoutFn,
    record: impl FnOnce(&mut Shapes<B>),
    draw: impl FnOnce(&mut Pieces<B>) -> M,
) -> Result<M, Error> {
    let dist = B::dist_device(device);
    let mut shapes = Shapes::<B> {
        device: Some(device),
        params: Vec::new(),
    };
    record(&mut shapes);
    let layouts = layouts(&shapes.params, dist.mesh())?;
    let mut pieces = Pieces::<B> {
        device: dist,
        layouts: shapes
            .params
            .into_iter()
            .map(|(p, _)| p)
            .zip(layouts)
            .collect(),
        error: None,
    };
    let model = draw(&mut pieces);
    match pieces.error {
        Some(e) => Err(e),
        None => Ok(model),
    }
}

/// Turns a parameter's values into a tensor: whole, or this rank's piece of it.
pub(crate) trait Place<B: Backend> {
    /// The tensor of global `shape` at `path` (module path, as Burn's visitors name it).
    fn tensor<const D: usize>(
        &mut self,
        path: &str,
        shape: [usize; D],
        values: Values,
    ) -> Tensor<B, D>;
}

/// Every value, on every rank.
pub(crate) struct Whole<'a, B: Backend>(pub &'a B::Device);

impl<B: Backend> Place<B> for Whole<'_, B> {
    fn tensor<const D: usize>(
        &mut self,
        _path: &str,
        shape: [usize; D],
        values: Values,
    ) -> Tensor<B, D> {
        let mut data = vec![0.0; shape.iter().product()];
        values.fill(0, &mut data);
        Tensor::from_data(TensorData::new(data, shape), self.0)
    }
}

/// Records the parameters' paths and shapes (the tensors it returns are empty placeholders).
#[derive(Default)]
pub(crate) struct Shapes<'a, B: Backend> {
    pub device: Option<&'a B::Device>,
    pub params: Vec<(String, Vec<usize>)>,
}

impl<B: Backend> Place<B> for Shapes<'_, B> {
    fn tensor<const D: usize>(
        &mut self,
        path: &str,
        shape: [usize; D],
        _values: Values,
    ) -> Tensor<B, D> {
        self.params.push((path.to_string(), shape.to_vec()));
        Tensor::empty([0; D], self.device.expect("a device"))
    }
}

/// This rank's piece of each parameter in its planned layout, drawn alone: no rank holds a
/// whole parameter that its layout splits.
pub(crate) struct Pieces<B: DistributedBackend> {
    pub device: DistDevice<B::Inner>,
    pub layouts: BTreeMap<String, Layout>,
    pub error: Option<Error>,
}

impl<B: DistributedBackend> Place<B> for Pieces<B> {
    fn tensor<const D: usize>(
        &mut self,
        path: &str,
        shape: [usize; D],
        values: Values,
    ) -> Tensor<B, D> {
        let layout = match self.layouts.get(path) {
            Some(layout) => layout.clone(),
            None => {
                self.error.get_or_insert(Error::Invalid {
                    path: path.into(),
                    reason: "no planned layout for this parameter".into(),
                });
                Layout::replicated(self.device.mesh())
            }
        };
        // A model about to be loaded whole keeps its pieces zero: no value is drawn.
        let draw = !self.device.context().is_building_for_load();
        let (local, extents) = layout.draw_local(
            &shape,
            self.device.mesh(),
            self.device.rank(),
            |start, run| {
                if draw {
                    values.fill(start, run)
                }
            },
        );
        let piece =
            Tensor::<B::Inner, D>::from_data(TensorData::new(local, extents), self.device.inner());
        // The planner checked that the layout splits only what divides (or pads on data axes).
        let t = DTensor::from_local_padded(
            piece.into_primitive().tensor(),
            layout,
            &shape,
            &self.device,
        )
        .expect("a planned layout fits its tensor");
        Tensor::from_primitive(TensorPrimitive::Float(B::from_dtensor(t)))
    }
}

#[cfg(test)]
mod tests {
    use super::Values;
    use crate::gpt::GptConfig;
    use crate::parallelize::{FsdpStrategy, ParallelConfig, parallelize_gpt};
    use burn::backend::{Autodiff, Flex};
    use burn::module::Param;
    use burn::prelude::*;
    use wildfire_parallel::{
        Distributed, LaunchOptions, Layout, ModulePath, ParamVisitor, dtensor, launch_ranks,
        visit_params,
    };

    type Dist = Autodiff<Distributed<Flex>>;

    /// Every parameter's layout and local values, in visiting order.
    #[derive(Default)]
    struct Pieces(Vec<(String, Layout, Vec<f32>)>);

    impl ParamVisitor<Dist> for Pieces {
        fn visit<const D: usize>(&mut self, path: &ModulePath, param: &Param<Tensor<Dist, D>>) {
            let t = dtensor(&param.val());
            let local = Tensor::<Flex, D>::from_primitive(burn::tensor::TensorPrimitive::Float(
                t.local().clone(),
            ));
            let values = local.into_data().convert::<f32>().to_vec().unwrap();
            self.0.push((path.name(), t.layout().clone(), values));
        }
    }

    /// `f` on every rank of `mesh` (threads), its results by rank.
    fn on_ranks<T: Send>(
        mesh: &wildfire_parallel::DeviceMesh,
        f: impl Fn(wildfire_parallel::DistDevice<Flex>) -> T + Sync,
    ) -> Vec<T> {
        launch_ranks::<Flex, _, _>(mesh, &Default::default(), &LaunchOptions::default(), f).unwrap()
    }

    /// A GPT of 2 blocks, d 8, a vocabulary of 50 (padded over 4 ranks).
    fn tiny() -> GptConfig {
        GptConfig {
            vocab_size: 50,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            init_seed: 3,
            dropout: 0.0,
            vocab_used: None,
            gelu: crate::gpt::Gelu::Erf,
        }
    }

    /// Sharded initialisation gives every rank exactly the pieces that building the whole model
    /// and laying it out gives it (bitwise, padding included), for DDP, ZeRO-1, FSDP (with a
    /// vocabulary of 50 padded over 4 ranks), HSDP, TP and FSDP × TP; the parameters a layout
    /// splits never exist whole on a rank (its bytes before `parallelize_gpt` are its pieces').
    #[test]
    fn sharded_init_draws_the_pieces_of_the_whole_init() {
        let config = tiny();
        let layout = ParallelConfig::layout;
        for parallel in [
            layout(2, 1, FsdpStrategy::NoShard, None),
            layout(2, 1, FsdpStrategy::ShardOptimizer, None),
            layout(4, 1, FsdpStrategy::FullShard, None),
            layout(4, 1, FsdpStrategy::Hybrid, Some(2)),
            layout(1, 2, FsdpStrategy::NoShard, None),
            layout(2, 2, FsdpStrategy::FullShard, None),
        ] {
            let mesh = parallel.mesh().unwrap();
            let out = on_ranks(&mesh, |device| {
                let whole = config.init::<Dist>(&device).unwrap();
                let whole = parallelize_gpt(whole, &mesh, &parallel).unwrap();
                let sharded =
                    crate::parallelize::init_gpt::<Dist>(&config, &device, &parallel).unwrap();
                let bytes = wildfire_parallel::parameter_bytes(&sharded);
                let sharded = parallelize_gpt(sharded, &mesh, &parallel).unwrap();
                let (mut a, mut b) = (Pieces::default(), Pieces::default());
                visit_params(&whole, &mut a);
                visit_params(&sharded, &mut b);
                (
                    a.0,
                    b.0,
                    bytes,
                    wildfire_parallel::parameter_bytes(&sharded),
                )
            });
            for (rank, (whole, sharded, before, after)) in out.into_iter().enumerate() {
                assert_eq!(whole.len(), sharded.len());
                for (w, s) in whole.iter().zip(&sharded) {
                    assert_eq!(w, s, "{parallel:?} rank {rank}");
                }
                // LayerNorms are built whole (a few floats) and laid out after; the rest never.
                let ln: u64 = whole
                    .iter()
                    .filter(|(p, _, _)| p.contains("ln_"))
                    .map(|(_, _, v)| v.len() as u64 * 4)
                    .sum();
                let ln_whole = (2 * 2 + 1) * 2 * 8 * 4;
                assert!(
                    before <= after - ln + ln_whole,
                    "{parallel:?} rank {rank}: {before} vs {after}"
                );
            }
        }
    }

    /// A model built for a load (`RankContext::build_for_load`, a resumed checkpoint) has the
    /// same parameters in the same layouts and shapes, with no value drawn: every piece of the
    /// drawn parameters is zero (the LayerNorms, constants built by Burn, are as always).
    #[test]
    fn a_model_built_for_a_load_draws_nothing_and_keeps_its_layouts() {
        let config = tiny();
        let parallel = ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None);
        let mesh = parallel.mesh().unwrap();
        let out = on_ranks(&mesh, |device| {
            let init = || crate::parallelize::init_gpt::<Dist>(&config, &device, &parallel);
            let drawn = init().unwrap();
            let ctx = device.context();
            let shell = ctx.build_for_load(|| {
                assert!(ctx.is_building_for_load());
                init().unwrap()
            });
            assert!(!ctx.is_building_for_load(), "the flag ends with the build");
            let (mut a, mut b) = (Pieces::default(), Pieces::default());
            visit_params(&drawn, &mut a);
            visit_params(&shell, &mut b);
            (a.0, b.0)
        });
        for (rank, (drawn, shell)) in out.into_iter().enumerate() {
            assert_eq!(drawn.len(), shell.len());
            for ((path, layout, values), (p, l, v)) in drawn.iter().zip(&shell) {
                assert_eq!((path, layout, values.len()), (p, l, v.len()), "rank {rank}");
                if path.contains("ln_") {
                    assert_eq!(values, v, "rank {rank} {path}");
                } else {
                    assert!(v.iter().all(|x| *x == 0.0), "rank {rank} {path} drawn");
                }
            }
            assert!(
                drawn
                    .iter()
                    .any(|(p, _, v)| !p.contains("ln_") && v.iter().any(|x| *x != 0.0)),
                "the normal build draws values"
            );
        }
    }

    #[test]
    fn any_run_of_a_stream_is_the_same_values() {
        let v = Values::Normal {
            stream: 42,
            std: 0.02,
        };
        let mut whole = vec![0.0; 101];
        v.fill(0, &mut whole);
        for (start, len) in [(0, 1), (1, 1), (1, 2), (7, 30), (50, 51), (100, 1)] {
            let mut part = vec![0.0; len];
            v.fill(start, &mut part);
            assert_eq!(part, whole[start..start + len], "{start}+{len}");
        }
        assert!(whole.iter().all(|x| x.is_finite()) && whole.iter().any(|x| *x != 0.0));
    }
}
