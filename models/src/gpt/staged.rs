//! The GPT's pipeline stages outside training: forward-only passes through a rank's stages
//! ([`stage_pass`] for [`StagePasses::forward`]) and text generated through them
//! ([`generate_staged`]).

use super::{GptStage, StageInput, TokenSampler};
use crate::Error;
use crate::lm::generate_by;
use burn::prelude::*;
use wildfire_kernels::FusedOps;
use wildfire_kernels::hooks::Inference;
use wildfire_parallel::Distributed;
use wildfire_parallel::pipeline::StagePasses;

/// A forward-only pass's stage runner over a rank's `chunks` (in chunk order): the first stage
/// reads the token ids `idx`, the others the hidden states [`StagePasses::forward`] hands them.
pub fn stage_pass<B: FusedOps>(
    chunks: &[GptStage<B>],
    idx: Tensor<B, 2, Int>,
) -> impl FnMut(usize, Option<Tensor<B, 3>>) -> Tensor<B, 3> + '_ {
    let mut idx = Some(idx);
    move |c, hidden| {
        let input = match hidden {
            Some(hidden) => StageInput::Hidden(hidden),
            None => StageInput::Tokens(idx.take().expect("one first stage")),
        };
        chunks[c].forward_with(input, &Inference)
    }
}

/// `prompt` continued by `new_tokens` tokens generated through the stages: per token, a
/// forward-only pass of the last `block_size` tokens through the stages in order; the rank of the
/// last stage picks the next token from the last position's logits with `sampler` (seeded as one
/// device seeds it, so the text is one device's) and sends it to every other member of its
/// pipeline group. Every rank of the group takes part; each has the tokens at the end.
pub fn generate_staged<X: FusedOps>(
    chunks: &[GptStage<Distributed<X>>],
    passes: &StagePasses<X>,
    prompt: &[u32],
    new_tokens: usize,
    block_size: usize,
    mut sampler: TokenSampler,
) -> Result<Vec<u32>, Error> {
    let device = passes.device();
    let p2p = device.context().comm().point_to_point()?;
    let members = passes.members();
    // The last stage (stage p·V − 1) is on the last pipeline rank.
    let last = *members.last().expect("a pipeline rank");
    generate_by(prompt, new_tokens, block_size, |context| {
        let t = context.len();
        let idx = Tensor::from_data(TensorData::new(context, [1, t]), device);
        Ok(match passes.forward(stage_pass(chunks, idx))? {
            Some(logits) => {
                let logits = logits.narrow(1, t - 1, 1).into_data().convert::<f32>();
                let token = sampler.pick(&logits.to_vec::<f32>().expect("f32 logits"));
                for &member in members.iter().filter(|&&m| m != device.rank()) {
                    p2p.send(member, TensorData::new(vec![i64::from(token)], [1]))?;
                }
                token
            }
            None => {
                let data = p2p.recv(last)?;
                let token = data.to_vec::<i64>().ok().and_then(|v| v.first().copied());
                let token = token.ok_or_else(|| wildfire_parallel::Error::Mismatch {
                    op: wildfire_parallel::CollectiveKind::Recv,
                    group: wildfire_parallel::PIPELINE_AXIS.into(),
                    detail: "a generated token that is not one integer".into(),
                })?;
                token as u32
            }
        })
    })
}
