"""What the optimizer fixture scripts share: deterministic values, and a PyTorch optimizer stepped
with given gradients on a few parameters, recorded as the engine's tests read it."""
import math

import torch


def values(n, a, b):
    # Deterministic, signed, of varied magnitude; exact in f32 after rounding.
    return [float(torch.tensor(math.sin(a * i + b) * (1 + (i % 3))).float()) for i in range(n)]


def record_steps(make_optimizer, shapes, steps):
    """Parameters of `shapes` from fixed values, `make_optimizer(params)` stepped `steps` times
    with fixed gradients (halving each step): the initial values, each step's gradients and each
    step's parameters, flattened."""
    params = [torch.tensor(values(math.prod(s), 0.37, 0.1 * k), dtype=torch.float32).reshape(s)
              .requires_grad_() for k, s in enumerate(shapes)]
    init = [p.detach().flatten().tolist() for p in params]
    opt = make_optimizer(params)
    grads, after = [], []
    for step in range(steps):
        g = [torch.tensor(values(math.prod(s), 0.91 + 0.1 * k, 1.7 * step), dtype=torch.float32)
             .reshape(s) * (0.5 ** step) for k, s in enumerate(shapes)]
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()
        grads.append([gi.flatten().tolist() for gi in g])
        after.append([p.detach().flatten().tolist() for p in params])
    return {"init": init, "grads": grads, "params": after}


def write_fixture(name, shapes, runs, extra=None):
    """`tests/fixtures/{name}`: the shapes, the runs and the torch version (and `extra`'s
    entries), as JSON."""
    import json
    import pathlib

    out = {"shapes": shapes, "runs": runs, "torch": torch.__version__, **(extra or {})}
    path = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures" / name
    path.write_text(json.dumps(out) + "\n")
    print(f"wrote {path} (torch {torch.__version__})")
