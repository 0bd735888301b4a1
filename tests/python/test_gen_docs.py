"""Tests of scripts/gen-docs.py: the elision and masking rules, and that a stale block fails the check."""
import importlib.util
import os
import subprocess
import sys
import tempfile
import unittest

SOURCE_DIR = os.environ.get("PIPER_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(SOURCE_DIR, "scripts", "gen-docs.py")
spec = importlib.util.spec_from_file_location("gen_docs", SCRIPT)
gen_docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen_docs)


class Match(unittest.TestCase):
    def test_exact(self):
        self.assertIsNotNone(gen_docs.match(["a", "b"], ["a", "b"]))
        self.assertIsNone(gen_docs.match(["a", "b"], ["a", "b", "c"]))
        self.assertIsNone(gen_docs.match(["a"], ["b"]))

    def test_elision(self):
        self.assertIsNotNone(gen_docs.match(["a", "...", "d"], ["a", "b", "c", "d"]))
        self.assertIsNotNone(gen_docs.match(["a", "...", "d"], ["a", "d"]))  # zero lines
        self.assertIsNotNone(gen_docs.match(["a", "  ..."], ["a", "x", "y"]))
        self.assertIsNotNone(gen_docs.match(["...", "c"], ["a", "b", "c"]))
        self.assertIsNotNone(gen_docs.match(["a", "...", "c", "...", "e"], list("abcde")))
        self.assertIsNone(gen_docs.match(["a", "...", "c"], ["a", "b", "c", "d"]))  # c must be last
        self.assertIsNone(gen_docs.match(["b", "..."], ["a", "b"]))  # b must be first
        self.assertIsNone(gen_docs.match(["a", "...", "c", "...", "b"], list("abc")))  # order

    def test_volatile_fields_are_masked(self):
        self.assertIsNotNone(gen_docs.match(["compile time          14.3 ms (1480 DAG nodes)"],
                                            ["compile time          9.1 ms (1480 DAG nodes)"]))
        self.assertIsNone(gen_docs.match(["compile time          14.3 ms (1480 DAG nodes)"],
                                         ["compile time          14.3 ms (1481 DAG nodes)"]))
        self.assertIsNotNone(gen_docs.match(["step    1  loss 4.509671  (28.3 ms)"],
                                            ["step    1  loss 4.509671  (1515.9 ms)"]))
        self.assertIsNone(gen_docs.match(["step    1  loss 4.509671  (28.3 ms)"],
                                         ["step    1  loss 4.509672  (28.3 ms)"]))
        self.assertIsNone(gen_docs.match(["step time             123.993 ms"], ["step time             123.994 ms"]))


class EndToEnd(unittest.TestCase):
    def run_tool(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)

    def test_stale_block_fails_and_update_fixes_it(self):
        with tempfile.TemporaryDirectory() as tmp:
            doc = os.path.join(tmp, "doc.md")
            with open(doc, "w") as f:
                f.write("# t\n\n```console\n$ echo one; echo two\none\nthree\n$ (exit 3); echo $?\n3\n```\n")
            check = self.run_tool(doc)
            self.assertEqual(check.returncode, 1)
            self.assertIn("+two", check.stderr)
            self.assertEqual(self.run_tool("--update", doc).returncode, 0)
            with open(doc) as f:
                self.assertIn("$ echo one; echo two\none\ntwo\n$ (exit 3)", f.read())
            self.assertEqual(self.run_tool(doc).returncode, 0)

    def test_update_recuts_a_block_elided_once(self):
        # One '...' keeps as many lines before and after it as the block had; two are left to a person.
        self.assertEqual(gen_docs.elide_like(["a", "...", "z"], list("pqrs")), ["p", "...", "s"])
        self.assertEqual(gen_docs.elide_like(["a", "b", "  ..."], list("pqrs")), ["p", "q", "  ..."])
        self.assertIsNone(gen_docs.elide_like(["a", "...", "b", "...", "c"], list("pqrstu")))
        self.assertIsNone(gen_docs.elide_like(["a", "...", "z"], ["p", "q"]))  # nothing left to elide
        with tempfile.TemporaryDirectory() as tmp:
            doc = os.path.join(tmp, "doc.md")
            with open(doc, "w") as f:
                f.write("```console\n$ printf 'new\\nx\\ny\\nlast\\n'\nold\n...\nlast\n```\n")
            self.assertEqual(self.run_tool(doc).returncode, 1)
            self.assertEqual(self.run_tool("--update", doc).returncode, 0)
            with open(doc) as f:
                self.assertIn("\nnew\n...\nlast\n```", f.read())
            self.assertEqual(self.run_tool(doc).returncode, 0)

    def test_skip_marker_and_plain_fence(self):
        with tempfile.TemporaryDirectory() as tmp:
            doc = os.path.join(tmp, "doc.md")
            with open(doc, "w") as f:
                f.write("<!-- docs: skip slow -->\n```console\n$ false\nnot this\n```\n")
            self.assertEqual(self.run_tool(doc).returncode, 0)
            with open(doc, "w") as f:
                f.write("```\n$ echo unchecked\nunchecked\n```\n")
            self.assertIn("make it ```console", self.run_tool(doc).stderr)


if __name__ == "__main__":
    unittest.main()
