//! Wildfire's fused CubeCL kernels (softmax, norms, cross-entropy, flash attention, optimizer
//! tail) and the `FusedOps` backend extension. Not written yet: see the kernels issue.
