use super::*;
use crate::hf::import_llama;
use crate::parallelize::{FsdpStrategy, ParallelConfig};
use burn::backend::{Autodiff, Flex};
use std::path::PathBuf;
use wildfire_checkpoint::dcp::{Checkpoint, CheckpointWriter, Snapshot};
use wildfire_parallel::{DistDevice, Distributed, LaunchOptions, launch_ranks};

type Dist = Autodiff<Distributed<Flex>>;

/// A tiny Llama `transformers` wrote (`tools/llama_reference.py`) and its reference values.
struct Fixture {
    dir: PathBuf,
    config: LlamaConfig,
    /// The `[2, t]` reference tokens, row-major.
    tokens: Vec<i64>,
    logits: Vec<f32>,
    loss: f32,
}

impl Fixture {
    fn load(name: &str) -> Self {
        Self::load_from(&format!("llama_tiny/{name}"))
    }

    /// The fixture in `tests/fixtures/{path}`.
    fn load_from(path: &str) -> Self {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(path);
        let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let values = |key: &str, width: usize| -> Vec<[u8; 8]> {
            let data = file.tensor(key).unwrap().data().to_vec();
            data.chunks_exact(width)
                .map(|c| {
                    let mut b = [0u8; 8];
                    b[..width].copy_from_slice(c);
                    b
                })
                .collect()
        };
        let tokens: Vec<i64> = values("tokens", 8)
            .into_iter()
            .map(i64::from_le_bytes)
            .collect();
        let floats = |key: &str| -> Vec<f32> {
            values(key, 4)
                .into_iter()
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        let t = tokens.len() / 2;
        let config = LlamaConfig::from_hf_config(&dir.join("config.json"), t).unwrap();
        Self {
            config,
            tokens,
            logits: floats("logits"),
            loss: floats("loss")[0],
            dir,
        }
    }

    /// Positions `range` of both rows of the tokens, on `device`.
    fn ids<B: Backend>(
        &self,
        range: std::ops::Range<usize>,
        device: &B::Device,
    ) -> Tensor<B, 2, Int> {
        let t = self.tokens.len() / 2;
        let rows: Vec<i64> = self
            .tokens
            .chunks(t)
            .flat_map(|row| row[range.clone()].to_vec())
            .collect();
        Tensor::from_data(TensorData::new(rows, [2, range.len()]), device)
    }

    /// The largest difference between `logits` and `transformers`' logits.
    fn logits_off(&self, logits: &[f32]) -> f32 {
        crate::largest_difference(logits, &self.logits)
    }

    /// `(logits, loss)` are `transformers`' within 1e-4 and 1e-5 of the loss (`at` says where).
    fn check(&self, at: &str, (logits, loss): &(Vec<f32>, f32)) {
        let worst = self.logits_off(logits);
        assert!(worst <= 1e-4, "{at}: logits off by {worst}");
        assert!(
            (loss - self.loss).abs() <= 1e-5 * self.loss,
            "{at}: loss {loss} vs {}",
            self.loss
        );
    }
}

/// The configuration `transformers` wrote reads back as the shape it describes: grouped-query
/// heads, Llama-3.2's rotary scaling under `rope_parameters`, the head tied or not.
#[test]
fn a_transformers_config_reads_as_its_shape() {
    let untied = Fixture::load("untied").config;
    assert_eq!(
        (
            untied.n_layer,
            untied.n_head,
            untied.n_kv_head,
            untied.d_model
        ),
        (2, 4, 2, 32)
    );
    assert_eq!((untied.ffn_hidden, untied.vocab_size), (64, 256));
    assert!(!untied.tie_embeddings);
    assert_eq!(untied.rope, llama3_rope(32.0));
    assert!(Fixture::load("tied").config.tie_embeddings);
    // A context past the file's positions is refused, as is a bias.
    let config = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/llama_tiny/untied/config.json");
    assert!(LlamaConfig::from_hf_config(&config, 65).is_err());
}

/// On every rank of `parallel`'s mesh (ranks as threads): the Llama of `fixture` laid out as
/// `parallel` says, loaded from its Hugging Face files, `f` of it; the results in rank order.
fn on_ranks<T: Send>(
    fixture: &Fixture,
    parallel: &ParallelConfig,
    f: impl Fn(&DistDevice<Flex>, Llama<Dist>) -> T + Sync,
) -> Vec<T> {
    let mesh = parallel.mesh().unwrap();
    let run = |device: DistDevice<Flex>| {
        let model = init_llama::<Dist>(&fixture.config, &device, parallel).unwrap();
        let model = parallelize_llama(model, device.mesh(), parallel).unwrap();
        let model = import_llama(&fixture.dir)
            .unwrap()
            .load_model(model)
            .unwrap();
        f(&device, model)
    };
    launch_ranks::<Flex, _, _>(&mesh, &Default::default(), &LaunchOptions::default(), run).unwrap()
}

/// Both tiny Llamas `transformers` wrote (4 query heads over 2 key/value heads, Llama-3's
/// rotary scaling, every parameter perturbed; one with its own head, one tied): imported,
/// Wildfire's logits on the reference tokens are within 1e-4 of `LlamaForCausalLM`'s and the
/// loss within 1e-5 — on one device, sharded dp 2 FullShard, and dp 2 × tp 2 FullShard (each
/// rank reading its pieces of the transposed projections); saved from the sharded layouts as a
/// distributed checkpoint and exported, every tensor is bitwise the file's, under its name.
#[test]
fn a_transformers_llama_gives_its_logits_and_exports_bitwise() {
    for name in ["untied", "tied"] {
        let fixture = Fixture::load(name);
        let original =
            wildfire_checkpoint::safetensors::read(&fixture.dir.join("model.safetensors")).unwrap();
        for (dp, tp) in [(1, 1), (2, 1), (2, 2)] {
            let fsdp = if dp > 1 {
                FsdpStrategy::FullShard
            } else {
                FsdpStrategy::NoShard
            };
            let parallel = ParallelConfig::layout(dp, tp, fsdp, None);
            round_trip(
                &fixture,
                &parallel,
                &format!("{name} dp {dp} tp {tp}"),
                &original,
            );
        }
    }
}

/// The tiny Mixtral `transformers` wrote (`tools/mixtral_reference.py`: 2 blocks of 4 SwiGLU
/// experts, top-2 renormalised softmax, 4 query heads over 2 key/value heads, every parameter
/// perturbed; its experts saved one matrix each): its configuration reads as a Llama whose
/// every block is that mixture of experts, and imported — each expert's three matrices a slice
/// of the stacked weights, read transposed — Wildfire's logits on the reference tokens are
/// within 1e-4 of `MixtralForCausalLM`'s and the loss within 1e-5: on one device, dp 2
/// FullShard, and expert-parallel (ep 2 from dp 2 FullShard, each rank reading only its
/// experts' matrices; ep 2 × dp 2); saved from each layout as a distributed checkpoint and
/// exported, every tensor is bitwise the file's, under Mixtral's names.
#[test]
fn a_transformers_mixtral_gives_its_logits_on_any_layout() {
    let fixture = Fixture::load_from("mixtral_tiny");
    let moe = fixture.config.moe.clone().expect("a mixture of experts");
    assert_eq!(
        (
            moe.every,
            moe.expert_hidden,
            moe.config.experts,
            moe.config.top_k
        ),
        (1, 48, 4, 2)
    );
    assert!(moe.config.normalize && moe.config.capacity_factor.is_none());
    assert_eq!(fixture.config.rope.theta, 1e6);
    let layouts = [
        ParallelConfig::default(),
        ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None),
        ParallelConfig {
            ep: 2,
            ..ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None)
        },
        ParallelConfig {
            ep: 2,
            ..ParallelConfig::layout(4, 1, FsdpStrategy::FullShard, None)
        },
    ];
    let original =
        wildfire_checkpoint::safetensors::read(&fixture.dir.join("model.safetensors")).unwrap();
    for parallel in layouts {
        let at = format!("dp {} ep {}", parallel.dp, parallel.ep);
        round_trip(&fixture, &parallel, &at, &original);
    }
}

/// On `parallel`'s layout, the fixture's model imported from its files gives `transformers`'
/// logits and loss on every rank ([`Fixture::check`]); saved from that layout as a distributed
/// checkpoint and exported to Hugging Face's names, every tensor is bitwise the file's
/// (`original`).
fn round_trip(
    fixture: &Fixture,
    parallel: &ParallelConfig,
    at: &str,
    original: &wildfire_checkpoint::safetensors::NamedTensors,
) {
    let t = fixture.tokens.len() / 2;
    let save = scratch(&at.replace(' ', "-"));
    let out = on_ranks(fixture, parallel, |device, model| {
        let logits = model.forward(fixture.ids(0..t, device)).into_data();
        // transformers' loss: each position predicts the next token.
        let (x, y) = (fixture.ids(0..t - 1, device), fixture.ids(1..t, device));
        let loss: f32 = model.loss(x, y).into_scalar();
        save_step_1(device, &model, &save);
        (logits.convert::<f32>().to_vec::<f32>().unwrap(), loss)
    });
    for (rank, out) in out.iter().enumerate() {
        fixture.check(&format!("{at} rank {rank}"), out);
    }
    let exported = save.join("export.safetensors");
    let checkpoint = Checkpoint::open(save.join("step-00000001")).unwrap();
    crate::ModelConfig::Llama(fixture.config.clone())
        .export_hf(&checkpoint, &exported)
        .unwrap();
    let back = wildfire_checkpoint::safetensors::read(&exported).unwrap();
    assert_eq!(back.len(), original.len(), "{at}");
    for (key, tensor) in original {
        assert_eq!(back.get(key), Some(tensor), "{at}: {key}");
    }
    std::fs::remove_dir_all(&save).unwrap();
}

/// This rank's pieces of `model` saved as the distributed checkpoint of step 1 under `root`.
fn save_step_1(device: &DistDevice<Flex>, model: &Llama<Dist>, root: &Path) {
    let world = device.mesh().world_size();
    let mut writer = CheckpointWriter::new(root, device.rank(), world).unwrap();
    device
        .context()
        .comm()
        .barrier(wildfire_parallel::Group::World)
        .unwrap();
    let snapshot = Snapshot::take::<Dist, _, burn::optim::AdamW>(model, None).unwrap();
    writer.save(snapshot, 1, Vec::new()).unwrap();
    writer.wait().unwrap();
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wildfire-llama-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A tensor as `wildfire_checkpoint::safetensors::read` gives it: shape and values.
type Named = (Vec<usize>, Vec<f32>);

/// The same model as Hugging Face writes a large one (two shards and
/// `model.safetensors.index.json`) loads from its directory to the same logits; a file with a
/// tensor that is not part of the model (a bias) is a typed error naming it, and a projection
/// of the wrong shape is refused when loaded, naming it.
#[test]
fn sharded_directories_load_and_bad_files_are_named() {
    let fixture = Fixture::load("untied");
    let t = fixture.tokens.len() / 2;
    let tensors =
        wildfire_checkpoint::safetensors::read(&fixture.dir.join("model.safetensors")).unwrap();
    let dir = scratch("shards");
    std::fs::copy(fixture.dir.join("config.json"), dir.join("config.json")).unwrap();
    let write = |path: &Path, tensors: &[(&String, &Named)]| {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, (_, v))| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views = tensors.iter().zip(&bytes).map(|((name, (shape, _)), b)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                    .unwrap();
            (name.to_string(), view)
        });
        safetensors::serialize_to_file(views, None, path).unwrap();
    };
    let all: Vec<_> = tensors.iter().collect();
    let (a, b) = all.split_at(all.len() / 2);
    let shards = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    write(&dir.join(shards[0]), a);
    write(&dir.join(shards[1]), b);
    let weight_map: serde_json::Map<String, serde_json::Value> = a
        .iter()
        .map(|(k, _)| (k.to_string(), shards[0].into()))
        .chain(b.iter().map(|(k, _)| (k.to_string(), shards[1].into())))
        .collect();
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let sharded = Fixture {
        dir: dir.clone(),
        ..Fixture::load("untied")
    };
    let parallel = ParallelConfig::layout(2, 1, FsdpStrategy::FullShard, None);
    let out = on_ranks(&sharded, &parallel, |device, model| {
        let logits = model.forward(sharded.ids(0..t, device)).into_data();
        logits.convert::<f32>().to_vec::<f32>().unwrap()
    });
    for logits in &out {
        assert!(fixture.logits_off(logits) <= 1e-4);
    }
    // A bias the model does not have: refused at import, named.
    let bias = "model.layers.0.self_attn.q_proj.bias".to_string();
    let extra = (vec![32], vec![0.0f32; 32]);
    let mut with_bias = all.clone();
    with_bias.push((&bias, &extra));
    let file = dir.join("bias.safetensors");
    write(&file, &with_bias);
    let err = import_llama(&file)
        .err()
        .expect("a bias is refused")
        .to_string();
    assert!(err.contains("q_proj.bias"), "{err}");
    // A projection of the wrong width: refused when loaded, named.
    let key = "model.layers.1.mlp.up_proj.weight".to_string();
    let wrong = (vec![48, 32], vec![0.0f32; 48 * 32]);
    let mut reshaped: Vec<_> = all.iter().filter(|(k, _)| **k != key).copied().collect();
    reshaped.push((&key, &wrong));
    let file = dir.join("wrong.safetensors");
    write(&file, &reshaped);
    let mesh = ParallelConfig::default().mesh().unwrap();
    let load = |device: DistDevice<Flex>| {
        let model: Llama<Dist> = fixture.config.init(&device).unwrap();
        let err = import_llama(&file).unwrap().load_model(model).err();
        err.expect("a wrong shape is refused").to_string()
    };
    let opts = LaunchOptions::default();
    let err = launch_ranks::<Flex, _, _>(&mesh, &Default::default(), &opts, load).unwrap();
    let err = &err[0];
    assert!(err.contains("up_proj"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The model trains: a few AdamW steps on a repeated batch lower the loss, through the
/// recomputation hooks' grouped-query path (plain Flex, no decorator).
#[test]
fn a_tiny_llama_learns_a_batch() {
    use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
    let device = Default::default();
    let config = LlamaConfig {
        n_layer: 2,
        d_model: 32,
        ffn_hidden: 64,
        block_size: 16,
        ..LlamaConfig::tiny(64)
    };
    let mut model: Llama<Autodiff<Flex>> = config.init(&device).unwrap();
    let mut optim = AdamWConfig::new().init();
    let tokens: Vec<i64> = (0..34).map(|i| (i * 7 % 64) as i64).collect();
    let batch = |r: std::ops::Range<usize>| {
        Tensor::<Autodiff<Flex>, 2, Int>::from_data(
            TensorData::new(tokens[r].to_vec(), [2, 16]),
            &device,
        )
    };
    let (x, y) = (batch(0..32), batch(1..33));
    let mut losses = Vec::new();
    for _ in 0..8 {
        let loss = model.loss(x.clone(), y.clone());
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    assert!(losses[7] < 0.6 * losses[0], "{losses:?}");
}

/// A Llama's pipeline stages are the whole model cut in pieces, tied and untied: every
/// parameter has the whole model's value and id under the whole model's name, the saved names
/// cover the whole model once (a tied table's copy on the last stage left out, its id one past
/// the whole model's), and the stages' forward passes chained are the whole forward, bitwise.
#[test]
fn llama_stages_are_the_whole_model() {
    use crate::stage::{PipelineStage, StageInput};
    use burn::module::{ModuleVisitor, Param};
    use wildfire_checkpoint::safetensors::named_parameters;
    use wildfire_kernels::hooks::Inference;
    /// (id, values) of every parameter, in visiting order.
    struct Ids(Vec<(u64, Vec<f32>)>);
    impl<B: Backend> ModuleVisitor<B> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let values = param.val().into_data().convert::<f32>().to_vec().unwrap();
            self.0.push((param.id.val(), values));
        }
    }
    let device = Default::default();
    for tied in [true, false] {
        let config = LlamaConfig {
            n_layer: 3,
            d_model: 32,
            ffn_hidden: 64,
            block_size: 16,
            tie_embeddings: tied,
            init_seed: 7,
            ..LlamaConfig::tiny(64)
        };
        let whole = config.init::<Flex>(&device).unwrap();
        let mut whole_ids = Ids(Vec::new());
        whole.visit(&mut whole_ids);
        let ids: Vec<u64> = whole_ids.0.iter().map(|(id, _)| *id).collect();
        assert_eq!(
            ids,
            (1..=ids.len() as u64).collect::<Vec<_>>(),
            "tied {tied}"
        );
        let stages: Vec<LlamaStage<Flex>> = [(0..1, true, false), (1..3, false, true)]
            .into_iter()
            .map(|(blocks, first, last)| config.init_stage(&device, blocks, first, last))
            .collect::<Result<_, _>>()
            .unwrap();
        let (mut saved, mut by_id) = (Vec::new(), Vec::new());
        for stage in &stages {
            for (name, shape, values) in named_parameters(stage) {
                if let Some(name) = stage.saved_name(&name) {
                    saved.push((name, shape, values));
                }
            }
            let mut visited = Ids(Vec::new());
            stage.visit(&mut visited);
            let copy = stage.tied_copy().map(|id| id.val());
            assert_eq!(copy.is_some(), tied && !stage.first, "tied {tied}");
            if let Some(copy) = copy {
                assert_eq!(
                    copy,
                    ids.len() as u64 + 1,
                    "the copy's id is past the model's"
                );
            }
            by_id.extend(visited.0.into_iter().filter(|(id, _)| Some(*id) != copy));
        }
        saved.sort_by(|a, b| a.0.cmp(&b.0));
        let mut expected = named_parameters(&whole);
        expected.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(saved, expected, "tied {tied}: names and values");
        by_id.sort_by_key(|(id, _)| *id);
        assert_eq!(by_id, whole_ids.0, "tied {tied}: ids and values");
        let idx = Tensor::<Flex, 2, Int>::from_data(
            TensorData::new((0..24i64).map(|i| (i * 7) % 64).collect(), [2, 12]),
            &device,
        );
        let hidden = stages[0].forward_with(StageInput::Tokens(idx.clone()), &Inference);
        let logits = stages[1].forward_with(StageInput::Hidden(hidden), &Inference);
        let want = whole.forward(idx);
        assert_eq!(
            logits.into_data().to_vec::<f32>().unwrap(),
            want.into_data().to_vec::<f32>().unwrap(),
            "tied {tied}: the stages' logits"
        );
    }
}
