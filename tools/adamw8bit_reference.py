#!/usr/bin/env python3
"""Write tests/fixtures/adamw8bit_bnb.json: bitsandbytes' 8-bit block-wise quantisation and an
8-bit AdamW built on it, for `wildfire_engine::QuantAdamW`'s tests.

- `maps`: bitsandbytes' own `create_dynamic_map(signed=True)` and `(signed=False)`, the maps its
  8-bit optimizers use for the first and second moment.
- `quantise`: inputs (three blocks of 2,048: magnitudes over six decades, a block of zeros, a
  block whose largest magnitude is negative) and what bitsandbytes' `quantize_blockwise`
  (its PyTorch kernel, block 2,048: see `quantise`) gives for each map: codes and block scales.
- `runs`: bitsandbytes' CPU reference step (`_optimizer_update_8bit_blockwise_cpu`: dequantise,
  update in f32, quantise the new moments; the parameter update reads the unquantised ones) at
  the paper's block of 2,048 instead of the 256 bitsandbytes' kernels use, with Wildfire's f32
  AdamW arithmetic in the middle (the Flex kernel's operation order, each coefficient rounded to
  f32 as it does, so the test can ask for equal bits), and f32 moments for tensors under 4,096
  elements (`min_8bit_size`). A matrix of two blocks and a vector, three steps.

Floats are written in the shortest decimal that reads back as the same f32.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch bitsandbytes
    /tmp/tv/bin/python tools/adamw8bit_reference.py
"""
import math

import bitsandbytes
import bitsandbytes.functional as F
import numpy as np
import torch

from optimizer_reference import record_steps, values, write_fixture

BLOCK = 2048
MIN_8BIT_SIZE = 4096
SHAPES = [[32, 128], [40]]
STEPS = 3
CONFIG = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-5, "weight_decay": 0.1}
SIGNED = F.create_dynamic_map(signed=True)
UNSIGNED = F.create_dynamic_map(signed=False)


def quantise(x, code):
    """bitsandbytes' block-wise quantisation at block 2,048 as its PyTorch kernel computes it
    (`backends/default/ops.py`, `quantize_blockwise`, for a whole number of blocks): each value
    scaled by its block's `1 / absmax`, clamped, given the code of the nearest map value
    (`bucketize` over the midpoints) — the semantics of its CUDA kernel too. Its native CPU
    kernel, which `torch.ops.bitsandbytes.quantize_blockwise` dispatches to here, approximates:
    it gives the farther neighbour for about a third of these values, so it is not the reference."""
    x = x.flatten().float()
    assert x.numel() % BLOCK == 0
    blocks = x.reshape(-1, BLOCK)
    absmax = blocks.abs().max(dim=-1)[0]
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    bounds = (code[:-1] + code[1:]) / 2
    return torch.bucketize(scaled, bounds, out_int32=True).to(torch.uint8), absmax


def dequantise(codes, absmax, code):
    return torch.ops.bitsandbytes.dequantize_blockwise(codes, absmax, code, BLOCK, torch.float32)


def f32(x):
    return torch.tensor(x, dtype=torch.float32)


class AdamW8bit(torch.optim.Optimizer):
    """bitsandbytes' CPU 8-bit step at block 2,048 around Wildfire's f32 AdamW arithmetic."""

    def __init__(self, params, lr, beta1, beta2, eps, weight_decay):
        super().__init__(params, dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, b1, b2 = group["lr"], group["beta1"], group["beta2"]
            for p in group["params"]:
                state = self.state[p]
                n = p.numel()
                quantised = n >= MIN_8BIT_SIZE
                if not state:
                    state["step"] = 0
                    if quantised:
                        blocks = -(n // -BLOCK)
                        state["c1"] = torch.zeros(n, dtype=torch.uint8)
                        state["c2"] = torch.zeros(n, dtype=torch.uint8)
                        state["a1"] = torch.zeros(blocks)
                        state["a2"] = torch.zeros(blocks)
                    else:
                        state["m"] = torch.zeros(n)
                        state["v"] = torch.zeros(n)
                state["step"] += 1
                t = state["step"]
                if quantised:
                    m = dequantise(state["c1"], state["a1"], SIGNED)
                    v = dequantise(state["c2"], state["a2"], UNSIGNED)
                else:
                    m, v = state["m"], state["v"]
                # Wildfire's kernel (kernels/src/flex/optim.rs), in f32 op by op.
                g = p.grad.flatten()
                beta1, beta2 = f32(b1), f32(b2)
                one = f32(1.0)
                decay = f32(1.0 - lr * group["weight_decay"])
                # Divisors as whole tensors: PyTorch may divide by a scalar through its reciprocal.
                bc1 = torch.full_like(g, 1.0 - b1 ** t)
                bc2 = torch.full_like(g, 1.0 - b2 ** t)
                m2 = beta1 * m + (one - beta1) * g
                v2 = beta2 * v + (one - beta2) * (g * g)
                # A correctly rounded square root, as Rust's: PyTorch's vectorised f32 `sqrt`
                # is off by an ulp for a fifth of the values on this CPU; through f64 it is exact.
                root = (v2 / bc2).double().sqrt().float()
                update = (m2 / bc1) / (root + f32(group["eps"]))
                p.copy_((p.flatten() * decay - f32(lr) * update).reshape(p.shape))
                if quantised:
                    state["c1"], state["a1"] = quantise(m2, SIGNED)
                    state["c2"], state["a2"] = quantise(v2, UNSIGNED)
                else:
                    state["m"], state["v"] = m2, v2


def quantise_cases():
    n = 3 * BLOCK
    x = torch.tensor(values(n, 0.37, 0.3), dtype=torch.float32)
    x = x * torch.logspace(-6, 0, n)
    x[BLOCK:2 * BLOCK] = 0.0
    x[2 * BLOCK + 5] = -3.5  # the last block's largest magnitude is negative
    cases = []
    for name, code, data in [("signed", SIGNED, x), ("unsigned", UNSIGNED, x.abs())]:
        codes, absmax = quantise(data, code)
        cases.append({"map": name, "input": data.tolist(), "codes": codes.tolist(),
                      "absmax": absmax.tolist()})
    return cases


def short(x):
    """`x` with every float in the shortest decimal that reads back as the same f32."""
    if isinstance(x, float):
        return float(str(np.float32(x)))
    if isinstance(x, list):
        return [short(v) for v in x]
    if isinstance(x, dict):
        return {k: short(v) for k, v in x.items()}
    return x


def write_maps():
    """engine/src/quant_maps.rs: the two maps as f32 bit patterns. `create_dynamic_map` runs
    `torch.linspace` on the CPU, whose vectorised kernel rounds by the machine's vector width: the
    engine keeps the values bitsandbytes gave here rather than recomputing them."""
    import pathlib

    def table(name, values):
        bits = np.asarray(values, dtype=np.float32).view(np.uint32)
        rows = ["    " + " ".join(f"0x{b:08x}," for b in bits[i:i + 6]) for i in range(0, 256, 6)]
        return f"pub(crate) const {name}: [u32; 256] = [\n" + "\n".join(rows) + "\n];\n"

    text = (
        "//! bitsandbytes' dynamic-tree maps (`create_dynamic_map(signed)`), as f32 bit patterns:\n"
        f"//! written by `tools/adamw8bit_reference.py` (bitsandbytes {bitsandbytes.__version__}, "
        f"torch {torch.__version__}).\n\n"
        "/// The signed map (the first moment's).\n"
        + table("SIGNED", SIGNED.tolist())
        + "\n/// The unsigned map (the second moment's).\n"
        + table("UNSIGNED", UNSIGNED.tolist())
    )
    path = pathlib.Path(__file__).resolve().parent.parent / "engine/src/quant_maps.rs"
    path.write_text(text)
    print(f"wrote {path}")


def main():
    write_maps()
    run = record_steps(lambda params: AdamW8bit(params, **CONFIG), SHAPES, STEPS)
    extra = {
        "bitsandbytes": bitsandbytes.__version__,
        "maps": {"signed": SIGNED.tolist(), "unsigned": UNSIGNED.tolist()},
        "quantise": quantise_cases(),
    }
    runs = [{"config": CONFIG, **short(run)}]
    write_fixture("adamw8bit_bnb.json", SHAPES, runs, short(extra))


if __name__ == "__main__":
    assert math.prod(SHAPES[0]) % BLOCK == 0
    main()
