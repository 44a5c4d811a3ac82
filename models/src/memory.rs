//! The per-rank memory a training run needs (GPT or Llama), predicted from its shape and parallel
//! layout:
//! the bytes the decorator's accounting measures (`parameter_bytes`, the gradient and
//! optimizer-state bytes of `StepMetrics`) and an activation estimate.
//!
//! Parameters, gradients and AdamW state are counted tensor by tensor on the layout
//! [`crate::parallelize::parallelize_gpt`] (or [`crate::llama::parallelize_llama`]) builds: tensor
//! parallelism splits the token embedding (and an untied head) by vocabulary, the column-parallel
//! weights and biases by output and the row-parallel weights by input (row-parallel biases and
//! norms stay whole); data-parallel sharding then splits every local piece along its first
//! dimension into `N` shards of `⌈rows/N⌉` rows (ZeRO, Rajbhandari et al. 2020). A GPT's
//! activations follow Korthikanti et al. (2022); a Llama's are counted tensor by tensor
//! ([`llama_activation_bytes`]).

use crate::ModelConfig;
use crate::gpt::GptConfig;
use crate::llama::LlamaConfig;
use crate::parallelize::{FsdpStrategy, ParallelConfig, Recompute};
use burn::tensor::FloatDType;
use serde::Serialize;
use wildfire_parallel::pipeline::StagePlan;

/// The optimizer state a run keeps, as the estimate counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum OptimizerState {
    /// AdamW: two moments shaped like each parameter, `moment_bytes` per element (4 for f32,
    /// 2 for bf16).
    AdamW {
        /// Bytes per moment element.
        moment_bytes: usize,
    },
    /// Adafactor: a matrix's row and column statistics (`n + m` f32 values for `n × m`; a
    /// stacked `[E, n, m]` keeps `E·(n + m)`), a vector's whole second moment. Under data
    /// sharding the row statistic is split with the rows and the column statistic replicated.
    Adafactor,
    /// Muon: one f32 momentum buffer shaped like each hidden matrix; AdamW's two f32 moments for
    /// the tables and vectors.
    Muon,
    /// AdamW with 8-bit block-quantised moments (`wildfire_engine::QuantAdamW`): a byte per
    /// moment element and an f32 scale per block of 2,048 elements of the whole tensor (every
    /// rank keeps all of a tensor's scales); f32 moments for tensors under 4,096 elements.
    AdamW8bit,
}

impl Default for OptimizerState {
    fn default() -> Self {
        OptimizerState::AdamW { moment_bytes: 4 }
    }
}

/// Per-rank memory in bytes (f32 parameters and gradients, the optimizer's state).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Parameters Ψ of the whole model.
    pub params: usize,
    /// Parameters a rank holds before data-parallel sharding (its tensor-parallel piece of its
    /// pipeline stages; pipeline rank 0's, which holds the token table).
    pub params_per_tp_rank: usize,
    /// Data-parallel ranks that shard (N of the formulas).
    pub shard_ranks: usize,
    /// Parameter bytes on the device (none between uses when offloaded).
    pub param_bytes: usize,
    /// Gradient bytes.
    pub grad_bytes: usize,
    /// Optimizer-state bytes on the device (AdamW's two moments, Adafactor's statistics,
    /// Muon's buffers; none when offloaded).
    pub optim_bytes: usize,
    /// Bytes in host memory (the moments of an offloaded optimizer, offloaded parameters).
    pub host_bytes: usize,
    /// Activations kept for backward (this rank's share of the batch), in the compute dtype
    /// (the residual stream f32).
    pub activation_bytes: usize,
    /// The sum.
    pub total_bytes: usize,
}

/// What an estimate keeps in host memory instead of the device (`--offload`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offloaded {
    /// Nothing.
    Nothing,
    /// The optimizer state.
    Optimizer,
    /// The optimizer state and the parameters' pieces (between uses).
    Params,
}

/// One parameter tensor on a tensor-parallel rank: `[rows, cols]` of its local piece (`cols`
/// the product of the dims past the first; `cols == 1` a vector), `last` its last dim; `table`
/// an embedding or the head.
/// `experts`: a stacked expert weight `[E, cols / last, last]`, its rows the experts, split over
/// the expert axis before the data-parallel sharding nests inside.
#[derive(Clone)]
struct Local {
    rows: usize,
    cols: usize,
    last: usize,
    experts: bool,
    table: bool,
    /// The whole tensor's elements (the piece's times the tensor-parallel split).
    numel: usize,
}

impl Local {
    /// The rows of the piece on one rank of the expert axis of `ep` members: an expert
    /// weight's share of the experts, anything else all.
    fn rows_on_expert_rank(&self, ep: usize) -> usize {
        if self.experts {
            self.rows / ep
        } else {
            self.rows
        }
    }

    /// The rows of the piece once the data-parallel sharding splits it
    /// (`placement::shard_dim0`): over `n` ranks, `⌈rows/n⌉` (padded); an expert weight's
    /// experts first over the `ep` members, then over each further data axis (`axes`, sizes
    /// in mesh order) that divides what is left.
    fn sharded_rows(&self, n: usize, ep: usize, axes: &[usize]) -> usize {
        if !self.experts {
            return self.rows.div_ceil(n);
        }
        let mut parts = ep;
        for &size in axes {
            if size > 1 && self.rows.is_multiple_of(parts * size) {
                parts *= size;
            }
        }
        self.rows / parts
    }

    /// The piece of a tensor tensor parallelism splits into `parts`.
    fn split(self, parts: usize) -> Self {
        Self {
            numel: self.numel * parts,
            ..self
        }
    }

    /// A rank-1 parameter (a norm's scale, a bias).
    fn is_vector(&self) -> bool {
        self.cols == 1 && !self.experts
    }

    /// The optimizer-state bytes of this piece where a rank holds `rows` of its rows.
    fn state_bytes(&self, rows: usize, optimizer: OptimizerState) -> usize {
        match optimizer {
            OptimizerState::AdamW { moment_bytes } => 2 * moment_bytes * rows * self.cols,
            // A vector: its second moment. A stacked matrix: per expert a row statistic of
            // `cols / last` and a column statistic of `last`. A matrix: its rows' statistic
            // (split with them) and every column's (replicated over the data axes).
            OptimizerState::Adafactor if self.is_vector() => 4 * rows,
            OptimizerState::Adafactor if self.experts => {
                4 * rows * (self.cols / self.last + self.last)
            }
            OptimizerState::Adafactor => 4 * (rows + self.cols),
            OptimizerState::Muon if self.table || self.is_vector() => 8 * rows * self.cols,
            OptimizerState::Muon => 4 * rows * self.cols,
            // f32 moments under the 8-bit size; else a byte per moment element and each
            // moment's f32 scale per block of the whole tensor (replicated).
            OptimizerState::AdamW8bit if self.numel < wildfire_parallel::MIN_QUANT_SIZE => {
                8 * rows * self.cols
            }
            OptimizerState::AdamW8bit => {
                2 * rows * self.cols + 8 * self.numel.div_ceil(wildfire_parallel::QUANT_BLOCK)
            }
        }
    }
}

/// A matrix `[rows, cols]` (or a vector, `cols` 1) that is not a table.
fn whole(rows: usize, cols: usize) -> Local {
    Local {
        rows,
        cols,
        last: cols,
        experts: false,
        table: false,
        numel: rows * cols,
    }
}

/// An embedding table or the output head, `[rows, cols]`.
fn table(rows: usize, cols: usize) -> Local {
    Local {
        table: true,
        ..whole(rows, cols)
    }
}

/// A model's parameter pieces on one tensor-parallel rank, grouped by where pipeline stages put
/// them: the first stage's tables, each block's, the last stage's final norm (and untied head),
/// and the token table the last stage holds a copy of when the head is tied to it.
struct ModelPieces {
    first: Vec<Local>,
    blocks: Vec<Vec<Local>>,
    last: Vec<Local>,
    tied: Option<Local>,
}

impl ModelPieces {
    /// The pieces pipeline rank 0 holds (`crate::parallelize::init_gpt_stages`: a balanced split
    /// of the blocks over the schedule's stages, its stages `0, p, 2p, …`): every piece without
    /// a pipeline; an unusable schedule counts as none (the run refuses it before any work).
    fn on_first_rank(self, parallel: &ParallelConfig) -> Vec<Local> {
        let whole_model = |p: Self| -> Vec<Local> {
            let mut all = p.first;
            all.extend(p.blocks.into_iter().flatten());
            all.extend(p.last);
            all
        };
        if parallel.pp <= 1 {
            return whole_model(self);
        }
        let Ok(schedule) = parallel.schedule() else {
            return whole_model(self);
        };
        let stages = schedule.stages();
        let Ok(plan) = StagePlan::balanced(self.blocks.len(), stages) else {
            return whole_model(self);
        };
        let mut pieces = Vec::new();
        for stage in schedule.stages_of(0) {
            if stage == 0 {
                pieces.extend(self.first.iter().cloned());
            }
            for block in plan.blocks(stage) {
                pieces.extend(self.blocks[block].iter().cloned());
            }
            if stage + 1 == stages {
                pieces.extend(self.last.iter().cloned());
                pieces.extend(self.tied.iter().cloned());
            }
        }
        pieces
    }
}

/// Every parameter's local piece on one tensor-parallel rank of `t`. Linear weights are
/// `[d_in, d_out]`.
fn local_pieces(model: &ModelConfig, t: usize) -> ModelPieces {
    match model {
        ModelConfig::Gpt(c) => gpt_pieces(c, t),
        ModelConfig::Llama(c) => llama_pieces(c, t),
    }
}

/// The pieces a Llama's key/value projections (and their activations) are split into at tensor
/// parallelism `t`: `t`, or 1 where tp replicates them ([`crate::llama::kv_replicated`]).
fn kv_shards(model: &LlamaConfig, t: usize) -> usize {
    if crate::llama::kv_replicated(model.n_kv_head, t) {
        1
    } else {
        t
    }
}

/// [`local_pieces`] of a Llama ([`crate::llama::llama_tp_plan`]: q, k, v, gate and up
/// column-parallel — k and v whole where tp replicates them; o and down row-parallel; the tables
/// vocabulary-parallel; the norms whole).
fn llama_pieces(model: &LlamaConfig, t: usize) -> ModelPieces {
    let (v, d, f) = (model.vocab_size, model.d_model, model.ffn_hidden);
    let kv_t = kv_shards(model, t);
    let (q, kv) = (
        model.n_head * model.head_dim(),
        model.n_kv_head * model.head_dim(),
    );
    let mut blocks = Vec::new();
    for layer in 0..model.n_layer {
        let mut pieces = Vec::new();
        pieces.extend([
            whole(d, 1), // input_layernorm γ
            whole(d, q / t).split(t),
            whole(d, kv / kv_t).split(kv_t),
            whole(d, kv / kv_t).split(kv_t),
            whole(q / t, d).split(t), // o_proj: row-parallel
            whole(d, 1),              // post_attention_layernorm γ
        ]);
        let swiglu =
            |f: usize| [whole(d, f / t), whole(d, f / t), whole(f / t, d)].map(|p| p.split(t));
        match model.moe_at(layer) {
            // Gate, up: column-parallel; down: row-parallel.
            None => pieces.extend(swiglu(f)),
            // The router whole; the stacked experts `[E, d, f]`, `[E, f, d]` and every shared
            // expert split as the dense MLP is.
            Some(m) => {
                pieces.push(whole(d, m.config.experts));
                let (e, f) = (m.config.experts, m.expert_hidden);
                // Gate and up `[E, d, f/t]`, down `[E, f/t, d]`.
                for last in [f / t, f / t, d] {
                    pieces.push(Local {
                        rows: e,
                        cols: d * f / t,
                        last,
                        experts: true,
                        table: false,
                        numel: e * d * f,
                    });
                }
                for _ in 0..m.config.shared_experts {
                    pieces.extend(swiglu(f));
                }
            }
        }
        blocks.push(pieces);
    }
    let mut last = vec![whole(d, 1)]; // norm γ
    if !model.tie_embeddings {
        last.push(table(v / t, d).split(t));
    }
    ModelPieces {
        first: vec![table(v / t, d).split(t)],
        blocks,
        last,
        tied: model.tie_embeddings.then(|| table(v / t, d).split(t)),
    }
}

/// [`local_pieces`] of a GPT ([`crate::parallelize::gpt_tp_plan`]).
fn gpt_pieces(model: &GptConfig, t: usize) -> ModelPieces {
    let (v, s, d) = (model.vocab_size, model.block_size, model.n_embd);
    let mut blocks = Vec::new();
    for _ in 0..model.n_layer {
        blocks.push(vec![
            whole(d, 1), // ln_1 γ, β
            whole(d, 1),
            whole(d, 3 * d / t).split(t), // c_attn: column-parallel
            whole(3 * d / t, 1).split(t),
            whole(d / t, d).split(t), // attn.c_proj: row-parallel, bias whole
            whole(d, 1),
            whole(d, 1), // ln_2
            whole(d, 1),
            whole(d, 4 * d / t).split(t), // c_fc: column-parallel
            whole(4 * d / t, 1).split(t),
            whole(4 * d / t, d).split(t), // mlp.c_proj: row-parallel, bias whole
            whole(d, 1),
        ]);
    }
    ModelPieces {
        first: vec![table(v / t, d).split(t), table(s, d)],
        blocks,
        last: vec![whole(d, 1), whole(d, 1)], // ln_f
        tied: Some(table(v / t, d).split(t)),
    }
}

/// The estimate for training `model` with `parallel`, `optimizer` and a global batch of
/// `batch_size` sequences, on one rank, with activations in `compute` (the precision policy's
/// compute dtype, `None`: f32).
pub fn estimate(
    model: &ModelConfig,
    parallel: &ParallelConfig,
    batch_size: usize,
    compute: Option<FloatDType>,
    optimizer: OptimizerState,
    offload: Offloaded,
) -> MemoryEstimate {
    use FsdpStrategy as S;
    let dims = parallel.dims();
    let t = dims.tp.max(1);
    let n = dims.shard_degree().max(1);
    let ep = dims.ep.max(1);
    // The data axes FSDP splits inside an expert-axis member's share, in mesh order.
    let inner = [dims.dp_shard / ep, dims.cp];
    // Pipeline rank 0's pieces (everything without a pipeline).
    let pieces = local_pieces(model, t).on_first_rank(parallel);
    let local_rows = |p: &Local| p.rows_on_expert_rank(ep);
    let sharded_rows = |p: &Local| p.sharded_rows(n, ep, &inner);
    let elems =
        |rows: &dyn Fn(&Local) -> usize| -> usize { pieces.iter().map(|p| rows(p) * p.cols).sum() };
    let state = |rows: &dyn Fn(&Local) -> usize| -> usize {
        pieces
            .iter()
            .map(|p| p.state_bytes(rows(p), optimizer))
            .sum()
    };
    let (local, sharded) = (elems(&local_rows), elems(&sharded_rows));
    let (p, g, o) = match parallel.fsdp {
        S::NoShard => (4 * local, 4 * local, state(&local_rows)),
        S::ShardOptimizer => (4 * local, 4 * local, state(&sharded_rows)),
        S::ShardGradOp => (4 * local, 4 * sharded, state(&sharded_rows)),
        S::FullShard | S::Hybrid => (4 * sharded, 4 * sharded, state(&sharded_rows)),
    };
    let rows = batch_size / dims.data_degree().max(1);
    let half = compute.is_some_and(|c| burn::tensor::DType::from(c).size() == 2);
    let activation_bytes = match model {
        ModelConfig::Gpt(c) => activation_bytes(c, parallel, rows, half),
        ModelConfig::Llama(c) => llama_activation_bytes(c, parallel, rows, half),
    };
    // An offloaded optimizer's state is in host memory, and offloaded parameters' shards too.
    let on_device = if offload == Offloaded::Nothing { o } else { 0 };
    let params_on_device = if offload == Offloaded::Params { 0 } else { p };
    MemoryEstimate {
        params: model.num_params(),
        params_per_tp_rank: local,
        shard_ranks: n,
        param_bytes: params_on_device,
        grad_bytes: g,
        optim_bytes: on_device,
        host_bytes: o - on_device + p - params_on_device,
        activation_bytes,
        total_bytes: params_on_device + g + on_device + activation_bytes,
    }
}

/// Korthikanti et al. (2022), bytes per layer at 16 bits with tensor parallelism t: all kept
/// sbh(10 + 24/t) + 5as²b/t (with context parallelism `s` is a rank's `s/cp` positions, and the
/// scores `5a(s/cp)·s·b/t`), with sequence parallelism sbh·34/t + 5as²b/t; selective
/// recomputation drops the 5as²b/t attention core; full keeps the block input 2sbh (2sbh/t with
/// sequence parallelism), and one block's activations while it is recomputed. Doubled for f32
/// activations. With `half` (a 16-bit compute dtype: the precision policy keeps what feeds the
/// matmuls in it) the residual stream stays f32 — the LayerNorms' two inputs per kept block, the
/// input of a recomputed one — and the rest is 16-bit. Plus the logits and their gradient
/// (vocabulary-split over tp), in the activations' dtype.
fn activation_bytes(model: &GptConfig, parallel: &ParallelConfig, b: usize, half: bool) -> usize {
    // Context parallelism: each rank holds `s/cp` of every sequence (its queries meet all `s`
    // keys).
    let whole = model.block_size;
    let (s, h, a, l, t) = (
        whole / parallel.cp.max(1),
        model.n_embd,
        model.n_head,
        model.n_layer,
        parallel.tp.max(1),
    );
    let sp = parallel.sp && t > 1;
    let kept_linear = if sp {
        // Keeping the sequence gathers: the two column-parallel inputs also whole (2·2sbh).
        s * b * h * 34 / t + usize::from(parallel.sp_keep_gathers) * 4 * s * b * h
    } else {
        s * b * h * (10 + 24 / t)
    };
    let keep_all = kept_linear + 5 * a * s * whole * b / t;
    let keep_input = if sp { 2 * s * b * h / t } else { 2 * s * b * h };
    // (bytes at 16 bits, of which the residual stream's) per kept block, per recomputed one.
    let all = (keep_all, 2 * keep_input);
    let recomputed = (keep_input, keep_input);
    let blocks: (usize, usize) = (0..l)
        .map(|i| match parallel.recompute {
            Recompute::None => all,
            Recompute::Selective => (kept_linear, 2 * keep_input),
            r if r.recomputes_block(i, l) => recomputed,
            _ => all,
        })
        .fold((0, 0), |(u, f), (du, df)| (u + du, f + df));
    let transient = match parallel.recompute {
        Recompute::Full | Recompute::EveryNth(_) => all,
        _ => (0, 0),
    };
    let (at_16, stream) = (blocks.0 + transient.0, blocks.1 + transient.1);
    let logits = s * b * (model.vocab_size / t) * 2;
    if half {
        at_16 + stream + logits * 2
    } else {
        at_16 * 2 + logits * 4
    }
}

/// A Llama's activations kept for backward, counted tensor by tensor per block (elements, for
/// `b` sequences of `s` tokens, width `h`, query width `q`, key/value width `kv`, SwiGLU width
/// `f`, `a` query heads, tensor parallelism `t`): the two RMSNorms' inputs (the residual
/// stream, f32), outputs and row statistics, `4sbh + 2sb` (`/t` with sequence parallelism); the
/// attention's queries, output and log-sum-exp, its grouped keys and values (never repeated;
/// whole on every rank where tp replicates them), and the output's heads merged for `o_proj`,
/// `(2sb(q + kv) + sbq + sba)/t` (the fused attention keeps no `s²` probabilities, so selective
/// recomputation drops nothing more; the fused rotary embedding keeps only its tables); the fused
/// SwiGLU gate's two inputs and its product, `3sbf/t` — in a mixture-of-experts block, dropless,
/// the router's logits, scores and gate matrix `3sbE`, each token's `k` gathered inputs and gated
/// outputs `2ksbh`, and the SwiGLUs of its `k` routed and shared experts of width `F`,
/// `3(k + shared)·sbF/t` (an estimate: the accounting is not checked against it yet). Full (or
/// every-N) recomputation keeps a recomputed block's f32 input, `sbh`, and one block's
/// activations while it runs again. With `half`, all but the residual stream in 16 bits. Plus
/// the logits and their gradient. With context parallelism `s` is a rank's `s/cp` positions.
pub fn llama_activation_bytes(
    model: &LlamaConfig,
    parallel: &ParallelConfig,
    b: usize,
    half: bool,
) -> usize {
    // Context parallelism: each rank holds `s/cp` of every sequence.
    let (s, h, l, t) = (
        model.block_size / parallel.cp.max(1),
        model.d_model,
        model.n_layer,
        parallel.tp.max(1),
    );
    let (q, kv, f) = (
        model.n_head * model.head_dim(),
        model.n_kv_head * model.head_dim(),
        model.ffn_hidden,
    );
    let sp = parallel.sp && t > 1;
    let split = |x: usize| if sp { x / t } else { x };
    let kv_t = kv_shards(model, t);
    // (elements in the compute dtype, elements of the f32 residual stream) per block.
    let stream = split(2 * s * b * h);
    let a = model.n_head;
    // The MLP: a SwiGLU's gate, up and product; a mixture of experts' (dropless, k routed
    // experts per token) router logits, scores and gate matrix, each token's k gathered inputs
    // and gated outputs, and the SwiGLUs of its routed and shared experts.
    let mlp = |i: usize| match model.moe_at(i) {
        None => 3 * s * b * f / t,
        Some(m) => {
            let (k, e) = (m.config.top_k, m.config.experts);
            let experts = k + m.config.shared_experts;
            3 * s * b * e + 2 * k * s * b * h + 3 * experts * s * b * m.expert_hidden / t
        }
    };
    let kept = |i: usize| {
        (
            split(2 * s * b * h + 2 * s * b)
                + (2 * s * b * q + s * b * q + s * b * a) / t
                + mlp(i)
                + 2 * s * b * kv / kv_t,
            stream,
        )
    };
    let input = (0, split(s * b * h));
    let blocks = (0..l)
        .map(|i| match parallel.recompute {
            Recompute::Full | Recompute::EveryNth(_)
                if parallel.recompute.recomputes_block(i, l) =>
            {
                input
            }
            _ => kept(i),
        })
        .fold((0, 0), |(u, r), (du, dr)| (u + du, r + dr));
    // One recomputed block's activations while it runs again: the largest.
    let transient = match parallel.recompute {
        Recompute::Full | Recompute::EveryNth(_) => (0..l).map(kept).max().unwrap_or((0, 0)),
        _ => (0, 0),
    };
    let (compute, stream) = (blocks.0 + transient.0, blocks.1 + transient.1);
    let logits = 2 * s * b * (model.vocab_size / t);
    let width = if half { 2 } else { 4 };
    (compute + logits) * width + stream * 4
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Preset;

    /// Without parallelism every parameter is counted once: Ψ.
    #[test]
    fn one_rank_holds_psi() {
        let model = Preset::Tiny.model(256);
        let e = estimate(
            &model,
            &ParallelConfig::default(),
            8,
            None,
            OptimizerState::default(),
            Offloaded::Nothing,
        );
        assert_eq!(e.params_per_tp_rank, model.num_params());
        assert_eq!(e.param_bytes, 4 * model.num_params());
        assert_eq!(e.optim_bytes, 8 * model.num_params());
    }

    /// Under a 16-bit compute dtype the activations that feed matmuls are 16-bit, the residual
    /// stream (the LayerNorms' inputs) f32: GPT-2 124M at 8 × 1024 without recomputation keeps
    /// sbh·34 + 5as²b bytes per layer at 16 bits, plus 2·2sbh for the f32 stream, plus the bf16
    /// logits and their gradient; f32 doubles everything.
    #[test]
    fn activations_follow_the_compute_dtype() {
        let model = Preset::Gpt2_124m.model(50304);
        let parallel = ParallelConfig::default();
        let (s, b, h, a, l, v) = (1024, 8, 768, 12, 12, 50304);
        let at_16 = l * (34 * s * b * h + 5 * a * s * s * b);
        let stream = l * 4 * s * b * h;
        let bf16 = estimate(
            &model,
            &parallel,
            b,
            Some(FloatDType::BF16),
            OptimizerState::default(),
            Offloaded::Nothing,
        );
        let f32 = estimate(
            &model,
            &parallel,
            b,
            None,
            OptimizerState::default(),
            Offloaded::Nothing,
        );
        assert_eq!(bf16.activation_bytes, at_16 + stream + s * b * v * 4);
        assert_eq!(f32.activation_bytes, 2 * at_16 + s * b * v * 8);
        assert_eq!(bf16.param_bytes, f32.param_bytes);
    }
}
