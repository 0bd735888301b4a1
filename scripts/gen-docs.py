#!/usr/bin/env python3
"""Re-runs every ```console block of README.md and docs/*.md and checks (or rewrites) its output.

The convention (docs/README.md says it for authors):
  * A ```console block holds `$ command` lines, each followed by the output it prints (stdout and
    stderr together). A command continues on the following lines after a trailing backslash or
    while a quoted string is open (a multi-line `python3 -c '...'`).
  * Commands run from the repository root, in one bash per block, blocks of a file in order (so a
    block may use a file an earlier block wrote). build/bin is first on PATH, so `piper` works;
    scratch files go under /tmp/, which is mapped to a private folder per file (and back in the
    output), so that concurrent runs cannot collide.
  * A line that is exactly `...` (indentation allowed) in the output stands for any number of lines.
  * Volatile fields (the wall time and memory of the compiler and simulator, per-step wall times)
    are compared with their numbers masked: see VOLATILE below.
  * `<!-- docs: skip REASON -->` on the line just before the fence leaves the block unchecked (slow
    benchmarks, mpirun jobs, GUI runs); --list shows them.
  * A plain ``` block whose lines start with `$ ` is an error: shown output must be checked.
  * A relative link [text](path) to a file that does not exist is an error.

Usage: scripts/gen-docs.py [--check | --update] [--list] [FILE.md ...]
  --check   (default) exit 1 and show a diff when a block's output differs
  --update  rewrite blocks with the real output (a block elided by one `...` line keeps as many lines
            before and after it as it had)
"""
import argparse
import difflib
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (pattern, replacement) applied to expected and actual lines before comparing.
VOLATILE = [
    (re.compile(r"(compile time|simulate time)\s+[0-9.]+ ms"), r"\1 # ms"),
    (re.compile(r"compiled in [0-9.]+ ms"), "compiled in # ms"),
    (re.compile(r"compiler peak memory\s+[0-9.]+ MiB"), "compiler peak memory # MiB"),
    (re.compile(r"^(step\s+\d+\s+loss \S+)\s+\([0-9.]+ ms\)$"), r"\1 (# ms)"),
]

FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
SKIP = re.compile(r"^\s*<!--\s*docs:\s*skip\b(.*?)-->\s*$")
MARK = "@@piper-docs-command-{}@@"


class Block:
    def __init__(self, path, start, end, lines, skip_reason):
        self.path, self.start, self.end = path, start, end  # fence lines (0-based), exclusive of content
        self.lines = lines
        self.skip_reason = skip_reason

    def commands(self):
        """[(command text, [expected output lines], first line index within the block)]"""
        out = []
        i = 0
        while i < len(self.lines):
            line = self.lines[i]
            if not line.startswith("$ "):
                raise SyntaxError(f"{self.path}:{self.start + 2 + i}: output before the first '$ ' command")
            cmd = [line[2:]]
            while (cmd[-1].endswith("\\") or not quotes_closed("\n".join(cmd))) and i + 1 < len(self.lines):
                i += 1
                cmd.append(self.lines[i])
            i += 1
            first = i
            while i < len(self.lines) and not self.lines[i].startswith("$ "):
                i += 1
            out.append(("\n".join(cmd), self.lines[first:i], first))
        return out


def quotes_closed(command):
    """False while a quoted string is still open (a multi-line `python3 -c '...'`)."""
    try:
        shlex.split(command)
        return True
    except ValueError:
        return False


def parse(path):
    with open(path) as f:
        text = f.read().split("\n")
    blocks, errors = [], []
    i = 0
    while i < len(text):
        m = FENCE.match(text[i])
        if not m:
            i += 1
            continue
        lang = m.group(2)
        j = i + 1
        while j < len(text) and not FENCE.match(text[j]):
            j += 1
        body = text[i + 1 : j]
        if lang == "console":
            skip = SKIP.match(text[i - 1]) if i > 0 else None
            blocks.append(Block(path, i, j, body, skip.group(1).strip() if skip else None))
        elif lang == "" and any(l.startswith("$ ") for l in body):
            errors.append(f"{path}:{i + 1}: a ``` block shows '$ ' commands: make it ```console (checked) "
                          "or <!-- docs: skip REASON --> ```console")
        i = j + 1
    # Relative links must point at files that exist (anchors and web links are not checked).
    for n, line in enumerate(text):
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file = os.path.join(os.path.dirname(path), target.split("#")[0])
            if not os.path.exists(file):
                errors.append(f"{path}:{n + 1}: link to a missing file: {target}")
    return text, blocks, errors


def normalise(line):
    line = line.rstrip()
    for pattern, repl in VOLATILE:
        line = pattern.sub(repl, line)
    return line


def match(expected, actual):
    """Line indices of `actual` matched by each non-'...' line of `expected`, or None."""
    segments, current = [], []
    for k, line in enumerate(expected):
        if line.strip() == "...":
            segments.append(current)
            current = []
        else:
            current.append(k)
    segments.append(current)
    norm_exp = [normalise(l) for l in expected]
    norm_act = [normalise(l) for l in actual]
    result = {}
    pos = 0
    last = len(segments) - 1
    for s, seg in enumerate(segments):
        n = len(seg)
        want = [norm_exp[k] for k in seg]
        if s == 0:
            candidates = [0]
        elif s == last:
            candidates = [len(actual) - n]
        else:
            candidates = range(pos, len(actual) - n + 1)
        found = None
        for c in candidates:
            if c >= pos and norm_act[c : c + n] == want:
                found = c
                break
        if found is None:
            return None
        for off, k in enumerate(seg):
            result[k] = found + off
        pos = found + n
    if last == 0 and pos != len(actual):
        return None
    return result


def elide_like(expected, actual):
    """`actual` cut as `expected` was: with one '...' line between a head of h and a tail of t
    lines, the first h and the last t lines of `actual` around it; None otherwise (or too short)."""
    dots = [k for k, l in enumerate(expected) if l.strip() == "..."]
    if len(dots) != 1:
        return None
    head, tail = dots[0], len(expected) - dots[0] - 1
    if len(actual) <= head + tail:
        return None
    return actual[:head] + [expected[head]] + (actual[len(actual) - tail:] if tail else [])


def run_block(block, env, scratch):
    """Runs the block's commands with /tmp/ mapped to `scratch`; outputs name /tmp/ again."""
    cmds = block.commands()
    script = ["set +e"]
    for n, (cmd, _, _) in enumerate(cmds):
        # Keep $? of the previous command across the marker, so `echo $?` reports it.
        script.append(f"__s=$?; printf '%s\\n' '{MARK.format(n)}'; (exit $__s)")
        script.append(cmd.replace("/tmp/", scratch + "/"))
    proc = subprocess.run(["bash", "-c", "\n".join(script) + "\n"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    outputs, current = [], None
    for line in proc.stdout.split("\n"):
        m = re.fullmatch(r"@@piper-docs-command-(\d+)@@", line)
        if m:
            current = []
            outputs.append(current)
        elif current is not None:
            current.append(line.replace(scratch + "/", "/tmp/"))
    while len(outputs) < len(cmds):
        outputs.append([])
    for out in outputs:
        while out and out[-1] == "":
            out.pop()
    return cmds, outputs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--update", action="store_true")
    ap.add_argument("--list", action="store_true", help="list the blocks, skipped ones with their reason")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    files = args.files or [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    env = dict(os.environ)
    env["PATH"] = os.path.join(ROOT, "build", "bin") + os.pathsep + env.get("PATH", "")
    env["COLUMNS"] = "100"
    # Qt warns on stderr when XDG_RUNTIME_DIR is unset (CI, root shells): give it a private one.
    xdg = tempfile.TemporaryDirectory(prefix="piper-docs-xdg-")  # removed when main returns
    env.setdefault("XDG_RUNTIME_DIR", xdg.name)
    failures, checked, skipped = [], 0, 0
    for path in files:
        rel = os.path.relpath(path, ROOT)
        text, blocks, errors = parse(path)
        failures += errors
        changed = False
        # The file's scratch folder: its blocks share it, and runs of other files or other
        # checkouts cannot overwrite its files.
        scratch_dir = tempfile.TemporaryDirectory(prefix="piper-docs-")
        for block in blocks:
            where = f"{rel}:{block.start + 1}"
            if block.skip_reason is not None:
                skipped += 1
                if args.list:
                    print(f"{where}: skipped ({block.skip_reason or 'no reason given'})")
                continue
            t0 = time.monotonic()
            try:
                cmds, outputs = run_block(block, env, scratch_dir.name)
            except SyntaxError as e:
                failures.append(str(e))
                continue
            checked += 1
            if args.list:
                print(f"{where}: {len(cmds)} command(s), {time.monotonic() - t0:.1f} s")
            new_body = []
            for (cmd, expected, first), actual in zip(cmds, outputs):
                new_body += block.lines[first - len(cmd.split("\n")) : first]
                m = match(expected, actual)
                if m is None:
                    if args.update and not any(l.strip() == "..." for l in expected):
                        new_body += actual
                        changed = True
                        continue
                    kept = elide_like(expected, actual) if args.update else None
                    if kept is not None:
                        new_body += kept
                        changed = True
                        continue
                    diff = "\n".join(difflib.unified_diff(expected, actual, "documented", "actual", lineterm=""))
                    failures.append(f"{where}: output of `{cmd.splitlines()[0]}` differs"
                                    + (" (elided block: fix it by hand)" if args.update else "") + f"\n{diff}")
                    new_body += expected
                    continue
                # A match keeps the documented lines: its volatile numbers need not churn.
                new_body += expected
            if args.update:
                text[block.start + 1 : block.end] = new_body
                shift = len(new_body) - (block.end - block.start - 1)
                for later in blocks:
                    if later.start > block.start:
                        later.start += shift
                        later.end += shift
                block.end += shift
        if args.update and changed:
            with open(path, "w") as f:
                f.write("\n".join(text))
            print(f"updated {rel}")
    for f in failures:
        print(f, file=sys.stderr)
    print(f"docs: {checked} console blocks checked, {skipped} skipped, {len(failures)} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
