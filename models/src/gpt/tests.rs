//! Tests of the GPT: shapes, parameter counts, names, saving and loading, stages.

use super::*;
use crate::Preset;
use burn::backend::{Autodiff, Flex};

fn tiny() -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        init_seed: 7,
        dropout: 0.0,
        vocab_used: None,
        gelu: crate::gpt::Gelu::Erf,
    }
}

fn tokens(b: usize, t: usize, shift: usize) -> Tensor<Autodiff<Flex>, 2, Int> {
    let v: Vec<i64> = (0..b * t).map(|i| ((i * 7 + shift) % 64) as i64).collect();
    Tensor::from_data(TensorData::new(v, [b, t]), &Default::default())
}

#[test]
fn initial_loss_is_near_uniform_and_gradients_are_finite() {
    let model = tiny().init::<Autodiff<Flex>>(&Default::default()).unwrap();
    let loss = model.loss(tokens(2, 16, 0), tokens(2, 16, 1));
    let value = loss.clone().into_scalar().elem::<f32>();
    assert!(
        (value - (64f32).ln()).abs() < 0.3,
        "initial loss {value}, ln(64) = {}",
        (64f32).ln()
    );
    let grads = loss.backward();
    let g = model.wte.val().grad(&grads).unwrap();
    assert!(
        g.into_data()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .all(|x| x.is_finite())
    );
}

#[test]
fn parameter_count_matches_the_formula() {
    let config = tiny();
    let model = config.init::<Flex>(&Default::default()).unwrap();
    assert_eq!(model.num_params(), config.num_params());
    // GPT-2 small: 124,439,808 parameters with the 50257 vocabulary (tied embedding).
    assert_eq!(
        Preset::Gpt2_124m.gpt(50257).unwrap().num_params(),
        124_439_808
    );
}

#[test]
fn attention_is_causal() {
    let model = tiny().init::<Flex>(&Default::default()).unwrap();
    let a: Vec<i64> = (0..16).map(|i| i % 64).collect();
    let mut b = a.clone();
    b[10] = 63;
    let run = |v: Vec<i64>| {
        let x = Tensor::<Flex, 2, Int>::from_data(TensorData::new(v, [1, 16]), &Default::default());
        model
            .forward(x)
            .narrow(1, 0, 10)
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    assert_eq!(run(a), run(b), "positions before 10 must not see token 10");
}

#[test]
fn safetensors_round_trip_by_name() {
    let config = tiny();
    let model = config.init::<Flex>(&Default::default()).unwrap();
    let names: Vec<String> = wildfire_checkpoint::safetensors::named_parameters(&model)
        .into_iter()
        .map(|(n, _, _)| n)
        .collect();
    assert_eq!(names[0], "wte");
    assert!(
        names.contains(&"blocks.1.attn.c_attn.weight".to_string()),
        "{names:?}"
    );
    let path =
        std::env::temp_dir().join(format!("wildfire-gpt-{}.safetensors", std::process::id()));
    wildfire_checkpoint::safetensors::save(&model, &path).unwrap();
    let other = GptConfig {
        init_seed: 99,
        ..config.clone()
    }
    .init::<Flex>(&Default::default())
    .unwrap();
    let loaded = wildfire_checkpoint::safetensors::load(other, &path).unwrap();
    assert_eq!(
        wildfire_checkpoint::safetensors::named_parameters(&loaded),
        wildfire_checkpoint::safetensors::named_parameters(&model)
    );
    let wider = GptConfig {
        n_embd: 64,
        ..config
    }
    .init::<Flex>(&Default::default())
    .unwrap();
    let err = wildfire_checkpoint::safetensors::load(wider, &path).unwrap_err();
    assert!(err.to_string().contains("same shape"), "{err}");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn stage_names_are_the_whole_model_names() {
    assert_eq!(
        stage_param_name(6, "blocks.1.attn.c_attn.weight"),
        "blocks.7.attn.c_attn.weight"
    );
    assert_eq!(stage_param_name(6, "wte"), "wte");
    assert_eq!(stage_param_name(6, "ln_f.gamma"), "ln_f.gamma");
    let config = tiny();
    let last = config
        .init_stage::<Flex>(&Default::default(), 1..2, false, true)
        .unwrap();
    assert_eq!(last.saved_name("wte"), None);
    assert_eq!(last.model_name("wte"), "wte");
    assert_eq!(
        last.saved_name("blocks.0.ln_1.gamma").as_deref(),
        Some("blocks.1.ln_1.gamma")
    );
    // Every name a stage saves is a name of the whole model, and together they are all of
    // them, each once.
    let whole: Vec<String> = wildfire_checkpoint::safetensors::named_parameters(
        &config.init::<Flex>(&Default::default()).unwrap(),
    )
    .into_iter()
    .map(|(n, _, _)| n)
    .collect();
    let mut saved = Vec::new();
    for (blocks, first, last) in [(0..1, true, false), (1..2, false, true)] {
        let stage = config
            .init_stage::<Flex>(&Default::default(), blocks, first, last)
            .unwrap();
        for (name, _, _) in wildfire_checkpoint::safetensors::named_parameters(&stage) {
            saved.extend(stage.saved_name(&name));
        }
    }
    saved.sort();
    let mut whole = whole;
    whole.sort();
    assert_eq!(saved, whole);
}

#[test]
fn bad_shapes_are_refused() {
    let mut c = tiny();
    c.n_head = 3;
    assert!(matches!(
        c.init::<Flex>(&Default::default()).unwrap_err(),
        Error::Heads {
            n_embd: 32,
            n_head: 3
        }
    ));
    assert!("gpt9".parse::<Preset>().is_err());
}

/// A padded vocabulary (64 entries, 50 that exist): the padded logits are masked
/// ([`PADDED_LOGIT`] below the rest), the loss is the cross-entropy over the 50 real logits
/// alone (an f64 reference from the same logits) and differs from the unmasked model's, and
/// sampling, even among all 64, never draws a padded token.
#[test]
fn a_padded_vocabulary_is_masked_out_of_the_loss_and_the_sampler() {
    let device = Default::default();
    let masked = GptConfig {
        vocab_used: Some(50),
        ..tiny()
    };
    let model = masked.init::<Flex>(&device).unwrap();
    let (b, t) = (2, 16);
    let ids = |shift: usize| -> Tensor<Flex, 2, Int> {
        let v: Vec<i64> = (0..b * t).map(|i| ((i * 7 + shift) % 50) as i64).collect();
        Tensor::from_data(TensorData::new(v, [b, t]), &device)
    };
    let (x, y) = (ids(0), ids(1));
    let logits: Vec<f32> = model.forward(x.clone()).into_data().to_vec().unwrap();
    let targets: Vec<i64> = y.clone().into_data().convert::<i64>().to_vec().unwrap();
    let mut reference = 0f64;
    for (row, &target) in logits.chunks(64).zip(&targets) {
        assert!(
            row[50..].iter().all(|&l| l < PADDED_LOGIT / 2.0),
            "{:?}",
            &row[50..]
        );
        let real = &row[..50];
        let max = real.iter().fold(f32::MIN, |m, &l| m.max(l)) as f64;
        let lse = max
            + real
                .iter()
                .map(|&l| (l as f64 - max).exp())
                .sum::<f64>()
                .ln();
        reference += lse - real[target as usize] as f64;
    }
    let reference = (reference / targets.len() as f64) as f32;
    let loss = model.loss(x.clone(), y.clone()).into_scalar().elem::<f32>();
    assert!(
        (loss - reference).abs() <= 1e-5 * reference,
        "{loss} vs {reference}"
    );
    let unmasked = tiny().init::<Flex>(&device).unwrap();
    let plain = unmasked.loss(x.clone(), y).into_scalar().elem::<f32>();
    assert!(
        (plain - loss).abs() > 1e-3,
        "the mask changes the loss: {plain} vs {loss}"
    );
    let tokens = model.generate(&[1, 2, 3], 300, 2.0, 64, 5, &device);
    assert!(tokens.iter().all(|&t| t < 50), "{tokens:?}");
    // Laid out dp 2 × tp 2 under FSDP (the logits vocabulary-split over tp, the mask with them):
    // the same loss.
    use crate::parallelize::{FsdpStrategy, ParallelConfig, init_gpt, parallelize_gpt};
    use wildfire_parallel::{Distributed, LaunchOptions, launch_ranks};
    type Dist = Autodiff<Distributed<Flex>>;
    let parallel = ParallelConfig::layout(2, 2, FsdpStrategy::FullShard, None);
    let mesh = parallel.mesh().unwrap();
    let x: Vec<i64> = x.into_data().convert::<i64>().to_vec().unwrap();
    let losses = launch_ranks::<Flex, _, _>(&mesh, &device, &LaunchOptions::default(), |d| {
        let model = init_gpt::<Dist>(&masked, &d, &parallel).unwrap();
        let model = parallelize_gpt(model, &mesh, &parallel).unwrap();
        let ids =
            |v: &[i64]| Tensor::<Dist, 2, Int>::from_data(TensorData::new(v.to_vec(), [b, t]), &d);
        let loss = model.loss(ids(&x), ids(&targets));
        loss.into_scalar().elem::<f32>()
    })
    .unwrap();
    for sharded in losses {
        assert!((sharded - loss).abs() <= 1e-5 * loss, "{sharded} vs {loss}");
    }
}
