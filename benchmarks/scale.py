"""Scale benchmark (issue 10): GPT with 2..48 layers on 8, 16 and 64 mixed V100/P100 devices.

Each case runs in a fresh process: trace ``gpt --layers L`` for the cluster, then ``hapnb.synthesize`` (the
same call as ``hapnb plan``) and records ``synthesis_s`` (graph -> final plan, tracing excluded, as
``hapnb plan --json`` reports it), the process's peak RSS after tracing and after synthesis, whether the
plan fits every device's memory, whether memory bound (the search had to keep to memory), the cost and
whether every search proved optimality. ``--command`` also times the whole ``hapnb plan --json`` command
for GPT-48 on 16xV100+48xP100 with ``/usr/bin/time -v`` (wall time and peak RSS). ``--unchanged`` checks
that plans that fit are unchanged by memory: every zoo model at its default size on the paper clusters,
synthesized with and without memory constraints, has the same program, ratios and cost.

Writes ``docs/benchmarks/benchmarks-scale.json`` and rewrites the scale section of ``docs/benchmarks/index.md``.

    python benchmarks/scale.py [--quick] [--command] [--unchanged] [--out docs/benchmarks/benchmarks-scale.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

CLUSTERS = ("2xV100+6xP100", "4xV100+12xP100", "16xV100+48xP100")
LAYERS = (2, 4, 8, 16, 24, 32, 48)
ROOT = Path(__file__).resolve().parents[1]


def one(model: str, layers: int, spec: str) -> dict:
    """One case in this process (``--one``): trace, synthesize, report."""
    import hapnb
    from hapnb.hardware.cluster import Cluster
    from hapnb.tracing import resolve_model

    c = Cluster.resolve(spec)
    t0 = time.perf_counter()
    g, _ = resolve_model(model, c, layers=layers)
    trace_s = time.perf_counter() - t0
    rss_trace = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"model": model, "layers": layers, "cluster": spec, "devices": c.n, "trace_s": trace_s}
    try:
        plan = hapnb.synthesize(g, c)
    except hapnb.OutOfMemoryError as e:
        out.update(fits=False, error=str(e)[:300])
    else:
        st = plan.stats
        caps = [d.memory_bytes / d.gpus for d in c.devices]
        out.update(
            synthesis_s=plan.synthesis_s,
            fits=all(m <= cap for m, cap in zip(plan.memory_bytes, caps)),
            memory_bound=bool(st.get("memory_bound")),
            zero_params=sum(1 for i in plan.program if i.kind == "load" and i.name.startswith("load_zero")),
            cost_s=plan.cost_s,
            optimal=bool(st.get("optimal")),
            expansions=st.get("expansions", 0),
            iterations=len(plan.history),
            peak_memory_fraction=max(m / cap for m, cap in zip(plan.memory_bytes, caps)),
        )
    out["rss_after_trace_bytes"] = rss_trace
    out["rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def run_case(model: str, layers: int, spec: str) -> dict:
    cmd = [sys.executable, __file__, "--one", model, str(layers), spec]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if res.returncode != 0:
        return {"model": model, "layers": layers, "cluster": spec, "error": res.stderr.strip()[-400:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def command() -> dict:
    """The whole ``hapnb plan --json`` command for GPT-48 on 16xV100+48xP100 (wall time, peak RSS)."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "hapnb", "plan", "--model", "gpt", "--layers", "48",
           "--cluster", "16xV100+48xP100", "--json", "--no-baselines"]  # fmt: skip
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    wall = time.perf_counter() - t0
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr)
    # the interpreter as the reader would type it (relative to the repository; no path of this machine)
    exe = Path(sys.executable)
    shown = os.path.relpath(exe, ROOT) if exe.is_relative_to(ROOT) else "python"
    out = {"command": " ".join([shown, *cmd[3:]]), "wall_s": wall, "returncode": res.returncode}
    if rss:
        out["rss_bytes"] = int(rss.group(1)) * 1024
    if res.returncode == 0:
        js = json.loads(res.stdout.strip().splitlines()[-1])
        out.update(
            synthesis_s=js["synthesis_s"], cost_s=js["cost_s"], memory_bytes_max=max(js["memory_bytes"])
        )
    else:
        out["error"] = res.stderr.strip()[-400:]
    return out


def unchanged() -> list[dict]:
    """Zoo models at their default sizes on the paper clusters: the plan with and without memory."""
    import hapnb
    from hapnb.hardware.cluster import Cluster
    from hapnb.tracing import resolve_model

    rows = []
    for spec in ("paper-hetero-8", "2xV100+2xP100"):
        c = Cluster.resolve(spec)
        for name in ("mlp", "vgg19", "vit", "bert", "bert-moe", "gpt"):
            g, _ = resolve_model(name, c)
            on, off = hapnb.synthesize(g, c), hapnb.synthesize(g, c, check_memory=False)
            same = (on.program, on.ratios, on.cost_s) == (off.program, off.ratios, off.cost_s)
            rows.append({"model": name, "cluster": spec, "identical": same, "memory_bound": bool(on.stats.get("memory_bound"))})  # fmt: skip
            print(f"  {name:9s} {spec:15s} identical={same}", flush=True)
    return rows


def table(cases: list[dict]) -> str:
    lines = [
        "| layers | devices | synthesis s | RSS after trace (GiB) | peak RSS (GiB) | fits | memory bound | ZeRO params "
        "| optimal | cost s |",
        "|---:|---:|---:|---:|---:|:---:|:---:|---:|:---:|---:|",
    ]
    for r in cases:
        if "synthesis_s" not in r:
            lines.append(
                f"| {r['layers']} | {r.get('devices', '?')} | — | | | no | | | | {r.get('error', '')[:60]} |"
            )
            continue
        lines.append(
            f"| {r['layers']} | {r['devices']} | {r['synthesis_s']:.2f} | {r['rss_after_trace_bytes'] / 2**30:.2f} "
            f"| {r['rss_bytes'] / 2**30:.2f} | {'yes' if r['fits'] else 'no'} | {'yes' if r['memory_bound'] else 'no'} "
            f"| {r['zero_params']} | {'yes' if r['optimal'] else 'no'} | {r['cost_s']:.4g} |"
        )
    return "\n".join(lines)


def write_docs(data: dict) -> None:
    md = ROOT / "docs" / "benchmarks" / "index.md"
    text = md.read_text()
    body = [
        "<!-- scale:begin (benchmarks/scale.py writes this section) -->",
        "## Scale: GPT layers x devices, memory-aware synthesis",
        "",
        f"`python benchmarks/scale.py{' --command' if data.get('command') else ''}"
        f"{' --unchanged' if data.get('unchanged') else ''}`, {data['date']}, load average {data['loadavg']} "
        f"on {data['cpus']} CPUs. Fresh process per case; synthesis = graph -> final plan (tracing excluded); RSS "
        "is the process's peak after tracing and after synthesis (the traced model's weights dominate the first).",
        "",
        table(data["cases"]),
    ]
    if data.get("command"):
        cm = data["command"]
        body += [
            "",
            f"Whole command `{cm['command']}`: {cm['wall_s']:.1f} s wall, peak RSS "
            f"{cm.get('rss_bytes', 0) / 2**30:.2f} GiB, synthesis {cm.get('synthesis_s', float('nan')):.2f} s.",
        ]
    if data.get("unchanged"):
        ok = sum(r["identical"] for r in data["unchanged"])
        body += [
            "",
            f"Plans that fit are unchanged by memory: {ok} of {len(data['unchanged'])} zoo models at their default "
            "sizes on paper-hetero-8 and 2xV100+2xP100 have the same program, ratios and cost with memory "
            "constraints on and off.",
        ]
    body.append("<!-- scale:end -->")
    section = "\n".join(body)
    pat = re.compile(r"<!-- scale:begin.*?<!-- scale:end -->", re.S)
    text = pat.sub(section, text) if pat.search(text) else text.rstrip() + "\n\n" + section + "\n"
    md.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "LAYERS", "CLUSTER"), help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="2, 8 and 48 layers on 8 and 64 devices")
    ap.add_argument("--command", action="store_true", help="also time the whole hapnb plan command (GPT-48)")
    ap.add_argument("--unchanged", action="store_true", help="also check zoo plans are unchanged by memory")
    ap.add_argument("--out", default="docs/benchmarks/benchmarks-scale.json")
    ns = ap.parse_args()
    if ns.one:
        print(json.dumps(one(ns.one[0], int(ns.one[1]), ns.one[2])))
        return
    layers = (2, 8, 48) if ns.quick else LAYERS
    clusters = (CLUSTERS[0], CLUSTERS[2]) if ns.quick else CLUSTERS
    cases = []
    for spec in clusters:
        for n in layers:
            r = run_case("gpt", n, spec)
            cases.append(r)
            print(f"gpt-{n:2d} on {spec:16s} " + json.dumps({k: r.get(k) for k in ("synthesis_s", "fits", "memory_bound", "rss_bytes", "error")}), flush=True)  # fmt: skip
    data = {
        "date": time.strftime("%Y-%m-%d"),
        "loadavg": " ".join(Path("/proc/loadavg").read_text().split()[:3])
        if Path("/proc/loadavg").exists()
        else "",
        "cpus": os.cpu_count(),
        "cases": cases,
    }
    if ns.command:
        data["command"] = command()
        print("command:", json.dumps(data["command"]), flush=True)
    if ns.unchanged:
        data["unchanged"] = unchanged()
    Path(ROOT / ns.out).write_text(json.dumps(data, indent=1) + "\n")
    write_docs(data)
    print(table(cases))


if __name__ == "__main__":
    main()
