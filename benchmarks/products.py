"""The matrix products of one SmolLM2-135M forward in every weight format this machine can run, side by side.

    python benchmarks/products.py                       # every side that loads here, rows 1 2 3 4 7
    python benchmarks/products.py --rows 1 4 7 --rounds 9
    python benchmarks/products.py --sides w8a16 ort-int4

A forward of SmolLM2-135M (the lean path's fused layout) is 121 products: 30 layers of q/k/v (576 -> 960), o
(576 -> 576), gate/up (576 -> 3072) and down (1536 -> 576), and the tied LM head (576 -> 49152). This times all
121 for r activation rows, the r new positions of a decoding step, on random weights (seeded), one thread,
thread CPU time. Rounds alternate between the sides, so a load that comes and goes shows in every side alike; it
prints each side's median and min-max per row count, the cost of r rows against one, and for the first q/k/v
product:
  batch == alone  whether 7 rows multiplied together give bitwise what each row gives alone (what lossless ==
                  AR and a batch == each row alone need from a format); else the largest difference
  rel. error      max |y - y_fp32| / max |y_fp32| against the fp32 product on the same weights and rows

The sides (those that cannot run here are listed with the reason and skipped):
  w8a16      our AVX2 kernel, int8 weights per channel, each row rounded to int16 levels (dtype="w8a16")
  w8a8       our own w8a8 kernel where one builds (VNNI or AVX2), two passes on q/k/v and down as served
             (both with their weights on 2 MB pages where the OS grants them, as the lean forward keeps them)
  fbgemm     torch's fbgemm dynamic int8 linear with our per-row rails (MARS_W8A8_KERNEL=fbgemm), served passes
  int8       int8 weights, bf16 activations (torch's _weight_int8pack_mm; dtype="int8")
  bf16, fp32 F.linear
  ort-int4, ort-int8
             ONNX Runtime's MatMulNBits (pip install onnxruntime onnx): blocks of 32 weights with one scale,
             symmetric, accuracy_level=4 (activations quantized to int8 per block of each row), all 121
             products as one graph run by one session with one thread, so its per-call cost is paid once
  torchao    torchao's Int8DynamicActivationInt8WeightConfig, eager (pip install torchao)
Not dependencies of the project: the ONNX Runtime and torchao sides run where those packages are installed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]   # (out, in)
TWO_PASS = {0, 3}   # a layer's q/k/v and down: the products w8a8 multiplies twice as served (mars_core/engine/lean.py)
SIDES = ("w8a16", "w8a8", "fbgemm", "int8", "bf16", "fp32", "ort-int4", "ort-int8", "torchao")


def weights(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, k, generator=g) * k ** -0.5 for n, k in SHAPES]


def torch_side(name: str, ws: list[torch.Tensor]):
    """A function of {in_features: x [r, in]} that runs the 121 products, and one of x that runs the first."""
    from mars_core.engine import int8, w8a8

    if name in ("w8a16", "w8a8", "fbgemm"):
        if name == "w8a16":
            kernel = w8a8.WIDE
        elif name == "fbgemm":
            kernel = "fbgemm"
        else:
            kernel = w8a8.pick_kernel()
            if kernel not in w8a8.OWN:
                raise RuntimeError(f"no own w8a8 kernel builds here (picked {kernel})")
        passes = (lambda i: 1) if name == "w8a16" else (lambda i: 2 if i % 4 in TWO_PASS and i < 120 else 1)
        mods = [w8a8.W8A8Linear(w, passes=passes(i), kernel=kernel) for i, w in enumerate(ws)]
        if kernel not in w8a8.NATIVE:
            def run(xs):
                for m, (_, k) in zip(mods, SHAPES):
                    m(xs[k])

            return run, lambda x: mods[0](x).float()
        # as the lean forward serves them: one buffer on 2 MB pages (mars_core.engine.hugepages), the kernel op called
        # directly as its scripted loop calls it (a module call adds ~10 us each)
        from mars_core.engine.hugepages import gather

        packed, _ = gather([m._own.packed for m in mods])
        for m, q in zip(mods, packed):
            m._own.packed = q
        calls = [(m._own.op.linear, m._own.packed, m._own.scale, m.passes == 2) for m in mods]
        step, inverse = float(w8a8._STEP), w8a8._INVERSE

        def run(xs):
            for (linear, packed, scale, two), (_, k) in zip(calls, SHAPES):
                linear(xs[k], packed, scale, None, two, inverse, step)

        return run, lambda x: mods[0](x).float()
    if name == "int8":
        if not int8.int8_supported():
            raise RuntimeError("this torch has no _weight_int8pack_mm")
        mods = [int8.Int8Linear(w, None, torch.bfloat16) for w in ws]
        calls = [(m.qweight, m.scale) for m in mods]

        def run(xs):
            xb = {k: x.bfloat16() for k, x in xs.items()}
            for (q, scale), (_, k) in zip(calls, SHAPES):
                torch.ops.aten._weight_int8pack_mm(xb[k], q, scale)

        return run, lambda x: mods[0](x).float()
    if name in ("bf16", "fp32"):
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        cast = [w.to(dtype) for w in ws]

        def run(xs):
            xc = {k: x.to(dtype) for k, x in xs.items()}
            for w, (_, k) in zip(cast, SHAPES):
                F.linear(xc[k], w)

        return run, lambda x: F.linear(x.to(dtype), cast[0]).float()
    raise ValueError(name)


def ort_side(bits: int, ws: list[torch.Tensor]):
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    block = 32
    zero = 1 << (bits - 1)
    nodes, inits, outs = [], [], []
    for i, (w, (n, k)) in enumerate(zip(ws, SHAPES)):
        blocks = w.numpy().reshape(n, k // block, block)
        scale = np.abs(blocks).max(-1) / (zero - 1)
        scale[scale == 0] = 1
        q = (np.clip(np.round(blocks / scale[..., None]), -zero, zero - 1) + zero).astype(np.uint8)
        if bits == 4:   # two codes a byte, the lower-indexed one in the low nibble
            q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        inits += [numpy_helper.from_array(q, f"b{i}"), numpy_helper.from_array(scale.astype(np.float32).reshape(-1),
                                                                               f"s{i}")]
        nodes.append(helper.make_node("MatMulNBits", [f"x{k}", f"b{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                      K=k, N=n, bits=bits, block_size=block, accuracy_level=4))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["r", n]))
    ins = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["r", k]) for k in (576, 1536)]
    model = helper.make_model(helper.make_graph(nodes, "products", ins, outs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def run(xs):
        session.run(None, {f"x{k}": x.numpy() for k, x in xs.items()})

    def first(x):
        return torch.from_numpy(session.run(["y0"], {"x576": x.numpy(), "x1536": np.zeros((len(x), 1536),
                                                                                           np.float32)})[0])

    return run, first


def torchao_side(ws: list[torch.Tensor]):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    mods = torch.nn.ModuleList()
    for w in ws:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        mods.append(lin)
    quantize_(mods, Int8DynamicActivationInt8WeightConfig())

    def run(xs):
        with torch.inference_mode():
            for m, (_, k) in zip(mods, SHAPES):
                m(xs[k])

    def first(x):
        with torch.inference_mode():
            return mods[0](x).float()

    return run, first


def make_side(name: str, ws: list[torch.Tensor]):
    if name.startswith("ort-"):
        return ort_side(4 if name == "ort-int4" else 8, ws)
    if name == "torchao":
        return torchao_side(ws)
    return torch_side(name, ws)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 7])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if any(r < 1 for r in args.rows) or args.rounds < 1:
        p.error(f"--rows {args.rows} and --rounds {args.rounds} must be positive: e.g. --rows 1 4 7 --rounds 7")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")   # torch.ao's deprecation notes, torchao's missing CUDA libraries
    ws = weights(args.seed)
    sides = {}
    for name in args.sides:
        try:
            sides[name] = make_side(name, ws)
        except Exception as e:   # a side this machine cannot run: say why, time the others
            print(f"{name}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
    if not sides:
        print("no side can run here")
        return 1
    g = torch.Generator().manual_seed(args.seed + 1)
    inputs = {r: {k: torch.randn(r, k, generator=g) for k in (576, 1536)} for r in args.rows}
    times = {(s, r): [] for s in sides for r in args.rows}
    for s in sides:   # a first call each: packing, allocation
        for r in args.rows:
            sides[s][0](inputs[r])
    for _ in range(args.rounds):
        for s, (run, _) in sides.items():
            for r in args.rows:
                t0 = time.thread_time()
                run(inputs[r])
                times[s, r].append((time.thread_time() - t0) * 1e3)

    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(args.seed + 2))
    exact = F.linear(x.double(), ws[0].double())
    print(f"SmolLM2-135M's {len(SHAPES)} products, ms a forward (median, min-max of {args.rounds} rounds), one thread, "
          "thread time")
    head = ["side"] + [f"{r} rows" for r in args.rows]
    one = 1 in args.rows
    if one:
        head += [f"{r} / 1" for r in args.rows if r > 1]
    head += ["batch == alone", "rel. error"]
    print(" | ".join(head))
    print(" | ".join("-" * len(h) for h in head))
    for s, (_, first) in sides.items():
        med = {r: statistics.median(times[s, r]) for r in args.rows}
        cells = [s] + [f"{med[r]:.2f} ({min(times[s, r]):.2f}-{max(times[s, r]):.2f})" for r in args.rows]
        if one:
            cells += [f"{med[r] / med[1]:.2f}" for r in args.rows if r > 1]
        together = first(x)
        alone = torch.cat([first(x[i:i + 1]) for i in range(len(x))])
        diff = (together - alone).abs().max().item()
        cells.append("yes" if diff == 0 else f"no ({diff:.2g})")
        cells.append(f"{((together.double() - exact).abs().max() / exact.abs().max()).item():.4f}")
        print(" | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
