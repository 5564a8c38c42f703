"""What the GPU machine code of the CUDA kernels costs, read without a GPU.

Builds every unit of custom_ops/kernels/cuda once for all SM versions (nvcc -c with every
-gencode, keeping each SM's cubin; the flags of benchmarks/same_machine_code.sh plus the
strict warnings of the CI compile check, which shares this build), reads registers / spills / shared memory from
``ptxas -v`` and the instructions from ``cuobjdump -sass``, and for each FMHA kernel
instantiation (head size, dtype, tile, dropout on / off, backward mode) reports:

* registers, spills, shared memory, blocks per SM and occupancy on an H100;
* the main loop (the loop with the most tensor-core instructions): HMMA, shared-memory
  bytes, RED/ATOM, MUFU, Philox calls (IMAD.WIDE.U32 by the Philox multipliers / 10 rounds)
  per warp iteration and per attention element, instructions per HMMA, and what dropout
  adds per element (main loop with dropout minus without, in thread-instructions);
* a roofline estimate of each kernel at BERT-large 40 x 512 (16 heads, d = 64) on an H100:
  per pipe (tensor, FMA, ALU, IMAD, MUFU, shuffle/movmatrix, shared memory, issue, L2
  atomics, DRAM) the time the kernel's instructions need at that pipe's rate, the kernel's
  time the largest of them; assumptions in ROOFLINE (written into the JSON and the docs).

Instruction counts are static counts of one pass through the main loop; a block of it that
only some warps run (the one-pass backward's dQ) is weighted by the warps that run it (the
forward branch in the loop that skips the RED instructions). Writes
benchmarks/results/kernel_static.json; ``benchmarks/report.py`` renders it into
docs/performance.md. tests/test_kernel_static.py holds the limits the kernels must keep.

    python benchmarks/kernel_static.py [--sm 80 90] [--out PATH]

Needs nvcc, c++filt, and cuobjdump + nvdisasm (the CUDA 13.0 toolkit here has neither:
``pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm``; found on PATH or in that
package's folder). About 3 minutes per SM version on 2 cores.
"""

import argparse
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_DIR = os.path.join(ROOT, "custom_ops", "kernels", "cuda")
OUT = os.path.join(ROOT, "benchmarks", "results", "kernel_static.json")
NVCC_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr"]
# tests/test_cuda_compile.py's strictness: host and device warnings are errors (host flags do
# not touch the device code, so the machine code read here is the one without them)
STRICT_FLAGS = ["-Xcompiler", "-fPIC", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror"]

# Philox4x32 multipliers as SASS prints an immediate (a negative 32-bit value).
PHILOX_M0 = ("0xd2511f53", "-0x2daee0ad")
PHILOX_M1 = ("0xcd9e8d57", "-0x326172a9")

# Per-SM, per-clock throughputs of an H100 (SXM5, sm_90) the estimate assumes, and the
# problem it is made for. Lanes are thread-instructions; a warp instruction is 32 lanes.
ROOFLINE = {
    "gpu": "H100 SXM5 (sm_90)",
    "sms": 132,
    "clock_ghz": 1.755,
    "tensor_flop_per_clk_sm": 2048,
    "tensor_note": "mma.sync m16n8k16 (HMMA.16816, 4096 FLOP): assumed at half of Hopper's dense peak "
    "(989 TFLOP/s needs wgmma, which these kernels do not use): 2048 FLOP/clk/SM, A100's rate",
    "fma_lanes_per_clk_sm": 128,  # FFMA, FMUL, FADD, F2FP, HFMA2 ...
    "alu_lanes_per_clk_sm": 64,  # LOP3, ISETP, IADD3, SHF, PRMT, SEL, FSEL, FMNMX, FSETP, MOV ...
    "imad_lanes_per_clk_sm": 64,  # IMAD*; IMAD.WIDE counts twice
    "mufu_lanes_per_clk_sm": 16,  # MUFU.EX2 ...
    "shfl_lanes_per_clk_sm": 32,  # SHFL, MOVM
    "issue_warp_instr_per_clk_sm": 4,
    "smem_bytes_per_clk_sm": 128,  # LDSM, LDS, STS, LDGSTS (cp.async) into shared memory
    "l2_atomic_bytes_per_s": 2.75e12,
    "l2_atomic_note": "RED.ADD.F32(x2) payload at half of H100's ~5.5 TB/s L2 bandwidth (the read-modify-write "
    "runs in the L2 slice); only the parts after a dQ tile's first are atomics",
    "dram_bytes_per_s": 3.35e12,
    "problem": {"batch": 40, "seqlen": 512, "heads": 16, "head_dim": 64, "dtype": "bf16"},
    "measured_h200": {
        "when": "2026-12-04, one H200, the kernels before the one-pass backward (three backward "
        "kernels, 16-bit draws shared by 4-8 lanes)",
        "bert_large_40x512_us": {"forward": 216, "backward_delta": 25, "backward_dkdv": 588, "backward_dq": 350},
        "bert_large_40x512_dropout_0.1_us": {"forward": 533, "backward_dkdv": 1263, "backward_dq": 793},
        "fwd_bwd_ms": {"dropout_0": 1.19, "dropout_0.1": 2.50},
    },
}


# ------------------------------------------------------------------------------ tools


def find_tool(name):
    path = shutil.which(name)
    if path:
        return path
    import site

    for base in site.getsitepackages() + [site.getusersitepackages()]:
        for cand in glob.glob(os.path.join(base, "nvidia", "cu*", "bin", name)):
            return cand
    return None


def tools():
    """nvcc, cuobjdump, c++filt; raises RuntimeError naming what is missing and how to get it."""
    found = {name: find_tool(name) for name in ("nvcc", "cuobjdump", "nvdisasm", "c++filt")}
    missing = [n for n, p in found.items() if p is None]
    if missing:
        raise RuntimeError(
            f"kernel_static: {', '.join(missing)} not found (nvcc from a CUDA toolkit; cuobjdump "
            "and nvdisasm: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)"
        )
    return found


# ------------------------------------------------------------------------------ build


class Built(NamedTuple):
    """One unit compiled for every SM: nvcc's exit code and its output without ptxas's report
    (warnings, errors), the command, seconds, each SM's cubin and ptxas's report per kernel."""

    unit: str
    returncode: int
    output: str
    command: str
    seconds: float
    cubins: dict
    ptxas: dict


def _is_ptxas_report(line):
    return line.startswith("ptxas info") or re.match(r"^\s+\d+ bytes stack frame", line) is not None


def ptxas_report(text):
    """{sm: {mangled name: {registers, spill_stores, spill_loads, smem_static}}} from ``-Xptxas -v``."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for 'sm_(\d+)'", line)
        if m:
            cur = out.setdefault(int(m.group(2)), {})[m.group(1)] = {
                "registers": 0,
                "spill_stores": 0,
                "spill_loads": 0,
                "smem_static": 0,
            }
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["spill_stores"], cur["spill_loads"] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            m2 = re.search(r"(\d+) bytes smem", line)
            cur["smem_static"] = int(m2.group(1)) if m2 else 0
    return out


def build_unit(nvcc, unit, sms, out_dir):
    """Compiles ``unit`` once for every SM in ``sms`` (host code too, warnings as errors)."""
    base = os.path.basename(unit)[:-3]
    keep = os.path.join(out_dir, base)
    os.makedirs(keep, exist_ok=True)
    gencode = [f for sm in sms for f in ("-gencode", f"arch=compute_{sm},code=sm_{sm}")]
    cmd = [
        nvcc,
        *NVCC_FLAGS,
        *STRICT_FLAGS,
        f"-I{os.path.join(ROOT, 'custom_ops')}",
        *gencode,
        "-Xptxas",
        "-v",
        "-keep",
        "-keep-dir",
        keep,
        "-c",
        unit,
        "-o",
        os.path.join(keep, base + ".o"),
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    output = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if not _is_ptxas_report(line))
    cubins = {sm: os.path.join(keep, f"{base}.compute_{sm}.cubin") for sm in sms}
    for name in os.listdir(keep):  # -keep leaves ~10 MB of preprocessed sources a unit: only the cubins are read
        if os.path.join(keep, name) not in cubins.values():
            os.remove(os.path.join(keep, name))
    return Built(
        unit,
        proc.returncode,
        output,
        " ".join(cmd),
        time.time() - t0,
        cubins,
        ptxas_report(proc.stderr),
    )


def build_all(nvcc, sms, out_dir, jobs):
    """{unit path: Built} for every unit of custom_ops/kernels/cuda, ``jobs`` compiles at a time."""
    units = sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu")))
    with ThreadPoolExecutor(jobs) as ex:
        return {b.unit: b for b in ex.map(lambda u: build_unit(nvcc, u, sms, out_dir), units)}


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")


def sass_functions(cuobjdump, cubin):
    """{mangled name: [(address, predicate, opcode, operands), ...]}."""
    text = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    funcs, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _INSTR.search(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return funcs


def demangle(cxxfilt, names):
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


# ------------------------------------------------------------------------------ what a kernel is


def header_constant(name, header=os.path.join(CUDA_DIR, "fmha_params.cuh")):
    with open(header) as f:
        m = re.search(rf"constexpr int {name} = (\d+);", f.read())
    return int(m.group(1))


def attention_rounds():
    return header_constant("kAttentionPhiloxRounds", os.path.join(ROOT, "custom_ops", "kernels", "common", "philox.h"))


def _targs(demangled):
    m = re.search(r"<(.*)>\(", demangled)
    args = [a.strip() for a in m.group(1).split(",")] if m else []
    return [
        (
            "bf16"
            if "bfloat16" in a
            else "fp16"
            if "half" in a
            else True
            if a == "true"
            else False
            if a == "false"
            else int(a)
            if re.fullmatch(r"-?\d+", a)
            else a
        )
        for a in args
    ]


def kernel_meta(demangled):
    """Kind, template arguments and per-iteration geometry of an FMHA kernel (None for others).

    elems: attention elements (query x key) one warp covers in one main-loop iteration;
    warps: warps per block; loop_warps: warps that run the conditional part of the loop."""
    a = _targs(demangled)
    if "fmha_fwd_kernel<" in demangled:
        dt, d, warps, drop = a
        return {
            "kind": "fwd",
            "dtype": dt,
            "d": d,
            "warps": warps,
            "dropout": drop,
            "rows": 16 * warps,
            "elems": 16 * header_constant("kFwdBlockN"),
            "gemms": 2,
            "label": f"forward {16 * warps} rows",
        }
    if "fmha_bwd_kv_kernel<" in demangled:
        dt, d, warps, bm, kv_regs, drop, dq = a
        return {
            "kind": "bwd_kv" if dq else "bwd_kv_det",
            "dtype": dt,
            "d": d,
            "warps": warps,
            "dropout": drop,
            "block_m": bm,
            "keys": 16 * warps,
            "elems": bm * 16,
            "gemms": 5 if dq else 4,
            "dq_warps": 4,
            "label": "backward, one pass" if dq else "backward (deterministic): dK, dV",
        }
    if "fmha_bwd_dq_kernel<" in demangled:
        dt, d, bn, q_regs, drop = a
        return {
            "kind": "bwd_dq_det",
            "dtype": dt,
            "d": d,
            "warps": 4,
            "dropout": drop,
            "keys": bn,
            "elems": 16 * bn,
            "gemms": 3,
            "label": "backward (deterministic): dQ",
        }
    if "fmha_bwd_prep_kernel<" in demangled or "fmha_bwd_dq_convert_kernel<" in demangled:
        dt, d = a[:2]
        return {
            "kind": "prep" if "prep" in demangled else "convert",
            "dtype": dt,
            "d": d,
            "warps": 8,
            "dropout": False,
            "elems": 0,
            "label": "backward prep" if "prep" in demangled else "dQ convert",
        }
    return None


# ------------------------------------------------------------------------------ instruction costs

_FMA = {"FFMA", "FMUL", "FADD", "F2FP", "HFMA2", "HMUL2", "HADD2", "FSWZADD", "F2F", "FRND"}
_ALU = {
    "LOP3",
    "LOP",
    "ISETP",
    "IADD3",
    "IADD",
    "SHF",
    "SHL",
    "SHR",
    "PRMT",
    "SEL",
    "FSEL",
    "FMNMX",
    "FSETP",
    "MOV",
    "LEA",
    "IABS",
    "IMNMX",
    "VIMNMX",
    "POPC",
    "FLO",
    "BREV",
    "PLOP3",
    "P2R",
    "R2P",
    "HMNMX2",
    "HSETP2",
    "VIADD",
    "IMNMX",
    "CS2R",
    "I2IP",
}
_UNIFORM_OR_CONTROL = re.compile(
    r"^(U[A-Z0-9]+|S2UR|R2UR|BRA|BSYNC|BSSY|EXIT|BAR|NOP|WARPSYNC|DEPBAR|"
    r"CALL|RET|YIELD|LDC|ULDC|S2R|MEMBAR|ERRBAR|CCTL|ACQBULK|BPT|PREEXIT|"
    r"ELECT|ENDCOLLECTIVE|VOTEU|UCGABAR_ARV|UCGABAR_WAIT|FENCE|WARPGROUP)"
)
_LDSM_BYTES = {"": 128, "2": 256, "4": 512}


def cost(op, operands):
    """Per warp instruction: {pipe: amount}; amounts are lanes (compute pipes), bytes
    (smem, l2_atomic, global) or FLOP (tensor); 'issue' counts every vector instruction."""
    base = op.split(".")[0]
    parts = op.split(".")
    c = {"issue": 1}
    if any(k in operands for k in PHILOX_M0 + PHILOX_M1):
        c["philox_constant"] = 1  # in any instruction (the no-dropout kernels must hold none)
    if _UNIFORM_OR_CONTROL.match(base):
        return c
    if base == "HMMA":
        shape = parts[1]  # 16816 or 1688
        m, n, k = (16, 8, 16) if shape == "16816" else (16, 8, 8)
        c["tensor"] = 2 * m * n * k
        c["hmma"] = 1
    elif base in ("LDSM", "LDS", "STS", "LDGSTS", "ATOMS"):
        if base == "LDSM":
            num = re.search(r"MT?88\.?(\d?)", op)
            c["smem"] = _LDSM_BYTES[num.group(1) if num else ""]
        else:
            width = next((int(p) for p in parts[1:] if p in ("64", "128")), 4)
            width = {64: 8, 128: 16}.get(width, width)
            if any(p in ("U8", "S8") for p in parts):
                width = 1
            elif any(p in ("U16", "S16") for p in parts):
                width = 2
            c["smem"] = 32 * width
            if base == "LDGSTS":
                c["global"] = 32 * width
    elif base in ("RED", "ATOM", "REDG", "ATOMG"):
        width = 8 if any(p in ("64", "F32x2") for p in parts) else 4  # F32x2: a float2 a lane
        c["l2_atomic"] = 32 * width
        c["atomic"] = 1
    elif base in ("LDG", "STG"):
        width = next(({"64": 8, "128": 16}[p] for p in parts[1:] if p in ("64", "128")), 4)
        c["global"] = 32 * width
    elif base == "MUFU":
        c["mufu"] = 32
    elif base in ("SHFL", "MOVM"):
        c["shfl"] = 32
    elif base == "IMAD":
        c["imad"] = 64 if "WIDE" in parts else 32
        if "WIDE" in parts and "U32" in parts:
            if any(k in operands for k in PHILOX_M0):
                c["philox_m0"] = 1
            if any(k in operands for k in PHILOX_M1):
                c["philox_m1"] = 1
    elif base in _FMA or base.startswith("F2") or base.startswith("I2F"):
        c["fma"] = 32
    else:  # integer / logic / compare / move and anything unlisted: the ALU pipe
        c["alu"] = 32
    return c


def add(into, c, weight=1.0):
    for k, v in c.items():
        into[k] = into.get(k, 0.0) + v * weight


def main_loop(instrs):
    """(start, end) indices of the loop with the most HMMA (else the longest), None if no loop."""
    index = {addr: i for i, (addr, _, _, _) in enumerate(instrs)}
    best = None
    for i, (addr, _, op, operands) in enumerate(instrs):
        if op.split(".")[0] != "BRA":
            continue
        m = re.match(r"(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", operands)
        if not m or not m.group(1):
            continue
        target = int(m.group(1), 16)
        if target >= addr or target not in index:
            continue
        lo = index[target]
        hmma = sum(1 for _, _, o, _ in instrs[lo : i + 1] if o.startswith("HMMA"))
        key = (hmma, i + 1 - lo)
        if best is None or key > best[0]:
            best = (key, lo, i)
    return None if best is None else (best[1], best[2])


def conditional_block(instrs, lo, hi):
    """(start, end) of the block inside the loop that a forward branch skips over and that holds
    RED instructions (the one-pass backward's dQ, run by some warps only), else None."""
    addr_index = {addr: i for i, (addr, _, _, _) in enumerate(instrs)}
    best = None
    for i in range(lo, hi + 1):
        addr, pred, op, operands = instrs[i]
        if not op.startswith("BRA") or not pred:
            continue
        m = re.match(r"0x([0-9a-f]+)", operands)
        if not m:
            continue
        t = int(m.group(1), 16)
        if t <= addr or t not in addr_index or addr_index[t] > hi + 1:
            continue
        j = addr_index[t]
        reds = sum(1 for _, _, o, _ in instrs[i + 1 : j] if o.split(".")[0] in ("RED", "ATOM", "REDG", "ATOMG"))
        hmma = sum(1 for _, _, o, _ in instrs[i + 1 : j] if o.startswith("HMMA"))
        if reds and hmma and (best is None or j - i > best[1] - best[0]):
            best = (i + 1, j - 1)
    return best


def philox_calls_per_iteration(per_iter):
    """Philox calls of one warp iteration from its multiplies by the Philox constants: R per
    call and multiplier (R = the attention layout's rounds), fewer when the compiler folds a
    round-0 multiply of counters that differ by constants into one (a round-0 multiply only:
    later rounds multiply data), so a count m of n calls lies in [(R - 1) n, R n] and n is
    ceil(m / R) while m < R (R - 1); above that the count is refused (an upper bound would be
    m / (R - 1))."""
    r = attention_rounds()
    m = max(per_iter.get("philox_m0", 0.0), per_iter.get("philox_m1", 0.0))
    if m >= r * (r - 1):
        raise RuntimeError(f"kernel_static: {m:.0f} Philox multiplies in one iteration: the call count is ambiguous")
    return math.ceil(m / r)


def analyse(instrs, meta):
    """Counts of the main loop per warp iteration (conditional block weighted by the share of
    warps that run it), of the whole function, and per attention element."""
    whole = {}
    for _, _, op, operands in instrs:
        add(whole, cost(op, operands))
    res = {"instructions": len(instrs), "whole": whole}
    loop = main_loop(instrs)
    if loop is None or not meta or not meta.get("elems"):
        return res
    lo, hi = loop
    cond = conditional_block(instrs, lo, hi) if meta["kind"] == "bwd_kv" else None
    share = meta.get("dq_warps", meta["warps"]) / meta["warps"] if cond else 1.0
    per_iter, unconditional = {}, {}
    for i in range(lo, hi + 1):
        _, _, op, operands = instrs[i]
        in_cond = cond is not None and cond[0] <= i <= cond[1]
        add(per_iter, cost(op, operands), share if in_cond else 1.0)
        if not in_cond:
            add(unconditional, cost(op, operands))
    elems = meta["elems"]
    res["loop"] = {
        "instructions": hi + 1 - lo,
        "conditional_instructions": 0 if not cond else cond[1] + 1 - cond[0],
        "conditional_share": share,
        "per_iteration": per_iter,
    }
    philox_calls = philox_calls_per_iteration(per_iter)
    res["per_element"] = {
        "tensor_flop": per_iter.get("tensor", 0.0) * 32 / (32 * elems),  # one warp's FLOP over its elements
        "smem_bytes": per_iter.get("smem", 0.0) / elems,
        "atomic_bytes": per_iter.get("l2_atomic", 0.0) / elems,
        "thread_instructions": per_iter.get("issue", 0.0) * 32 / elems,
        "philox_calls": philox_calls * 32 / elems,
        # outside the block only some warps run (the dQ tile, which draws no dropout): what
        # dropout adds is compared there, free of that block's own scheduling differences
        "unconditional_thread_instructions": unconditional.get("issue", 0.0) * 32 / elems,
    }
    hmma = per_iter.get("hmma", 0.0)
    res["hmma_per_iteration"] = hmma
    res["red_per_iteration"] = per_iter.get("atomic", 0.0)
    res["instructions_per_hmma"] = per_iter.get("issue", 0.0) / hmma if hmma else None
    # per 64 x 64 tile of attention elements (HMMA.16816 = 4096 FLOP, so HMMA per tile = FLOP per element)
    res["per_64x64_tile"] = {"hmma": hmma * 4096 / elems, "red_atom": per_iter.get("atomic", 0.0) * 4096 / elems}
    return res


# ------------------------------------------------------------------------------ occupancy and roofline


def occupancy(regs, smem_dyn, smem_static, threads):
    """Blocks per SM and occupancy on an H100 (64K registers, 228 KB shared memory of which a
    block may use 227 KB, 1 KB reserved per block, 64 warps, 32 blocks)."""
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = 65536 // (regs_per_warp * warps)
    smem = smem_dyn + smem_static
    by_smem = (228 * 1024) // (smem + 1024) if smem else 32
    blocks = max(0, min(by_regs, by_smem, 32, 64 // warps))
    return {
        "blocks_per_sm": blocks,
        "occupancy": blocks * warps / 64,
        "limited_by": "registers" if blocks == by_regs else "shared memory" if blocks == by_smem else "warps",
    }


def smem_bytes(meta):
    """Dynamic shared memory the launcher gives the kernel (mirrors fmha_fwd.cuh / fmha_bwd.cuh)."""
    d, e = meta["d"], 2
    if meta["kind"] == "fwd":
        return (meta["rows"] + 2 * header_constant("kFwdBlockN")) * (d + 8) * e
    if meta["kind"] in ("bwd_kv", "bwd_kv_det"):
        bm, keys = meta["block_m"], meta["keys"]
        return (2 * keys + 4 * bm) * (d + 8) * e + 4 * bm * 4 + (bm * (keys + 8) * e if meta["kind"] == "bwd_kv" else 0)
    if meta["kind"] == "bwd_dq_det":
        return (2 * header_constant("kBwdQueriesPerBlock") + 4 * meta["keys"]) * (d + 8) * e
    return 0


def roofline_us(per_iter, iterations, warps_per_iter, dram_bytes, atomic_share=1.0, r=ROOFLINE):
    """Time in microseconds each pipe needs for `iterations` main-loop iterations of
    `warps_per_iter` warps (per_iter: one warp's amounts), and the kernel's estimate (the max).
    atomic_share: the share of the loop's atomics that run (the rest are plain stores)."""
    clk = r["clock_ghz"] * 1e9 * r["sms"]  # SM-clocks per second
    n = iterations * warps_per_iter
    rates = {
        "tensor": r["tensor_flop_per_clk_sm"],
        "fma": r["fma_lanes_per_clk_sm"],
        "alu": r["alu_lanes_per_clk_sm"],
        "imad": r["imad_lanes_per_clk_sm"],
        "mufu": r["mufu_lanes_per_clk_sm"],
        "shfl": r["shfl_lanes_per_clk_sm"],
        "issue": r["issue_warp_instr_per_clk_sm"],
        "smem": r["smem_bytes_per_clk_sm"],
    }
    pipes = {k: per_iter.get(k, 0.0) * n / rate / clk * 1e6 for k, rate in rates.items()}
    pipes["l2_atomic"] = per_iter.get("l2_atomic", 0.0) * atomic_share * n / r["l2_atomic_bytes_per_s"] * 1e6
    pipes["dram"] = dram_bytes / r["dram_bytes_per_s"] * 1e6
    bound = max(pipes, key=pipes.get)
    return {"us": pipes[bound], "bound": bound, "pipes_us": pipes}


def problem_estimates(kernels, r=ROOFLINE):
    """Roofline of forward and backward at the problem of ROOFLINE (equal lengths, so every tile
    is full), per backward mode and dropout setting. DRAM bytes: what each kernel must read
    and write once (the re-reads of a sequence's Q, K, V, dO by its other blocks come from L2);
    the one-pass backward's fp32 dQ accumulator stays in L2 (the tiles in flight: 132 blocks'
    sequences and heads, about 4 MB at this problem) and is never written back."""
    pb = r["problem"]
    B, S, H, D = pb["batch"], pb["seqlen"], pb["heads"], pb["head_dim"]
    rows = B * S * H  # [T, H] rows
    e = 2  # bytes of a bf16 element

    def pick(kind, dropout, **want):
        for k in kernels:
            m = k["meta"]
            if (
                m["kind"] == kind
                and m["d"] == D
                and m["dtype"] == pb["dtype"]
                and m["dropout"] == dropout
                and all(m.get(a) == v for a, v in want.items())
            ):
                return k
        raise RuntimeError(f"kernel_static: no {kind} kernel for d={D} {pb['dtype']} dropout={dropout} {want}")

    def estimate(k, queries_per_block, keys_per_step, dram, atomic_share=1.0):
        blocks = B * H * math.ceil(S / queries_per_block)
        iters = blocks * math.ceil(S / keys_per_step)
        return roofline_us(k["analysis"]["loop"]["per_iteration"], iters, k["meta"]["warps"], dram, atomic_share)

    tensor = rows * D * e  # bytes of one [T, H, D] tensor
    out = {}
    for dropout in (False, True):
        fwd = pick("fwd", dropout, rows=128)
        est = {"forward": estimate(fwd, 128, header_constant("kFwdBlockN"), 3 * tensor + tensor + rows * 4)}
        # prep: reads O and dO, writes delta (and, one pass, zeroes 8 counters per row)
        est["prep"] = roofline_us({}, 0, 0, 2 * tensor + rows * 4 + rows * 32)
        est["prep_deterministic"] = roofline_us({}, 0, 0, 2 * tensor + rows * 4)
        kv = pick("bwd_kv", dropout)
        m = kv["meta"]
        nkb = math.ceil(S / m["keys"])  # parts of a dQ tile: the first is stored, the others added
        est["backward_one_pass"] = estimate(
            kv, m["keys"], m["block_m"], 4 * tensor + rows * 8 + 3 * tensor, (nkb - 1) / nkb
        )
        kvd = pick("bwd_kv_det", dropout)
        md = kvd["meta"]
        est["backward_det_kv"] = estimate(kvd, md["keys"], md["block_m"], 4 * tensor + rows * 8 + 2 * tensor)
        dq = pick("bwd_dq_det", dropout)
        est["backward_det_dq"] = estimate(
            dq, header_constant("kBwdQueriesPerBlock"), dq["meta"]["keys"], 4 * tensor + rows * 8 + tensor
        )
        t = {k: v["us"] for k, v in est.items()}
        bwd = t["prep"] + t["backward_one_pass"]
        bwd_det = t["prep_deterministic"] + t["backward_det_kv"] + t["backward_det_dq"]
        flop = 4 * B * S * S * H * D
        out["dropout_0.1" if dropout else "dropout_0"] = {
            "kernels": est,
            "forward_us": t["forward"],
            "backward_us": bwd,
            "backward_deterministic_us": bwd_det,
            "backward_over_forward": bwd / t["forward"],
            "deterministic_backward_over_forward": bwd_det / t["forward"],
            "fwd_bwd_us": t["forward"] + bwd,
            "fwd_bwd_tflops": flop * 3.5 / ((t["forward"] + bwd) * 1e-6) / 1e12,
        }
    out["fwd_bwd_dropout_over_none"] = out["dropout_0.1"]["fwd_bwd_us"] / out["dropout_0"]["fwd_bwd_us"]
    return out


def checks(kernels, units, d=64, dtype="bf16"):
    """The numbers the kernels are held to (tests/test_kernel_static.py states the limits):
    per kernel kind at head size d and dtype, and over every kernel of every unit."""

    def sel(kind, dropout):
        return [
            k
            for k in kernels
            if k["meta"]["kind"] == kind
            and k["meta"]["d"] == d
            and k["meta"]["dtype"] == dtype
            and k["meta"]["dropout"] == dropout
        ]

    out = {"head_dim": d, "dtype": dtype, "kinds": {}}
    for kind in ("fwd", "bwd_kv", "bwd_kv_det", "bwd_dq_det"):
        on, off = sel(kind, True), sel(kind, False)
        out["kinds"][kind] = {
            "philox_calls_per_element": max(k["analysis"]["per_element"]["philox_calls"] for k in on),
            "dropout_added_thread_instructions_per_element": max(
                k["dropout_added_thread_instructions_per_element"] for k in on
            ),
            "registers_without_dropout": max(k["registers"] for k in off),
            "registers_with_dropout": max(k["registers"] for k in on),
            "blocks_per_sm": min(k["blocks_per_sm"] for k in on + off),
            "tensor_flop_per_element": max(k["analysis"]["per_element"]["tensor_flop"] for k in on + off),
            "red_atom_instructions": max(k["analysis"]["whole"].get("atomic", 0) for k in on + off),
        }
    kinds = out["kinds"]
    out["backward_tensor_flop_per_element"] = kinds["bwd_kv"]["tensor_flop_per_element"]
    out["deterministic_backward_tensor_flop_per_element"] = (
        kinds["bwd_kv_det"]["tensor_flop_per_element"] + kinds["bwd_dq_det"]["tensor_flop_per_element"]
    )
    out["deterministic_red_atom_instructions"] = sum(
        k["analysis"]["whole"].get("atomic", 0) for k in kernels if k["meta"]["kind"] in ("bwd_kv_det", "bwd_dq_det")
    )
    out["philox_constants_without_dropout"] = sum(
        k["analysis"]["whole"].get("philox_constant", 0) for k in kernels if not k["meta"]["dropout"]
    )
    out["spill_bytes"] = sum(e.get("spill_stores", 0) + e.get("spill_loads", 0) for es in units.values() for e in es)
    return out


# ------------------------------------------------------------------------------ main


def run(sms, out_path, jobs, built=None):
    """Builds (or takes ``built``, from :func:`build_all` for these ``sms``), analyses, writes ``out_path``."""
    t0 = time.time()
    tl = tools()
    work = tempfile.mkdtemp(prefix="pu_kernel_static_")
    try:
        if built is None:
            built = build_all(tl["nvcc"], sms, work, jobs)
        failed = [b for b in built.values() if b.returncode != 0]
        if failed:
            raise RuntimeError(f"nvcc failed for {failed[0].unit}:\n{failed[0].output[-4000:]}")
        os.environ["PATH"] = os.pathsep.join([os.path.dirname(tl["nvdisasm"]), os.environ.get("PATH", "")])
        nvcc_version = subprocess.run([tl["nvcc"], "--version"], capture_output=True, text=True).stdout
        result = {
            "command": "python benchmarks/kernel_static.py " + " ".join(f"--sm {s}" for s in sms),
            "when": time.strftime("%Y-%m-%d"),
            "nvcc": nvcc_version.strip().splitlines()[-1],
            "flags": NVCC_FLAGS + STRICT_FLAGS,
            "roofline_assumptions": ROOFLINE,
            "sms": {},
        }
        for sm in sms:
            result["sms"][str(sm)] = _analyse_sm(tl, built, sm)
        result["seconds"] = round(time.time() - t0, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return result


def _analyse_sm(tl, built, sm):
    kernels, all_units = [], {}
    for unit, b in sorted(built.items()):
        info = b.ptxas.get(sm, {})
        funcs = sass_functions(tl["cuobjdump"], b.cubins[sm])
        names = demangle(tl["c++filt"], sorted(set(info) | set(funcs)))
        all_units[os.path.basename(unit)] = [{"name": names[n], **info[n]} for n in sorted(info)]
        for mangled, instrs in funcs.items():
            meta = kernel_meta(names[mangled])
            if meta is None:
                continue
            pi = info.get(mangled, {})
            k = {
                "name": names[mangled],
                "unit": os.path.basename(unit),
                "meta": meta,
                **pi,
                "smem_dynamic": smem_bytes(meta),
                "analysis": analyse(instrs, meta),
            }
            k.update(occupancy(pi.get("registers", 0), k["smem_dynamic"], pi.get("smem_static", 0), meta["warps"] * 32))
            kernels.append(k)
    # what dropout adds to each main loop, per element
    for k in kernels:
        m = k["meta"]
        if not m["dropout"] or "loop" not in k["analysis"]:
            continue
        twin = next((o for o in kernels if o["meta"] == {**m, "dropout": False}), None)
        if twin and "loop" in twin["analysis"]:
            a, b = k["analysis"]["per_element"], twin["analysis"]["per_element"]
            k["dropout_added_thread_instructions_per_element"] = (
                a["unconditional_thread_instructions"] - b["unconditional_thread_instructions"]
            )
    sm_res = {"units": all_units, "kernels": kernels, "checks": checks(kernels, all_units)}
    if sm == 90:
        sm_res["estimate"] = problem_estimates(kernels)
    return sm_res


def summary_lines(result):
    lines = []
    for sm, r in result["sms"].items():
        lines.append(f"sm_{sm}:")
        for k in sorted(
            r["kernels"],
            key=lambda k: (
                k["meta"]["kind"],
                k["meta"]["d"],
                k["meta"]["dtype"],
                k["meta"]["warps"],
                k["meta"]["dropout"],
            ),
        ):
            m, a = k["meta"], k["analysis"]
            pe = a.get("per_element", {})
            lines.append(
                f"  {m['kind']:<11} {m['dtype']} d={m['d']:<3} w={m['warps']} drop={int(m['dropout'])} "
                f"regs={k.get('registers', 0):>3} spill={k.get('spill_stores', 0)}/{k.get('spill_loads', 0)} "
                f"blocks/SM={k['blocks_per_sm']} "
                + (
                    f"HMMA/it={a['hmma_per_iteration']:.0f} flop/el={pe['tensor_flop']:.0f} "
                    f"smemB/el={pe['smem_bytes']:.1f} instr/el={pe['thread_instructions']:.1f} "
                    f"philox/el={pe['philox_calls']:.3f} "
                    f"RED/it={a['red_per_iteration']:.1f}"
                    if pe
                    else ""
                )
                + (
                    f" +drop/el={k['dropout_added_thread_instructions_per_element']:.2f}"
                    if "dropout_added_thread_instructions_per_element" in k
                    else ""
                )
            )
        if "estimate" in r:
            for case in ("dropout_0", "dropout_0.1"):
                e = r["estimate"][case]
                lines.append(
                    f"  estimate {case}: fwd {e['forward_us']:.0f} us ({e['kernels']['forward']['bound']}), "
                    f"bwd {e['backward_us']:.0f} us ({e['kernels']['backward_one_pass']['bound']}), "
                    f"bwd/fwd {e['backward_over_forward']:.2f}, det bwd/fwd "
                    f"{e['deterministic_backward_over_forward']:.2f}, {e['fwd_bwd_tflops']:.0f} TFLOP/s"
                )
            lines.append(f"  fwd+bwd with dropout 0.1 over without: {r['estimate']['fwd_bwd_dropout_over_none']:.3f}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sm", type=int, action="append", help="SM version (repeatable; default 80 and 90)")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    try:
        result = run(args.sm or [80, 90], args.out, args.jobs)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    print("\n".join(summary_lines(result)))
    print(f"wrote {os.path.relpath(args.out, ROOT)} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
