//! Wildfire's model family (GPT-2 and its tensor-parallel plan) and token datasets. Not written
//! yet: see the GPT pretraining issue.
