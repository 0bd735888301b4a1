#!/usr/bin/env python3
"""Piper's tokens/s on dense-1b as a ratio of PyTorch's, eager and torch.compile, in one line each.

Reads the log of bench_cuda_step (its line "... steady step X ms (...), N tokens/s, ...") and the log of
torch_dense1b.py (its lines "torch eager: ... N tok/s, ..." and "torch compile: ... N tok/s, ...").
A log without the line it needs is refused in one line naming the file and the line, exit 2; a
PyTorch log with only one of the two modes prints the ratio of the one it has.

    python3 scripts/measure/bench_ratio.py PIPER_LOG TORCH_LOG
"""
import re
import sys

PIPER = re.compile(r"steady step ([0-9.]+) ms .*?, ([0-9.]+) tokens/s")
TORCH = re.compile(r"^torch (eager|compile): .*?step ([0-9.]+) ms .*?, ([0-9,]+) tok/s", re.M)


class BadLog(Exception):
    pass


def piper_tokens(text, path):
    m = PIPER.search(text)
    if not m:
        raise BadLog(f"{path}: no 'steady step ... tokens/s' line of bench_cuda_step")
    return float(m.group(2)), float(m.group(1))


def torch_tokens(text, path):
    found = {mode: (float(tok.replace(",", "")), float(ms)) for mode, ms, tok in TORCH.findall(text)}
    if not found:
        raise BadLog(f"{path}: no 'torch eager: ...' or 'torch compile: ...' tok/s line of torch_dense1b.py")
    return found


def report(piper, torch):
    """Lines comparing piper = (tok/s, ms) with torch = {mode: (tok/s, ms)}."""
    tok, ms = piper
    lines = [f"piper: {tok:,.0f} tok/s ({ms:.1f} ms/step)"]
    for mode, name in (("eager", "PyTorch eager"), ("compile", "torch.compile")):
        if mode in torch:
            t, m = torch[mode]
            lines.append(f"piper / {name}: {tok / t:.3f} ({tok:,.0f} vs {t:,.0f} tok/s; {ms:.1f} vs {m:.1f} ms/step)")
    return lines


def main(argv):
    if len(argv) != 3:
        print("usage: bench_ratio.py PIPER_LOG TORCH_LOG", file=sys.stderr)
        return 2
    try:
        texts = []
        for path in argv[1:3]:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    texts.append(f.read())
            except OSError as e:
                raise BadLog(f"{path}: cannot read ({e.strerror})")
        lines = report(piper_tokens(texts[0], argv[1]), torch_tokens(texts[1], argv[2]))
    except BadLog as e:
        print(f"bench_ratio: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
