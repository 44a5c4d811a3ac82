#!/usr/bin/env python3
"""Write tests/fixtures/adafactor_torch.json: PyTorch's own `torch.optim.Adafactor` run on three
parameters (a 5 × 3 matrix, a 4-vector, a 2 × 3 × 4 tensor) for 5 steps with given gradients,
two configurations (PyTorch's defaults; weight decay 0.1 with ε₁ = 1e-3, d = 2 and β₂ decay −0.6). The
engine's test applies the same gradients with `wildfire_engine::Adafactor` and compares.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch
    /tmp/tv/bin/python tools/adafactor_reference.py
"""
import torch

from optimizer_reference import record_steps, write_fixture

SHAPES = [[5, 3], [4], [2, 3, 4]]
STEPS = 5
CONFIGS = [
    {"lr": 1e-2},
    {"lr": 1.0, "weight_decay": 0.1, "eps": (1e-3, 1e-3), "d": 2.0, "beta2_decay": -0.6},
]


def main():
    runs = []
    for config in CONFIGS:
        run = record_steps(
            lambda params: torch.optim.Adafactor(params, foreach=False, **config), SHAPES, STEPS)
        cfg = dict(config)
        if "eps" in cfg:
            cfg["eps1"], cfg["eps2"] = cfg.pop("eps")
        runs.append({"config": cfg, **run})
    write_fixture("adafactor_torch.json", SHAPES, runs)


if __name__ == "__main__":
    main()
