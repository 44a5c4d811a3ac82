//! `parallelize_gpt`: how a GPT is laid out over a mesh, in torchtitan's fixed order
//! (tensor parallel → activation recomputation → FSDP / data parallel).

use crate::Error;
use crate::gpt::GptStage;
use crate::gpt::{Gpt, GptConfig};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use wildfire_parallel::comm::Links;
use wildfire_parallel::pipeline::{Schedule, ScheduleKind, StagePlan};
use wildfire_parallel::{
    CpLayout, CpRotate, DeviceMesh, DistributedBackend, ExpertPlan, Group, PIPELINE_AXIS,
    ParallelDims, TpPlan, TpStyle, context_parallel, expert_parallel, fully_shard, planned_layouts,
    tensor_parallel,
};

/// The data-parallel strategy: `wildfire_parallel::FsdpStrategy`, parsed from the names users
/// know (`none`/`ddp`, `zero1`, `grad-op`/`zero2`, `full`/`zero3`, `hybrid`/`hsdp`).
pub use wildfire_parallel::FsdpStrategy;

/// Parse `--fsdp`.
pub fn parse_fsdp(s: &str) -> Result<FsdpStrategy, String> {
    Ok(match s {
        "none" | "ddp" => FsdpStrategy::NoShard,
        "zero1" => FsdpStrategy::ShardOptimizer,
        "grad-op" | "zero2" => FsdpStrategy::ShardGradOp,
        "full" | "zero3" => FsdpStrategy::FullShard,
        "hybrid" | "hsdp" => FsdpStrategy::Hybrid,
        other => {
            return Err(format!(
                "unknown --fsdp '{other}': choose none, zero1, grad-op, full or hybrid"
            ));
        }
    })
}

pub use wildfire_kernels::hooks::Recompute;

/// How to parallelise: sizes of the mesh axes and the strategies. The command-line flags and
/// the defaults are this one definition (`Default` is what the flags give when none is passed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
pub struct ParallelConfig {
    /// Data-parallel ranks (under a launcher, `WORLD_SIZE / --tp` unless given).
    #[arg(
        long,
        default_value_t = 1,
        env = "WILDFIRE_DP",
        help_heading = "Parallelism"
    )]
    pub dp: usize,
    /// Tensor-parallel ranks.
    #[arg(long, default_value_t = 1, help_heading = "Parallelism")]
    pub tp: usize,
    /// Megatron sequence parallelism over the tensor-parallel ranks (needs `tp > 1`): LayerNorm,
    /// dropout and the residual stream hold `1/tp` of the sequence.
    #[serde(default)]
    #[arg(long, help_heading = "Parallelism")]
    pub sp: bool,
    /// With `sp`: keep the sequence all-gathers of the column-parallel layers' inputs for their
    /// backward (2 all-gathers + 2 reduce-scatters per block each way, 2·b·t·d more bytes per
    /// block) instead of gathering again (Megatron-LM's default, less memory).
    #[serde(default)]
    #[arg(long, help_heading = "Parallelism")]
    pub sp_keep_gathers: bool,
    /// Context-parallel ranks (the `cp` axis): every sequence split over them, attention meeting
    /// the other ranks' keys and values (ring attention). A data axis: parameters are
    /// replicated or sharded over it as over `--dp` (FSDP shards over `dp × cp`).
    #[serde(default = "one")]
    #[arg(long, default_value_t = 1, help_heading = "Parallelism")]
    pub cp: usize,
    /// Expert-parallel ranks (the `ep` axis), taken from the data-parallel ranks (`--dp` a
    /// multiple of it): a mixture of experts' experts split over them, the routed tokens
    /// exchanged with all-to-alls. The other parameters keep their data-parallel layout (FSDP
    /// shards them over all `--dp` ranks), the experts' nested inside their member's share.
    #[serde(default = "one")]
    #[arg(long, default_value_t = 1, help_heading = "Parallelism")]
    pub ep: usize,
    /// Which chunks of each sequence a context-parallel rank holds: balanced (chunks `r` and
    /// `2·cp − 1 − r`, equal causal work) or plain (chunk `r`).
    #[serde(default)]
    #[arg(long, default_value = "balanced", help_heading = "Parallelism")]
    pub cp_layout: CpLayout,
    /// How context-parallel attention meets the other ranks' keys and values: ring (blocks
    /// passed around, transfers overlapping compute) or allgather (one all-gather per layer).
    #[serde(default)]
    #[arg(long, default_value = "ring", help_heading = "Parallelism")]
    pub cp_rotate: CpRotate,
    /// Data-parallel strategy: none (DDP), zero1, grad-op, full (FSDP / ZeRO-3), hybrid (HSDP).
    #[arg(long, default_value = "none", value_parser = parse_fsdp, help_heading = "Parallelism")]
    pub fsdp: FsdpStrategy,
    /// HSDP: ranks per shard group (`dp_shard`); the `dp / dp_shard` groups replicate.
    #[arg(long, help_heading = "Parallelism")]
    pub dp_shard: Option<usize>,
    /// Activation recomputation: none, selective, full, every-N.
    #[arg(long, default_value = "none", help_heading = "Parallelism")]
    pub recompute: Recompute,
    /// Pipeline ranks (the `pp` axis of a `dp × pp × tp` mesh): the blocks split into stages,
    /// the embeddings on the first, the final norm, head and loss on the last.
    #[serde(default = "one")]
    #[arg(long, default_value_t = 1, help_heading = "Pipeline")]
    pub pp: usize,
    /// The pipeline schedule: gpipe, 1f1b, interleaved (with --pp-virtual), zb (ZB-H1).
    #[serde(default = "one_f_one_b")]
    #[arg(long, default_value = "1f1b", help_heading = "Pipeline")]
    pub pp_schedule: String,
    /// Micro-batches per step in the pipeline schedule (each data-parallel rank's rows split
    /// into this many).
    #[serde(default = "eight")]
    #[arg(long, default_value_t = 8, help_heading = "Pipeline")]
    pub microbatches: usize,
    /// Model chunks (stages) per pipeline rank: the interleaved schedule's V.
    #[serde(default = "one")]
    #[arg(long, default_value_t = 1, help_heading = "Pipeline")]
    pub pp_virtual: usize,
}

fn one() -> usize {
    1
}

fn eight() -> usize {
    8
}

fn one_f_one_b() -> String {
    "1f1b".into()
}

impl Default for ParallelConfig {
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            config: ParallelConfig,
        }
        // The environment is not read here: `WILDFIRE_DP` is a flag's source, not a default.
        let mut command = <Flags as clap::CommandFactory>::command();
        command = command.mut_arg("dp", |a| a.env(None::<&str>));
        let matches = command.get_matches_from(["wildfire"]);
        <Flags as clap::FromArgMatches>::from_arg_matches(&matches)
            .expect("the defaults parse")
            .config
    }
}

impl ParallelConfig {
    /// `dp × tp` ranks with `fsdp` (`dp_shard`: the shard group's size for HSDP), the rest the
    /// defaults.
    pub fn layout(dp: usize, tp: usize, fsdp: FsdpStrategy, dp_shard: Option<usize>) -> Self {
        Self {
            dp,
            tp,
            fsdp,
            dp_shard,
            ..Self::default()
        }
    }

    /// The run's parallel degrees: `--dp` is `dp_replicate × dp_shard` (HSDP: `--dp-shard` ranks
    /// per shard group), with `--pp`, `--tp` and `--sp`. Unchecked: [`Self::check_available`]
    /// checks the flags, the mesh ([`Self::mesh`]) the degrees.
    pub fn dims(&self) -> ParallelDims {
        let shard = match self.fsdp {
            FsdpStrategy::Hybrid => self.dp_shard.unwrap_or(self.dp).max(1),
            _ => self.dp,
        };
        ParallelDims {
            dp_replicate: self.dp / shard.max(1),
            dp_shard: shard,
            ep: self.ep.max(1),
            pp: self.pp.max(1),
            cp: self.cp.max(1),
            tp: self.tp,
            sp: self.sp,
        }
    }

    /// Ranks in all: every mesh axis (`dp × pp × tp`).
    pub fn world_size(&self) -> usize {
        self.dims().world_size()
    }

    /// The device mesh of [`Self::dims`]: `dp × tp`, or `dp_replicate × dp_shard × tp` for HSDP
    /// (a `tp` of size 1 kept, so layouts have a fixed shape); with `pp > 1` a `pp` axis before
    /// `tp`.
    pub fn mesh(&self) -> Result<DeviceMesh, wildfire_parallel::Error> {
        self.dims().validate()?.mesh()
    }

    /// The pipeline schedule of `--pp`, `--pp-schedule`, `--microbatches` and `--pp-virtual`.
    pub fn schedule(&self) -> Result<Schedule, Error> {
        let kind: ScheduleKind = self.pp_schedule.parse()?;
        Ok(Schedule::new(
            kind,
            self.pp.max(1),
            self.microbatches,
            self.pp_virtual,
        )?)
    }

    /// Fit the layout to the world a launcher started (`world` processes, one rank each,
    /// `launcher` naming it in errors): unless `dp_given`, `--dp` becomes the world over the
    /// model axes; then the mesh must have one rank per process.
    pub fn fit_world(&mut self, world: usize, launcher: &str, dp_given: bool) -> Result<(), Error> {
        if !dp_given && let Some(dp) = self.dims().data_degree_of(world) {
            self.dp = dp;
        }
        let mesh = self.world_size();
        if mesh != world {
            return Err(Error::Config(format!(
                "{launcher} started {world} processes, but --dp {} × --pp {} × --cp {} × --tp {} \
                 = {mesh} ranks: one process per rank (change --dp/--pp/--cp/--tp or the \
                 launcher's process count)",
                self.dp,
                self.pp,
                self.cp.max(1),
                self.tp.max(1)
            )));
        }
        Ok(())
    }

    /// The modelled links of `--link` specs (`AXIS=BANDWIDTH,LATENCY` or `AXIS=nvlink|…`),
    /// each naming an axis of the mesh.
    pub fn links(&self, specs: &[String]) -> Result<Links, Error> {
        let mesh = self.mesh()?;
        let mut links = Links::default();
        for spec in specs {
            links.add(spec).map_err(Error::Config)?;
        }
        for axis in links.0.keys() {
            if mesh.axis_index(axis).is_err() {
                return Err(Error::Config(format!(
                    "--link {axis}=…: the mesh {mesh} has no axis {axis}"
                )));
            }
        }
        Ok(links)
    }

    /// Refuse a global batch of `batch_size` sequences that does not split evenly: into `--dp`
    /// ranks × `accum` micro-batches, or with `--pp` into `--dp` × the pipeline's micro-batches
    /// (which are its gradient accumulation: `accum` must be 1).
    pub fn check_batch(&self, batch_size: usize, accum: usize) -> Result<(), Error> {
        let dp = self.dp;
        if batch_size == 0 {
            return Err(Error::Config("--batch-size must be at least 1".into()));
        }
        if accum == 0 || !batch_size.is_multiple_of(dp * accum) {
            return Err(Error::Config(format!(
                "--batch-size {batch_size} does not split into --dp {dp} × --accum {accum} \
                 micro-batches: choose a multiple of {}",
                dp * accum.max(1)
            )));
        }
        if self.pp > 1 {
            let m = self.microbatches;
            if accum != 1 {
                return Err(Error::Config(format!(
                    "--pp {}: the pipeline's micro-batches are its gradient accumulation: use \
                     --microbatches instead of --accum {accum}",
                    self.pp
                )));
            }
            if !batch_size.is_multiple_of(dp * m) {
                return Err(Error::Config(format!(
                    "--batch-size {batch_size} does not split into --dp {dp} × --microbatches \
                     {m}: choose a multiple of {}",
                    dp * m
                )));
            }
        }
        Ok(())
    }

    /// Refuse, before any work, what is not implemented yet.
    pub fn check_available(&self) -> Result<(), Error> {
        if self.fsdp == FsdpStrategy::Hybrid {
            let shard = self.dp_shard.unwrap_or(0);
            if shard < 2 || shard >= self.dp || !self.dp.is_multiple_of(shard) {
                return Err(Error::Config(format!(
                    "--fsdp hybrid needs --dp-shard K with 1 < K < --dp {} and K dividing it (got {shard})",
                    self.dp
                )));
            }
        }
        if self.sp_keep_gathers && !self.sp {
            return Err(Error::Config(
                "--sp-keep-gathers is an option of sequence parallelism: add --sp".into(),
            ));
        }
        if self.pp > 1 {
            self.schedule()?;
        }
        if self.sp && self.tp < 2 {
            return Err(Error::Config(
                "--sp (sequence parallelism) shards over the tensor-parallel axis: it needs --tp 2 or more".into(),
            ));
        }
        if self.cp == 0 {
            return Err(Error::Config("--cp must be at least 1".into()));
        }
        self.check_experts()?;
        Ok(())
    }

    /// Refuse, before any work, a sequence of `t` positions that context parallelism cannot
    /// split: with `--cp` above 1, `t` must be a multiple of the layout's chunks (`2·cp`
    /// balanced, `cp` plain).
    pub fn check_sequence(&self, t: usize) -> Result<(), Error> {
        if self.cp > 1 {
            self.cp_layout
                .chunk_len(self.cp, t)
                .map_err(|e| Error::Config(format!("--cp {}: {e}", self.cp)))?;
        }
        Ok(())
    }

    /// Context parallelism ([`context_parallel`]) on the rank of `module`'s parameters, when
    /// `--cp` is above 1.
    /// Refuse what expert parallelism does not combine with: `--ep` of 0, or not dividing
    /// `--dp` (the ranks it is taken from); with `--tp` (the experts would be replicated over
    /// the tensor-parallel ranks, each exchanging the same tokens: not built — use tp for the
    /// dense layers of a model without `--ep`); with HSDP (`--fsdp hybrid` shards over
    /// `--dp-shard` alone, which the expert axis would have to split).
    fn check_experts(&self) -> Result<(), Error> {
        let ep = self.ep;
        let refuse = |why: String| Err(Error::Config(format!("--ep {ep}: {why}")));
        if ep == 0 {
            return refuse("the expert-parallel degree is at least 1".into());
        }
        if ep == 1 {
            return Ok(());
        }
        if !self.dp.is_multiple_of(ep) {
            return refuse(format!(
                "expert parallelism is taken from the data-parallel ranks: choose --dp a \
                 multiple of it (got --dp {})",
                self.dp
            ));
        }
        if self.tp > 1 {
            return refuse(
                "with --tp the experts would be replicated over the tensor-parallel ranks; \
                 not built: use --ep or --tp for a mixture of experts"
                    .into(),
            );
        }
        if self.fsdp == FsdpStrategy::Hybrid {
            return refuse(
                "HSDP shards over --dp-shard alone; choose --fsdp full, grad-op, zero1 or none"
                    .into(),
            );
        }
        Ok(())
    }

    /// Refuse `--ep` on a model it cannot split: one without a mixture of experts, or whose
    /// experts the expert-parallel ranks do not divide.
    pub fn check_model(&self, model: &crate::ModelConfig) -> Result<(), Error> {
        if self.ep <= 1 {
            return Ok(());
        }
        let (blocks, experts) = model.moe_blocks();
        if blocks.is_empty() {
            return Err(Error::Config(format!(
                "--ep {}: expert parallelism splits a mixture of experts' experts, and this \
                 model has none: add --experts E (a Llama)",
                self.ep
            )));
        }
        if !experts.is_multiple_of(self.ep) {
            return Err(Error::Config(format!(
                "--ep {} does not divide the {experts} experts: choose ep a factor of them",
                self.ep
            )));
        }
        Ok(())
    }

    pub(crate) fn lay_out_context<B: DistributedBackend, M: burn::module::Module<B>>(
        &self,
        module: &M,
    ) -> Result<(), Error> {
        if self.cp <= 1 {
            return Ok(());
        }
        let Some(device) = module.devices().into_iter().next() else {
            return Err(Error::Config(
                "--cp: a model without parameters has no device to split the sequence on".into(),
            ));
        };
        Ok(context_parallel::<B>(
            &device,
            self.cp_layout,
            self.cp_rotate,
        )?)
    }
}

/// Numeric precision of the compute (`--precision`; `--grad-reduce` for the dtype gradient
/// reductions communicate in): the policy's compute dtype and the memory estimate's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[value(rename_all = "lowercase")]
pub enum Precision {
    /// f32 everywhere.
    F32,
    /// bf16 compute, f32 master weights.
    Bf16,
    /// f16 compute with dynamic loss scaling, f32 master weights.
    F16,
}

impl Precision {
    /// The reduced dtype (`None` for f32).
    pub fn reduced_dtype(self) -> Option<burn::tensor::FloatDType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16 => Some(burn::tensor::FloatDType::BF16),
            Precision::F16 => Some(burn::tensor::FloatDType::F16),
        }
    }
}

/// The GPT's tensor-parallel plan (Megatron): attention's fused q/k/v projection and the MLP's
/// first layer column-wise (whole heads per rank: `c_attn` groups its columns by head), the
/// attention output and the MLP's second layer row-wise; the token embedding vocabulary-parallel,
/// so the tied output projection yields vocabulary-split logits and the cross-entropy is
/// loss-parallel (no rank holds the full logits).
pub fn gpt_tp_plan() -> TpPlan {
    gpt_block_tp_plan().with("wte", TpStyle::VocabParallel)
}

/// [`gpt_tp_plan`] for the blocks alone (a pipeline stage without the token table).
pub fn gpt_block_tp_plan() -> TpPlan {
    TpPlan::new()
        .with("blocks.*.attn.c_attn", TpStyle::Colwise)
        .with("blocks.*.attn.c_proj", TpStyle::Rowwise)
        .with("blocks.*.mlp.c_fc", TpStyle::Colwise)
        .with("blocks.*.mlp.c_proj", TpStyle::Rowwise)
}

/// Build the GPT already laid out as [`parallelize_gpt`] lays it out on `device`'s mesh: each rank
/// draws only its pieces ([`GptConfig::init_in_layouts`] over [`planned_layouts`]), and
/// `parallelize_gpt` then changes no layout (it sets the rank's policy).
pub fn init_gpt<B: DistributedBackend>(
    config: &GptConfig,
    device: &B::Device,
    parallel: &ParallelConfig,
) -> Result<Gpt<B>, Error> {
    // Sequence parallelism changes no parameter's layout: the plan without it.
    let plan = (parallel.tp > 1).then(|| gpt_tp_plan().with_heads("blocks.*.attn", config.n_head));
    config.init_in_layouts(device, |params, mesh| {
        planned_layouts(params, mesh, plan.as_ref(), parallel.fsdp)
    })
}

/// Lay `model` out over `mesh` (tensor parallel → FSDP / DDP). Recomputation needs no change to
/// the layout: the training step's `Recomputer` applies `config.recompute` at run time.
pub fn parallelize_gpt<B: DistributedBackend>(
    model: Gpt<B>,
    mesh: &DeviceMesh,
    config: &ParallelConfig,
) -> Result<Gpt<B>, Error> {
    config.check_available()?;
    let model = if config.tp > 1 {
        // The column split of `c_attn` must fall on head boundaries (its columns are grouped by
        // head), so each rank computes whole heads: the plan checks the head count.
        let heads = model.blocks.first().map_or(1, |b| b.attn.n_head);
        let plan = gpt_tp_plan().with_heads("blocks.*.attn", heads);
        let plan = if config.sp {
            with_sequence_parallel(plan, config, true)
        } else {
            plan
        };
        tensor_parallel(model, mesh, &plan)?
    } else {
        model
    };
    config.lay_out_context(&model)?;
    Ok(fully_shard(model, mesh, config.fsdp)?)
}

/// `plan` with Megatron sequence parallelism over the GPT's blocks' norms and, with
/// `final_norm`, the final norm (the whole model, or the last pipeline stage).
fn with_sequence_parallel(plan: TpPlan, config: &ParallelConfig, final_norm: bool) -> TpPlan {
    let plan = plan.with("blocks.*.ln_1|ln_2", TpStyle::SequenceParallel);
    let plan = if final_norm {
        plan.with("ln_f", TpStyle::SequenceParallel)
    } else {
        plan
    };
    plan.with_keep_sequence_gathers(config.sp_keep_gathers)
}

/// One pipeline stage of the GPT (blocks `blocks`; the embeddings when `first`, the head when
/// `last`), laid out as [`parallelize_gpt`] lays out the whole model (tensor parallel, then the
/// data-parallel strategy), each rank drawing only its pieces.
pub fn init_gpt_stage<B: DistributedBackend>(
    config: &GptConfig,
    device: &B::Device,
    parallel: &ParallelConfig,
    blocks: Range<usize>,
    first: bool,
    last: bool,
) -> Result<GptStage<B>, Error> {
    parallel.check_available()?;
    // The tied table's vocabulary-parallel split only where the stage holds it.
    let plan = (parallel.tp > 1).then(|| {
        let plan = if first || last {
            gpt_tp_plan()
        } else {
            gpt_block_tp_plan()
        };
        plan.with_heads("blocks.*.attn", config.n_head)
    });
    let stage = config.init_stage_in_layouts(device, blocks, first, last, |params, mesh| {
        planned_layouts(params, mesh, plan.as_ref(), parallel.fsdp)
    })?;
    // Sequence parallelism (no parameter's layout changes; it sets the rank's policy), the
    // final norm on the last stage.
    let plan = plan.map(|plan| match parallel.sp {
        true => with_sequence_parallel(plan, parallel, last),
        false => plan,
    });
    lay_out_stage(stage, device, plan.as_ref(), &ExpertPlan::new(), parallel)
}

/// A pipeline stage built in its layouts, laid out as they say: tensor parallel by `plan`, then
/// the data-parallel strategy.
pub(crate) fn lay_out_stage<B: DistributedBackend, M: burn::module::Module<B>>(
    stage: M,
    device: &B::Device,
    plan: Option<&TpPlan>,
    experts: &ExpertPlan,
    parallel: &ParallelConfig,
) -> Result<M, Error> {
    let mesh = B::dist_device(device).mesh().clone();
    let stage = match plan {
        Some(plan) => tensor_parallel(stage, &mesh, plan)?,
        None => stage,
    };
    parallel.lay_out_context(&stage)?;
    let stage = expert_parallel(stage, &mesh, experts)?;
    Ok(fully_shard(stage, &mesh, parallel.fsdp)?)
}

/// The stages of `schedule` that the rank of `device` holds, in chunk order, each with its stage
/// number: a [`StagePlan::balanced`] split of the blocks (the longer runs first), each stage laid
/// out by [`init_gpt_stage`] (the rank draws only its pieces).
pub fn init_gpt_stages<B: DistributedBackend>(
    config: &GptConfig,
    device: &B::Device,
    parallel: &ParallelConfig,
    schedule: &Schedule,
) -> Result<Vec<(usize, GptStage<B>)>, Error> {
    init_stages::<B, _>(config.n_layer, device, schedule, |blocks, first, last| {
        init_gpt_stage(config, device, parallel, blocks, first, last)
    })
}

/// The stages of `schedule` that the rank of `device` holds, in chunk order, each with its stage
/// number: a [`StagePlan::balanced`] split of `n_layer` blocks (the longer runs first), a stage
/// of blocks `blocks` made by `init(blocks, first, last)` (the rank draws only its pieces).
pub(crate) fn init_stages<B: DistributedBackend, S>(
    n_layer: usize,
    device: &B::Device,
    schedule: &Schedule,
    mut init: impl FnMut(Range<usize>, bool, bool) -> Result<S, Error>,
) -> Result<Vec<(usize, S)>, Error> {
    let plan = StagePlan::balanced(n_layer, schedule.stages())?;
    let dist = B::dist_device(device);
    let mesh = dist.mesh();
    let axis = mesh.axis_index(PIPELINE_AXIS)?;
    let pp_rank = Group::Axis(axis).index(mesh, dist.rank())?;
    let last = schedule.stages() - 1;
    let chunks = plan.chunks(schedule, pp_rank)?;
    schedule
        .stages_of(pp_rank)
        .zip(chunks)
        .map(|(stage, blocks)| {
            tracing::debug!(stage, ?blocks, "pipeline stage");
            Ok((stage, init(blocks, stage == 0, stage == last)?))
        })
        .collect()
}
