#!/usr/bin/env python3
"""CubeCL's generated CUDA -> PTX -> cubin -> SASS, on a machine without a GPU.

The kernel sources come from CubeCL's own CUDA code generation run here, with an sm_90 device's
properties and the comptime split a launch picks there (no GPU needed):
    cargo run -p wildfire-kernels --features cuda --release --example flash_cuda -- DIR [64 bf16 causal]
or from a GPU run's compilation log (a `cubecl.toml` with `[compilation.logger] level = "full"`
and `file = "…"`; the GPU bench's `kernel_sources` step): `--split LOG DIR` writes each kernel of
the log whose name matches `--match` (default `flash`) to `DIR/NN_name.cu`. Each `.cu` given then
compiles as CubeCL compiles it on the device (NVRTC, `--gpu-architecture=compute_90a`,
`-lineinfo`), and `ptxas -v` / `cuobjdump -sass` report registers, spills and the SASS beside it
(`name.ptx`, `name.sass`); `--loops` adds each loop's instruction count and mix (a loop is a
backward branch's range: the flash kernels' key-block loop is the long one).

Needs, in a virtual environment (nothing of it on the system):
    python3 -m venv /tmp/nv && /tmp/nv/bin/pip install nvidia-cuda-nvrtc-cu12 \
        nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12 triton
and runs under that interpreter: /tmp/nv/bin/python tools/cuda_sass.py [--loops] KERNEL.cu …
(Triton's wheel carries `ptxas` and `cuobjdump`; the NVIDIA wheels NVRTC and the headers.)
docs/architecture.md §15 and §23 tell what it found.
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import sysconfig


def split(log, out, match):
    os.makedirs(out, exist_ok=True)
    text = open(log, errors="replace").read()
    n = 0
    for block in text.split("[START_KERNEL_COMPILATION]")[1:]:
        m = re.search(r"```[a-z]*\n(.*)\n```", block, re.S)
        if not m:
            continue
        src = m.group(1)
        name = re.search(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)", src)
        name = name.group(1) if name else "unknown"
        if match in name:
            n += 1
            open(os.path.join(out, f"{n:02d}_{name[:60]}.cu"), "w").write(src)
    print(f"{n} kernels into {out}")


def compile_one(path, site):
    nv = ctypes.CDLL(f"{site}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    prog = ctypes.c_void_p()
    if nv.nvrtcCreateProgram(ctypes.byref(prog), open(path, "rb").read(), b"k.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [
        b"--gpu-architecture=compute_90a",
        f"--include-path={site}/nvidia/cuda_nvcc/include".encode(),
        f"--include-path={site}/nvidia/cuda_runtime/include".encode(),
        b"-lineinfo",
    ]
    rc = nv.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    if rc:
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, log)
        sys.exit(f"{path}: NVRTC failed\n{log.value.decode()[:4000]}")
    nv.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetPTX(prog, ptx)
    base = os.path.splitext(path)[0]
    open(base + ".ptx", "wb").write(ptx.value)
    bin_dir = f"{site}/triton/backends/nvidia/bin"
    out = subprocess.run(
        [f"{bin_dir}/ptxas", "-arch=sm_90a", "-v", "-o", base + ".cubin", base + ".ptx"],
        capture_output=True, text=True, check=True,
    )
    sass = subprocess.run(
        [f"{bin_dir}/cuobjdump", "-sass", base + ".cubin"], capture_output=True, text=True
    ).stdout
    open(base + ".sass", "w").write(sass)
    os.remove(base + ".cubin")
    used = [l.split("info    : ")[-1] for l in out.stderr.splitlines() if "Used" in l or "spill" in l]
    print(f"{os.path.basename(path)}: {'; '.join(used)}")
    return base + ".sass"


def loops(sass_path):
    """Each loop of the SASS (a backward branch's range): its instruction count and opcode mix.
    Static counts: both sides of a branch inside the loop are counted."""
    ins = []
    for line in open(sass_path):
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if not m or int(m.group(1), 16) > addr:
            continue
        start = int(m.group(1), 16)
        body = [t for a, t in ins if start <= a <= addr]
        if len(body) < 2:
            continue
        ops = {}
        for t in body:
            op = re.sub(r"^@!?U?P[0-9T]+\s+", "", t).split()[0].split(".")[0]
            ops[op] = ops.get(op, 0) + 1
        mix = ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:16])
        print(f"  loop {start:#x}-{addr:#x}: {len(body)} instructions; {mix}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", nargs=2, metavar=("LOG", "DIR"))
    p.add_argument("--match", default="flash")
    p.add_argument("--loops", action="store_true", help="each loop's instruction count and mix")
    p.add_argument("kernels", nargs="*")
    a = p.parse_args()
    if a.split:
        split(*a.split, a.match)
    site = sysconfig.get_paths()["purelib"]
    for k in a.kernels:
        sass = compile_one(k, site)
        if a.loops:
            loops(sass)


if __name__ == "__main__":
    main()
