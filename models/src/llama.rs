//! The Llama-3 family, as Hugging Face's `LlamaForCausalLM` computes it: pre-RMSNorm blocks,
//! grouped-query attention with rotary positions (Llama-3's frequency scaling included), a SwiGLU
//! MLP, no biases, the output head tied to the token table or its own as
//! `tie_word_embeddings` says.
//!
//! Parameter paths follow Hugging Face's names (`layers.0.self_attn.q_proj.weight`, …, the
//! norms' `weight` as Burn's `gamma`), so its files map name for name ([`crate::hf`]); linear
//! weights are kept `[in, out]` (Burn's `Linear`), the token table and an untied head
//! `[vocab, d]` (as stored).

use crate::CausalLm;
use crate::Error;
use crate::init::{LayoutFn, Place, Values};
use crate::moe::{MoeConfig, MoeMlp};
use burn::module::Param;
use burn::nn::RmsNorm;
use burn::prelude::*;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::Path;
use wildfire_kernels::FusedOps;
use wildfire_kernels::hooks::ForwardHooks;
use wildfire_parallel::DistributedBackend;

mod block;
mod parallel;
mod rope;
mod stage;

pub use block::{LlamaAttention, LlamaBlock, SwiGlu};
pub use parallel::{
    Mlps, init_llama, init_llama_stage, init_llama_stages, kv_replicated, llama_tp_plan,
    parallelize_llama,
};
pub use rope::{Llama3Scaling, Rope, apply_rope};
pub use stage::LlamaStage;

/// A Llama model's shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size (rows of the token table).
    pub vocab_size: usize,
    /// The tokens that exist, when the table is padded past them (their logits are masked to
    /// [`PADDED_LOGIT`](crate::gpt::PADDED_LOGIT)); `None`: every row is a token.
    #[serde(default)]
    pub vocab_used: Option<usize>,
    /// Blocks.
    pub n_layer: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention; `n_head` for plain multi-head attention).
    pub n_kv_head: usize,
    /// Width.
    pub d_model: usize,
    /// The MLP's hidden width.
    pub ffn_hidden: usize,
    /// The context length trained on (rotary positions reach any length; this sizes batches).
    pub block_size: usize,
    /// The rotary embedding.
    pub rope: Rope,
    /// RMSNorm's ε.
    pub rms_eps: f64,
    /// The output head is the token table (`tie_word_embeddings`).
    pub tie_embeddings: bool,
    /// Seed of the initial values.
    #[serde(default)]
    pub init_seed: u64,
    /// Mixture-of-experts MLPs in some or all blocks (`None`: every block dense).
    #[serde(default)]
    pub moe: Option<LlamaMoe>,
}

/// Which of a Llama's blocks are mixtures of experts, and their experts (SwiGLU MLPs of the
/// Llama family, routed as [`MoeConfig`] says).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaMoe {
    /// The router and experts.
    pub config: MoeConfig,
    /// Every `every`-th block is a mixture of experts: blocks `every − 1`, `2·every − 1`, …
    /// (GShard's every other block at 2); 1: all of them.
    pub every: usize,
    /// Each expert's SwiGLU width (routed and shared).
    pub expert_hidden: usize,
}

impl LlamaMoe {
    /// Whether block `layer` is a mixture of experts.
    pub fn is_moe(&self, layer: usize) -> bool {
        self.every > 0 && layer % self.every == self.every - 1
    }
}

/// Llama-3.1/3.2's rotary embedding: θ 500,000, scaled by `factor` from an 8,192-token
/// original context.
fn llama3_rope(factor: f64) -> Rope {
    Rope {
        theta: 500_000.0,
        scaling: Some(Llama3Scaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
    }
}

/// Llama-3's vocabulary (the `tokenizer.json` of every Llama-3 model).
pub const LLAMA3_VOCAB: usize = 128_256;

impl LlamaConfig {
    /// A tiny Llama for CPUs and tests: 4 layers, 4 query heads over 2 key/value heads, width
    /// 128, SwiGLU width 384, context 128, the head tied, Llama-3.2's rotary embedding.
    pub fn tiny(vocab_size: usize) -> Self {
        Self {
            vocab_size,
            vocab_used: None,
            n_layer: 4,
            n_head: 4,
            n_kv_head: 2,
            d_model: 128,
            ffn_hidden: 384,
            block_size: 128,
            rope: llama3_rope(32.0),
            rms_eps: 1e-5,
            tie_embeddings: true,
            init_seed: 0,
            moe: None,
        }
    }

    /// [`LlamaConfig::tiny`] with a mixture of experts in every other block (blocks 1 and 3):
    /// 8 SwiGLU experts of width 192, top-2 with renormalised softmax gates, dropless, Switch's
    /// and ST-MoE's loss coefficients.
    pub fn tiny_moe(vocab_size: usize) -> Self {
        Self {
            moe: Some(LlamaMoe {
                config: MoeConfig::default(),
                every: 2,
                expert_hidden: 192,
            }),
            ..Self::tiny(vocab_size)
        }
    }

    /// Llama-3.2-1B's shape (16 layers, 32 heads over 8, width 2,048, SwiGLU 8,192, tied head),
    /// with a `block_size` context.
    pub fn llama3_2_1b(block_size: usize) -> Self {
        Self {
            vocab_size: LLAMA3_VOCAB,
            n_layer: 16,
            n_head: 32,
            n_kv_head: 8,
            d_model: 2048,
            ffn_hidden: 8192,
            block_size,
            ..Self::tiny(LLAMA3_VOCAB)
        }
    }

    /// Llama-3.2-3B's shape (28 layers, 24 heads over 8, width 3,072, SwiGLU 8,192, tied head).
    pub fn llama3_2_3b(block_size: usize) -> Self {
        Self {
            n_layer: 28,
            n_head: 24,
            d_model: 3072,
            ..Self::llama3_2_1b(block_size)
        }
    }

    /// Llama-3-8B's shape (32 layers, 32 heads over 8, width 4,096, SwiGLU 14,336, a head of its
    /// own, θ 500,000 unscaled).
    pub fn llama3_8b(block_size: usize) -> Self {
        Self {
            n_layer: 32,
            n_head: 32,
            d_model: 4096,
            ffn_hidden: 14_336,
            tie_embeddings: false,
            rope: Rope {
                theta: 500_000.0,
                scaling: None,
            },
            ..Self::llama3_2_1b(block_size)
        }
    }

    /// A head's width.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head.max(1)
    }

    /// Refuse shapes the model cannot have.
    pub fn validate(&self) -> Result<(), Error> {
        let hd = self.head_dim();
        let problem = if self.n_head == 0 || self.n_kv_head == 0 {
            Some("no heads".to_string())
        } else if !self.d_model.is_multiple_of(self.n_head) {
            Some(format!("width {} over {} heads", self.d_model, self.n_head))
        } else if !self.n_head.is_multiple_of(self.n_kv_head) {
            Some(format!(
                "{} query heads over {} key/value heads",
                self.n_head, self.n_kv_head
            ))
        } else if !hd.is_multiple_of(2) {
            Some(format!(
                "an odd head width {hd} (rotary positions pair dims)"
            ))
        } else if self.vocab_used.is_some_and(|u| u > self.vocab_size) {
            Some(format!(
                "{:?} tokens used of {}",
                self.vocab_used, self.vocab_size
            ))
        } else {
            None
        };
        if let Some(p) = problem {
            return Err(Error::Config(format!("a Llama with {p}")));
        }
        if let Some(moe) = &self.moe {
            moe.config.check()?;
            if moe.every == 0 || moe.every > self.n_layer {
                return Err(Error::Config(format!(
                    "--moe-every {} over {} blocks: choose 1 (every block) to {}",
                    moe.every, self.n_layer, self.n_layer
                )));
            }
            if moe.expert_hidden == 0 {
                return Err(Error::Config("an expert hidden width of 0".into()));
            }
        }
        Ok(())
    }

    /// The mixture-of-experts settings of block `layer`, if it is one.
    pub fn moe_at(&self, layer: usize) -> Option<&LlamaMoe> {
        self.moe.as_ref().filter(|m| m.is_moe(layer))
    }

    /// Parameter tensors of block `layer`: two norms, four attention projections, and three
    /// per MLP (one dense, or the router, the stacked routed experts and each shared expert).
    pub fn block_tensors(&self, layer: usize) -> usize {
        6 + match self.moe_at(layer) {
            Some(m) => 1 + 3 * (1 + m.config.shared_experts),
            None => 3,
        }
    }

    /// Parameters of block `layer`'s MLP; with `active`, only those a token goes through (the
    /// router, its `k` routed experts and the shared ones).
    fn mlp_params(&self, layer: usize, active: bool) -> usize {
        let d = self.d_model;
        match self.moe_at(layer) {
            Some(m) => {
                let c = &m.config;
                let routed = if active { c.top_k } else { c.experts };
                d * c.experts + 3 * d * m.expert_hidden * (routed + c.shared_experts)
            }
            None => 3 * d * self.ffn_hidden,
        }
    }

    /// Parameters in the model (the tied head counted once).
    pub fn num_params(&self) -> usize {
        self.params(false)
    }

    /// Parameters one token goes through: a mixture of experts' router, `k` routed and its
    /// shared experts, not the other experts (the tied head counted once).
    pub fn active_params(&self) -> usize {
        self.params(true)
    }

    fn params(&self, active: bool) -> usize {
        let (d, kv) = (self.d_model, self.n_kv_head * self.head_dim());
        let attention = 2 * d * d + 2 * d * kv + 2 * d;
        let blocks: usize = (0..self.n_layer)
            .map(|l| attention + self.mlp_params(l, active))
            .sum();
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        blocks + self.vocab_size * d + d + head
    }

    /// Training FLOPs per token for sequences of `seq` tokens: 6N + 12·L·d·T, N the parameters
    /// a token goes through ([`LlamaConfig::active_params`]; without the token table when the
    /// head is tied: its lookup is not a matmul).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let n = self.active_params()
            - if self.tie_embeddings {
                0
            } else {
                self.vocab_size * self.d_model
            };
        6.0 * n as f64 + 12.0 * (self.n_layer * self.d_model * seq) as f64
    }

    /// The shape a Hugging Face `config.json` of a `LlamaForCausalLM` gives (`transformers`
    /// 4.x's `rope_theta` / `rope_scaling`, or 5.x's `rope_parameters`), with a `block_size`
    /// context (at most the file's `max_position_embeddings`) — or of a `MixtralForCausalLM`:
    /// every block a mixture of `num_local_experts` SwiGLU experts of `intermediate_size`, top
    /// `num_experts_per_tok` of a softmax renormalised, `router_aux_loss_coef` its balance
    /// loss's coefficient (no z-loss), dropless. A sliding window or router jitter (which
    /// Wildfire's attention and router do not have) is refused.
    pub fn from_hf_config(path: &Path, block_size: usize) -> Result<Self, Error> {
        let file = crate::hf::HfConfig::read(path, &["llama", "mixtral"])?;
        let (json, invalid, int) = (&file.json, |r| file.invalid(r), |k| file.int(k));
        for key in ["attention_bias", "mlp_bias"] {
            if json.get(key).and_then(|v| v.as_bool()) == Some(true) {
                return Err(invalid(format!(
                    "{key} is true; Wildfire's Llama has no biases"
                )));
            }
        }
        if let Some(act) = json.get("hidden_act").and_then(|v| v.as_str())
            && act != "silu"
        {
            return Err(invalid(format!(
                "hidden_act {act:?}; the Llama MLP is SwiGLU (silu)"
            )));
        }
        let n_head = int("num_attention_heads")?;
        let d_model = int("hidden_size")?;
        if let Some(hd) = json.get("head_dim").and_then(|v| v.as_u64())
            && hd as usize * n_head != d_model
        {
            return Err(invalid(format!(
                "head_dim {hd} × {n_head} heads is not the width {d_model}"
            )));
        }
        let max_positions = int("max_position_embeddings")?;
        if block_size > max_positions {
            return Err(invalid(format!(
                "a context of {block_size} past max_position_embeddings {max_positions}"
            )));
        }
        let rope_params = json
            .get("rope_parameters")
            .or_else(|| json.get("rope_scaling"))
            .filter(|v| !v.is_null());
        let float = |v: Option<&serde_json::Value>, key: &str| {
            v.and_then(|v| v.get(key))
                .and_then(serde_json::Value::as_f64)
        };
        let theta = float(rope_params, "rope_theta")
            .or_else(|| json.get("rope_theta").and_then(|v| v.as_f64()))
            .unwrap_or(10_000.0);
        let kind = rope_params
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let scaling = match kind {
            "default" => None,
            "llama3" => {
                let get = |key: &str| {
                    float(rope_params, key)
                        .ok_or_else(|| invalid(format!("llama3 rope without {key}")))
                };
                Some(Llama3Scaling {
                    factor: get("factor")?,
                    low_freq_factor: get("low_freq_factor")?,
                    high_freq_factor: get("high_freq_factor")?,
                    original_max_position_embeddings: get("original_max_position_embeddings")?
                        as usize,
                })
            }
            other => {
                return Err(invalid(format!(
                    "rope_type {other:?}; Wildfire's Llama reads \"default\" and \"llama3\""
                )));
            }
        };
        let n_kv_head = match json.get("num_key_value_heads") {
            Some(v) if !v.is_null() => int("num_key_value_heads")?,
            _ => n_head,
        };
        let moe = match file.model_type() {
            "mixtral" => {
                if json.get("sliding_window").is_some_and(|v| !v.is_null()) {
                    return Err(invalid(
                        "sliding_window is set; Wildfire's attention is full causal".into(),
                    ));
                }
                let jitter = json.get("router_jitter_noise").and_then(|v| v.as_f64());
                if jitter.is_some_and(|j| j != 0.0) {
                    return Err(invalid(format!(
                        "router_jitter_noise {}; Wildfire's router has none",
                        jitter.unwrap_or_default()
                    )));
                }
                Some(LlamaMoe {
                    config: MoeConfig {
                        experts: int("num_local_experts")?,
                        top_k: int("num_experts_per_tok")?,
                        score: crate::moe::RouterScore::Softmax,
                        normalize: true,
                        aux_loss_coef: json
                            .get("router_aux_loss_coef")
                            .and_then(|v| v.as_f64())
                            .unwrap_or(0.001),
                        z_loss_coef: 0.0,
                        capacity_factor: None,
                        shared_experts: 0,
                        balance: crate::moe::BalanceScope::MicroBatch,
                    },
                    every: 1,
                    expert_hidden: int("intermediate_size")?,
                })
            }
            _ => None,
        };
        let config = Self {
            vocab_size: int("vocab_size")?,
            vocab_used: None,
            n_layer: int("num_hidden_layers")?,
            n_head,
            n_kv_head,
            d_model,
            ffn_hidden: int("intermediate_size")?,
            block_size,
            rope: Rope { theta, scaling },
            rms_eps: json
                .get("rms_norm_eps")
                .and_then(|v| v.as_f64())
                .unwrap_or(1e-6),
            tie_embeddings: json
                .get("tie_word_embeddings")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            init_seed: 0,
            moe,
        };
        config.validate().map_err(|e| invalid(e.to_string()))?;
        Ok(config)
    }

    /// [`LlamaConfig::block_tensors`] of every block.
    fn block_tensor_counts(&self) -> Vec<u64> {
        (0..self.n_layer)
            .map(|l| self.block_tensors(l) as u64)
            .collect()
    }

    /// The model, every parameter drawn whole: normal(0, 0.02) linear weights and tables (as
    /// `transformers` initialises a Llama), norms at 1.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Result<Llama<B>, Error> {
        let whole = self.init_stage(device, 0..self.n_layer, true, true)?;
        Ok(whole.into_llama())
    }

    /// The model already laid out over `device`'s mesh, each parameter in the layout `layouts`
    /// gives it, each rank drawing only its own pieces (the values [`LlamaConfig::init`] gives
    /// there).
    pub fn init_in_layouts<B: DistributedBackend>(
        &self,
        device: &B::Device,
        layouts: impl LayoutFn,
    ) -> Result<Llama<B>, Error> {
        let whole = self.init_stage_in_layouts(device, 0..self.n_layer, true, true, layouts)?;
        Ok(whole.into_llama())
    }

    /// Blocks `blocks` of the model (the token table when `first`; the final norm and the head
    /// when `last`, a copy of the token table for a tied head), their parameters made by `place`
    /// under stage-local paths (`layers.0` is the stage's first block: the parallel plans match
    /// them by pattern). Every parameter's values have their own stream, numbered as in the
    /// whole model, so a stage holds exactly the whole model's values.
    fn build<B: Backend>(
        &self,
        place: &mut impl Place<B>,
        device: &B::Device,
        blocks: Range<usize>,
        first: bool,
        last: bool,
    ) -> LlamaStage<B> {
        let (d, hd) = (self.d_model, self.head_dim());
        let normal = |count: usize| Values::Normal {
            stream: self.init_seed ^ (count as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            std: 0.02,
        };
        let place = std::cell::RefCell::new(place);
        let tensor = |path: &str, shape: [usize; 2], count: usize| {
            place
                .borrow_mut()
                .tensor(&format!("{path}.weight"), shape, normal(count))
        };
        let norm = || RmsNorm {
            gamma: Param::from_tensor(Tensor::ones([d], device)),
            epsilon: self.rms_eps,
        };
        let (q, kv) = (self.n_head * hd, self.n_kv_head * hd);
        let layers = blocks
            .clone()
            .map(|l| {
                let i = l - blocks.start;
                let at = |s: &str| format!("layers.{i}.{s}");
                let c = 7 * l;
                let self_attn = LlamaAttention {
                    q_proj: block::linear(tensor(&at("self_attn.q_proj"), [d, q], c + 1)),
                    k_proj: block::linear(tensor(&at("self_attn.k_proj"), [d, kv], c + 2)),
                    v_proj: block::linear(tensor(&at("self_attn.v_proj"), [d, kv], c + 3)),
                    o_proj: block::linear(tensor(&at("self_attn.o_proj"), [q, d], c + 4)),
                    n_head: self.n_head,
                    n_kv_head: self.n_kv_head,
                };
                let (mlp, moe) = match self.moe_at(l) {
                    None => (
                        Some(SwiGlu {
                            gate_proj: block::linear(tensor(
                                &at("mlp.gate_proj"),
                                [d, self.ffn_hidden],
                                c + 5,
                            )),
                            up_proj: block::linear(tensor(
                                &at("mlp.up_proj"),
                                [d, self.ffn_hidden],
                                c + 6,
                            )),
                            down_proj: block::linear(tensor(
                                &at("mlp.down_proj"),
                                [self.ffn_hidden, d],
                                c + 7,
                            )),
                        }),
                        None,
                    ),
                    Some(m) => {
                        // The router takes the dense MLP's first stream; each stacked expert
                        // projection and each shared expert's projection one of its own, past
                        // every dense stream.
                        let stream = std::cell::Cell::new(0u64);
                        let next = || {
                            stream.set(stream.get() + 1);
                            let n = (l as u64) << 24 | stream.get();
                            (1usize << 40) + n as usize
                        };
                        let moe = MoeMlp::new(
                            &m.config,
                            d,
                            m.expert_hidden,
                            |name, shape| {
                                let path = format!("layers.{i}.moe.{name}.weight");
                                let count = if name == "router" { c + 5 } else { next() };
                                place.borrow_mut().tensor(&path, shape, normal(count))
                            },
                            |name, shape| {
                                let path = format!("layers.{i}.moe.{name}.weight");
                                place.borrow_mut().tensor(&path, shape, normal(next()))
                            },
                        )
                        .expect("validated");
                        (None, Some(moe))
                    }
                };
                LlamaBlock {
                    input_layernorm: norm(),
                    self_attn,
                    post_attention_layernorm: norm(),
                    mlp,
                    moe,
                }
            })
            .collect();
        let tables = 7 * self.n_layer;
        let vocab = self.vocab_size;
        let tied = self.tie_embeddings;
        let embed_tokens = (first || (last && tied)).then(|| {
            Param::from_tensor(place.borrow_mut().tensor(
                "embed_tokens",
                [vocab, d],
                normal(tables + 1),
            ))
        });
        let lm_head = (last && !tied).then(|| {
            Param::from_tensor(
                place
                    .borrow_mut()
                    .tensor("lm_head", [vocab, d], normal(tables + 2)),
            )
        });
        LlamaStage {
            embed_tokens,
            layers,
            norm: last.then(norm),
            lm_head,
            rope: self.rope,
            first,
            tied,
            first_block: blocks.start,
            n_layer: self.n_layer,
            vocab_used: self.vocab_used.unwrap_or(vocab),
        }
        .with_model_ids(&self.block_tensor_counts())
    }
}

/// A Llama model (see the module docs).
#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    /// Token table `[vocab, d]`.
    pub embed_tokens: Param<Tensor<B, 2>>,
    /// The blocks.
    pub layers: Vec<LlamaBlock<B>>,
    /// Final RMSNorm.
    pub norm: RmsNorm<B>,
    /// The output head `[vocab, d]`, or `None` when tied to the token table.
    pub lm_head: Option<Param<Tensor<B, 2>>>,
    /// The rotary embedding.
    #[module(skip)]
    pub rope: Rope,
    /// The tokens that exist (logits past them masked).
    pub vocab_used: usize,
}

impl<B: FusedOps> CausalLm<B> for Llama<B> {
    fn forward_with<'a, H: ForwardHooks<'a, B>>(
        &self,
        idx: Tensor<B, 2, Int>,
        hooks: &H,
    ) -> Tensor<B, 3> {
        let x = wildfire_kernels::ops::embedding(self.embed_tokens.val(), idx);
        let n = self.layers.len();
        let x = stage::run_layers(&self.layers, &self.rope, 0, n, x, hooks);
        let table = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        stage::head(&self.norm, table, hooks.head_input(x), self.vocab_used)
    }
}

#[cfg(test)]
mod tests;
