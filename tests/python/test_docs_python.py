"""Every ```python block of docs/python.md runs, and prints what the ```text block right after it shows.

Each block runs in a fresh interpreter from the repository root (PYTHONPATH names the built package).
A ```text block that directly follows a ```python block (blank lines between allowed) is its
expected standard output; a line that is exactly `...` stands for any number of lines. A block
right after a line `<!-- python: needs pandas -->` is skipped where pandas is not installed. Every
public function of the package appears in some example.
"""
import os
import re
import subprocess
import sys
import unittest

SOURCE_DIR = os.environ["PIPER_SOURCE_DIR"]
DOC = os.path.join(SOURCE_DIR, "docs", "python.md")
# Other pages whose Python blocks run the same way (docs/first-hour.md: the walkthrough).
MORE_DOCS = [os.path.join(SOURCE_DIR, "docs", "first-hour.md")]
NEEDS_PANDAS = re.compile(r"^\s*<!--\s*python:\s*needs pandas\s*-->\s*$")
FUNCTIONS = ["compile", "directives", "simulate", "verify", "sweep", "tune", "run", "plot", "read_results", "models", "schedule_show"]


def blocks(text):
    """[(line number, code, expected output or None, needs pandas)] of the ```python blocks."""
    lines = text.split("\n")
    fences = []  # (kind, first line index, body lines)
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            j = i + 1
            while j < len(lines) and lines[j].rstrip() != "```":
                j += 1
            fences.append((m.group(1), i, j, lines[i + 1:j]))
            i = j + 1
        else:
            i += 1
    out = []
    for k, (kind, start, end, body) in enumerate(fences):
        if kind != "python":
            continue
        expected = None
        if k + 1 < len(fences) and fences[k + 1][0] == "text":
            between = lines[end + 1:fences[k + 1][1]]
            if all(not l.strip() for l in between):
                expected = fences[k + 1][3]
        pandas = start > 0 and NEEDS_PANDAS.match(lines[start - 1]) is not None
        out.append((start + 1, "\n".join(body) + "\n", expected, pandas))
    return out


def matches(actual, expected):
    """Lines equal, `...` standing for any number of lines."""
    pattern = "".join(r"(?:.*\n)*?" if l.strip() == "..." else re.escape(l) + r"\n" for l in expected)
    return re.fullmatch(pattern, "".join(l + "\n" for l in actual)) is not None


class DocsExamples(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(DOC) as f:
            cls.blocks = blocks(f.read())
        cls.more = []
        for doc in MORE_DOCS:
            with open(doc) as f:
                cls.more += [(os.path.basename(doc), *b) for b in blocks(f.read())]

    def test_the_matcher(self):
        self.assertTrue(matches(["a", "b", "c"], ["a", "...", "c"]))
        self.assertTrue(matches(["a", "c"], ["a", "...", "c"]))
        self.assertFalse(matches(["a", "b"], ["a", "c"]))
        self.assertFalse(matches(["a", "b", "x"], ["a", "...", "c"]))
        parsed = blocks("x\n```python\nprint(1)\n```\n\n```text\n1\n```\n<!-- python: needs pandas -->\n"
                        "```python\npass\n```\n")
        self.assertEqual(parsed, [(2, "print(1)\n", ["1"], False), (10, "pass\n", None, True)])

    def test_every_function_has_an_example(self):
        code = "".join(b[1] for b in self.blocks)
        for name in FUNCTIONS:
            self.assertIn(f"piper.{name}(", code, name)

    def test_examples_run_and_print_what_the_doc_shows(self):
        self.assertGreater(len(self.blocks), 0)
        try:
            import pandas  # noqa: F401
            have_pandas = True
        except ImportError:
            have_pandas = False
        for doc, line, code, expected, needs_pandas in [("python.md", *b) for b in self.blocks] + self.more:
            with self.subTest(doc=doc, line=line):
                if needs_pandas and not have_pandas:
                    continue  # the block's own text says it needs pandas
                p = subprocess.run([sys.executable, "-c", code], cwd=SOURCE_DIR, capture_output=True, text=True,
                                   timeout=300)
                self.assertEqual(p.returncode, 0, f"docs/{doc}:{line}: exit {p.returncode}\n{p.stderr}")
                if expected is not None:
                    actual = p.stdout.rstrip("\n").split("\n") if p.stdout else []
                    self.assertTrue(matches(actual, expected),
                                    f"docs/{doc}:{line}: printed\n{p.stdout}\nthe doc shows\n" + "\n".join(expected))


if __name__ == "__main__":
    unittest.main()
