"""Tests of experiments/fidelity/steptimes.py: the case-file schema (the committed file passes, each kind of
broken case is refused with one line naming it), the statistics derived by hand, the log-axis plot's
coordinates, and `--check` simulating 3 committed cases with the piper binary ($PIPER); and stagetimes.py
comparing the committed per-stage op times."""
import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

SOURCE_DIR = os.environ.get("PIPER_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(SOURCE_DIR, "experiments", "fidelity", "steptimes.py")
CASES = os.path.join(SOURCE_DIR, "experiments", "fidelity", "steptimes.json")
PIPER = os.environ.get("PIPER", os.path.join(SOURCE_DIR, "build", "bin", "piper"))
spec = importlib.util.spec_from_file_location("steptimes", SCRIPT)
steptimes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(steptimes)

ZOO = {"llama3-8b", "llama3-70b"}  # enough for the committed file's zoo references


def good_case():
    return {"id": "c1", "source": "S", "url": "https://example.org/x", "quote": "| 1b | 2048 | 8 |", "model": "llama3-8b",
            "gpu": "H100-80GB", "cluster": "dgx-h100", "gpus": 8, "flags": ["--pp", "1", "--dp", "8", "--zero", "3"],
            "family": "fsdp/zero3", "runtime": "eager", "measured": {"value": 1000, "unit": "tokens/s"},
            "measured_step_s": 2.5, "conversion": "x / y", "notes": "n"}


class Schema(unittest.TestCase):
    def test_committed_file_is_valid_and_large_enough(self):
        cases = steptimes.load_cases(CASES)
        self.assertEqual(steptimes.validate(cases, "steptimes.json", ZOO), [])
        self.assertGreaterEqual(len(cases), 40)
        self.assertGreaterEqual(len({steptimes.short_source(c) for c in cases}), 4)
        for c in cases:  # the quote is the text the numbers were read from
            self.assertGreater(len(c["quote"]), 20, c["id"])

    def test_good_case_passes(self):
        self.assertEqual(steptimes.validate([good_case()], "f.json", ZOO), [])

    def test_each_defect_is_one_line_naming_the_case(self):
        def errors(mutate):
            c = good_case()
            mutate(c)
            return steptimes.validate([c], "f.json", ZOO)

        self.assertEqual(errors(lambda c: c.pop("quote")), ["f.json: case 'c1': missing 'quote'"])
        self.assertEqual(errors(lambda c: c.update(quote="  ")), ["f.json: case 'c1': 'quote' is empty"])
        self.assertEqual(errors(lambda c: c.update(url="http://x")), ["f.json: case 'c1': 'url' must be an https:// address"])
        self.assertEqual(errors(lambda c: c.update(measured={"value": 0, "unit": "s"})),
                         ["f.json: case 'c1': 'measured.value' must be a positive number"])
        self.assertEqual(errors(lambda c: c.update(measured_step_s=-1.0)),
                         ["f.json: case 'c1': 'measured_step_s' must be a positive number"])
        self.assertEqual(errors(lambda c: c.update(gpus=16)), ["f.json: case 'c1': pp x dp x tp x cp = 8 but 'gpus' is 16"])
        self.assertEqual(errors(lambda c: c.update(flags=["--dp", "8", "--model", "x"])),
                         ["f.json: case 'c1': 'flags' must not contain --model (the script sets it)"])
        self.assertEqual(errors(lambda c: c.update(model="nope.json")),
                         ["f.json: case 'c1': 'model' nope.json is neither a zoo model nor a file under the repository"])
        self.assertEqual(errors(lambda c: c.update(cluster="dgx-v100")),
                         ["f.json: case 'c1': 'cluster' dgx-v100 is neither a preset nor a file under the repository"])
        self.assertEqual(errors(lambda c: c.update(extra=1)), ["f.json: case 'c1': unknown field 'extra'"])
        self.assertEqual(errors(lambda c: c.update(gpus=True)), ["f.json: case 'c1': 'gpus' has the wrong type"])

    def test_duplicate_ids(self):
        self.assertEqual(steptimes.validate([good_case(), good_case()], "f.json", ZOO), ["f.json: case 'c1': duplicate id"])


class Statistics(unittest.TestCase):
    def test_by_hand(self):
        rows = [{"id": "a", "error_pct": -10.0, "oom": False}, {"id": "b", "error_pct": 20.0, "oom": True},
                {"id": "c", "error_pct": -30.0, "oom": False}]
        s = steptimes.stats(rows)
        self.assertAlmostEqual(s["mean_abs"], 20.0)  # (10 + 20 + 30) / 3
        self.assertAlmostEqual(s["signed"], -20.0 / 3)  # (-10 + 20 - 30) / 3
        self.assertAlmostEqual(s["max_abs"], 30.0)
        self.assertEqual(s["worst"], "c")
        self.assertEqual(s["too_fast"], 2)
        self.assertEqual(s["oom"], 1)

    def test_error_sign(self):
        c = good_case()  # measured 2.5 s; predicted 2.0 s is 20 % too fast
        rows = steptimes.rows_of([c], {"c1": {"predicted_s": 2.0, "oom": False, "peak_gib": 1.0}})
        self.assertAlmostEqual(rows[0]["error_pct"], -20.0)

    def test_svg_log_axes(self):
        rows = [{"id": "a", "gpu": "G", "family": "f", "measured_s": 1.0, "predicted_s": 1.0, "error_pct": 0.0},
                {"id": "b", "gpu": "G", "family": "f", "measured_s": 100.0, "predicted_s": 10.0, "error_pct": -90.0}]
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "p.svg")
            steptimes.write_svg(p, rows)
            with open(p) as f:
                svg = f.read()
        # Axes span 1..100 s over 440 px (x) and 460 px (y): 1 s at x 80, 10 s at x 300, 100 s at x 520.
        self.assertIn('cx="80.0" cy="500.0"', svg)  # (1, 1): bottom left
        self.assertIn('cx="520.0" cy="270.0"', svg)  # measured 100, predicted 10: one decade up of two
        self.assertIn(">1<", svg)
        self.assertIn(">100<", svg)


@unittest.skipUnless(os.access(PIPER, os.X_OK), "piper binary not built")
class Cli(unittest.TestCase):
    def run_script(self, *args):
        env = dict(os.environ, PIPER=PIPER)
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env)

    def test_check_simulates_three_committed_cases(self):
        out = self.run_script("--check")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("cases valid; 3 simulated", out.stdout)
        self.assertEqual(len([l for l in out.stdout.splitlines() if ": measured " in l]), 3)

    def test_bad_file_exits_2_and_names_the_case(self):
        cases = steptimes.load_cases(CASES)
        bad = copy.deepcopy(cases[0])
        del bad["quote"]
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "bad.json")
            with open(p, "w") as f:
                json.dump({"format": "piper-fidelity-steptimes", "cases": [bad]}, f)
            out = self.run_script("--check", "--cases", p)
        self.assertEqual(out.returncode, 2)
        self.assertEqual(out.stderr.strip(), f"steptimes: {p}: case '{bad['id']}': missing 'quote'")

    def test_failing_simulation_names_the_case_and_writes_nothing(self):
        cases = steptimes.load_cases(CASES)
        bad = copy.deepcopy(min(cases, key=lambda c: c["gpus"]))
        bad["flags"] = bad["flags"] + ["--microbatches", "0"]
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "bad.json")
            with open(p, "w") as f:
                json.dump({"format": "piper-fidelity-steptimes", "cases": [bad]}, f)
            out = self.run_script("--cases", p, "--out", d)
            self.assertEqual(out.returncode, 1)
            self.assertIn(f"case '{bad['id']}': piper simulate exited", out.stderr)
            self.assertEqual(sorted(os.listdir(d)), ["bad.json"])


@unittest.skipUnless(os.access(PIPER, os.X_OK), "piper binary not built")
class StageTimes(unittest.TestCase):
    """experiments/fidelity/stagetimes.py: every committed stage row simulated, one table row each, and the
    measured figures in the table are the file's."""
    script = os.path.join(SOURCE_DIR, "experiments", "fidelity", "stagetimes.py")

    def test_committed_rows_are_compared(self):
        with open(os.path.join(SOURCE_DIR, "experiments", "fidelity", "stagetimes.json")) as f:
            stages = json.load(f)["stages"]
        self.assertGreaterEqual(len(stages), 12)
        with tempfile.TemporaryDirectory() as d:
            out = subprocess.run([sys.executable, self.script, "--out", d], capture_output=True, text=True,
                                 env=dict(os.environ, PIPER=PIPER))
            self.assertEqual(out.returncode, 0, out.stderr)
            with open(os.path.join(d, "stagetimes.md")) as f:
                table = f.read()
        rows = [l for l in table.splitlines() if l.startswith("| zb-")]
        self.assertEqual(len(rows), len(stages))
        for s, row in zip(stages, rows):
            self.assertTrue(row.startswith(f"| {s['id']} |"), row)
            self.assertIn(f"{s['measured_ms']['F']:.2f} / ", row)
            self.assertIn(f"{s['measured_ms']['BW']:.2f} / ", row)
        self.assertIn("Signed mean error per pass: F ", table)

    def test_bad_argument_exits_2(self):
        out = subprocess.run([sys.executable, self.script, "--out"], capture_output=True, text=True)
        self.assertEqual(out.returncode, 2)
        self.assertEqual(out.stderr.strip(), "stagetimes: usage: stagetimes.py [--stages FILE] [--out DIR]")

    def test_bad_stage_exits_2_naming_it_and_writes_nothing(self):
        with open(os.path.join(SOURCE_DIR, "experiments", "fidelity", "stagetimes.json")) as f:
            doc = json.load(f)
        doc["stages"][2]["measured_ms"]["BI"] = "18 ms"
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "bad.json")
            with open(p, "w") as f:
                json.dump(doc, f)
            out = subprocess.run([sys.executable, self.script, "--stages", p, "--out", d], capture_output=True, text=True,
                                 env=dict(os.environ, PIPER=PIPER))
            self.assertEqual(out.returncode, 2)
            self.assertEqual(out.stderr.strip(), f"stagetimes: {p}: stage 2 '{doc['stages'][2]['id']}': "
                                                 "'measured_ms.BI' must be a positive number")
            self.assertEqual(os.listdir(d), ["bad.json"])


if __name__ == "__main__":
    unittest.main()
