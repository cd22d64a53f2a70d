"""The flash-attention kernel's machine code, read without a GPU: for each variant, the
registers and spills ptxas reports, and the instructions of the main loop's hot path (one
chunk of keys, with no soft cap, no mask and no rescale: the common case of a long
prefill) per tensor-core instruction. An issue-bound kernel runs about as fast as that
ratio lets it, so the figure tracks changes that cannot be timed here.

Needs nvcc, and cuobjdump (the CUDA toolkit's, or `pip download --no-deps
nvidia-cuda-cuobjdump` unpacked onto PATH). Static counts, not a timing.

The last line printed is one JSON object, also written to bench/results/gpu_sass_mix.json.

    python -m bench.gpu.sass_mix [--arch sm_90] [--source cuda/]

(from the repository root: it imports no pyengine)
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..common import print_table
from ..common import report as write_results  # `report` and `common` name locals here

ROOT = Path(__file__).resolve().parents[2]
# (label, mangled name fragment): bfloat16 kernels of the shapes that matter most.
VARIANTS = [
    ("prefill, head 128, 8 warps", "I13__nv_bfloat16Li128ELi8E"),
    ("prefill, head 128, 4 warps", "I13__nv_bfloat16Li128ELi4E"),
    ("prefill, head 64, 8 warps", "I13__nv_bfloat16Li64ELi8E"),
    ("decode, head 128, 1 warp", "I13__nv_bfloat16Li128ELi1E"),
]


@dataclass
class Instruction:
    address: int
    text: str

    @property
    def opcode(self) -> str:
        return re.sub(r"^@!?U?P[T0-9]+\s+", "", self.text).split()[0].split(".")[0]

    @property
    def never_runs(self) -> bool:  # ptxas's `@!PT` padding
        return self.text.startswith("@!PT")

    def branch_target(self) -> int | None:
        if self.opcode != "BRA":
            return None
        match = re.search(r"0x([0-9a-f]+)\s*$", self.text)
        return int(match.group(1), 16) if match else None


def compile_cubin(source: Path, arch: str, out: Path) -> str:
    """ptxas's report of compiling flash_attention.cu into `out`. The folder above `source`
    is on the include path, since cuda/ includes its headers by folder ("cuda/...");
    `source` itself too, for trees older than that."""
    command = ["nvcc", "-std=c++17", "-O3", f"-arch={arch}", "-cubin", "-Xptxas", "-v",
               "-I", str(source.resolve().parent), "-I", str(source),
               "-I", str(ROOT / "cpp" / "include"),
               str(source / "flash_attention.cu"), "-o", str(out)]  # fmt: skip
    return subprocess.run(command, check=True, capture_output=True, text=True).stderr


def resources(report: str, fragment: str) -> tuple[int, int]:
    """(registers, spill-store bytes) of the kernel whose name holds `fragment`."""
    lines = report.splitlines()
    for i, line in enumerate(lines):
        if fragment in line and "Compiling entry" in line:
            block = "\n".join(lines[i : i + 6])
            registers = re.search(r"Used (\d+) registers", block)
            spills = re.search(r"(\d+) bytes spill stores", block)
            if registers and spills:
                return int(registers.group(1)), int(spills.group(1))
    raise ValueError(f"ptxas reported nothing for {fragment}")


def disassemble(cubin: Path, fragment: str) -> list[Instruction]:
    symbols = subprocess.run(["cuobjdump", "-symbols", str(cubin)], check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
    name = next(n for n in re.findall(r"(\S*flash_attention_kernel\S*)", symbols) if fragment in n)
    sass = subprocess.run(["cuobjdump", "-sass", "-fun", name, str(cubin)], check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    return [
        Instruction(int(m.group(1), 16), m.group(2).strip())
        for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.MULTILINE)
    ]


def hot_path(code: list[Instruction]) -> tuple[collections.Counter[str], bool]:
    """Opcodes of the innermost loop holding every HMMA, without what its conditional
    forward branches skip (the soft cap, the mask, the rescale, a few lanes' block-table
    reads), except the branches that skip the copies or a warp's whole compute; and
    whether a loop ptxas kept rolled runs inside it (its body is counted once)."""
    mma = [i.address for i in code if i.opcode == "HMMA"]
    first, last = min(mma), max(mma)
    loops = [
        (target, i.address)
        for i in code
        if (target := i.branch_target()) is not None and target <= first and i.address >= last
    ]
    start, end = min(loops, key=lambda loop: loop[1] - loop[0])
    body = [i for i in code if start <= i.address <= end]
    skipped: set[int] = set()
    for i in body:
        target = i.branch_target()
        if target is None or not i.text.startswith("@") or target <= i.address:
            continue
        region = [j for j in body if i.address < j.address < target]
        if target - i.address < (end - start) / 2 and not any(j.opcode == "LDGSTS" for j in region):
            skipped.update(j.address for j in region)
    inner = any((t := i.branch_target()) is not None and t <= i.address < end for i in body)
    mix = collections.Counter(
        i.opcode for i in body if i.address not in skipped and not i.never_runs
    )
    return mix, inner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--source", type=Path, default=ROOT / "cuda", help="a cuda/ folder")
    args = parser.parse_args()
    for tool in ("nvcc", "cuobjdump"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not on PATH (see this script's docstring)")
    rows, figures = [], {}
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "flash.cubin"
        report = compile_cubin(args.source, args.arch, cubin)
        for label, fragment in VARIANTS:
            try:
                registers, spills = resources(report, fragment)
            except ValueError:
                continue  # a variant this source tree does not have
            mix, inner = hot_path(disassemble(cubin, fragment))
            label += " (*)" if inner else ""
            total, mma = sum(mix.values()), mix["HMMA"]
            common = ", ".join(f"{op} {n}" for op, n in mix.most_common(8) if op != "HMMA")
            rows.append((label, str(registers), str(spills), str(mma), str(total),
                         f"{total / mma:.2f}", common))  # fmt: skip
            key = re.sub(r"\W+", "_", label).strip("_")
            figures[f"{key}_instructions_per_mma"] = round(total / mma, 2)
    print(f"# flash_attention_kernel (bfloat16) for {args.arch}: one chunk's hot path")
    table = print_table(("kernel", "registers", "spill bytes", "HMMA", "instructions",
                         "per HMMA", "most common others"), rows)  # fmt: skip
    if any(row[0].endswith("(*)") for row in rows):
        print("(*) a loop of copies ptxas kept rolled runs inside the chunk's: counted once")
    write_results("gpu_sass_mix", figures, tables=[table])


if __name__ == "__main__":
    main()
