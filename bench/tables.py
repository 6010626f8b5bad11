"""The tables of benchmark figures in docs/, written from recorded benchmark output and checked against it.

A benchmark's output is recorded as a text file in ``bench/results/`` (``bench.py --save FILE`` writes what it
prints; older files hold several runs, each under a ``## NAME`` line). Each table of a page sits between
``<!-- bench-table:NAME -->`` and ``<!-- /bench-table:NAME -->``; TABLES says which recorded output (and
which section of it) each is made from. Nothing needs running to check them: the recorded outputs are in
the repository.

    python bench/tables.py --check    # exit 1 with a diff when a page's table is not what its output gives
    python bench/tables.py --write    # rewrite every table from bench/results/
    python bench/bench.py --rounds 60 --repeat 5 --variants auto,inprocess,flower,torch --load idle \\
        --save bench/results/bench_default_flower.txt && python bench/tables.py --write
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(<!-- bench-table:([\w-]+) -->\n)(.*?)(^<!-- /bench-table:\2 -->)", re.S | re.M)
# bench.py's variants as the tables name them
VARIANT_NAMES = {
    "auto": "fedsim `auto` (default)",
    "auto-2threads": "fedsim `auto`, 2 threads",
    "inprocess": "fedsim `inprocess`",
    "inprocess-w2": "fedsim `inprocess`, 2 workers",
    "vectorized": "fedsim `vectorized`",
    "vectorized-allcores": "fedsim `vectorized`, every core",
    "ray": "fedsim `ray`",
    "flower": "vanilla Flower `run_simulation`, data cached per process",
    "torch": "plain torch loop, same SGD steps",
    "batched": "hand-batched torch limit (`batched`)",
}
BENCH_COLUMNS = (  # (heading, index of the value in a row of bench.py's table, format)
    ("wall s", 0, ".2f"),
    ("start-up s", 1, ".2f"),
    ("round s (2..R)", 3, ".3f"),
    ("peak MB", 4, ".0f"),
    ("accuracy", 5, ".4f"),
    ("torch/this (round)", 6, ".2f"),
    ("flower/this (wall)", 8, ".1f"),
)


def save(path: str | Path) -> None:
    """Also write everything this process prints to ``path`` (``bench.py --save``): a recorded output."""

    class Tee:
        def __init__(self, *streams) -> None:
            self.streams = streams

        def write(self, text: str) -> int:
            for s in self.streams:
                s.write(text)
            return len(text)

        def flush(self) -> None:
            for s in self.streams:
                s.flush()

    sys.stdout = Tee(sys.stdout, open(path, "w"))  # open until the process ends


def section(text: str, name: str | None) -> str:
    """The part of a recorded output under its ``## name`` line (the whole text when ``name`` is None)."""
    if name is None:
        return text
    start = text.index(f"## {name}\n") + len(f"## {name}\n")
    end = text.find("\n## ", start)
    return text[start : end if end >= 0 else len(text)]


@dataclass
class BenchRun:
    """One bench.py run as it printed it: the heading line, the rows and the goal lines."""

    heading: str
    rows: list[tuple[str, str, list[float | None]]]  # (scenario, variant, the table's nine numbers)
    goals: list[str]


def parse_bench(text: str) -> BenchRun:
    """bench.py's printed table (``format_rows``) read back: every number as printed, '-' as None."""
    lines = text.splitlines()
    top = next(i for i, ln in enumerate(lines) if ln.startswith("scenario "))
    heading = next(ln for ln in reversed(lines[:top]) if ln.strip() and not ln.startswith("#"))
    rows = []
    for ln in lines[top + 2 :]:
        parts = ln.split()
        if len(parts) != 11 or not re.fullmatch(r"[-\d.]+", parts[2]):
            break
        rows.append((parts[0], parts[1], [None if p == "-" else float(p) for p in parts[2:]]))
    goals = [ln for ln in lines[top:] if re.match(r"\([\w+-]+\) ", ln)]
    return BenchRun(heading.strip(), rows, goals)


def bench_table(source: str, name: str | None, scenario: str) -> str:
    """The markdown table of one scenario of a recorded bench.py run, with where it came from."""
    run = parse_bench(section((RESULTS / source).read_text(), name))
    head = ["variant", *(h for h, _, _ in BENCH_COLUMNS)]
    out = [
        f"From `bench/results/{source}`" + (f', run "{name}"' if name else "") + f": {run.heading}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for sc, variant, nums in run.rows:
        if sc != scenario:
            continue
        cells = ["–" if nums[i] is None else format(nums[i], fmt) for _, i, fmt in BENCH_COLUMNS]
        out.append(f"| {VARIANT_NAMES.get(variant, variant)} | " + " | ".join(cells) + " |")
    goals = [g.split(") ", 1)[1] for g in run.goals if g.startswith(f"({scenario}) ")]
    if goals:
        out += ["", *(f"- {g}" for g in goals)]
    return "\n".join(out)


GPU_VARIANTS = {
    "time-inprocess": "`engine=inprocess` (per client)",
    "time-vectorized": "`engine=vectorized` (one batched model)",
    "time-torch": "plain torch loop, same steps",
}
TARGET = re.compile(r"^\s+(.+?): (.+?)\s+([\d.]+) ms /\s+([\d.]+) ms =\s+([\d.]+)x(?: \((.*)\))?$")


def gpu_part(source: str, number: int) -> tuple[str, list[str]]:
    """The machine line and section ``number`` (its heading line first) of a recorded ``gpu_check.py`` output."""
    lines = (RESULTS / source).read_text().splitlines()
    machine = next(ln for ln in lines if ln.startswith("fedsim GPU check on "))
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"{number}. "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return machine, lines[start:end]


def gpu_agreement_table(source: str) -> str:
    """Section 1 of gpu_check.py: the engines' final models against each other, per check."""
    machine, lines = gpu_part(source, 1)
    out = [
        f"From `bench/results/{source}`: {machine}",
        "",
        "| check | max abs diff | bound (rtol = atol) | clients batched | |",
        "|---|---|---|---|---|",
    ]
    for ln in lines:
        m = re.match(
            r"\s+(\S+)\s+max abs diff (\S+) \(rtol = atol = (\S+)\), batched (\S+) clients: (\w+)", ln
        )
        if m:
            out.append("| " + " | ".join(m.groups()) + " |")
    return "\n".join(out)


def gpu_timing_table(source: str) -> str:
    """Section 3 of gpu_check.py: seconds per round, GPU use and memory of each variant."""
    machine, lines = gpu_part(source, 3)
    title, head, rows = lines[0].split(". ", 1)[1], lines[1], lines[2:]
    busy = ["GPU busy", "GPU busy during rounds"] if "in rounds" in head else ["GPU busy"]
    out = [
        f"From `bench/results/{source}`: {machine}; {title}",
        "",
        "| variant | s per round | plain torch / this | "
        + " | ".join(busy)
        + " | GPU memory | peak RSS | batched |",
        "|" + "---|" * (6 + len(busy)),
    ]
    for ln in rows:
        cells, gpu_mb = ln[: ln.index("{")].split(), ln[ln.index("{") :]
        name, rnd, ratio, *rest = cells
        pct, (rss, batched) = rest[: len(busy)], rest[len(busy) :]
        total_mb = sum(float(v) for v in re.findall(r": ([\d.]+)", gpu_mb))
        out.append(
            f"| {GPU_VARIANTS.get(name, name)} | {rnd} | {ratio} | "
            + " | ".join(p.replace("%", " %") for p in pct)
            + f" | {total_mb / 1000:.1f} GB | {float(rss) / 1000:.1f} GB | {batched} |"
        )
    return "\n".join(out)


def gpu_targets_table(source: str) -> str:
    """Section 4 of gpu_check.py: fedsim's round against the batched limits measured in the same run."""
    machine, lines = gpu_part(source, 4)
    out = [
        f"From `bench/results/{source}`: {machine}",
        "",
        "| CIFAR-size CNN | a / b | a | b | a / b | goal |",
        "|---|---|---|---|---|---|",
    ]
    for ln in lines:
        m = TARGET.match(ln)
        if m:
            what, compared, mine, limit, ratio, goal = m.groups()
            out.append(
                f"| {what} | {compared} | {float(mine):,.0f} ms | {float(limit):,.0f} ms | {ratio}x | {goal or '–'} |"
            )
    return "\n".join(out)


ASYNC_NAMES = {"fedavg": "FedAvg (sync)", "fedasync": "FedAsync", "fedbuff": "FedBuff"}


def async_table(source: str) -> str:
    """``bench/async_vs_sync.py``'s report: simulated seconds to the target per seed, the mean, against FedAvg."""
    text = (RESULTS / source).read_text()
    times: dict[str, dict[int, str]] = {}
    for name, seed, sim_s in re.findall(r"^(\w+)\s+(\d+)\s+(\S+)\s+\d+$", text, re.M):
        times.setdefault(name, {})[int(seed)] = "not reached" if sim_s == "None" else f"{float(sim_s):.2f}"
    means = {n: float(m) for n, m in re.findall(r"^mean (\w+)\s+(\S+) s", text, re.M)}
    seeds = sorted({s for per in times.values() for s in per})
    comments = [ln[2:] for ln in text.splitlines() if ln.startswith("# ")]
    out = [f"From `bench/results/{source}`: " + " ".join(comments), ""]
    out += [
        "| strategy | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | mean simulated s to target | vs FedAvg |"
    ]
    out += ["|" + "---|" * (len(seeds) + 3)]
    for name, per in times.items():
        m, base = means[name], means.get("fedavg")
        vs = "1.00×" if name == "fedavg" else f"{base / m:.2f}× sooner" if base and m < float("inf") else "–"
        cells = [per.get(s, "–") for s in seeds]
        out.append(f"| {ASYNC_NAMES.get(name, name)} | " + " | ".join(cells) + f" | {m:.2f} | {vs} |")
    return "\n".join(out)


# table name -> what writes it (each reads only files committed under bench/results/)
TABLES: dict[str, Callable[[], str]] = {
    "default-idle": lambda: bench_table("bench_default_cpu_clock_stacked.txt", "after (3)", "default"),
    "default-busy": lambda: bench_table("bench_default_cpu_clock_stacked.txt", "after (3)", "default+busy"),
    "default-variants": lambda: bench_table("bench_default_cpu_clock.txt", None, "default"),
    "async-vs-sync": lambda: async_table("async_vs_sync.txt"),
    "gpu-agreement": lambda: gpu_agreement_table("gpu_check_h200.txt"),
    "gpu-timing": lambda: gpu_timing_table("gpu_timing_h200.txt"),
    "gpu-targets": lambda: gpu_targets_table("gpu_targets_h200.txt"),
}


def blocks(text: str) -> dict[str, str]:
    return {m.group(2): m.group(3) for m in BLOCK.finditer(text)}


def write_or_check(docs: list[Path], check: bool) -> int:
    """Rewrite (or compare) every table of ``docs``; 1 when one differs, is unknown or has no markers."""
    status, seen = 0, set()
    for doc in docs:
        text = doc.read_text()
        found = blocks(text)
        unknown = sorted(set(found) - set(TABLES))
        if unknown:
            print(f"tables: {doc.name}: no generator for {', '.join(unknown)}", file=sys.stderr)
            status = 1
        new = {n: TABLES[n]() + "\n" for n in found if n in TABLES}
        seen |= set(new)
        if check:
            for n, table in new.items():
                if found[n] != table:
                    status = 1
                    diff = difflib.unified_diff(
                        found[n].splitlines(),
                        table.splitlines(),
                        f"{doc.name} ({n})",
                        "generated",
                        lineterm="",
                    )
                    print("\n".join(diff))
        else:
            updated = BLOCK.sub(
                lambda m, new=new: m.group(1) + new.get(m.group(2), m.group(3)) + m.group(4), text
            )
            if updated != text:
                doc.write_text(updated)
                print(f"tables: wrote {len(new)} table(s) in {doc}")
    for n in sorted(set(TABLES) - seen):
        print(f"tables: no page holds <!-- bench-table:{n} -->", file=sys.stderr)
        status = 1
    if check:
        print(
            f"tables: {len(seen)} table(s) "
            + ("differ from their results" if status else "match their results")
        )
    return status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the tables between their markers")
    mode.add_argument("--check", action="store_true", help="exit 1 with a diff when a table differs")
    ap.add_argument("--doc", type=Path, action="append", help="pages to read (default: every docs/*.md)")
    a = ap.parse_args()
    sys.exit(write_or_check(a.doc or sorted(DOCS.rglob("*.md")), a.check))


if __name__ == "__main__":
    main()
