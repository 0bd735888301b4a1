#!/usr/bin/env python3
"""Published measured training step times against `piper simulate --engine analytic`.

Reads steptimes.json (each case: source, URL, verbatim quote, the setting as piper flags, the measured
step time and how it was derived), simulates every case, and writes steptimes.csv, steptimes.md and
steptimes.svg (predicted against measured on log axes). Python 3 standard library only.

  python3 experiments/fidelity/steptimes.py            # all cases, outputs next to this script
  python3 experiments/fidelity/steptimes.py --check    # schema of every case + 3 cases simulated (CI)

The piper binary is $PIPER (default build/bin/piper from the repository root). Error = (predicted -
measured) / measured: negative means Piper predicts a step faster than was measured.
"""
import argparse
import concurrent.futures
import csv
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PRESET_CLUSTERS = {"dgx-a100-80g", "dgx-h100", "dgx-h200", "hgx-h800"}
REQUIRED = {  # field -> type
    "id": str, "source": str, "url": str, "quote": str, "model": str, "gpu": str, "cluster": str, "gpus": int,
    "flags": list, "family": str, "runtime": str, "measured": dict, "measured_step_s": (int, float), "conversion": str,
    "notes": str}
OPTIONAL = {"repo", "commit", "path", "text_of", "quote_context", "measured_peak_gib", "measured_peak_kind",
            "attention_kernel"}
# What a published peak counts: "allocated" (live tensors, what Piper predicts) or "reserved" (the caching
# allocator's reserved peak, torch.cuda's reserved_bytes.all.peak: allocated plus cached, fragmented blocks).
# "unstated": the source prints a peak without saying which of the two.
PEAK_KINDS = {"allocated", "reserved", "unstated"}


class CaseError(Exception):
    pass


# The case's runtime as the cluster's runtime profile (docs/cost-model.md): PyTorch eager launches
# its element-wise ops one by one; torch.compile and Megatron-LM fuse them.
PROFILE_OF_RUNTIME = {"eager": "eager", "eager-fused-loss": "eager-fused-loss", "eager-unfused-norm": "eager-unfused-norm",
                      "torch.compile": "fused", "megatron": "fused"}

def fail(msg):
    print(f"steptimes: {msg}", file=sys.stderr)
    sys.exit(2)


def load_cases(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        fail(f"{path}: cannot read ({e.strerror})")
    except json.JSONDecodeError as e:
        fail(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}")
    if not isinstance(doc, dict) or doc.get("format") != "piper-fidelity-steptimes":
        fail(f"{path}: 'format' must be \"piper-fidelity-steptimes\"")
    cases = doc.get("cases")
    if not isinstance(cases, list) or not cases:
        fail(f"{path}: 'cases' must be a non-empty list")
    return cases


def flag_value(flags, name, default=None):
    for i, f in enumerate(flags):
        if f == name:
            return flags[i + 1] if i + 1 < len(flags) else None
    return default


def validate(cases, path, zoo):
    """Every problem as one line naming the case and field; empty when the file is sound."""
    errors, seen = [], set()
    for k, c in enumerate(cases):
        where = f"{path}: case {k}"
        if not isinstance(c, dict):
            errors.append(f"{where}: expected an object")
            continue
        if isinstance(c.get("id"), str):
            where = f"{path}: case '{c['id']}'"
        for field, typ in REQUIRED.items():
            if field not in c:
                errors.append(f"{where}: missing '{field}'")
            elif not isinstance(c[field], typ) or isinstance(c[field], bool):
                errors.append(f"{where}: '{field}' has the wrong type")
            elif isinstance(c[field], str) and not c[field].strip():
                errors.append(f"{where}: '{field}' is empty")
        for field in c:
            if field not in REQUIRED and field not in OPTIONAL:
                errors.append(f"{where}: unknown field '{field}'")
        if any(e.startswith(where + ":") for e in errors):
            continue
        if c["id"] in seen:
            errors.append(f"{where}: duplicate id")
        seen.add(c["id"])
        if not c["url"].startswith("https://"):
            errors.append(f"{where}: 'url' must be an https:// address")
        m = c["measured"]
        if not isinstance(m.get("value"), (int, float)) or isinstance(m.get("value"), bool) or m["value"] <= 0:
            errors.append(f"{where}: 'measured.value' must be a positive number")
        if not isinstance(m.get("unit"), str) or not m["unit"].strip():
            errors.append(f"{where}: 'measured.unit' missing")
        if not c["measured_step_s"] > 0 or not math.isfinite(c["measured_step_s"]):
            errors.append(f"{where}: 'measured_step_s' must be a positive number")
        peak = c.get("measured_peak_gib")
        if peak is not None and (not isinstance(peak, (int, float)) or isinstance(peak, bool) or not peak > 0):
            errors.append(f"{where}: 'measured_peak_gib' must be a positive number")
        if peak is not None and c.get("measured_peak_kind") not in PEAK_KINDS:
            errors.append(f"{where}: 'measured_peak_kind' must be one of {sorted(PEAK_KINDS)} where 'measured_peak_gib' is given")
        flags = c["flags"]
        if not flags or not all(isinstance(f, str) for f in flags):
            errors.append(f"{where}: 'flags' must be a non-empty list of strings")
            continue
        for banned in ("--model", "--cluster", "--engine", "--report", "--plan"):
            if banned in flags:
                errors.append(f"{where}: 'flags' must not contain {banned} (the script sets it)")
        degrees = 1
        for name in ("--pp", "--dp", "--tp", "--cp"):
            v = flag_value(flags, name, "1")
            if v is None or not v.isdigit() or int(v) < 1:
                errors.append(f"{where}: {name} needs a positive integer")
                break
            degrees *= int(v)
        else:
            if degrees != c["gpus"]:
                errors.append(f"{where}: pp x dp x tp x cp = {degrees} but 'gpus' is {c['gpus']}")
        if c["model"] not in zoo and not os.path.isfile(os.path.join(REPO, c["model"])):
            errors.append(f"{where}: 'model' {c['model']} is neither a zoo model nor a file under the repository")
        if c["cluster"] not in PRESET_CLUSTERS and not os.path.isfile(os.path.join(REPO, c["cluster"])):
            errors.append(f"{where}: 'cluster' {c['cluster']} is neither a preset nor a file under the repository")
        if c["runtime"] not in PROFILE_OF_RUNTIME:
            errors.append(f"{where}: 'runtime' {c['runtime']} is not one of {', '.join(sorted(PROFILE_OF_RUNTIME))}")
        kernel = c.get("attention_kernel")
        if kernel is not None and (not isinstance(kernel, str) or not kernel.strip()):
            errors.append(f"{where}: 'attention_kernel' must be a kernel name of the GPU's table (e.g. \"fa2\")")
    return errors


def zoo_names(piper):
    try:
        out = subprocess.run([piper, "models"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        fail(f"cannot run {piper} ({e.strerror}); build it first (cmake --build build --target piper) or set PIPER")
    if out.returncode != 0:
        fail(f"'{piper} models' failed: {out.stderr.strip()}")
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def resolve(path_or_name, known):
    return path_or_name if path_or_name in known else os.path.join(REPO, path_or_name)


def cluster_with_profile(case, workdir):
    """A cluster file: the case's cluster with "runtime" set from the case's runtime label and, where the case
    names one, the attention implementation the source ran ("attention_kernel", docs/cost-model.md)."""
    name = case["cluster"]
    if name in PRESET_CLUSTERS:
        spec = {"preset": name}
    else:
        with open(os.path.join(REPO, name)) as f:
            spec = json.load(f)
        # The copy lives elsewhere: a kernel table file named beside the cluster file goes by its full path.
        gpu = spec.get("node", {}).get("gpu", {})
        table = gpu.get("kernel_table", "")
        beside = os.path.join(REPO, os.path.dirname(name), table)
        if table and not os.path.isabs(table) and os.path.isfile(beside):
            gpu["kernel_table"] = beside
    spec["runtime"] = PROFILE_OF_RUNTIME[case["runtime"]]
    if "attention_kernel" in case:
        spec["attention_kernel"] = case["attention_kernel"]
    path = os.path.join(workdir, case["id"] + "-cluster.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def simulate(piper, case, zoo, workdir):
    report = os.path.join(workdir, case["id"] + ".json")
    cmd = [piper, "simulate", "--model", resolve(case["model"], zoo), "--cluster", cluster_with_profile(case, workdir),
           "--engine", "analytic", "--report", report] + case["flags"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise CaseError(f"case '{case['id']}': piper simulate exited {out.returncode}: {last}")
    try:
        with open(report) as f:
            r = json.load(f)
        step = float(r["step_time_s"])
    except (OSError, ValueError, KeyError) as e:
        raise CaseError(f"case '{case['id']}': unreadable report {report} ({e})")
    if not step > 0 or not math.isfinite(step):
        raise CaseError(f"case '{case['id']}': step time {step} is not a positive number")
    return {"predicted_s": step, "oom": bool(r.get("oom", False)),
            "peak_gib": float(r.get("peak_memory_bytes", 0)) / 2**30}


def run_all(piper, cases, zoo, jobs):
    results = {}
    with tempfile.TemporaryDirectory(prefix="piper-steptimes-") as tmp:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(simulate, piper, c, zoo, tmp): c["id"] for c in cases}
            errors = []
            for fut in concurrent.futures.as_completed(futures):
                try:
                    results[futures[fut]] = fut.result()
                except CaseError as e:
                    errors.append(str(e))
    if errors:
        for e in sorted(errors):
            print(f"steptimes: {e}", file=sys.stderr)
        sys.exit(1)
    return results


def short_source(c):
    s = c["source"]
    for key, short in (("MosaicML", "MosaicML llm-foundry"), ("TorchTitan", "TorchTitan"), ("BigScience", "BigScience BLOOM"),
                       ("Megatron-Turing", "MT-NLG"), ("Zero Bubble", "Zero Bubble PP (Qi et al.)"),
                       ("Megatron-Bridge", "NVIDIA Megatron-Bridge")):
        if key in s:
            return short
    return s.split(",")[0]


def rows_of(cases, results):
    rows = []
    for c in cases:
        r = results[c["id"]]
        err = 100.0 * (r["predicted_s"] - c["measured_step_s"]) / c["measured_step_s"]
        rows.append({"id": c["id"], "source": short_source(c), "gpu": c["gpu"], "family": c["family"], "runtime": c["runtime"],
                     "recompute": flag_value(c["flags"], "--recompute", "none"),
                     "gpus": c["gpus"], "measured_s": c["measured_step_s"], "predicted_s": r["predicted_s"], "error_pct": err,
                     "oom": r["oom"], "peak_gib": r["peak_gib"], "measured_peak_gib": c.get("measured_peak_gib"),
                     "measured_peak_kind": c.get("measured_peak_kind", "")})
    return rows


def stats(rows):
    errs = [r["error_pct"] for r in rows]
    n = len(errs)
    worst = max(rows, key=lambda r: abs(r["error_pct"]))
    return {"n": n, "mean_abs": sum(abs(e) for e in errs) / n, "max_abs": abs(worst["error_pct"]), "worst": worst["id"],
            "signed": sum(errs) / n, "too_fast": sum(1 for e in errs if e < 0), "oom": sum(1 for r in rows if r["oom"])}


def group_table(rows, key, title):
    groups = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    out = [f"| {title} | cases | mean abs error | max abs error | signed mean | too fast | predicted OOM |",
           "|---|---|---|---|---|---|---|"]
    for name in sorted(groups):
        s = stats(groups[name])
        out.append(f"| {name} | {s['n']} | {s['mean_abs']:.1f} % | {s['max_abs']:.1f} % | {s['signed']:+.1f} % | "
                   f"{s['too_fast']} of {s['n']} | {s['oom']} |")
    return out


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["id", "source", "gpu", "family", "runtime", "gpus", "measured_s", "predicted_s", "error_pct", "oom", "peak_gib",
                    "measured_peak_gib"])
        for r in rows:
            mp = r.get("measured_peak_gib")
            w.writerow([r["id"], r["source"], r["gpu"], r["family"], r["runtime"], r["gpus"], f"{r['measured_s']:.6g}",
                        f"{r['predicted_s']:.6g}", f"{r['error_pct']:.2f}", "yes" if r["oom"] else "no", f"{r['peak_gib']:.2f}",
                        "" if mp is None else f"{mp:g}"])


def write_md(path, rows, piper_version):
    s = stats(rows)
    lines = ["# Published step times against `piper simulate --engine analytic`", "",
             f"Generated by `python3 experiments/fidelity/steptimes.py` ({piper_version}). Cases, quotes and settings: "
             "[`steptimes.json`](steptimes.json); plot: [`steptimes.svg`](steptimes.svg). Error = (predicted - measured) / "
             "measured; negative = Piper too fast.", "",
             f"**All {s['n']} cases:** mean |error| {s['mean_abs']:.1f} %, max |error| {s['max_abs']:.1f} % ({s['worst']}), "
             f"signed mean {s['signed']:+.1f} %, {s['too_fast']} of {s['n']} too fast, {s['oom']} predicted out of memory.", ""]
    for key, title in (("gpu", "GPU"), ("family", "strategy family"), ("source", "source"), ("runtime", "runtime"),
                       ("recompute", "recomputation")):
        lines += [f"## By {title}", ""] + group_table(rows, key, title) + [""]
    mem = [r for r in rows if r.get("measured_peak_gib")]
    if mem:
        lines += ["## Peak memory, where published", "",
                  "Piper predicts the peak of live (allocated) bytes; a `reserved` figure is the caching allocator's reserved "
                  "peak, which adds cached and fragmented blocks, so a prediction below it is expected by that margin; an "
                  "`unstated` one may be either.", "",
                  "| id | published GiB | published kind | predicted GiB (allocated) | error | predicted OOM |",
                  "|---|---|---|---|---|---|"]
        by_kind = {}
        for r in mem:
            e = 100.0 * (r["peak_gib"] - r["measured_peak_gib"]) / r["measured_peak_gib"]
            by_kind.setdefault(r["measured_peak_kind"], []).append(e)
            lines.append(f"| {r['id']} | {r['measured_peak_gib']:g} | {r['measured_peak_kind']} | {r['peak_gib']:.1f} | {e:+.1f} % | "
                         f"{'yes' if r['oom'] else 'no'} |")
        lines.append("")
        for kind, errs in sorted(by_kind.items()):
            lines.append(f"Against the {len(errs)} `{kind}` figures: mean |error| {sum(map(abs, errs)) / len(errs):.1f} %, "
                         f"signed mean {sum(errs) / len(errs):+.1f} %.")
        lines.append("")
    lines += ["## Cases", "", "| id | source | GPU | family | GPUs | measured s | predicted s | error | OOM |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['id']} | {r['source']} | {r['gpu']} | {r['family']} | {r['gpus']} | {r['measured_s']:.4g} | "
                     f"{r['predicted_s']:.4g} | {r['error_pct']:+.1f} % | {'yes' if r['oom'] else 'no'} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_svg(path, rows):
    """Predicted against measured, both log10, with the y = x line and +-25 % bands."""
    W, H, L, R, T, B = 720, 560, 80, 200, 40, 60
    vals = [r["measured_s"] for r in rows] + [r["predicted_s"] for r in rows]
    lo = 10 ** math.floor(math.log10(min(vals)))
    hi = 10 ** math.ceil(math.log10(max(vals)))
    lx0, lx1 = math.log10(lo), math.log10(hi)

    def px(v):
        return L + (math.log10(v) - lx0) / (lx1 - lx0) * (W - L - R)

    def py(v):
        return H - B - (math.log10(v) - lx0) / (lx1 - lx0) * (H - T - B)

    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
    families = sorted({r["family"] for r in rows})
    shapes = {}
    for g in sorted({r["gpu"] for r in rows}):
        shapes[g] = ["circle", "square", "triangle", "diamond"][len(shapes) % 4]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{(W - R + L) / 2}" y="22" text-anchor="middle" font-size="14">Published step times: Piper (analytic) '
           f'against measured, {len(rows)} cases</text>']
    decade = lo
    while decade <= hi * 1.0001:
        for m in range(1, 10):
            v = decade * m
            if v > hi * 1.0001:
                break
            op = "0.35" if m == 1 else "0.12"
            out.append(f'<line x1="{px(v):.1f}" y1="{T}" x2="{px(v):.1f}" y2="{H - B}" stroke="black" stroke-opacity="{op}"/>')
            out.append(f'<line x1="{L}" y1="{py(v):.1f}" x2="{W - R}" y2="{py(v):.1f}" stroke="black" stroke-opacity="{op}"/>')
        out.append(f'<text x="{px(decade):.1f}" y="{H - B + 16}" text-anchor="middle">{decade:g}</text>')
        out.append(f'<text x="{L - 6}" y="{py(decade) + 4:.1f}" text-anchor="end">{decade:g}</text>')
        decade *= 10
    out.append(f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="black"/>')
    out.append(f'<line x1="{px(lo):.1f}" y1="{py(lo):.1f}" x2="{px(hi):.1f}" y2="{py(hi):.1f}" stroke="black"/>')
    for f in (0.75, 1.25):
        a, b = max(lo, lo / f), min(hi, hi / f)
        out.append(f'<line x1="{px(a):.1f}" y1="{py(a * f):.1f}" x2="{px(b):.1f}" y2="{py(b * f):.1f}" stroke="black" '
                   f'stroke-dasharray="4 4" stroke-opacity="0.6"/>')
    out.append(f'<text x="{(W - R + L) / 2}" y="{H - 18}" text-anchor="middle">measured step time (s, log)</text>')
    out.append(f'<text x="18" y="{(H - B + T) / 2}" text-anchor="middle" transform="rotate(-90 18 {(H - B + T) / 2})">'
               f'predicted step time (s, log)</text>')

    def marker(shape, x, y, colour):
        if shape == "circle":
            return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="{colour}" fill-opacity="0.75"/>'
        if shape == "square":
            return f'<rect x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="{colour}" fill-opacity="0.75"/>'
        if shape == "triangle":
            return f'<polygon points="{x:.1f},{y - 5:.1f} {x - 5:.1f},{y + 4:.1f} {x + 5:.1f},{y + 4:.1f}" fill="{colour}" fill-opacity="0.75"/>'
        return f'<polygon points="{x:.1f},{y - 5:.1f} {x + 5:.1f},{y:.1f} {x:.1f},{y + 5:.1f} {x - 5:.1f},{y:.1f}" fill="{colour}" fill-opacity="0.75"/>'

    for r in rows:
        colour = colours[families.index(r["family"]) % len(colours)]
        out.append(f'<g><title>{r["id"]}: measured {r["measured_s"]:.4g} s, predicted {r["predicted_s"]:.4g} s '
                   f'({r["error_pct"]:+.1f} %)</title>{marker(shapes[r["gpu"]], px(r["measured_s"]), py(r["predicted_s"]), colour)}</g>')
    y = T + 10
    out.append(f'<text x="{W - R + 14}" y="{y}" font-weight="bold">strategy family</text>')
    for i, fam in enumerate(families):
        y += 18
        out.append(marker("circle", W - R + 20, y - 4, colours[i % len(colours)]))
        out.append(f'<text x="{W - R + 30}" y="{y}">{fam}</text>')
    y += 28
    out.append(f'<text x="{W - R + 14}" y="{y}" font-weight="bold">GPU</text>')
    for g, shape in shapes.items():
        y += 18
        out.append(marker(shape, W - R + 20, y - 4, "#555555"))
        out.append(f'<text x="{W - R + 30}" y="{y}">{g}</text>')
    y += 28
    out.append(f'<text x="{W - R + 14}" y="{y}">solid: predicted = measured</text>')
    out.append(f'<text x="{W - R + 14}" y="{y + 16}">dashed: +-25 %</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def replace_atomically(files):
    """files: {final path: temp path}; all temps exist, so the outputs change together."""
    for final, tmp in files.items():
        os.replace(tmp, final)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=os.path.join(HERE, "steptimes.json"), help="case file (default: steptimes.json here)")
    ap.add_argument("--out", default=HERE, help="folder for steptimes.csv/.md/.svg (default: this script's folder)")
    ap.add_argument("--only", default="", help="comma-separated case ids to run (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="simulations in parallel (default 2)")
    ap.add_argument("--check", action="store_true",
                    help="validate every case, then simulate 3 of them (the 3 smallest GPU counts); writes nothing")
    args = ap.parse_args()
    piper = os.environ.get("PIPER") or os.path.join(REPO, "build", "bin", "piper")
    if not os.access(piper, os.X_OK):
        fail(f"{piper} not found or not executable; build it first (cmake --build build --target piper) or set PIPER")
    if args.jobs < 1:
        fail("--jobs must be >= 1")
    cases = load_cases(args.cases)
    zoo = zoo_names(piper)
    errors = validate(cases, args.cases, zoo)
    if errors:
        for e in errors:
            print(f"steptimes: {e}", file=sys.stderr)
        sys.exit(2)
    if args.only:
        want = [s for s in args.only.split(",") if s]
        unknown = [w for w in want if w not in {c["id"] for c in cases}]
        if unknown:
            fail(f"--only: unknown case id(s) {', '.join(unknown)}")
        cases = [c for c in cases if c["id"] in want]
    if args.check:
        picked = sorted(cases, key=lambda c: (c["gpus"], c["id"]))[:3]
        results = run_all(piper, picked, zoo, args.jobs)
        for c in picked:
            r = results[c["id"]]
            print(f"{c['id']}: measured {c['measured_step_s']:.4g} s, predicted {r['predicted_s']:.4g} s")
        print(f"steptimes --check: {len(cases)} cases valid; {len(picked)} simulated")
        return
    results = run_all(piper, cases, zoo, args.jobs)
    rows = rows_of(cases, results)
    commit = subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    version = f"repository at {commit}" if commit else "piper"
    os.makedirs(args.out, exist_ok=True)
    final = {os.path.join(args.out, n): os.path.join(args.out, f".{n}.tmp") for n in ("steptimes.csv", "steptimes.md", "steptimes.svg")}
    paths = list(final.values())
    write_csv(paths[0], rows)
    write_md(paths[1], rows, version)
    write_svg(paths[2], rows)
    replace_atomically(final)
    s = stats(rows)
    print(f"steptimes: {s['n']} cases: mean |error| {s['mean_abs']:.1f} %, max {s['max_abs']:.1f} % ({s['worst']}), "
          f"signed mean {s['signed']:+.1f} %, {s['too_fast']} too fast, {s['oom']} predicted OOM")


if __name__ == "__main__":
    main()
