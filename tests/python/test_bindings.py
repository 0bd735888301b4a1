"""Tests of the `piper` Python module against the piper CLI and hand-derived schedule formulas."""
import json
import os
import re
import shlex
import subprocess
import tempfile
import unittest

import piper

SOURCE_DIR = os.environ["PIPER_SOURCE_DIR"]
CLI = os.environ["PIPER_CLI"]

# Fields that measure this process rather than the strategy: wall-clock time of compiling and
# simulating, and the compiler's peak RSS (the Python process is larger than the CLI's).
REPORT_TIMING_FIELDS = ("compile_time_s", "simulate_time_s")
PROGRAM_TIMING_FIELDS = ("compile_seconds", "compiler_peak_rss_bytes")


def run_cli(*args, check=True):
    return subprocess.run([CLI, *args], cwd=SOURCE_DIR, capture_output=True, text=True, check=check)


def default_scenario_flags():
    """The flags scripts/run-default.sh gives `piper simulate`, minus its output files."""
    with open(os.path.join(SOURCE_DIR, "scripts", "run-default.sh")) as f:
        text = f.read().replace("\\\n", " ")
    line = next(l for l in text.splitlines() if l.strip().startswith("build/bin/piper simulate"))
    words = shlex.split(line)[2:]
    flags = []
    i = 0
    while i < len(words):
        if words[i] in ("--report", "--trace", "--save-scenario"):
            i += 2
            continue
        flags.append(words[i])
        i += 1
    return flags


def without(d, keys):
    return {k: v for k, v in d.items() if k not in keys}


class DefaultScenario(unittest.TestCase):
    """The default scenario through the module equals the CLI's report and plan, field for field."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.flags = default_scenario_flags()
        report = os.path.join(cls.tmp.name, "report.json")
        scenario = os.path.join(cls.tmp.name, "scenario.json")
        run_cli("simulate", *cls.flags, "--report", report, "--save-scenario", scenario)
        with open(report) as f:
            cls.cli_report = json.load(f)
        with open(scenario) as f:
            cls.scenario = json.load(f)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_simulate_matches_cli_report(self):
        report = piper.simulate(self.scenario)
        self.assertEqual(sorted(report), sorted(self.cli_report))
        self.assertEqual(without(report, REPORT_TIMING_FIELDS), without(self.cli_report, REPORT_TIMING_FIELDS))
        self.assertGreater(report["step_time_s"], 0)

    def test_compile_matches_cli_plan(self):
        flags = []
        skip = False
        for w in self.flags:  # compile takes no cluster or engine
            if skip:
                skip = False
            elif w in ("--cluster", "--engine"):
                skip = True
            else:
                flags.append(w)
        plan_path = os.path.join(self.tmp.name, "plan.json")
        run_cli("compile", *flags, "-o", plan_path)
        with open(plan_path) as f:
            cli_plan = json.load(f)
        plan = piper.compile(self.scenario)
        plan["stats"] = without(plan["stats"], PROGRAM_TIMING_FIELDS)
        cli_plan["stats"] = without(cli_plan["stats"], PROGRAM_TIMING_FIELDS)
        self.assertEqual(plan, cli_plan)
        self.assertEqual(piper.verify(plan), [])

    def test_simulate_plan_equals_simulate_scenario(self):
        plan = piper.compile(self.scenario)
        by_plan = piper.simulate(plan=plan, cluster=self.scenario["cluster"], engine=self.scenario["engine"])
        self.assertEqual(by_plan["step_time_s"], self.cli_report["step_time_s"])


class Directives(unittest.TestCase):
    def test_matches_cli(self):
        out = run_cli("directives", "--model", "qwen3-9m", "--pp", "2", "--dp", "2", "--ep", "2",
                      "--schedule", "1f1b", "--microbatches", "2").stdout
        program = piper.directives({"model": "qwen3-9m", "strategy": {"pp": 2, "dp": 2, "ep": 2,
                                                                       "schedule": "1f1b", "microbatches": 2}})
        self.assertEqual(program, json.loads(out))

    def test_without_model_is_the_generator(self):
        out = run_cli("directives", "--pp", "2", "--schedule", "gpipe", "--microbatches", "3").stdout
        program = piper.directives({"strategy": {"pp": 2, "schedule": "gpipe", "microbatches": 3}})
        self.assertEqual(program, json.loads(out))


class ScheduleShow(unittest.TestCase):
    def test_text_matches_cli(self):
        out = run_cli("schedule", "show", "dualpipev", "--ranks", "4", "--microbatches", "10").stdout
        self.assertEqual(piper.schedule_show("dualpipev", ranks=4, microbatches=10)["text"], out)

    def test_1f1b_bubble_formula(self):
        # 1F1B on p ranks with M microbatches, F = 1, B = 2: every rank idles (p-1)(F+B) units and
        # the step lasts (M + p - 1)(F + B).
        p, m, f, b = 4, 8, 1, 2
        s = piper.schedule_show("1f1b", ranks=p, microbatches=m, costs=[f, b, 1])
        self.assertEqual(s["step_time"], (m + p - 1) * (f + b))
        self.assertEqual([r["bubble"] for r in s["ranks"]], [(p - 1) * (f + b)] * p)
        # Rank r holds at most p - r microbatches' activations.
        self.assertEqual([r["peak_activations"] for r in s["ranks"]], [p - r for r in range(p)])
        self.assertEqual(len(s["ranks"][0]["ops"]), 2 * m)

    def test_unknown_family_is_an_error(self):
        with self.assertRaises(piper.Error):
            piper.schedule_show("no-such-schedule")


class Sweep(unittest.TestCase):
    SPEC = {"model": "qwen3-9m", "cluster": "dgx-h200", "engine": "analytic", "pp": [1, 2],
            "ep": [1, 3], "schedule": "1f1b", "microbatches": 2}

    def test_rows_match_cli_csv(self):
        with tempfile.TemporaryDirectory() as tmp:
            spec_path = os.path.join(tmp, "spec.json")
            with open(spec_path, "w") as f:
                json.dump(self.SPEC, f)
            csv_path = os.path.join(tmp, "cli.csv")
            run_cli("sweep", spec_path, "-j", "1", "-o", csv_path)
            with open(csv_path) as f:
                lines = f.read().splitlines()
            header = lines[0].split(",")
            cli_rows = {}
            for line in lines[1:]:
                fields = line.split(",", len(header) - 1)
                row = dict(zip(header, fields))
                cli_rows[row["key"]] = row
            out = piper.sweep(self.SPEC, jobs=1)
        # 2 pp values x 2 ep values; ep 3 does not divide dp 1, so those two are invalid.
        self.assertEqual(out["combinations"], 4)
        self.assertEqual((out["ran"], out["ok"], out["invalid"]), (4, 2, 2))
        self.assertEqual(sorted(r["key"] for r in out["rows"]), sorted(cli_rows))
        for r in out["rows"]:
            cli = cli_rows[r["key"]]
            self.assertEqual(r["status"], cli["status"])
            if r["status"] == "ok":
                self.assertEqual(r["step_time_s"], float(cli["step_time_s"]))
                self.assertEqual(r["peak_memory_bytes"], int(cli["peak_memory_bytes"]))
            else:
                # Not simulated: no figures (None here, blank in the CSV), never a 0.
                self.assertIsNone(r["step_time_s"])
                self.assertIsNone(r["peak_memory_bytes"])
                self.assertEqual((cli["step_time_s"], cli["peak_memory_bytes"]), ("", ""))

    def test_resume_with_output(self):
        with tempfile.TemporaryDirectory() as tmp:
            csv_path = os.path.join(tmp, "rows.csv")
            first = piper.sweep(self.SPEC, output=csv_path)
            again = piper.sweep(self.SPEC, output=csv_path)
        self.assertEqual(first["ran"], 4)
        self.assertEqual((again["resumed"], again["ran"], again["rows"]), (4, 0, []))

    def test_comm_sms_axis(self):
        # One device, no communication: an sm_partition of 33 of the H200's 132 SMs runs every compute
        # op at 99/132 of its speed, so the step takes 132/99 as long (docs/sm-partition.md); the sweep
        # row equals piper.simulate of the scenario with strategy.comm_sms.
        spec = {"model": "qwen3-9m", "cluster": "dgx-h200", "engine": "analytic", "pp": 1, "dp": 1,
                "microbatches": 2, "comm_sms": [0, 33]}
        out = piper.sweep(spec)
        step = {r["comm_sms"]: r["step_time_s"] for r in out["rows"]}
        self.assertEqual(sorted(step), [0, 33])
        self.assertAlmostEqual(step[33] / step[0], 132 / 99, places=9)
        scenario = {"model": "qwen3-9m", "strategy": {"pp": 1, "dp": 1, "microbatches": 2, "comm_sms": 33}}
        report = piper.simulate(scenario, cluster="dgx-h200", engine="analytic")
        self.assertEqual(report["step_time_s"], step[33])
        with self.assertRaisesRegex(piper.Error, r"^sweep spec: field 'comm_sms': 132 SMs for communication leave none"):
            piper.sweep(dict(spec, comm_sms=[24, 132]))


class Errors(unittest.TestCase):
    def test_bad_directive_has_the_cli_message(self):
        bad = "tests/data/bad/order_cycle.json"
        cli = run_cli("compile", "--model", "qwen3-9m", "--directives", bad, check=False)
        self.assertEqual(cli.returncode, 2)
        # Relative to the same folder as the CLI's run, so that both name the file the same way.
        cwd = os.getcwd()
        os.chdir(SOURCE_DIR)
        try:
            with self.assertRaises(piper.Error) as ctx:
                piper.compile({"model": "qwen3-9m", "directives": bad})
        finally:
            os.chdir(cwd)
        self.assertEqual(cli.stderr, "piper: error: " + str(ctx.exception) + "\n")
        self.assertIn("directive 7 field 'filters[1]'", str(ctx.exception))

    def test_bad_scenario_field(self):
        with self.assertRaisesRegex(piper.Error, r"^scenario: field 'strategy.pp': must be an integer >= 1 \(got 0\)$"):
            piper.compile({"model": "qwen3-9m", "strategy": {"pp": 0}})

    def test_misspelt_strategy_key_is_an_error(self):
        with self.assertRaisesRegex(piper.Error, r"^scenario: field 'strategy.microbatchs': unknown field "
                                                 r"\(did you mean 'microbatches'\?\)$"):
            piper.simulate({"model": "qwen3-9m", "strategy": {"pp": 2, "microbatchs": 4}})

    def test_error_is_a_value_error(self):
        self.assertTrue(issubclass(piper.Error, ValueError))
        with self.assertRaises(piper.Error):
            piper.simulate()


class Version(unittest.TestCase):
    def test_models_are_the_clis(self):
        rows = piper.models()
        lines = run_cli("models").stdout.splitlines()
        self.assertEqual([r["name"] for r in rows], [l.split()[0] for l in lines])
        for r, line in zip(rows, lines):
            # The CLI prints the count in billions or millions with two decimals ("1.07 B").
            value, unit = line.split()[1:3]
            scale = {"B": 1e9, "M": 1e6, "K": 1e3}[unit]
            self.assertAlmostEqual(r["params"] / scale, float(value), delta=0.005, msg=r["name"])
            self.assertIn(f"{r['layers']} layers, hidden {r['hidden']}", line)
            if r["experts"]:
                self.assertIn(f"MoE {r['experts']} experts top-{r['top_k']}", line)

    def test_version_is_the_clis(self):
        self.assertRegex(piper.__version__, r"^\d+\.\d+\.\d+$")
        self.assertEqual(run_cli("--version").stdout, "piper " + piper.__version__ + "\n")


if __name__ == "__main__":
    unittest.main()
