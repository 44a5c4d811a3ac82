#!/usr/bin/env python3
"""Write tests/fixtures/adafactor_torch.json: PyTorch's own `torch.optim.Adafactor` run on three
parameters (a 5 × 3 matrix, a 4-vector, a 2 × 3 × 4 tensor) for 5 steps with given gradients,
two configurations (PyTorch's defaults; weight decay 0.1 with ε₁ = 1e-3, d = 2 and β₂ decay −0.6). The
engine's test applies the same gradients with `wildfire_engine::Adafactor` and compares.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch
    /tmp/tv/bin/python tools/adafactor_reference.py
"""
import json
import math
import pathlib

import torch

SHAPES = [[5, 3], [4], [2, 3, 4]]
STEPS = 5
CONFIGS = [
    {"lr": 1e-2},
    {"lr": 1.0, "weight_decay": 0.1, "eps": (1e-3, 1e-3), "d": 2.0, "beta2_decay": -0.6},
]


def values(n, a, b):
    # Deterministic, signed, of varied magnitude; exact in f32 after rounding.
    return [float(torch.tensor(math.sin(a * i + b) * (1 + (i % 3))).float()) for i in range(n)]


def main():
    out = {"shapes": SHAPES, "runs": []}
    for config in CONFIGS:
        params = [torch.tensor(values(math.prod(s), 0.37, 0.1 * k), dtype=torch.float32).reshape(s)
                  .requires_grad_() for k, s in enumerate(SHAPES)]
        init = [p.detach().flatten().tolist() for p in params]
        opt = torch.optim.Adafactor(params, foreach=False, **config)
        grads, after = [], []
        for step in range(STEPS):
            g = [torch.tensor(values(math.prod(s), 0.91 + 0.1 * k, 1.7 * step), dtype=torch.float32)
                 .reshape(s) * (0.5 ** step) for k, s in enumerate(SHAPES)]
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            opt.step()
            grads.append([gi.flatten().tolist() for gi in g])
            after.append([p.detach().flatten().tolist() for p in params])
        cfg = dict(config)
        if "eps" in cfg:
            cfg["eps1"], cfg["eps2"] = cfg.pop("eps")
        out["runs"].append({"config": cfg, "init": init, "grads": grads, "params": after})
    out["torch"] = torch.__version__
    path = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/adafactor_torch.json"
    path.write_text(json.dumps(out) + "\n")
    print(f"wrote {path} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
