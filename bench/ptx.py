"""Reading a compiled kernel without a GPU, for the compile guard (`bench/kernels.py`): register and spill counts
from the `ptxas -v` log, the widths of the global loads and stores in the PTX, the approximate arithmetic it uses
(docs/gpu.md#rounding), and the occupancy those give on an SM (the CUDA occupancy calculator's rules, per-SM
resources of sm_80 and sm_90).
"""
from __future__ import annotations

import dataclasses
import math
import re


@dataclasses.dataclass(frozen=True)
class SMModel:
    """Per-SM resources the occupancy is computed from (CUDA programming guide, compute capability tables)."""

    name: str
    regs: int            # 32-bit registers per SM
    threads: int         # resident threads per SM
    smem: int            # shared memory per SM usable by blocks, bytes
    smem_per_block: int  # largest shared memory one block may use (opt-in), bytes
    blocks: int          # resident blocks per SM
    sms: int             # SMs on the device, for waves


# sm_90: H100 SXM / H200 (132 SMs): 64K regs, 2048 threads, 228 KB smem (227 KB per block), 32 blocks per SM.
# sm_80: A100 (108 SMs): 64K regs, 2048 threads, 164 KB smem (163 KB per block), 32 blocks per SM.
SM_MODELS = {
    90: SMModel("H100/H200", 65536, 2048, 228 * 1024, 227 * 1024, 32, 132),
    80: SMModel("A100", 65536, 2048, 164 * 1024, 163 * 1024, 32, 108),
}
_REG_UNIT = 256          # registers are allocated per warp in units of 256
_SMEM_UNIT = 128         # shared memory allocation unit, bytes
_SMEM_RESERVED = 1024    # shared memory the runtime reserves per block (sm_80 and later), bytes


def occupancy(regs: int, smem: int, num_warps: int, sm: SMModel) -> tuple[int, str]:
    """(resident blocks per SM, the limiting resource) for a kernel of `num_warps` warps using `regs` registers
    per thread and `smem` bytes of shared memory per block (the CUDA occupancy calculator's rules)."""
    regs_per_warp = math.ceil(max(regs, 1) * 32 / _REG_UNIT) * _REG_UNIT
    smem_per_block = math.ceil(smem / _SMEM_UNIT) * _SMEM_UNIT + _SMEM_RESERVED
    limits = {"regs": sm.regs // (regs_per_warp * num_warps), "threads": sm.threads // (32 * num_warps),
              "smem": sm.smem // smem_per_block, "blocks": sm.blocks}
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTX_GLOBAL = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld|st)\.global((?:\.[\w:]+)*)\s", re.MULTILINE)
# cp.async.cg.shared.global [dst], [src], SIZE: SIZE bytes from global to shared per thread
_PTX_CP_ASYNC = re.compile(r"^\s*(?:@!?%p\d+\s+)?cp\.async\.c[ag]\.shared\.global(?:\.[\w:]+)*"
                           r"\s+\[[^]]*\],\s*\[[^]]*\],\s*(\w+)", re.MULTILINE)


def parse_ptxas_log(log: str) -> dict[str, int]:
    """registers, stack, spill_stores, spill_loads (bytes) from `ptxas -v` output of one kernel."""
    regs = _PTXAS_REGS.search(log)
    spills = _PTXAS_SPILLS.search(log)
    if regs is None or spills is None:
        raise ValueError(f"log: no register/spill line in the ptxas output:\n{log}")
    stack, stores, loads = (int(x) for x in spills.groups())
    return {"registers": int(regs.group(1)), "stack": stack, "spill_stores": stores, "spill_loads": loads}


def global_access_mix(ptx: str) -> dict[str, dict[int, int]]:
    """Static counts of the global-memory instructions in PTX by bytes per thread per instruction:
    {"ld": {16: n, 8: n, ...}, "cp": {...}, "st": {...}} for ld.global, cp.async (global -> shared, what Triton's
    pipeliner makes of loads feeding a dot) and st.global; 16 bytes is the widest (v4 of 32-bit, v2 of 64-bit)."""
    mix: dict[str, dict[int, int]] = {"ld": {}, "cp": {}, "st": {}}
    for op, suffix in _PTX_GLOBAL.findall(ptx):
        vector = re.search(r"\.v(\d)", suffix)
        bits = re.findall(r"\.[bfsu](\d+)", suffix)
        if not bits:
            raise ValueError(f"ptx: cannot read the width of {op}.global{suffix}")
        width = (int(vector.group(1)) if vector else 1) * int(bits[-1]) // 8
        mix[op][width] = mix[op].get(width, 0) + 1
    for size in _PTX_CP_ASYNC.findall(ptx):
        width = int(size, 0)
        mix["cp"][width] = mix["cp"].get(width, 0) + 1
    return mix


# PTX arithmetic that is not correctly rounded (PTX ISA: div.approx / div.full within 2 ulp, rcp/sqrt/rsqrt.approx,
# ex2/lg2.approx, sin/cos.approx with an absolute error bound, tanh.approx); div.rn, sqrt.rn and the like are exact.
_PTX_APPROX = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:div|rcp|sqrt|rsqrt|ex2|lg2|sin|cos|tanh)\.(?:approx|full)"
                         r"(?:\.ftz)?\.\w+)\s", re.MULTILINE)


def approximate_instructions(ptx: str) -> dict[str, int]:
    """Static counts of the approximate arithmetic instructions in PTX, by opcode (e.g. {"ex2.approx.f32": 3,
    "div.full.f32": 1}); empty when every division, root and transcendental is correctly rounded."""
    found: dict[str, int] = {}
    for opcode in _PTX_APPROX.findall(ptx):
        found[opcode] = found.get(opcode, 0) + 1
    return found
