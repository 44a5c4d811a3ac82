#!/usr/bin/env python3
"""Write tests/fixtures/muon_torch.json: PyTorch's own `torch.optim.Muon` on two matrices (a wide
6 x 10 and a tall 12 x 5, PyTorch's [out, in]) for 5 steps with given gradients, two
configurations (PyTorch's defaults with weight decay; no Nesterov, momentum 0.9, Moonlight's
"match_rms_adamw" learning rate, no weight decay). The Newton-Schulz iteration is PyTorch's with
its bf16 cast removed (Wildfire iterates in f32); everything else is `torch.optim.Muon` as
shipped. The engine's test applies the same gradients to the transposed ([in, out]) matrices with
`wildfire_engine::MuonOptimizer` and compares.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch
    /tmp/tv/bin/python tools/muon_reference.py
"""
import torch
import torch.optim._muon as muon

from optimizer_reference import record_steps, write_fixture

SHAPES = [[6, 10], [12, 5]]
STEPS = 5
CONFIGS = [
    {"lr": 1e-2, "weight_decay": 0.1},
    {"lr": 5e-3, "weight_decay": 0.0, "momentum": 0.9, "nesterov": False,
     "adjust_lr_fn": "match_rms_adamw"},
]


def f32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    # torch.optim._muon._zeropower_via_newtonschulz without `grad.to(torch.bfloat16)`.
    a, b, c = ns_coefficients
    ortho_grad = grad.to(dtype=torch.float32, copy=True)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def main():
    muon._zeropower_via_newtonschulz = f32_newton_schulz
    runs = []
    for config in CONFIGS:
        run = record_steps(lambda params: torch.optim.Muon(params, **config), SHAPES, STEPS)
        cfg = {"momentum": 0.95, "nesterov": True, "adjust_lr_fn": "original", **config}
        runs.append({"config": cfg, **run})
    write_fixture("muon_torch.json", SHAPES, runs)


if __name__ == "__main__":
    main()
