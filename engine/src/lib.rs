//! Wildfire's training engine (precision policy, loss scaling, accumulation, clipping,
//! recomputation, checkpoints). Not written yet: see the training-step and recomputation issues.
